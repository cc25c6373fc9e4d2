"""The files `llamaspec chat` and `run` read and write: /save keeps an existing file unless /save! says so, writes
all or nothing and readable by the user alone (autosaved chats too, in a folder of their own); /load and `run -f`
read only a regular file, and no more of it than the context could hold.

ChatSession's file commands use only the pair's paths and context size, so a stand-in pair (a crafted model's
header, no weights loaded) drives them here; tests/cli/test_chat_repl.py drives the same commands in a terminal."""
from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from support.gguf_crafted import tiny_llama

from llamaspec.cli.chat import CHAT_DIR_ENV, ChatSession
from llamaspec.cli.textfile import BYTES_PER_TOKEN, read_text_file
from llamaspec.errors import PromptFileError
from llamaspec.gguf.reader import read_model_info

N_CTX = 256
MESSAGES = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]


@pytest.fixture
def session(tmp_path) -> ChatSession:
    model = tiny_llama().write(tmp_path / "model.gguf")
    pair = SimpleNamespace(target=SimpleNamespace(path=model, info=read_model_info(model)), draft=None, n_ctx=N_CTX,
                           tokenize=lambda text, add_special=True: list(text.encode()))   # /load counts tokens
    chat = ChatSession(pair, None, {"max_tokens": None, "temperature": 0.0})
    chat.messages = [dict(m) for m in MESSAGES]
    return chat


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def said(capsys) -> str:
    out = capsys.readouterr()
    return out.out + out.err


def test_save_writes_a_new_file_readable_by_the_user_alone(session, tmp_path, capsys):
    path = tmp_path / "mine.json"
    session.command(f"/save {path}")
    assert f"saved 2 messages to {path}" in said(capsys)
    assert json.loads(path.read_text())["messages"] == MESSAGES
    assert mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json", "model.gguf"]   # no temporary left


def test_save_keeps_an_existing_file_and_save_bang_replaces_it(session, tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    os.chmod(path, 0o644)
    assert session.command(f"/save {path}") is True
    assert said(capsys).strip() == f"error: /save: {path} exists; /save! {path} overwrites it"
    assert path.read_text() == "my notes\n"
    session.command(f"/save! {path}")
    assert f"saved 2 messages to {path}" in said(capsys)
    assert json.loads(path.read_text())["messages"] == MESSAGES and mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "notes.txt"]


def test_save_through_a_dangling_link_does_not_write_where_it_points(session, tmp_path, capsys):
    link, target = tmp_path / "link.json", tmp_path / "elsewhere.json"
    link.symlink_to(target)
    session.command(f"/save {link}")
    assert "exists; /save! " in said(capsys)
    assert not target.exists() and link.is_symlink()


def test_help_names_save_bang(session, capsys):
    session.command("/help")
    assert "/save! FILE overwrites" in said(capsys)


def test_a_failed_write_leaves_the_old_file_whole(session, tmp_path, capsys, monkeypatch):
    path = tmp_path / "keep.json"
    path.write_text("old\n")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    session.command(f"/save! {path}")
    assert f"cannot write {path}: No space left on device" in said(capsys)
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.json", "model.gguf"]


def test_an_autosaved_chat_is_private_in_a_private_folder(session, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "data" / "chats"
    monkeypatch.setenv(CHAT_DIR_ENV, str(folder))
    session.save_on_exit()
    session.save_on_exit()   # the same second: a second name, never the first file again
    saved = sorted(folder.glob("chat-*.json"))
    assert len(saved) == 2 and all(mode(p) == 0o600 for p in saved) and mode(folder) == 0o700
    assert all(json.loads(p.read_text())["messages"] == MESSAGES for p in saved)
    assert f"conversation saved to {saved[0]}" in said(capsys)


# ---------------------------------------------------------------------------------------------------------------
# bounded reads
# ---------------------------------------------------------------------------------------------------------------
def conversation_of(n_bytes: int) -> str:
    text = json.dumps({"system": None, "messages": [{"role": "user", "content": "x" * n_bytes}]})
    return text


def test_load_refuses_a_conversation_larger_than_the_context_could_hold(session, tmp_path, capsys):
    fits, too_big = tmp_path / "fits.json", tmp_path / "big.json"
    fits.write_text(conversation_of(N_CTX * BYTES_PER_TOKEN // 2))
    too_big.write_text(conversation_of(N_CTX * BYTES_PER_TOKEN))
    session.command(f"/load {too_big}")
    assert said(capsys).strip().startswith(f"error: /load: {too_big}: more than 16 KiB")
    assert session.messages == MESSAGES
    session.command(f"/load {fits}")
    assert "loaded 1 messages" in said(capsys)


def with_writer(fifo: Path, data: bytes) -> threading.Thread:
    """A writer for `fifo`, so that code which opens it to read does not wait forever (as it once did)."""
    def write():
        try:
            fd = os.open(fifo, os.O_WRONLY)
        except OSError:
            return
        try:   # the reader may close first: the write or the flush at close then meets a broken pipe
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BrokenPipeError:
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def unblock(fifo: Path) -> None:
    """Open and close the read end, so a writer still waiting in with_writer goes on."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.close(fd)


def test_load_refuses_a_fifo_and_a_device(session, tmp_path, capsys):
    fifo = tmp_path / "chat.fifo"
    os.mkfifo(fifo)
    writer = with_writer(fifo, json.dumps({"system": None, "messages": []}).encode())
    session.command(f"/load {fifo}")
    assert said(capsys).strip() == f"error: /load: {fifo}: not a regular file (a pipe, socket or device); give a " \
                                   "text file"
    unblock(fifo)
    writer.join(5)
    assert session.messages == MESSAGES
    with pytest.raises(PromptFileError, match="/dev/zero: not a regular file"):
        read_text_file(Path("/dev/zero"), 1 << 20)


def run_cli(args, input=None):
    from llamaspec.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_run_reads_a_prompt_file_or_stdin_only_as_far_as_the_context_goes(tmp_path):
    model = tiny_llama().write(tmp_path / "model.gguf")
    big = tmp_path / "big.txt"
    big.write_text("word " * (64 * BYTES_PER_TOKEN // 5 + 1))
    line = one_error_line(run_cli(["run", "-m", model, "-c", "64", "-n", "1", "-f", big]))
    assert line.startswith(f"error: {big}: more than 4 KiB")
    line = one_error_line(run_cli(["run", "-m", model, "-c", "64", "-n", "1", "-"], input=big.read_bytes()))
    assert line.startswith("error: stdin: more than 4 KiB")
    fifo = tmp_path / "prompt.fifo"
    os.mkfifo(fifo)
    writer = with_writer(fifo, b"hello")
    line = one_error_line(run_cli(["run", "-m", model, "-c", "64", "-n", "1", "-f", fifo]))
    unblock(fifo)
    writer.join(5)
    assert line == f"error: {fifo}: not a regular file (a pipe, socket or device); give a text file"
