"""The line a command prints while a model loads: `loading Qwen3.6-27B-Q4_K_M.gguf (16.7 GB) on CUDA0 ...` on stderr.

On a terminal the line ends with the time the load took, and a bar grows after it while a load is long. Elsewhere
(a pipe, a file, a service's log) `serve` prints the line alone and the other commands print nothing: what they
write is what scripts read, and a failure stays one `error:` line. stdout is never written.
"""
from __future__ import annotations

import sys
import time

from ..backend import LoadWatcher


def placement(options, gpus, n_layer: int) -> str:
    """Where llama.cpp puts a model's layers, in a few words: "CPU", "CUDA0", "CUDA0+CUDA1", "CUDA0 (20 of 64
    layers, the rest on the CPU)". `options`: its ModelConfig; `gpus`: the backend's GPU devices, in order."""
    if options.devices is not None:
        chosen = [d for d in gpus if d.name in options.devices]
    elif options.split_mode == "none":
        chosen = gpus[options.main_gpu:options.main_gpu + 1]
    else:
        chosen = list(gpus)
    if options.n_gpu_layers == 0 or not chosen:
        return "CPU"
    names = "+".join(d.name for d in chosen)
    if 0 < options.n_gpu_layers < n_layer:
        return f"{names} ({options.n_gpu_layers} of {n_layer} layers, the rest on the CPU)"
    return names


def file_size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{max(n_bytes / 1e6, 1):.0f} MB"


class LoadLine(LoadWatcher):
    """One line per model load on `stream`; with `terminal`, finished in place with the time it took, and a bar
    after `bar_after` seconds of loading (redrawn at most every tenth of a second)."""

    BAR_WIDTH = 24

    def __init__(self, stream, terminal: bool, bar_after: float = 1.0, clock=time.monotonic):
        self.stream, self.terminal, self.bar_after, self.clock = stream, terminal, bar_after, clock
        self.head: str | None = None

    def begins(self, info, options) -> None:
        from ..backend import devices

        where = placement(options, [d for d in devices() if d.kind == "gpu"], info.n_layer)
        self.head = f"loading {info.path.name} ({file_size(info.file_size)}) on {where} ..."
        self.started = self.drawn = self.clock()
        self._write(self.head + ("" if self.terminal else "\n"))

    def progress(self, fraction: float) -> None:
        if not self.terminal or self.head is None:
            return
        now = self.clock()
        if now - self.started < self.bar_after or (now - self.drawn < 0.1 and fraction < 1):
            return
        self.drawn = now
        filled = int(min(max(fraction, 0.0), 1.0) * self.BAR_WIDTH)
        self._write(f"\r{self.head} [{'#' * filled}{'.' * (self.BAR_WIDTH - filled)}] {fraction:4.0%}")

    def ends(self, outcome: str) -> None:
        if self.terminal and self.head is not None:
            said = f"done ({self.clock() - self.started:.1f} s)" if outcome == "done" else outcome
            self._write(f"\r\x1b[K{self.head} {said}\n")    # \x1b[K: the bar's end is cleared
        self.head = None

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def load_line(log_always: bool = False, stream=None) -> LoadLine | None:
    """The load line for a command: on a terminal always, elsewhere only for a log (`serve`); None: no line."""
    stream = stream or sys.stderr
    terminal = bool(getattr(stream, "isatty", lambda: False)())
    return LoadLine(stream, terminal) if terminal or log_always else None
