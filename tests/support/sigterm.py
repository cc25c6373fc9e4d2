"""pytest hooks: a SIGTERM (from `timeout`, CI, a user's kill) ends the test run at once, also when it arrives
during a llama.cpp call, instead of failing one test and going on.

llamaspec turns a SIGTERM that arrives during a call into llama.cpp into a flag the call's callbacks read, and
raises SystemExit(143) once the call has stopped (llamaspec.interrupt). A test that gets that exception would be
reported as failed and the run would go on; these hooks end the run there (pytest.exit, so the fixtures' teardown
still stops the servers they started). Outside a call, `interrupt.terminate` raises the same exception.
"""
from __future__ import annotations

import signal

import pytest

from llamaspec import interrupt

SIGTERM_EXIT = 128 + signal.SIGTERM
_installed = False


def pytest_configure(config):
    global _installed
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt.terminate)
        _installed = True


def pytest_unconfigure(config):
    global _installed
    if _installed and signal.getsignal(signal.SIGTERM) is interrupt.terminate:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _installed = False


def _end_run_on_sigterm():
    try:
        return (yield)
    except SystemExit as exc:
        if exc.code == SIGTERM_EXIT:
            pytest.exit("terminated (SIGTERM)", returncode=SIGTERM_EXIT)
        raise


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    return (yield from _end_run_on_sigterm())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item):
    return (yield from _end_run_on_sigterm())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _end_run_on_sigterm())
