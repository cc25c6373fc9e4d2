"""`llamaspec chat` in a real terminal (tmux), with the real test pair: two turns that reuse the KV cache,
Ctrl-C in the middle of a reply, /stats, /exit. Skipped without tmux or without the real models."""
from __future__ import annotations

import re
import shlex
import sys

import pytest
from conftest import REAL_DRAFT, REAL_TARGET
from support.paths import REPO
from support.tmux import tmux  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

STATS = re.compile(r"tok/s \| acceptance \S+ \| [\d.]+ tok/pass \| draft \d+ \| first token ([\d.]+) s "
                   r"\((\d+)/(\d+) prompt tokens cached\)")


def reply_after(screen: str, message: str) -> str:
    """The text between the line where `message` was typed and the reply's statistics line."""
    tail = screen.split(message, 1)[1].split("\n", 1)[1]
    return re.split(r"^\d+ tokens \| ", tail, maxsplit=1, flags=re.M)[0]


def test_chat_in_a_terminal_two_turns_ctrl_c_stats_exit(tmux, real_models):
    env = {"PYTHONPATH": str(REPO), "LLAMASPEC_NO_REPACK": "1"}
    command = " ".join(["env", *(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.quote(sys.executable),
                        "-m", "llamaspec", "chat", "-m", shlex.quote(str(real_models / REAL_TARGET)),
                        "-md", shlex.quote(str(real_models / REAL_DRAFT)), "-c", "1024"])
    tmux.start(command)
    tmux.wait_for(lambda s: "llamaspec chat:" in s and s.rstrip().endswith(">>>"), 180, "the first prompt")

    # 1. two short turns; the second reuses the cached first turn
    tmux.type("What is 2+2? Answer with just the number.")
    tmux.wait_for(lambda s: len(STATS.findall(s)) == 1 and s.rstrip().endswith(">>>"), 240, "reply 1")
    tmux.type("And 3+3? Answer with just the number.")
    screen = tmux.wait_for(lambda s: len(STATS.findall(s)) == 2 and s.rstrip().endswith(">>>"), 240, "reply 2")
    (ttft1, cached1, prompt1), (ttft2, cached2, prompt2) = [tuple(map(float, m)) for m in STATS.findall(screen)]
    print(f"\nturn 1: first token {ttft1} s, {cached1:.0f}/{prompt1:.0f} cached; "
          f"turn 2: first token {ttft2} s, {cached2:.0f}/{prompt2:.0f} cached")
    assert cached1 == 0 and cached2 >= prompt1
    assert "4" in reply_after(screen, "What is 2+2?") and "6" in reply_after(screen, "And 3+3?")

    # 2. Ctrl-C in the middle of a long reply returns to the prompt
    tmux.type("Write a 400-word story about a dragon who learns to bake bread.")
    start = len(tmux.screen())

    def reply_started(s: str) -> bool:
        tail = s.split("bake bread.", 1)[-1]
        return len(tail.strip()) > 20

    tmux.wait_for(reply_started, 240, "the long reply to start")
    tmux.keys("C-c")
    screen = tmux.wait_for(lambda s: "[stopped" in s and s.rstrip().endswith(">>>"), 120, "the stopped reply")
    assert len(STATS.findall(screen)) == 3 and len(screen) > start
    assert "EXIT=" not in screen                       # Ctrl-C stopped the reply, not the program

    # 3. /stats describes the stopped reply; /exit leaves with status 0
    tmux.type("/stats")
    screen = tmux.wait_for(lambda s: "finish_reason" in s, 30, "/stats")
    assert re.search(r"finish_reason\s+cancelled", screen)
    assert re.search(r"prompt_tokens_cached\s+[1-9]", screen)
    tmux.type("/exit")
    tmux.wait_for(lambda s: "EXIT=0" in s, 30, "EXIT=0")
