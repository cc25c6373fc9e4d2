"""The target on llama.cpp's RPC backend: an rpc-server on 127.0.0.1 built from the same llama.cpp source as
llama-cpp-python, and llama.cpp libraries built with -DGGML_RPC=ON loaded through LLAMA_CPP_LIB_PATH (both made by
benchmarks/build-llama-tools.sh; CI builds them). Each case runs in a subprocess, since the libraries are chosen
when llama_cpp is imported."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.paths import REPO

TOOLS = Path(os.environ.get("LLAMASPEC_LLAMA_TOOLS", "~/.cache/llamaspec/llama-tools/bin")).expanduser()
SERVER = TOOLS / "rpc-server"
HAVE_RPC = SERVER.exists() and any(TOOLS.glob("libggml-rpc*")) and any(TOOLS.glob("libllama*"))
pytestmark = pytest.mark.skipif(
    not HAVE_RPC, reason=f"no rpc-server and RPC-enabled llama.cpp libraries in {TOOLS}: run "
    "benchmarks/build-llama-tools.sh (or set LLAMASPEC_LLAMA_TOOLS to the folder it prints)")

SCRIPT = r"""
import json, sys
from llamaspec import load_pair
from llamaspec.backend import devices, supports_rpc
from llamaspec.errors import ModelLoadError
target, draft, port, dead = sys.argv[1:5]
out = {"supports_rpc": supports_rpc()}
opts = dict(n_ctx=512, policy="fixed", draft_max=4, no_repack=True)
local = load_pair(target, draft, **opts)
out["local"] = local.generate("def fib(n):", max_tokens=32).text
local.close()
try:
    load_pair(target, draft, rpc_servers=f"127.0.0.1:{dead}", **opts)
except ModelLoadError as e:
    out["dead_error"] = str(e)
pair = load_pair(target, draft, rpc_servers=f"127.0.0.1:{port}", **opts)
out["rpc"] = pair.generate("def fib(n):", max_tokens=32).text
out["drafted"] = pair.last_stats.drafted
out["target_buffers"] = [l for l in pair.target.load_log.splitlines() if "model buffer size" in l]
out["draft_buffers"] = [l for l in pair.draft.load_log.splitlines() if "model buffer size" in l]
out["devices"] = [[d.name, d.backend, d.description] for d in devices()]
print("RESULT " + json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rpc_server():
    port = free_port()
    proc = subprocess.Popen([str(SERVER), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"rpc-server did not start: {proc.stdout.read()}")
            time.sleep(0.2)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.slow
def test_target_on_an_rpc_server_gives_the_same_text(tiny_models, rpc_server):
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(TOOLS), PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_models["target"]), str(tiny_models["noisy"]),
                          str(rpc_server), str(free_port())], env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["supports_rpc"]
    assert ["RPC0", "RPC", f"127.0.0.1:{rpc_server}"] in out["devices"]
    # the target's weights went to the server, the draft's stayed here; the text is the local one
    assert any(b.split(":", 1)[1].strip().startswith("RPC0[") for b in out["target_buffers"]), out["target_buffers"]
    assert not any("RPC" in b for b in out["draft_buffers"]), out["draft_buffers"]
    assert out["drafted"] > 0
    assert out["rpc"] == out["local"]
    assert "cannot reach the RPC server at 127.0.0.1:" in out["dead_error"]
