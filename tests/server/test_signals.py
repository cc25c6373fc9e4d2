"""Stopping `llamaspec serve` (and the clients that leave it) at every stage, with the real pair on one CPU, where a
3,000-token prompt takes tens of seconds to prefill: a client that hangs up mid-prefill frees the worker within a
chunk; SIGINT and SIGTERM during the load, the prefill, the generation and while idle end the process within a few
seconds, cut replies end with a JSON error or a final chunk saying "cancelled", and no run ends in a traceback or a
signal (the double Ctrl-C during a prefill once crashed the interpreter: it runs 20 times)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from conftest import REAL_DRAFT, REAL_TARGET  # noqa: E402
from support.servers import start_server  # noqa: E402

pytestmark = [pytest.mark.realmodel]
LONG_PROMPT = "Summarize the following log. " + "the quick brown fox jumps over the lazy dog; " * 300  # ~3,000 tokens
EXIT_WITHIN = 8.0   # seconds from the (last) signal to the process's end


@pytest.fixture(scope="module")
def pair(real_models):
    return {"target": real_models / REAL_TARGET, "noisy": real_models / REAL_DRAFT}


def serve(pair, tmp_path, *args):
    return start_server(pair, tmp_path / "server.log", "--shutdown-timeout", "0.5", *args, n_ctx=4096)


class Stream(threading.Thread):
    """A streamed completion read in the background: the SSE payloads it got, and how it ended."""

    def __init__(self, url: str, prompt: str, max_tokens: int = 200):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.events: list = []
        self.status = None
        self.error = None
        self.started = threading.Event()

    def run(self):
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", timeout=120,
                              json={"prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        if isinstance(self.events[-1], dict) and self.events[-1].get("choices", [{}])[0].get("text"):
                            self.started.set()
        except httpx.HTTPError as e:
            self.error = e

    @property
    def finish(self):
        reasons = [c.get("finish_reason") for e in self.events if isinstance(e, dict) for c in e.get("choices", [])]
        return next((r for r in reversed(reasons) if r), None)


def wait_busy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health", timeout=5).json()["running"] != 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


def signals_as_a_terminal_gives_them() -> None:
    """In the child before exec: SIGINT, SIGTERM and SIGHUP at their defaults and nothing blocked, as a command
    started from a shell gets them (an ignored or blocked disposition would be inherited from whatever ran before in
    this process)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def ends_cleanly(proc: subprocess.Popen, log_text, expected_rc: int = 0) -> float:
    t0 = time.monotonic()
    try:
        rc = proc.wait(EXIT_WITHIN)
    except subprocess.TimeoutExpired:
        proc.kill()
        masks = [line for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines()
                 if line.startswith(("SigBlk", "SigIgn"))]   # what the child inherited, where it was not reset
        raise AssertionError(f"still running {EXIT_WITHIN} s after the signal ({', '.join(masks)}):\n{log_text()}")
    text = log_text()
    assert rc == expected_rc, f"exit {rc}:\n{text}"
    assert "Traceback" not in text and "Exception ignored" not in text, text
    return time.monotonic() - t0


def test_a_client_that_hangs_up_mid_prefill_frees_the_worker(pair, tmp_path):
    server = serve(pair, tmp_path)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 5}, timeout=2)
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        waited = time.monotonic() - t0
        assert r.status_code == 200, r.text
        print(f"\nthe next request answered {waited:.2f} s after the first client hung up")
        assert waited < 5.0   # the prefill alone takes tens of seconds on one CPU
    finally:
        server.stop()
    assert "Traceback" not in server.stderr()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_during_the_load_stops_it(pair, tmp_path, sig):
    log = tmp_path / "load.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "llamaspec", "serve", "-m", str(pair["target"]), "-md",
                                 str(pair["noisy"]), "--port", "0"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, preexec_fn=signals_as_a_terminal_gives_them)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 120
    while str(pair["target"]) not in maps.read_text():   # llama.cpp has mapped the file: the load is under way
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    proc.send_signal(sig)
    ends_cleanly(proc, log.read_text, 130 if sig == signal.SIGINT else 128 + sig)   # a hang-up too: 129
    text = log.read_text()
    assert "listening" not in text
    said = [line for line in text.splitlines() if not line.startswith("loading ")]   # serve logs each load
    assert said in ([], ["interrupted"]), text


@pytest.mark.parametrize("stage", ["idle", "prefill", "generation"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_each_stage_ends_the_server_cleanly(pair, tmp_path, stage, sig):
    server = serve(pair, tmp_path)
    stream = None
    if stage != "idle":
        stream = Stream(server.url, LONG_PROMPT if stage == "prefill" else "Count from one to a thousand:", 400)
        stream.start()
        wait_busy(server.url)
        if stage == "generation":
            assert stream.started.wait(120), "no token came"
        else:
            time.sleep(1.0)
            assert not stream.started.is_set()
    server.proc.send_signal(sig)
    seconds = ends_cleanly(server.proc, server.stderr)
    print(f"\n{stage}: exited {seconds:.2f} s after the signal")
    if stream is not None:
        stream.join(10)
        assert stream.status == 200 and stream.events[-1] == "[DONE]", (stream.events[-3:], stream.error)
        assert stream.finish == "cancelled"   # not "length": the reply was cut


@pytest.mark.slow
def test_a_double_ctrl_c_during_a_prefill_ends_cleanly_20_times(pair, tmp_path):
    for i in range(20):
        server = start_server(pair, tmp_path / f"server-{i}.log", n_ctx=4096)   # default grace: 10 s
        stream = Stream(server.url, LONG_PROMPT, 50)
        stream.start()
        wait_busy(server.url)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.15)
        server.proc.send_signal(signal.SIGINT)   # the reflexive second one: cut now, do not crash
        ends_cleanly(server.proc, server.stderr)
        stream.join(10)
        assert stream.events and stream.events[-1] == "[DONE]" and stream.finish == "cancelled", (i, stream.events)
        assert re.search(r"llamaspec serve: stopped", server.stderr())
