"""A `llamaspec serve` process for the server tests, and the HTTP helpers they share: start one on a free loopback
port, read its metrics and health, post raw bodies, check OpenAI's error JSON, hold a stream open. Imported after the
test module's `pytest.importorskip("httpx")`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .paths import REPO

API_KEY = "sk-test-key"
ADMIN_KEY = "admin-test-key"
N_CTX = 1024
HTTP = httpx.Client(timeout=60)  # one client for the helpers: a new one per call costs ~40 ms (TLS set-up)


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _one_cpu() -> None:
    """Keep the server on one CPU (llama.cpp's default thread count follows the affinity), leaving the other
    cores to the test process: fewer threads fighting over a small machine."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})


def start_server(models: dict, log: Path, *args: str, n_ctx: int = N_CTX, draft: str = "noisy") -> ServerProcess:
    """`python -m llamaspec serve` on 127.0.0.1, any free port; returns once it says where it listens."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "llamaspec", "serve", "-m", str(models["target"]), "-md", str(models[draft]),
           "-c", str(n_ctx), "-t", "1", "--port", "0", *args]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                preexec_fn=_one_cpu)
    deadline = time.monotonic() + 90
    while True:
        text = log.read_text(errors="replace")
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
        if found:
            return ServerProcess(proc, found.group(1), log)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start (exit {proc.poll()}):\n{text}")
        time.sleep(0.1)


def metric(url: str, line_prefix: str, headers=None) -> float:
    """One sample of /metrics (0 when absent)."""
    text = HTTP.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def health(url: str) -> dict:
    return HTTP.get(f"{url}/health", timeout=10).json()


def post(url: str, path: str, body, headers=None, timeout: float = 60) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return HTTP.post(f"{url}{path}", content=data, headers={"Content-Type": "application/json", **(headers or {})},
                      timeout=timeout)


def assert_openai_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if status == 400:
        assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


class OpenStream:
    """A streamed request whose first chunk has arrived (so it is generating); `close()` hangs up."""

    def __init__(self, url: str, body: dict):
        self.http = httpx.Client(timeout=60)
        self.response = self.http.send(self.http.build_request("POST", f"{url}/v1/completions", json=body),
                                       stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()  # keep a reference: dropping the iterator closes the connection
        for line in self.lines:
            if line.startswith("data: "):
                break

    def read_to_end(self) -> list[str]:
        return list(self.lines)

    def close(self) -> None:
        self.response.close()
        self.http.close()
