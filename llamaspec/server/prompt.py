"""A request's prompt as token ids, at a cost bounded by the context size, for text nobody vetted.

llama.cpp's tokenizer is linear in plain text but quadratic in the number of special-token matches (its partition
re-walks a linked list for each one: 32k `<|im_start|>` take 10 s), and one call cannot be interrupted. So this
module finds special tokens itself (one compiled trie per kind, leftmost-longest), hands llama.cpp only plain text
with special-token parsing off, in bounded chunks, and stops as soon as the prompt cannot fit the context.

Text arrives as segments marked trusted or not. Control tokens (`<|im_start|>`, `<eos>`) are recognised only in
trusted text: the chat template's own output, or a raw completion prompt, whose author owns every byte of it.
Message contents are untrusted: there, as in llama.cpp with special tokens off, only user-defined tokens are
recognised, so a message cannot forge a turn. When no message holds special-token text (nearly always) the
template's output is tokenized whole, exactly as llama.cpp would; only otherwise is it rendered a second time
with each content wrapped in two Unicode noncharacters, which mark where message text lies.

Knows nothing about HTTP or about request fields: it is given a model, a context size and a chat template.
"""
from __future__ import annotations

import json
import math
import re
import threading
from typing import Iterable

from ..chat_template import ChatTemplate, ChatTemplateError
from ..errors import ContextOverflowError

# Unicode noncharacters, reserved for a program's internal use: request validation refuses them in messages.
OPEN, CLOSE = "\ufdd0", "\ufdd1"
CHUNK_CHARS = 32768    # plain text handed to llama.cpp at once (a BPE vocabulary's worst case: ~40 ms)
_C_SPACE = " \t\n\v\f\r"   # what llama.cpp's isspace() strips around lstrip/rstrip tokens


from ..errors import Cancelled  # noqa: E402,F401  (raised when a request is cancelled during its tokenization)


def _trie_regex(texts: Iterable[str]) -> re.Pattern | None:
    """One pattern matching any of `texts`, longest first at each position, in time linear in the text
    (an alternation of 6,000 literals would try each one at every candidate position)."""
    texts = sorted(set(texts), key=len, reverse=True)
    if not texts:
        return None
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> str:
        branches = []
        for ch, child in sorted(node.items()):
            if not ch:
                continue
            chain = re.escape(ch)
            while len(child) == 1 and "" not in child:  # a run without branches: one literal, no nesting
                (ch, child), = child.items()
                chain += re.escape(ch)
            branches.append(chain + emit(child))
        if "" in node:
            branches.append("")  # ending here is tried last: a longer token wins
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"

    try:
        return re.compile(emit(trie))
    except RecursionError:  # thousands of nested prefixes (say, runs of 1..5000 spaces): a flat alternation
        return re.compile("|".join(re.escape(t) for t in texts))


class PromptTokenizer:
    """Segments of text -> token ids for one model, refusing what cannot fit `n_ctx` before the work grows."""

    def __init__(self, model, n_ctx: int):
        self.model, self.n_ctx = model, n_ctx
        self.holder = "the context"   # what n_ctx is, for the error ("a slot" when requests share the context)
        self._special: dict[str, object] = {}
        for token in model.special_tokens():
            try:
                text = token.text.decode("utf-8")
            except UnicodeDecodeError:  # cannot occur in a str prompt
                continue
            if text:
                self._special.setdefault(text, token)
        tokens = self._special.items()
        self._any = _trie_regex(t for t, tok in tokens)
        self._user_defined = _trie_regex(t for t, tok in tokens if not tok.control)
        self._control = _trie_regex(t for t, tok in tokens if tok.control)
        # Each plain token stands for at most `plain_max` bytes of text and each special token for its own text,
        # so a prompt of B bytes is at least B / max tokens. Sound for BPE and SPM, which never drop text; not for
        # normalising tokenizers (WPM, UGM) or when a token eats the whitespace around it.
        exact_bytes = model.vocab_kind in ("bpe", "spm")
        strips = any(tok.lstrip or tok.rstrip for tok in self._special.values())
        self._plain_max = model.max_piece_bytes() if exact_bytes else None
        longest_special = max((len(t.encode()) for t in self._special), default=1)
        self._any_max = max(self._plain_max, longest_special) if exact_bytes and not strips else None
        # BPE tokenizes pieces independently after its pre-tokenizer split; SPM may prefix each call with a space
        self._chunked = model.vocab_kind == "bpe"
        edges = model.tokenize("", add_special=True, parse_special=False)  # [BOS] and/or [EOS] as the model adds
        self._prefix = edges[:1] if edges and edges[0] == model.bos and model.add_bos else []
        self._suffix = edges[len(self._prefix):]

    def control_text(self, text: str) -> str | None:
        """The first control-token text inside `text`, if any."""
        found = self._control.search(text) if self._control is not None else None
        return found.group() if found else None

    def mark_control(self, text: str, open_: str, close: str) -> str:
        """`text` with every control-token text in it between `open_` and `close` ("" and "": removed)."""
        if self._control is None:
            return text
        return self._control.sub(lambda m: open_ + m.group() + close if open_ or close else "", text)

    def count_control(self, text: str) -> int:
        return sum(1 for _ in self._control.finditer(text)) if self._control is not None else 0

    # -------------------------------------------------------------------------------------------------------
    def tokenize(self, segments: list[tuple[str, bool]], add_special: bool,
                 cancelled: threading.Event | None = None) -> list[int]:
        """Token ids for the concatenated `segments` ((text, trusted) pairs), BOS/EOS as the model adds them when
        `add_special`. Raises ContextOverflowError once the prompt is known to leave no room to generate:
        the tokens so far plus a lower bound for the text still to go (its bytes / the most bytes a token covers)."""
        count = _Count(self, self.n_ctx - 1, cancelled)  # the engine needs one free position to generate into
        if self._any_max is not None:
            count.bytes_left = sum(len(text.encode("utf-8")) for text, _ in segments)
        count.add(self._prefix if add_special else [], 0)
        pending: list[str] = []      # plain text since the last special token
        strip_next = False           # the last special token eats the whitespace after it
        for text, trusted in segments:
            pattern = self._any if trusted else self._user_defined
            pos = 0
            for match in pattern.finditer(text) if pattern is not None else ():
                strip_next = self._plain(pending, text[pos:match.start()], strip_next)
                token = self._special[match.group()]
                if token.lstrip and pending:
                    run = "".join(pending).rstrip(_C_SPACE)
                    pending[:] = [run] if run else []
                self._flush(pending, count)
                count.add([token.id], len(match.group().encode("utf-8")))
                strip_next, pos = token.rstrip, match.end()
            strip_next = self._plain(pending, text[pos:], strip_next)
        self._flush(pending, count)
        count.add(self._suffix if add_special else [], 0)
        return count.out

    @staticmethod
    def _plain(pending: list[str], text: str, strip: bool) -> bool:
        if strip:
            text = text.lstrip(_C_SPACE)
            strip = not text  # all whitespace: the next piece's leading whitespace goes too
        if text:
            pending.append(text)
        return strip

    def _flush(self, pending: list[str], count: "_Count") -> None:
        if not pending:
            return
        run = "".join(pending)
        pending.clear()
        if self._plain_max is not None:
            n_bytes = len(run.encode("utf-8"))
            if n_bytes > (count.limit - len(count.out)) * self._plain_max:
                self._overflow(len(count.out) + math.ceil(n_bytes / self._plain_max))
        for chunk in self._chunks(run):
            count.check_cancelled()
            tokens = self.model.tokenize(chunk, add_special=False, parse_special=False)
            count.add(tokens, len(chunk.encode("utf-8")) if count.bytes_left is not None else 0)

    def _chunks(self, run: str) -> Iterable[str]:
        """`run` in pieces of at most CHUNK_CHARS, cut after a line break or before a space between words, where
        a BPE pre-tokenizer splits anyway (runs this long are the only place the tokens can differ from a whole
        call)."""
        if not self._chunked or len(run) <= CHUNK_CHARS:
            yield run
            return
        start = 0
        while len(run) - start > CHUNK_CHARS:
            lo, hi = start + CHUNK_CHARS // 2, start + CHUNK_CHARS
            cut = run.rfind("\n", lo, hi) + 1
            if cut == 0:
                cut = run.rfind(" ", lo, hi)
                cut = cut if cut > lo else hi
            yield run[start:cut]
            start = cut
        yield run[start:]

    def _overflow(self, n_tokens: int):
        raise ContextOverflowError(
            f"the prompt is at least {n_tokens} tokens but {self.holder} holds {self.n_ctx}; "
            "shorten the prompt or raise the context size (-c / n_ctx)")


class _Count:
    """The tokens of one prompt so far, and the bytes still to tokenize (None where bytes bound nothing)."""

    def __init__(self, tokenizer: PromptTokenizer, limit: int, cancelled: threading.Event | None):
        self.tokenizer, self.limit, self.cancelled = tokenizer, limit, cancelled
        self.out: list[int] = []
        self.bytes_left: int | None = None
        self._adds = 0

    def add(self, tokens: list[int], n_bytes: int) -> None:
        self.out.extend(tokens)
        at_least = len(self.out)
        if self.bytes_left is not None:
            self.bytes_left -= n_bytes
            at_least += math.ceil(self.bytes_left / self.tokenizer._any_max)
        if at_least > self.limit:
            self.tokenizer._overflow(at_least)
        self._adds += 1
        if self._adds % 1024 == 0:
            self.check_cancelled()

    def check_cancelled(self) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise Cancelled("the request was cancelled while its prompt was being tokenized")


# -----------------------------------------------------------------------------------------------------------
# Chat prompts
# -----------------------------------------------------------------------------------------------------------
class ForgedTokenError(ChatTemplateError):
    """A message holds special-token text, and the template's output cannot tell it from the template's own."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def chat_segments(template: ChatTemplate, messages: list[dict], tokenizer: PromptTokenizer,
                  template_vars: dict | None = None) -> tuple[list[tuple[str, bool]], bool]:
    """The chat prompt as (text, trusted) segments, and whether to add BOS. Roles and contents are untrusted;
    `template_vars` are the request's chat_template_kwargs (and its tools). They and the messages' tool fields may
    hold no special-token text at all."""
    template_vars = template_vars or {}
    for i, m in enumerate(messages):
        if (hit := tokenizer.control_text(m["role"])) is not None:
            raise ForgedTokenError(f"messages[{i}].role contains the special token text {hit!r}", f"messages[{i}].role")
        extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        if extra and (hit := tokenizer.control_text(json.dumps(extra, ensure_ascii=False))) is not None:
            raise ForgedTokenError(f"messages[{i}] contains the special token text {hit!r} in its tool fields",
                                   f"messages[{i}]")
    if template_vars and (hit := tokenizer.control_text(json.dumps(template_vars, ensure_ascii=False))) is not None:
        raise ForgedTokenError(f"the tools or template variables contain the special token text {hit!r}", "tools")
    rendered = template.render(messages, **template_vars)
    add_bos = template.add_special_for(rendered)
    forged = next(((i, hit) for i, m in enumerate(messages) if (hit := tokenizer.control_text(m["content"]))), None)
    if forged is None:
        return [(rendered, True)], add_bos
    index, hit = forged
    param = f"messages[{index}].content"
    # each message's text apart: the template's own text is trusted, the messages' not
    whole = [{**m, "content": OPEN + m["content"] + CLOSE} for m in messages]
    segments = _split(template.render(whole, **template_vars), rendered)
    if segments is None:
        # a template that rewrites message text (Qwen's trims and splits it) keeps the control text's spans apart
        # instead: what a message says around them has none, and the trusted text must hold exactly the control
        # tokens the template writes (none formed where a message's text meets the template's)
        spans = [{**m, "content": tokenizer.mark_control(m["content"], OPEN, CLOSE)} for m in messages]
        segments = _split(template.render(spans, **template_vars), rendered)
        if segments is not None:
            bare = template.render([{**m, "content": tokenizer.mark_control(m["content"], "", "")} for m in messages],
                                   **template_vars)
            trusted = sum(tokenizer.count_control(text) for text, ok in segments if ok)
            segments = segments if trusted == tokenizer.count_control(bare) else None
    if segments is not None:
        return segments, add_bos
    raise ForgedTokenError(
        f"{param} contains the special token text {hit!r}, and this model's chat template rewrites message text, "
        "so it cannot be kept apart as plain text; remove it from the message", param)


def _split(wrapped: str, rendered: str) -> list[tuple[str, bool]] | None:
    """`wrapped` (message text between OPEN and CLOSE) as (text, trusted) segments, or None where the markers do
    not pair up or the text without them is not `rendered` (the template cut, reordered or rewrote message text)."""
    segments, trusted = [], True
    for piece in re.split(f"([{OPEN}{CLOSE}])", wrapped):
        if piece in (OPEN, CLOSE):
            if (piece == OPEN) != trusted:
                return None
            trusted = not trusted
        elif piece:
            segments.append((piece, trusted))
    if trusted and "".join(text for text, _ in segments) == rendered:
        return segments
    return None
