"""Where draft tokens come from: a small draft model, prompt lookup (n-grams of the text so far), or both.

A drafter proposes up to `max_len` tokens that follow `history + [last]`; in sampling mode it also fills one row of
`probs_out` with the distribution each token was drawn from (the q of the rejection rule). Drafters know nothing
about acceptance or the target.
"""
from __future__ import annotations

import time

import numpy as np

from .backend import Context
from .sampling import SamplerConfig, filtered_probs, max_prob, sample_from


def common_prefix_len(a, b, start: int = 0) -> int:
    """Length of the common prefix of two token sequences, assuming the first `start` tokens are known equal."""
    n = min(len(a), len(b))
    start = min(start, n)
    if start == n:
        return n
    x = np.asarray(a[start:n], dtype=np.int64)
    y = np.asarray(b[start:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return start + (int(diff[0]) if len(diff) else n - start)


class ModelDrafter:
    """Drafts with a small model whose KV cache follows the committed history; accepted tokens are never
    re-decoded.

    The cache holds history[offset:] (offset is 0 unless the draft fell far behind or ran out of context): after a
    long stretch without drafting (the policy had turned speculation off), catching up on every missed token would
    cost as much as drafting them, so the draft restarts on the last `window` tokens instead. Its positions are its
    own, so a window is a valid (shorter) context.
    """

    name = "draft-model"

    def __init__(self, ctx: Context, n_vocab_target: int, window: int = 64, max_catchup: int = 128):
        self.ctx = ctx
        self.n_vocab = ctx.n_vocab
        self.n_vocab_target = n_vocab_target
        self.window, self.max_catchup = window, max_catchup
        self.offset = 0           # history index of the cache's first token
        self._known_equal = 0     # ctx.tokens[:known_equal] == history[offset:offset + known_equal]
        self.catchup_seconds = 0.0
        self._scratch = np.empty(ctx.n_vocab, dtype=np.float32)

    def _align(self, history: list[int], extra: int) -> list[int]:
        """Drop what the cache holds beyond the common prefix with history; return what it still has to decode."""
        rel = history[self.offset:] if self.offset else history
        common = common_prefix_len(self.ctx.tokens, rel, self._known_equal)
        missing = len(rel) - common
        too_long = len(rel) + extra > self.ctx.n_ctx
        if missing > self.max_catchup or too_long or not self.ctx.truncate(common):
            self.ctx.clear()
            self.offset = max(0, len(history) - self.window) if (missing > self.max_catchup or too_long) else 0
            rel, common = history[self.offset:], 0
        return rel[common:]

    def sync(self, history: list[int], known_equal: int | None = None) -> None:
        """Bring the cache up to date with history (used at prefill, so the first draft step is cheap)."""
        if known_equal is not None:
            self._known_equal = min(known_equal, self._known_equal)
        self.offset = 0
        rel = history
        common = common_prefix_len(self.ctx.tokens, rel, self._known_equal)
        if len(rel) + 1 > self.ctx.n_ctx:
            self.ctx.clear()
            self.offset = max(0, len(history) - self.window)
            rel, common = history[self.offset:], 0
        elif not self.ctx.truncate(common):
            self.ctx.clear()
            common = 0
        if common < len(rel):
            self.ctx.eval(rel[common:], logits="none")
        self._known_equal = len(rel)

    def draft(self, history: list[int], last: int, max_len: int, p_min: float, cfg: SamplerConfig,
              rng: np.random.Generator, probs_out: np.ndarray | None) -> list[int]:
        t0 = time.perf_counter()
        missing = self._align(history, max_len + 1)
        if cfg.greedy and p_min <= 0 and self.ctx.device_argmax:
            return self._draft_argmax(missing, last, max_len, t0)
        # catch up on what the target accepted since the last draft, and decode `last`, in one batch
        logits = self.ctx.eval(missing + [last], logits="last")[0]
        self.catchup_seconds = (time.perf_counter() - t0) if len(missing) > 2 else 0.0
        self._known_equal = len(history) - self.offset + 1
        drafted: list[int] = []
        for i in range(max_len):
            if cfg.greedy:
                token = int(logits.argmax())
                confidence = max_prob(logits, self._scratch, logits[token]) if p_min > 0 else 1.0
            else:
                q = probs_out[i]
                if self.n_vocab < len(q):  # the target's vocabulary is padded beyond the draft's
                    q[self.n_vocab:] = 0.0
                filtered_probs(logits, cfg, out=q[:self.n_vocab])
                token = sample_from(q, rng)
                confidence = float(q.max()) if p_min > 0 else 1.0
            if confidence < p_min or token >= self.n_vocab_target:
                break  # the draft is unsure (llama.cpp's p_min rule), or proposes a token the target lacks
            drafted.append(token)
            if i + 1 == max_len:
                break
            logits = self.ctx.eval([token], logits="last")[0]
        return drafted

    def _draft_argmax(self, missing: list[int], last: int, max_len: int, t0: float) -> list[int]:
        """Greedy drafting without a confidence stop: llama.cpp takes each argmax on the device, no logits move."""
        token = self.ctx.eval_argmax(missing + [last])[0]
        self.catchup_seconds = (time.perf_counter() - t0) if len(missing) > 2 else 0.0
        self._known_equal = len(self.ctx.tokens)
        drafted = [token]
        while len(drafted) < max_len and token < self.n_vocab_target:
            token = self.ctx.eval_argmax([token])[0]
            drafted.append(token)
        return drafted if drafted[-1] < self.n_vocab_target else drafted[:-1]


class PromptLookupDrafter:
    """Proposes the continuation of the most recent earlier occurrence of the last n tokens (n = ngram_max..min).

    No model: it shines on input-grounded output (editing code, quoting, reformatting) where the text repeats.
    Its proposals are deterministic, so in sampling mode q is a point mass on each proposed token.
    """

    name = "prompt-lookup"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2, n_vocab: int = 0):
        self.ngram_max, self.ngram_min, self.n_vocab = ngram_max, ngram_min, n_vocab
        # the text so far as a growing int64 array: history only grows within a generation (and the engine gives
        # each generation a new list), so each step appends the new tokens instead of copying the whole history
        self._buf = np.empty(1024, dtype=np.int64)
        self._len = 0
        self._source: list[int] | None = None

    catchup_seconds = 0.0

    def sync(self, history: list[int], known_equal: int | None = None) -> None:
        self._source, self._len = None, 0

    def _tokens(self, history: list[int], last: int) -> np.ndarray:
        if history is not self._source or len(history) < self._len:
            self._source, self._len = history, 0
        n = len(history) + 1
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), dtype=np.int64)
            grown[:self._len] = self._buf[:self._len]
            self._buf = grown
        if len(history) > self._len:
            self._buf[self._len:len(history)] = history[self._len:]
            self._len = len(history)
        self._buf[n - 1] = last
        return self._buf[:n]

    def lookup(self, tokens: np.ndarray, max_len: int) -> list[int]:
        n_tok = len(tokens)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            tail = tokens[n_tok - n:]
            # candidate starts: positions where the first token of the tail occurs (vectorised), newest first
            starts = np.flatnonzero(tokens[:n_tok - n] == tail[0])
            for s in starts[::-1]:
                if np.array_equal(tokens[s:s + n], tail):
                    cont = tokens[s + n:s + n + max_len]
                    if len(cont):
                        return [int(t) for t in cont]
        return []

    def draft(self, history: list[int], last: int, max_len: int, p_min: float, cfg: SamplerConfig,
              rng: np.random.Generator, probs_out: np.ndarray | None) -> list[int]:
        drafted = self.lookup(self._tokens(history, last), max_len)
        if probs_out is not None:
            for i, tok in enumerate(drafted):
                probs_out[i].fill(0.0)
                probs_out[i][tok] = 1.0
        return drafted


class CombinedDrafter:
    """Prompt lookup first; the draft model when lookup finds nothing."""

    name = "lookup+draft-model"

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model

    @property
    def catchup_seconds(self) -> float:
        return self.model.catchup_seconds

    def sync(self, history, known_equal=None) -> None:
        self.model.sync(history, known_equal)

    def draft(self, history, last, max_len, p_min, cfg, rng, probs_out) -> list[int]:
        drafted = self.lookup.draft(history, last, max_len, p_min, cfg, rng, probs_out)
        if drafted:
            self.model.catchup_seconds = 0.0
            return drafted
        return self.model.draft(history, last, max_len, p_min, cfg, rng, probs_out)
