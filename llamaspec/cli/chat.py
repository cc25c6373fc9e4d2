"""`llamaspec chat`: an interactive terminal chat with the target's own chat template.

Both KV caches are reused across turns (the engine keeps what matches the new prompt's prefix), so a turn only
prefills the new messages. Ctrl-C during a reply stops it (within a chunk of a long prefill); the partial reply
stays in the history (the model can be asked to continue, and templates that insist on user/assistant alternation
keep working). A reply stopped before its first token removes the user message again. Ctrl-C at the prompt clears
the line; only Ctrl-D and /exit quit, and the conversation is then saved (chats_dir(), readable by the user alone),
as it is on SIGTERM and SIGHUP (a closed terminal), so no key press or dropped connection loses it.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import click

from . import main
from .options import (Command, check_shaping_options, handle_errors, not_utf8, pair_options, reasoning_option,
                      sampler_kwargs, sampler_options, shaping_from_options, shaping_options, utf8_argument)
from .pair_choice import load_pair_from_options
from .textfile import read_text_file, text_limit

PROMPT = ">>> "
CONTINUATION = "... "
MULTILINE = '"""'
HELP = f"""Commands:
  /stats          full statistics of the last reply
  /reset          forget the conversation (keeps the system prompt)
  /k N            fixed draft length N (0 = plain decoding)
  /policy NAME    draft-length policy: auto, fixed, confidence, threshold
  /temp X         sampling temperature (0 = greedy)
  /save FILE      write the conversation as JSON (a new FILE; /save! FILE overwrites one)
  /load FILE      go on with a conversation /save wrote
  /help           this text
  /exit           quit (Ctrl-D too); the conversation is saved first
Ctrl-C stops a reply, or clears the line. Start a message with {MULTILINE} to type several lines; end it with {MULTILINE}."""


CHAT_DIR_ENV = "LLAMASPEC_CHAT_DIR"
PROGRESS_AFTER_S = 1.0   # a prefill shorter than this shows no progress line


def chats_dir() -> Path:
    """Where a conversation is saved on exit: $LLAMASPEC_CHAT_DIR, else the user data folder's chats/
    (~/.local/share/llamaspec/chats on Linux)."""
    if os.environ.get(CHAT_DIR_ENV):
        return Path(os.environ[CHAT_DIR_ENV]).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("llamaspec")) / "chats"


def dim(text: str) -> str:
    return click.style(text, dim=True)


def stats_line(stats, draft_len: int | None) -> str:
    """tok/s, acceptance, mean accepted length, current draft length, time to first token."""
    parts = [f"{stats.tokens_generated} tokens", f"{stats.tokens_per_second:.1f} tok/s"]
    if draft_len is not None:
        acceptance = f"{stats.acceptance_rate:.0%}" if stats.drafted else "-"
        parts += [f"acceptance {acceptance}", f"{stats.mean_accepted_length:.2f} tok/pass", f"draft {draft_len}"]
    parts.append(f"first token {stats.time_to_first_token:.2f} s "
                 f"({stats.prompt_tokens_cached}/{stats.prompt_tokens} prompt tokens cached)")
    return " | ".join(parts)


def format_stats(stats) -> str:
    lines = []
    for key, value in stats.to_dict().items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
        lines.append(f"  {key:<22} {value}")
    return "\n".join(lines)


def read_message() -> str:
    """One message; a message starting with \"\"\" runs until a line ending with \"\"\"."""
    line = input(PROMPT)
    if not line.lstrip().startswith(MULTILINE):
        return line
    lines = [line.lstrip()[len(MULTILINE):]]
    while not lines[-1].rstrip().endswith(MULTILINE):
        lines.append(input(CONTINUATION))
    lines[-1] = lines[-1].rstrip()[:-len(MULTILINE)]
    return "\n".join(lines).strip("\n")


class PrefillProgress:
    """While a long prompt is read (the prefill before the first token), a line on stderr with the tokens read so
    far and the rate, from PROGRESS_AFTER_S on; erased when the reply starts. It follows the target context's
    decodes (`on_decode`, chained to whoever else follows them)."""

    def __init__(self, ctx, clock=time.monotonic):
        self.ctx, self.clock = ctx, clock
        self.started, self.tokens, self.reading = clock(), 0, True
        self.shown = 0   # the width of the line on screen

    def __enter__(self):
        self.follower = getattr(self.ctx, "on_decode", None)
        self.ctx.on_decode = self._decoded
        return self

    def _decoded(self, tokens, first_position) -> None:
        if self.follower is not None:
            self.follower(tokens, first_position)
        if not self.reading:
            return
        self.tokens += len(tokens)
        elapsed = self.clock() - self.started
        if elapsed >= PROGRESS_AFTER_S:
            line = f"[reading the prompt: {self.tokens} tokens, {self.tokens / elapsed:.0f} tok/s]"
            click.echo("\r" + line, nl=False, err=True)
            self.shown = len(line)

    def done(self) -> None:
        """The first token is out: the prompt is read."""
        if self.reading and self.shown:
            click.echo("\r" + " " * self.shown + "\r", nl=False, err=True)
        self.reading = False

    def __exit__(self, *exc):
        self.done()
        if self.ctx.on_decode == self._decoded:
            self.ctx.on_decode = self.follower


class ChatSession:
    """The conversation, the sampler settings, and the slash commands that change them."""

    def __init__(self, pair, system: str | None, sampler: dict, reasoning: str = "auto"):
        from ..chat_template import ChatTemplate

        self.pair = pair
        self.template = ChatTemplate.from_model_info(pair.target.info)
        self.system = system
        self.messages: list[dict] = []
        self.sampler = sampler
        self.shaping = None       # --repeat-penalty, --grammar, -j: the same for every reply
        self.last_stats = None
        self.reasoning = reasoning
        self.opens_thinking = False

    # -- a turn ---------------------------------------------------------------------------------------------
    def conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def prompt_tokens(self) -> list[int]:
        from ..reasoning import opens_thinking, template_kwargs

        rendered = self.template.render(self.conversation(), **template_kwargs(self.reasoning))
        self.opens_thinking = opens_thinking(rendered)
        return self.pair.tokenize(rendered, add_special=self.template.add_special_for(rendered))

    def reply(self, text: str) -> None:
        from ..errors import ContextOverflowError, LlamaspecError

        self.messages.append({"role": "user", "content": text})
        sampler = dict(self.sampler)
        if sampler["max_tokens"] is None:
            sampler["max_tokens"] = self.pair.n_ctx
        try:
            pieces = self.pair.stream(self.prompt_tokens(), shaping=self.shaping, **sampler)
        except KeyboardInterrupt:
            self.messages.pop()
            click.echo(dim("\n[stopped]"))
            return
        except LlamaspecError as e:
            self.messages.pop()
            click.echo(f"error: {e}", err=True)
            if isinstance(e, ContextOverflowError):
                click.echo(dim("the conversation no longer fits in the context: /reset starts a new one "
                               "(or restart with a larger -c)"))
            return
        from ..interrupt import shielded
        from ..reasoning import ThinkSplitter

        parts: list[str] = []
        interrupted = failed = False
        splitter = ThinkSplitter(self.opens_thinking)
        try:
            with PrefillProgress(self.pair.target_ctx) as progress:
                for piece in pieces:
                    progress.done()
                    self._show(splitter.feed(piece.text), parts)
            self._show(splitter.flush(), parts)
        except KeyboardInterrupt:
            interrupted = True
        except SystemExit:   # SIGTERM or SIGHUP mid-reply: keep what came; the chat is saved on the way out
            pieces.close()
            self._keep_reply("".join(parts), cut=True)
            raise
        except LlamaspecError as e:
            failed = True
            click.echo(f"\nerror: {e}", err=True)
        with shielded(interrupted):   # a second Ctrl-C while the stopped reply is put away: the same request
            if interrupted:
                pieces.close()
            reply = "".join(parts)
            self._keep_reply(reply, cut=interrupted or failed)
            self.last_stats = stats = self.pair.last_stats
            click.echo()
            if interrupted:
                click.echo(dim("[stopped" + ("; the partial reply stays in the history]" if reply else "]")))
        if stats is not None and stats.finish_reason == "context":
            click.echo(dim(f"[the context is full ({self.pair.n_ctx} tokens): /reset starts a new conversation, "
                           "or restart with a larger -c]"))
        if stats is not None:
            draft_len = self.pair.policy.next_draft_len() if self.pair.speculative else None
            click.echo(dim(stats_line(stats, draft_len)))
            why = plain_reason(self.pair, stats)
            if why:
                click.echo(dim(f"[{why}]"))

    def _keep_reply(self, reply: str, cut: bool) -> None:
        """The reply goes into the history; a reply cut before its first token takes its user message away."""
        if reply or not cut:
            self.messages.append({"role": "assistant", "content": reply})
        else:
            self.messages.pop()

    def _show(self, reply_parts, content: list[str]) -> None:
        """The thinking dimmed and set apart, the answer as it is (only the answer goes into the history)."""
        for part in reply_parts:
            if part.kind == "reasoning":
                click.echo(dim(part.text), nl=False)
                self._thinking = True
                continue
            if getattr(self, "_thinking", False):
                click.echo(dim("\n[end of thinking]"))
                self._thinking = False
            content.append(part.text)
            click.echo(part.text, nl=False)

    # -- slash commands -------------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a slash command; False means quit."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        handler = {"/exit": self.cmd_exit, "/quit": self.cmd_exit, "/help": self.cmd_help, "/stats": self.cmd_stats,
                   "/reset": self.cmd_reset, "/k": self.cmd_k, "/policy": self.cmd_policy, "/temp": self.cmd_temp,
                   "/save": self.cmd_save, "/save!": self.cmd_save_over, "/load": self.cmd_load}.get(name)
        if handler is None:
            click.echo(f"unknown command {name}; /help lists them")
            return True
        from ..errors import LlamaspecError

        try:
            return handler(arg) is not False
        except (LlamaspecError, ValueError, OSError) as e:   # a bad argument: one line, the chat goes on
            click.echo(f"error: {name}: {e}")
            return True

    def cmd_exit(self, arg):
        return False

    def cmd_help(self, arg):
        click.echo(HELP)

    def cmd_stats(self, arg):
        if self.last_stats is None:
            click.echo("no reply yet")
        else:
            click.echo(format_stats(self.last_stats))

    def cmd_reset(self, arg):
        self.messages.clear()
        self.pair.reset()
        self.last_stats = None
        click.echo(dim("[new conversation]"))

    def _needs_draft(self) -> bool:
        if not self.pair.speculative:
            click.echo("no draft model loaded (-md): decoding is plain")
            return False
        return True

    def cmd_k(self, arg):
        import dataclasses

        from .. import bounds

        if not (arg.isascii() and arg.isdigit()):
            click.echo("usage: /k N  (a draft length; 0 = plain decoding)")
        elif self._needs_draft():
            draft_max = bounds.check("draft_max", int(arg), {"n_batch": self.pair.target_ctx.n_batch}, param="N")
            self.pair.set_drafting(dataclasses.replace(self.pair.config.drafting, policy="fixed", draft_max=draft_max))
            click.echo(dim(f"[draft length {draft_max}, fixed]"))

    def cmd_policy(self, arg):
        import dataclasses

        from ..errors import InvalidParameterError
        from ..policy import POLICY_NAMES

        if arg not in POLICY_NAMES:
            click.echo(f"usage: /policy NAME  ({', '.join(POLICY_NAMES)})")
            return
        if not self._needs_draft():
            return
        try:   # the pair's settings as loaded (a --pair entry's draft_max too), with the new policy name
            self.pair.set_drafting(dataclasses.replace(self.pair.config.drafting, policy=arg))
        except InvalidParameterError as e:
            click.echo(f"error: {e}")
            return
        click.echo(dim(f"[policy {arg}, next draft length {self.pair.policy.next_draft_len()}]"))

    def cmd_temp(self, arg):
        from .. import bounds

        try:
            value = float(arg) if arg.isascii() else None
        except ValueError:
            value = None
        if value is None:
            click.echo("usage: /temp X  (0 = greedy)")
            return
        self.sampler["temperature"] = bounds.check("temperature", value, param="X")
        click.echo(dim(f"[temperature {value:g}]"))

    def cmd_save(self, arg, overwrite: bool = False):
        if not arg:
            click.echo(f"usage: /save{'!' if overwrite else ''} FILE")
            return
        path = Path(arg).expanduser()
        if not overwrite and os.path.lexists(path):
            click.echo(f"error: /save: {path} exists; /save! {arg} overwrites it")
            return
        path = self.save(path, overwrite)
        if path is not None:
            click.echo(dim(f"[saved {len(self.messages)} messages to {path}]"))

    def cmd_save_over(self, arg):
        self.cmd_save(arg, overwrite=True)

    def save(self, path: Path, overwrite: bool = False) -> Path | None:
        """Write the conversation as JSON (what /load reads), readable by the user alone; None, with one line
        said, when it cannot (or when the file exists and not `overwrite`)."""
        record = {"model": str(self.pair.target.path),
                  "draft": str(self.pair.draft.path) if self.pair.draft is not None else None,
                  "system": self.system, "messages": self.messages,
                  "sampler": {k: v for k, v in self.sampler.items() if k != "max_tokens"}}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_private(path, json.dumps(record, indent=2, ensure_ascii=False) + "\n", overwrite)
        except FileExistsError:
            click.echo(f"error: {path} exists; /save! {path} overwrites it", err=True)
            return None
        except OSError as e:
            click.echo(f"error: cannot write {path}: {e.strerror or e}", err=True)
            return None
        return path

    def cmd_load(self, arg):
        if not arg:
            click.echo("usage: /load FILE")
            return
        path = Path(arg).expanduser()
        text = read_text_file(path, text_limit(self.pair.n_ctx), "conversation file")
        try:
            record = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError(f"{path} is not a conversation /save wrote (not JSON)") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        system = record.get("system") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
                for m in messages) or not isinstance(system, (str, type(None))):
            raise ValueError(f"{path} is not a conversation /save wrote (no list of {{role, content}} messages)")
        self.messages, self.system, self.last_stats = messages, system, None
        click.echo(dim(f"[loaded {len(messages)} messages from {path}]"))
        click.echo(dim(f"[{len(self.prompt_tokens())} tokens, read before the next reply]"))

    def save_on_exit(self) -> None:
        if not self.messages:
            return
        folder, stem, n = chats_dir(), time.strftime("chat-%Y%m%d-%H%M%S"), 1
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            click.echo(f"error: cannot write {folder}: {e.strerror or e}", err=True)
            return
        path = folder / f"{stem}.json"
        while os.path.lexists(path):
            n += 1
            path = folder / f"{stem}-{n}.json"
        path = self.save(path)
        if path is not None:
            with contextlib.suppress(OSError):   # the terminal may be gone (SIGHUP); the file is written
                click.echo(dim(f"[conversation saved to {path}; /load it to go on]"))

    # -- the loop -------------------------------------------------------------------------------------------
    def loop(self) -> None:
        """Turns until Ctrl-D or /exit; Ctrl-C clears the line being typed (or stops what runs) and goes on."""
        while True:
            try:
                if not self.turn():
                    return
            except KeyboardInterrupt:
                click.echo()
            except EOFError:
                click.echo()
                return

    def turn(self) -> bool:
        """Read one message and answer it; False means quit."""
        try:
            line = read_message()
        except UnicodeDecodeError as e:  # stdin under a UTF-8 locale
            click.echo(f"error: the message is not valid UTF-8 (byte 0x{e.object[e.start]:02x}); "
                       "nothing was sent", err=True)
            return True
        problem = not_utf8(line)
        if problem is not None:
            click.echo(f"error: the message is not valid UTF-8 ({problem}); nothing was sent", err=True)
            return True
        if not line.strip():
            return True
        if line.startswith("/") and not line.startswith("//"):
            return self.command(line)
        self.reply(line[1:] if line.startswith("//") else line)
        return True


def write_private(path: Path, text: str, overwrite: bool) -> None:
    """Write `text` to `path` with mode 0600, all or nothing: a temporary file in the same folder, then renamed
    over `path` (overwrite) or linked to it (FileExistsError when `path` exists, even if it appeared meanwhile)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")   # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(temporary, path)
        else:
            try:
                os.link(temporary, path)
            except FileExistsError:
                raise
            except OSError:   # a file system without hard links: not atomic against a file appearing meanwhile
                if os.path.lexists(path):
                    raise FileExistsError(path) from None
                os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (input() gains history and editing)
    except ImportError:
        pass


def plain_reason(pair, stats) -> str | None:
    """Why the `auto` policy decoded a whole reply plainly, or None when it drafted (or is not `auto`)."""
    policy = pair.policy if pair.speculative else None
    if policy is None or policy.name != "auto" or stats.drafted or stats.tokens_generated < 8:
        return None
    bound = policy.perfect_draft_gain() if hasattr(policy, "perfect_draft_gain") else None
    if bound is not None and bound < getattr(policy, "min_gain", 1.0):
        return (f"auto decoded plainly: on this machine even a draft that is always right would be only {bound:.2f}x "
                "plain decoding (verifying several tokens costs about as much as decoding them one by one)")
    return "auto decoded plainly: the draft's tokens were not accepted often enough to pay for drafting"


@main.command(cls=Command)
@click.option("--system", "-sys", "--system-prompt", "system", default=None, help="System prompt.")
@pair_options
@sampler_options(max_tokens=None)
@shaping_options
@reasoning_option
@handle_errors
def chat(system, reasoning, **opts):
    """Chat with the pair in the terminal (uses the chat template in the target GGUF)."""
    from ..interrupt import exit_on_hangup

    exit_on_hangup()   # a closed terminal ends the chat like SIGTERM and Ctrl-D: the conversation is saved
    system = utf8_argument(system, "--system")
    check_shaping_options(opts)
    pair = load_pair_from_options(opts, use_default_pair=True)
    try:
        session = ChatSession(pair, system, sampler_kwargs(opts), reasoning)
        session.shaping = shaping_from_options(opts, pair.target)
        draft = f"draft {pair.draft.path.name}" if pair.draft is not None else \
            (f"drafter {pair.drafter_kind}" if pair.speculative else "no draft")
        policy = f", policy {pair.policy.name}" if pair.speculative else ""
        click.echo(dim(f"llamaspec chat: {pair.target.path.name}, {draft}{policy}, context {pair.n_ctx}. "
                       "/help for commands, Ctrl-C stops a reply, Ctrl-D or /exit quits."))
        _enable_line_editing()
        if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach the loop's check, one line each
            sys.stdin.reconfigure(errors="surrogateescape")
        try:
            session.loop()
        finally:
            session.save_on_exit()
    finally:
        pair.close()
