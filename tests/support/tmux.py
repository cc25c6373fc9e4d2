"""A real terminal for the chat tests: a tmux session that a test types into and reads the screen of; the `tmux`
fixture skips when tmux is not installed."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest


class Tmux:
    def __init__(self, name: str):
        self.name = name

    def start(self, command: str) -> None:
        shell = f"{command}; echo EXIT=$?; sleep 600"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "50", shell], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def type(self, text: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, "-l", text], check=True)
        self.keys("Enter")

    def screen(self) -> str:
        out = subprocess.run(["tmux", "capture-pane", "-p", "-J", "-t", self.name, "-S", "-3000"],
                             capture_output=True, text=True, check=True)
        return out.stdout

    def wait_for(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            if "EXIT=" in screen and "EXIT=" not in what:
                break
            time.sleep(0.3)
        pytest.fail(f"timed out waiting for {what}; the terminal shows:\n{self.screen()[-3000:]}")

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


@pytest.fixture
def tmux():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    session = Tmux(f"llamaspec-test-{os.getpid()}")
    yield session
    session.kill()
