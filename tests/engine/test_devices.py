"""llama.cpp's device registry as llamaspec uses it: listing devices, placing a model on named devices, RPC servers
asked by handshake before llama.cpp (which aborts the process on a bad server) ever sees them, and the greedy
argmax taken on the device."""
from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest
from click.testing import CliRunner

from llamaspec import backend, load_pair
from llamaspec.backend import Context, Model
from llamaspec.config import ModelConfig
from llamaspec.errors import ModelLoadError


def test_devices_lists_the_cpu():
    found = backend.devices()
    cpu = [d for d in found if d.kind == "cpu"]
    assert cpu and cpu[0].backend == "CPU" and cpu[0].total > 0


@pytest.mark.parametrize("endpoint", ["localhost", "host:", ":50052", "host:port", "host:70000"])
def test_rpc_endpoint_must_be_host_port(endpoint):
    with pytest.raises(ModelLoadError, match="is not host:port"):
        backend.rpc_hello(endpoint)


def test_rpc_unreachable_server_is_one_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ModelLoadError, match=f"cannot reach the RPC server at 127.0.0.1:{port}.*rpc-server"):
        backend.rpc_hello(f"127.0.0.1:{port}", timeout=2)


def _serve_once(reply: bytes | None) -> tuple[int, list[bytes]]:
    """A one-connection TCP server: records what the client sent, answers `reply` (or closes at once)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got: list[bytes] = []

    def run():
        conn, _ = srv.accept()
        with conn:
            if reply is not None:
                got.append(conn.recv(1 + 8 + 24))
                conn.sendall(reply)
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1], got


def test_rpc_hello_speaks_llama_cpp_handshake():
    caps = bytes(24)
    port, got = _serve_once(struct.pack("<Q", 4 + len(caps)) + bytes([7, 0, 0, 0]) + caps)
    assert backend.rpc_hello(f"127.0.0.1:{port}") == (7, 0, 0)
    # RPC_CMD_HELLO (14), the request size, and conn_caps
    assert got[0][:9] == struct.pack("<BQ", 14, 24)


def test_rpc_server_that_does_not_answer_is_one_error():
    port, _ = _serve_once(None)
    with pytest.raises(ModelLoadError, match="did not answer llama.cpp's RPC handshake"):
        backend.rpc_hello(f"127.0.0.1:{port}")


def test_rpc_without_rpc_build_says_how_to_get_it():
    if backend.supports_rpc():
        pytest.skip("this llama-cpp-python has the RPC backend")
    with pytest.raises(ModelLoadError, match="-DGGML_RPC=on"):
        backend.add_rpc_servers("127.0.0.1:50052")


@pytest.mark.slow
def test_unknown_device_is_named_in_the_error(tiny_models):
    with pytest.raises(ModelLoadError, match=r"no device named 'CUDA7' \(devices: .*CPU"):
        Model(tiny_models["target"], ModelConfig(devices=("CUDA7",), no_repack=True))


def test_tensor_split_mode_without_gpus_is_one_error(tiny_models):
    if any(d.kind == "gpu" for d in backend.devices()):
        pytest.skip("this machine has a GPU")
    with pytest.raises(ModelLoadError, match="split mode 'tensor'.*needs GPUs"):
        Model(tiny_models["target"], ModelConfig(split_mode="tensor", no_repack=True))


@pytest.mark.slow
def test_no_devices_runs_on_the_cpu(tiny_models):
    pair = load_pair(str(tiny_models["target"]), str(tiny_models["draft"]), n_ctx=256, devices=(), no_repack=True,
                     policy="fixed", draft_max=3)
    assert pair.generate("def f(x):", max_tokens=8).stats.tokens_generated == 8
    pair.close()


def test_cli_bad_device_is_one_line(tiny_models):
    from llamaspec.cli import main

    res = CliRunner().invoke(main, ["run", "-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]),
                                    "--no-repack", "-devd", "NOPE0", "-n", "4", "hello"])
    assert res.exit_code == 1
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and "no device named 'NOPE0'" in lines[-1]
    assert "Traceback" not in res.output


# -- the argmax on the device (llama.cpp backend sampling) ----------------------------------------------------
def _contexts(path):
    model = Model(path, ModelConfig(no_repack=True))
    return model, Context(model, ModelConfig(n_ctx=256, n_batch=64, n_threads=2))


def test_device_argmax_matches_numpy_on_every_row(tiny_models):
    model, ctx = _contexts(tiny_models["target"])
    ref = Context(model, ModelConfig(n_ctx=256, n_batch=64, n_threads=2))
    prompt = model.tokenize("def quicksort(arr):\n    if len(arr) <= 1:")
    assert ctx.set_device_argmax(True) and ctx.device_argmax
    got = ctx.eval_argmax(prompt, rows="all")
    want = ref.eval(prompt, logits="all").argmax(axis=1).tolist()
    assert got == want and len(got) == len(prompt)
    assert ctx.eval_argmax([got[-1]]) == ref.eval([want[-1]], logits="last").argmax(axis=1).tolist()
    # asking for logits detaches it: the logits are real again
    row = ctx.eval([got[-1]], logits="last")
    assert not ctx.device_argmax
    np.testing.assert_allclose(row, ref.eval([want[-1]], logits="last"), rtol=1e-4, atol=1e-4)
    ctx.close(), ref.close(), model.close()


def test_device_argmax_can_be_turned_off(tiny_models, monkeypatch):
    monkeypatch.setenv("LLAMASPEC_NO_DEVICE_ARGMAX", "1")
    model, ctx = _contexts(tiny_models["target"])
    assert ctx.set_device_argmax(True) is False
    assert ctx.eval_argmax(model.tokenize("hello world"), rows="all")  # numpy's argmax instead
    ctx.close(), model.close()


@pytest.mark.slow
def test_greedy_uses_device_argmax_and_sampling_does_not(tiny_models, monkeypatch):
    pair = load_pair(str(tiny_models["target"]), str(tiny_models["noisy"]), n_ctx=512, no_repack=True,
                     policy="fixed", draft_max=4)
    greedy = pair.generate("def fib(n):", max_tokens=24).text
    assert pair.target_ctx.device_argmax and pair.draft_ctx.device_argmax
    pair.generate("def fib(n):", max_tokens=8, temperature=0.7, seed=3)
    assert not pair.target_ctx.device_argmax and not pair.draft_ctx.device_argmax
    assert pair.generate("def fib(n):", max_tokens=24).text == greedy
    pair.close()
    # plain decoding (no drafter: one row a step) takes numpy's argmax over the copied row, and gives the same text
    plain = load_pair(str(tiny_models["target"]), n_ctx=512, no_repack=True)
    assert plain.generate("def fib(n):", max_tokens=24).text == greedy
    assert not plain.target_ctx.device_argmax
    plain.close()
