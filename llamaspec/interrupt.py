"""Stopping llama.cpp's long calls (a model load, a prefill, a drafter's catch-up) when asked to.

llama.cpp asks two callbacks whether to go on: the abort callback between the graph nodes of a CPU decode, the
progress callback between the tensors of a load; llamaspec's Context also asks between the chunks of a long decode.
They all answer `requested()`: the calling thread's cancel event (`cancel_when(event)`: the server's job, set when
its client leaves or the server stops), or a Ctrl-C / SIGTERM / SIGHUP that arrived while the call ran.

Python cannot raise inside a C call, and an exception raised in a ctypes callback (the log, the progress) is
printed and lost: so while a call into llama.cpp runs in the main thread, `signals_stop()` turns SIGINT, SIGTERM
and SIGHUP into a flag the callbacks read, and raises KeyboardInterrupt (SIGINT) or SystemExit(128 + the signal)
once the call has returned. Handlers someone else installed (uvicorn's, a host program's, nohup's SIG_IGN) are
left alone.
Knows nothing about llama.cpp: the backend installs the callbacks.
"""
from __future__ import annotations

import contextlib
import signal
import threading

_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
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
    """A SIGTERM (or SIGHUP) handler for a command's lifetime: exit 128 + the signal through the `finally` blocks
    (the models are freed, a chat is saved), where the default action would end the process at once;
    signals_stop takes over from it during a call."""
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Install `terminate` for SIGTERM, unless someone else handles it (main thread only)."""
    _exit_on("SIGTERM")


def exit_on_hangup() -> None:
    """Install `terminate` for SIGHUP (a closed terminal, a dropped SSH connection), unless someone else handles or
    ignores it (nohup), in the main thread only."""
    _exit_on("SIGHUP")


def _exit_on(name: str) -> None:
    sig = getattr(signal, name, None)
    if sig is not None and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(sig) == signal.SIG_DFL:
        signal.signal(sig, terminate)


@contextlib.contextmanager
def shielded(active: bool = True):
    """Ctrl-C ignored inside the block (`active`, in the main thread, under Python's own SIGINT handler): what must
    finish once a stop was asked, a stopped reply put away, is not cut short by the next Ctrl-C."""
    previous = None
    if active and threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def signals_stop():
    """Run a call into llama.cpp so that Ctrl-C, SIGTERM or SIGHUP stops it (through `requested()`) and then
    raises KeyboardInterrupt or SystemExit(128 + the signal). Outside the main thread, or under handlers someone
    else installed, it changes nothing."""
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
            if first == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + first)
