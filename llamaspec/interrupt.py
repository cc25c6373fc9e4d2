"""Stopping llama.cpp's long calls (a model load, a prefill, a drafter's catch-up) when asked to.

llama.cpp asks two callbacks whether to go on: the abort callback between the graph nodes of a CPU decode, the
progress callback between the tensors of a load; llamaspec's Context also asks between the chunks of a long decode.
They all answer `requested()`: the calling thread's cancel event (`cancel_when(event)`: the server's job, set when
its client leaves or the server stops), or a Ctrl-C / SIGTERM that arrived while the call ran.

Python cannot raise inside a C call, and an exception raised in a ctypes callback (the log, the progress) is
printed and lost: so while a call into llama.cpp runs in the main thread, `signals_stop()` turns SIGINT and
SIGTERM into a flag the callbacks read, and raises KeyboardInterrupt (SIGINT) or SystemExit(143) (SIGTERM) once
the call has returned. Handlers someone else installed (uvicorn's, a host program's) are left alone.
Knows nothing about llama.cpp: the backend installs the callbacks.
"""
from __future__ import annotations

import contextlib
import signal
import threading

_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)
_caught: list[int] = []   # signals that arrived while a call ran (main thread only)


class _Local(threading.local):
    event: threading.Event | None = None


_local = _Local()


@contextlib.contextmanager
def cancel_when(event: threading.Event | None):
    """Calls into llama.cpp made by this thread inside the block stop soon after `event` is set."""
    previous, _local.event = _local.event, event
    try:
        yield
    finally:
        _local.event = previous


def requested() -> bool:
    """Whether the current call should stop (read from llama.cpp's callbacks, so: cheap, and never raises)."""
    event = _local.event
    return bool(_caught) or (event is not None and event.is_set())


def _catch(signum, frame) -> None:
    _caught.append(signum)


def terminate(signum, frame):
    """A SIGTERM handler for a command's lifetime: exit 143 through the `finally` blocks (the models are freed),
    where the default action would end the process at once; signals_stop takes over from it during a call."""
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Install `terminate` for SIGTERM, unless someone else handles it (main thread only)."""
    sigterm = getattr(signal, "SIGTERM", None)
    if sigterm is not None and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(sigterm) == signal.SIG_DFL:
        signal.signal(sigterm, terminate)


@contextlib.contextmanager
def signals_stop():
    """Run a call into llama.cpp so that Ctrl-C or SIGTERM stops it (through `requested()`) and then raises
    KeyboardInterrupt or SystemExit(143). Outside the main thread, or under handlers someone else installed, it
    changes nothing."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            handler = signal.getsignal(sig)
            if handler in (signal.default_int_handler, signal.SIG_DFL, terminate):
                previous[sig] = signal.signal(sig, _catch)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous and _caught:
            first = _caught[0]
            _caught.clear()
            if first == getattr(signal, "SIGTERM", None):
                raise SystemExit(128 + first)
            raise KeyboardInterrupt
