"""Run the target through llama.cpp's RPC backend (an rpc-server on 127.0.0.1) and check that speculative
decoding gives the same greedy text as with the target loaded locally.

    python benchmarks/probes/rpc_check.py --target T.gguf --draft D.gguf --rpc-server PATH/rpc-server [-n 64]

Needs a llama-cpp-python built with -DGGML_RPC=on (or LLAMA_CPP_LIB_PATH pointing at llama.cpp libraries built
with it) and an rpc-server from the same llama.cpp source. Prints where each model's weights went (from
llama.cpp's load log), both texts' agreement and both speeds.
"""
from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time

from llamaspec import load_pair
from llamaspec.backend import add_rpc_servers, devices


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server(binary: str, port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"rpc-server exited: {proc.stdout.read()}")
            time.sleep(0.2)
    proc.kill()
    sys.exit("rpc-server did not start listening within 30 s")


def buffers(log: str) -> list[str]:
    """llama.cpp's 'model buffer size' lines: which device got how much of the weights."""
    return [m.group(0).strip() for m in re.finditer(r"[\w\[\]:.]+ model buffer size\s*=\s*[\d.]+ MiB", log)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--rpc-server", required=True)
    ap.add_argument("--server-args", default="", help="extra rpc-server flags (e.g. -d CUDA0)")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-ngl", type=int, default=-1)
    ap.add_argument("--prompt", default="def quicksort(arr):")
    a = ap.parse_args()

    port = free_port()
    server = start_rpc_server(a.rpc_server, port, a.server_args.split())
    try:
        results = {}
        for where in ("local", "rpc"):
            rpc = f"127.0.0.1:{port}" if where == "rpc" else None
            # name the server's devices: llama.cpp skips an RPC device that reports the same GPU as a local one,
            # which is what a server on this machine does
            names = tuple(d.name for d in add_rpc_servers(rpc)) if rpc else None
            t0 = time.perf_counter()
            pair = load_pair(a.target, a.draft, n_ctx=1024, n_gpu_layers=a.ngl, rpc_servers=rpc, devices=names,
                             policy="fixed", draft_max=4)
            load_s = time.perf_counter() - t0
            pair.generate(a.prompt, max_tokens=8)
            pair.reset()
            c = pair.generate(a.prompt, max_tokens=a.n)
            results[where] = c
            print(f"{where}: load {load_s:.1f} s; {c.stats.summary()}")
            print(f"  target weights: {'; '.join(buffers(pair.target.load_log)) or 'n/a'}")
            print(f"  draft weights:  {'; '.join(buffers(pair.draft.load_log)) or 'n/a'}")
            if rpc and not any(b.startswith("RPC") for b in buffers(pair.target.load_log)):
                sys.exit("the target's weights did not go to the RPC server")
            pair.close()
        print("devices:", ", ".join(f"{d.name} ({d.backend}: {d.description})" for d in devices()))
        same = results["local"].text == results["rpc"].text
        speed = results["rpc"].stats.tokens_per_second / results["local"].stats.tokens_per_second
        print(f"same greedy text: {same}; rpc/local speed: {speed:.2f}x")
        sys.exit(0 if same else 1)
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
