"""Thinking models (Qwen3 / 3.5 / 3.6 / 3.8, DeepSeek-R1 style): the reply's `<think>...</think>` part apart from
its answer, as a stream.

A template with `enable_thinking` turns thinking on or off (`--reasoning on|off`; left out, the template's own
default). Some templates open the `<think>` block in the prompt itself, so the reply starts inside it: `starts_inside`
says so, and `opens_thinking(rendered_prompt)` finds it out. Speculation is not touched: this module only splits the
text the engine already produced. It knows nothing about tokens or models.
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
REASONING_MODES = ("on", "off", "auto")


def template_kwargs(mode: str | None) -> dict:
    """--reasoning on|off|auto -> the chat template's variables (auto: the template's own default)."""
    if mode in (None, "auto"):
        return {}
    if mode not in REASONING_MODES:
        raise ValueError(f"reasoning must be one of {', '.join(REASONING_MODES)}, got {mode!r}")
    return {"enable_thinking": mode == "on"}


def opens_thinking(rendered_prompt: str) -> bool:
    """The prompt ends inside an open <think> block (the template started the thinking for the model)."""
    tail = rendered_prompt.rstrip()
    return tail.endswith(OPEN)


@dataclass(frozen=True)
class Part:
    kind: str   # "reasoning" or "content"
    text: str


class ThinkSplitter:
    """Feed the reply's text pieces in order; get back Parts with the <think> tags removed. A tag cut across two
    pieces is held back until it is whole."""

    def __init__(self, starts_inside: bool = False):
        self.inside = starts_inside
        self.seen_open = starts_inside
        self.pending = ""
        self.started = False   # any content emitted (leading whitespace after </think> is dropped until then)

    def feed(self, text: str) -> list[Part]:
        self.pending += text
        parts: list[Part] = []
        while self.pending:
            # one thinking block, at the start of the reply: <think> only before any content, then </think>
            tag = CLOSE if self.inside else (OPEN if not (self.seen_open or self.started) else None)
            at = self.pending.find(tag) if tag else -1
            if tag == OPEN and at > 0 and self.pending[:at].strip():
                tag, at = None, -1   # text came first: this reply does not think, its tags are text
            if at >= 0:
                self._emit(parts, self.pending[:at])
                self.pending = self.pending[at + len(tag):]
                self.inside, self.seen_open = not self.inside, True
                continue
            keep = _partial_suffix(self.pending, tag) if tag else 0
            self._emit(parts, self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return parts

    def flush(self) -> list[Part]:
        parts: list[Part] = []
        self._emit(parts, self.pending)
        self.pending = ""
        return parts

    def _emit(self, parts: list[Part], text: str) -> None:
        if not text:
            return
        if not self.inside and not self.started:
            text = text.lstrip()   # the blank lines before <think> or after </think>
            if not text:
                return
            self.started = True
        kind = "reasoning" if self.inside else "content"
        if parts and parts[-1].kind == kind:
            parts[-1] = Part(kind, parts[-1].text + text)
        else:
            parts.append(Part(kind, text))


def split_reply(text: str, starts_inside: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    splitter = ThinkSplitter(starts_inside)
    parts = splitter.feed(text) + splitter.flush()
    return ("".join(p.text for p in parts if p.kind == "reasoning").strip(),
            "".join(p.text for p in parts if p.kind == "content"))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (a tag that may be cut in two)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
