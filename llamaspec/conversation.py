"""Chat from Python: `pair.chat(messages)` and `pair.chat_stream(messages)` render the messages with the chat
template in the target GGUF, generate through the same speculative loop as `pair.stream`, and give the thinking of
a reasoning model apart from its answer.

Both KV caches are reused across turns the way `pair.stream` reuses them (by common prefix): a follow-up that
appends messages to the same conversation prefills only what is new. The caller keeps the conversation: append the
reply (`{"role": "assistant", "content": reply.content}`) and the next user message, and call again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .chat_template import ChatTemplate
from .reasoning import Part, ThinkSplitter, opens_thinking, template_kwargs


@dataclass(frozen=True)
class ChatReply:
    content: str
    reasoning: str          # the <think> part ("" when the model did not think)
    finish_reason: str      # stop, length or context
    stats: object           # GenerationStats


def chat_template(pair) -> ChatTemplate:
    template = getattr(pair, "_chat_template", None)
    if template is None:
        template = pair._chat_template = ChatTemplate.from_model_info(pair.target.info)
    return template


def chat_prompt(pair, messages: list[dict], reasoning: str | None = None,
                template_vars: dict | None = None) -> tuple[list[int], bool]:
    """(prompt tokens, whether the prompt leaves a <think> block open) for the conversation; `reasoning` on/off
    sets the template's enable_thinking, `template_vars` any other variable (the server's chat_template_kwargs)."""
    template = chat_template(pair)
    rendered = template.render(messages, **{**(template_vars or {}), **template_kwargs(reasoning)})
    tokens = pair.tokenize(rendered, add_special=template.add_special_for(rendered))
    return tokens, opens_thinking(rendered)


def chat_stream(pair, messages: list[dict], reasoning: str | None = None, template_vars: dict | None = None,
                **sampling) -> Iterator[Part]:
    """The reply as Parts: kind "reasoning" (inside <think>...</think>) or "content", tags removed. `sampling`:
    pair.stream's keywords (max_tokens, temperature, top_k, top_p, min_p, seed, stop)."""
    tokens, starts_inside = chat_prompt(pair, messages, reasoning, template_vars)
    splitter = ThinkSplitter(starts_inside)
    pieces = pair.stream(tokens, **sampling)
    try:
        for piece in pieces:
            yield from splitter.feed(piece.text)
        yield from splitter.flush()
    finally:
        pieces.close()


def chat(pair, messages: list[dict], reasoning: str | None = None, template_vars: dict | None = None,
         **sampling) -> ChatReply:
    parts = list(chat_stream(pair, messages, reasoning, template_vars, **sampling))
    stats = pair.last_stats
    return ChatReply("".join(p.text for p in parts if p.kind == "content"),
                     "".join(p.text for p in parts if p.kind == "reasoning").strip(),
                     stats.finish_reason, stats)
