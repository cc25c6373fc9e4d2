"""`llamaspec chat` keeps the conversation when its terminal goes away (a closed window, a dropped SSH connection:
SIGHUP), as on Ctrl-D and SIGTERM: at the prompt, and in the middle of a reply (the part that came is kept).

The chat runs in a pseudo-terminal of its own (pty.fork: the chat leads a session whose controlling terminal it
is), with the small real model; closing the terminal's master side is a real hang-up."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import REAL_SMOLLM
from support.paths import REPO

pytestmark = [pytest.mark.realmodel]


class Terminal:
    """The chat in a pseudo-terminal: what it printed so far, typing into it, hanging it up."""

    def __init__(self, real_models: Path, chat_dir: Path):
        args = [sys.executable, "-m", "llamaspec", "chat", "-m", str(real_models / REAL_SMOLLM), "--lookup-only",
                "-c", "1024", "-n", "200", "-t", "1"]
        env = dict(os.environ, PYTHONPATH=str(REPO), LLAMASPEC_NO_REPACK="1", LLAMASPEC_CHAT_DIR=str(chat_dir),
                   TERM="dumb")
        self.pid, self.fd = pty.fork()
        if self.pid == 0:   # the chat, with SIGHUP as a shell would leave it (pytest's own may differ)
            try:
                signal.signal(signal.SIGHUP, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, [])
                os.execve(sys.executable, args, env)
            finally:
                os._exit(127)   # never back into pytest in the child
        self.output = b""

    def wait_for(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    self.output += os.read(self.fd, 65536)
                except OSError:   # the chat ended
                    break
            text = self.output.decode("utf-8", "replace")
            if predicate(text):
                return text
        pytest.fail(f"timed out waiting for {what}; the terminal shows:\n{self.output.decode('utf-8', 'replace')}")

    def read_rest(self) -> None:
        try:
            while select.select([self.fd], [], [], 0)[0]:
                self.output += os.read(self.fd, 65536)
        except OSError:   # the chat ended, or the terminal was closed here
            pass

    def type(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\r")

    def exit_status(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read_rest()
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        pytest.fail(f"the chat was still running {timeout} s after the hang-up")

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.fixture
def terminal(real_models, tmp_path):
    chat_dir = tmp_path / "chats"
    term = Terminal(real_models, chat_dir)
    term.chat_dir = chat_dir
    yield term
    term.close()


def plain(text: str) -> str:
    """The text without the terminal's escape sequences (colours, the line editor's modes)."""
    return re.sub(r"\x1b(\[[0-9;?]*[A-Za-z]|[=>])", "", text)


def after(text: str, marker: str) -> str:
    return text.split(marker, 1)[1] if marker in text else ""


def prompts(text: str) -> int:
    return text.count(">>> ")


def saved_messages(terminal: Terminal) -> list[dict]:
    saved = list(terminal.chat_dir.glob("chat-*.json"))
    assert len(saved) == 1, f"saved {saved}; the terminal showed:\n{terminal.output.decode('utf-8', 'replace')}"
    return json.loads(saved[0].read_text())["messages"]


def test_closing_the_terminal_at_the_prompt_saves_the_conversation(terminal):
    terminal.wait_for(lambda s: "llamaspec chat:" in s and prompts(s) == 1, 120, "the first prompt")
    terminal.type("Say hello.")
    terminal.wait_for(lambda s: "tok/s" in s and prompts(s) == 2, 120, "the reply")
    os.close(terminal.fd)   # the window closes: the kernel sends SIGHUP to the chat, which leads the session
    assert terminal.exit_status() == 128 + signal.SIGHUP
    messages = saved_messages(terminal)
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "Say hello."
    assert messages[1]["content"].strip()


def test_a_hangup_in_the_middle_of_a_reply_keeps_what_came(terminal):
    terminal.wait_for(lambda s: "llamaspec chat:" in s and prompts(s) == 1, 120, "the first prompt")
    terminal.type("Write a long story about a dragon.")
    terminal.wait_for(lambda s: len(re.findall(r"[A-Za-z]", after(plain(s), "about a dragon."))) > 20, 120,
                      "the story to start")
    os.kill(terminal.pid, signal.SIGHUP)
    assert terminal.exit_status() == 128 + signal.SIGHUP
    messages = saved_messages(terminal)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"].strip()   # the part of the story that came
