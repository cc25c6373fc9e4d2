"""`llamaspec chat` keeps the conversation whatever is typed: a bad slash-command argument is one line, Ctrl-C at the
prompt clears the line (also the reflexive second one after stopping a reply), only Ctrl-D and /exit quit, /save keeps
an existing file (/save! replaces it), and the conversation is saved on the way out and can be loaded again. Driven
in a real terminal (tmux) with a small real model (smollm2-135m, drafting by prompt lookup so /k has something to
set)."""
from __future__ import annotations

import json
import shlex
import sys

import pytest
from conftest import REAL_SMOLLM
from support.paths import REPO
from support.tmux import tmux  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.realmodel]


def start_chat(tmux, real_models, chat_dir, *extra: str) -> None:
    env = {"PYTHONPATH": str(REPO), "LLAMASPEC_NO_REPACK": "1", "LLAMASPEC_CHAT_DIR": str(chat_dir)}
    command = " ".join(["env", *(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.quote(sys.executable),
                        "-m", "llamaspec", "chat", "-m", shlex.quote(str(real_models / REAL_SMOLLM)),
                        "--lookup-only", "-c", "1024", "-n", "40", "-t", "1", *extra])
    tmux.start(command)
    tmux.wait_for(lambda s: "llamaspec chat:" in s and s.rstrip().endswith(">>>"), 120, "the first prompt")


def prompts(screen: str) -> int:
    return sum(1 for line in screen.splitlines() if line.startswith(">>>"))


def test_no_key_press_or_bad_argument_loses_the_conversation(tmux, real_models, tmp_path):  # noqa: F811
    chat_dir = tmp_path / "chats"
    start_chat(tmux, real_models, chat_dir)

    # 1. every slash command's bad argument is one line, and the chat goes on
    for command, answer in [("/k ²", "usage: /k N"), ("/k 99999", "error: /k: N must be an integer in [0, 1023]"),
                            ("/temp inf", "error: /temp: X must be a number in [0, 2], got inf"),
                            ("/temp 1e999", "error: /temp: X must be a number"), ("/temp ½", "usage: /temp X"),
                            ("/policy nope", "usage: /policy NAME"), ("/save", "usage: /save FILE"),
                            ("/load /nonexistent/x.json", "error: /load: /nonexistent/x.json: no such conversation"),
                            ("/load " + str(REPO / "pyproject.toml"), "is not a conversation /save wrote")]:
        before = prompts(tmux.screen())
        tmux.type(command)
        screen = tmux.wait_for(lambda s: prompts(s) > before, 30, command)
        tail = screen.split(command, 1)[-1]
        assert answer in tail and "Traceback" not in screen, screen[-1500:]

    # 2. Ctrl-C clears a half-typed line and does not quit
    tmux.keys("-l", "half a thought")
    before = prompts(tmux.screen())
    tmux.keys("C-c")
    screen = tmux.wait_for(lambda s: prompts(s) > before, 30, "a fresh prompt after Ctrl-C")
    assert "EXIT=" not in screen

    # 3. a reply, then Ctrl-C twice in quick succession during the next one: the reply stops, the chat stays
    tmux.type("Say hello.")
    tmux.wait_for(lambda s: s.count("tok/s") == 1 and s.rstrip().endswith(">>>"), 120, "the first reply")
    tmux.type("Write a long story about a dragon.")
    tmux.wait_for(lambda s: len(s.split("about a dragon.")[-1].strip()) > 10, 120, "the story to start")
    tmux.keys("C-c")
    tmux.keys("C-c")
    screen = tmux.wait_for(lambda s: "[stopped" in s and s.rstrip().endswith(">>>"), 60, "the stopped reply")
    assert "EXIT=" not in screen

    # 4. /save writes the conversation; Ctrl-D quits and saves it to the folder the chat names
    saved = tmp_path / "mine.json"
    tmux.type(f"/save {saved}")
    tmux.wait_for(lambda s: f"to {saved}]" in s, 30, "/save")
    tmux.type(f"/save {saved}")   # a second time: the file is kept, and the way to replace it named
    tmux.wait_for(lambda s: f"/save! {saved} overwrites it" in s.replace("\n", ""), 30, "/save refusing")
    tmux.type(f"/save! {saved}")
    tmux.wait_for(lambda s: s.replace("\n", "").count(f"to {saved}]") == 2, 30, "/save!")
    record = json.loads(saved.read_text())
    assert [m["role"] for m in record["messages"]][:2] == ["user", "assistant"]
    assert record["messages"][0]["content"] == "Say hello."
    tmux.keys("C-d")
    screen = tmux.wait_for(lambda s: "EXIT=0" in s, 30, "EXIT=0 after Ctrl-D")
    on_exit = list(chat_dir.glob("chat-*.json"))
    assert len(on_exit) == 1 and f"conversation saved to {on_exit[0]}" in screen.replace("\n", "")
    assert json.loads(on_exit[0].read_text())["messages"] == record["messages"]

    # 5. /load brings it back in a new session, whose next turn sees the earlier ones
    tmux.kill()
    start_chat(tmux, real_models, chat_dir)
    tmux.type(f"/load {saved}")
    tmux.wait_for(lambda s: f"[loaded {len(record['messages'])} messages from {saved}]" in s, 30, "/load")
    tmux.type("Thanks.")
    screen = tmux.wait_for(lambda s: "tok/s" in s and s.rstrip().endswith(">>>"), 120, "the reply after /load")
    assert "prompt tokens cached" in screen
    tmux.type("/exit")
    tmux.wait_for(lambda s: "EXIT=0" in s, 30, "EXIT=0 after /exit")
    assert len(list(chat_dir.glob("chat-*.json"))) >= 1
