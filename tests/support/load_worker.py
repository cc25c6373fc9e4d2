"""Load GGUF files through llamaspec in a separate process, so that a file which aborts the process (a GGML_ASSERT
in llama.cpp, a division by zero) fails a test instead of killing pytest.

`python load_worker.py` reads one path per line on stdin; for each it loads the model on the CPU, makes a small
context, generates two tokens and prints one line: "ok", "error <LlamaspecError subclass>: <message>" or
"exception <type>: <message>" (an error that should have been a LlamaspecError). `LoadWorker` drives one such
process and restarts it after it dies.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading


STATUS = "@@status"  # marks the worker's own lines among anything a library prints on stdout


def main() -> None:
    from llamaspec import load_pair
    from llamaspec.errors import LlamaspecError

    for line in sys.stdin:
        try:
            pair = load_pair(line.strip(), None, n_ctx=64, n_batch=64, n_gpu_layers=0, no_repack=True, n_threads=1)
            try:
                list(pair.stream([0, 0], max_tokens=2))
            finally:
                pair.close()
            status = "ok"
        except LlamaspecError as e:
            status = f"error {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
            status = f"exception {type(e).__name__}: {e}"
        print(STATUS, " ".join(status.split()), flush=True)


class LoadWorker:
    """One worker process; `load(path)` returns its status line, or "died: ..." / "hung: ..." (restarting it)."""

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        from .paths import REPO   # here, not at the top: the worker runs this file as a script, outside the package

        env = dict(os.environ, LLAMASPEC_NO_REPACK="1", GGML_NO_BACKTRACE="1")  # an abort without a gdb session
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the worker
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()

    @staticmethod
    def _read(proc, lines) -> None:
        for line in proc.stdout:
            if line.startswith(STATUS):
                lines.put(line[len(STATUS):].strip())
        lines.put(None)

    def load(self, path: str | os.PathLike) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self.close()
            return f"hung: no answer in {self.timeout_s:.0f} s"
        if line is None:
            rc = self.proc.wait()
            self.stderr.seek(0)
            tail = self.stderr.read()[-400:].strip().replace("\n", " | ")
            self.proc = None
            return f"died: exit status {rc} ({tail})"
        return line

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


if __name__ == "__main__":
    main()
