"""Drafting with a small model of the same tokenizer, whose cache follows the committed history."""
from __future__ import annotations

import time

import numpy as np

from ..sampling import Sampling, draft_filters, filter_logits, max_prob, sample
from .base import Draft, Drafter, ProbsBuffer, common_prefix_len


class ModelDrafter(Drafter):
    """Drafts with a small model; accepted tokens are never re-decoded.

    The cache holds history[offset:] (offset is 0 unless the draft fell far behind or ran out of context): after a
    long stretch without drafting (the policy had turned speculation off), catching up on every missed token would
    cost as much as drafting them, so the draft restarts on the last `window` tokens instead. Its positions are its
    own, so a window is a valid (shorter) context.

    Drafting decodes one token at a time, after which a recurrent memory cannot drop the rejected ones; so each
    drafting run marks its start (`ctx.checkpoint()`, a no-op for attention caches) and `accepted` goes back there.
    """

    kind = "model"

    def __init__(self, ctx, n_vocab_target: int, window: int = 64, max_catchup: int = 128):
        self.ctx = ctx
        self.contexts = (ctx,)
        self.n_vocab = ctx.n_vocab
        self.n_vocab_target = n_vocab_target
        self.window, self.max_catchup = window, max_catchup
        self.offset = 0           # history index of the cache's first token
        self._known_equal = 0     # ctx.tokens[:known_equal] == history[offset:offset + known_equal]
        self._base = 0            # cache length before the last proposal's `last`
        self._sampling: Sampling | None = None
        self._filters = None   # the request's filters cut to the draft's best candidates (draft_filters)
        self._probs = ProbsBuffer(max(n_vocab_target, ctx.n_vocab))
        self._scratch = np.empty(ctx.n_vocab, dtype=np.float32)   # for the confidence stop
        self.branch = None   # tree verification (tree.py): called with (i, logits, q, token) for each drafted row

    # -- keeping in step ---------------------------------------------------------------------------------------
    def begin(self, history, sampling, p_min, prefill) -> None:
        self._sampling = sampling
        self._filters = draft_filters(sampling.config) if sampling is not None else None
        self._known_equal = 0     # a new generation: the history may have changed anywhere
        # greedy without a confidence stop needs only argmaxes: let llama.cpp take them on the device
        self.ctx.set_device_argmax(sampling is None and p_min <= 0)
        if prefill:
            self.offset = 0
            missing = self._align(history, extra=1, limit=None)
            if missing:
                self.ctx.eval(missing, logits="none")
            self.ctx.checkpoint(turn=True)  # the prompt's end: a later prompt that extends it restarts here
            self._known_equal = self.ctx.n_past

    def _align(self, history: list[int], extra: int, limit: int | None) -> list[int]:
        """Drop what the cache holds beyond its common prefix with history; return what it still has to decode.
        More than `limit` tokens missing, or no room for `extra` more: restart on the last `window` tokens."""
        rel = history[self.offset:] if self.offset else history
        common = common_prefix_len(self.ctx.tokens, rel, self._known_equal)
        missing = len(rel) - common
        behind = limit is not None and missing > limit
        too_long = len(rel) + extra > self.ctx.n_ctx
        if behind or too_long or not self.ctx.keep(common):
            self.ctx.clear()
            self.offset = max(0, len(history) - self.window) if (behind or too_long) else 0
            rel, common = history[self.offset:], 0
        return rel[common:]

    def accepted(self, n_accepted: int) -> None:
        # the cache holds history[offset:] + [last] + the drafts it decoded: keep [last] and the accepted ones
        self.ctx.keep(min(self._base + 1 + n_accepted, self.ctx.n_past))
        self._known_equal = self.ctx.n_past

    saves_state = True

    def save_state(self):
        return self.ctx.save_state(offset=self.offset)

    def restore_state(self, saved) -> bool:
        self._known_equal = 0
        if saved is None or not self.ctx.restore_state(saved):
            self.reset()
            return saved is None
        self.offset = saved.extra["offset"]
        return True

    def reset(self) -> None:
        self.ctx.clear()
        self.offset = self._known_equal = 0

    def close(self) -> None:
        self.ctx.close()
        self.ctx.model.close()

    # -- drafting ----------------------------------------------------------------------------------------------
    def propose(self, history, last, max_len, p_min) -> Draft:
        t0 = time.perf_counter()
        missing = self._align(history, max_len + 1, self.max_catchup)
        self._base = len(history) - self.offset
        if self._sampling is None and p_min <= 0 and self.ctx.device_argmax:
            return self._propose_argmax(missing, last, max_len, t0)
        if self._sampling is not None and self._sampling.device:
            return self._propose_device(missing, last, max_len, p_min, t0)
        # catch up on what the target accepted since the last draft, and decode `last`, in one batch
        logits = self.ctx.eval(missing + [last], logits="last")[0]
        self.ctx.checkpoint()  # the drafting run starts here: `accepted` comes back to it
        setup = (time.perf_counter() - t0) if len(missing) > 2 else 0.0
        sampling = self._sampling
        rows = self._probs.rows(max_len) if sampling is not None else None
        drafted: list[int] = []
        dists = []
        for i in range(max_len):
            if sampling is None:
                token = int(logits.argmax())
                confidence = max_prob(logits, self._scratch, logits[token]) if p_min > 0 else 1.0
            else:  # q: the request's filters cut to the draft's best candidates, as on the device (draft_filters)
                q = filter_logits(logits, self._filters, rows[i][:self.n_vocab])
                token = sample(q, sampling.rng)
                confidence = q.max_prob() if p_min > 0 else 1.0
                dists.append(q)
            if confidence < p_min or token >= self.n_vocab_target:
                break  # the draft is unsure (llama.cpp's p_min rule), or proposes a token the target lacks
            drafted.append(token)
            if self.branch is not None:
                self.branch(i, logits, dists[-1] if sampling is not None else None, token)
            if i + 1 == max_len:
                break
            logits = self.ctx.eval([token], logits="last")[0]
        return Draft(drafted, dists[:len(drafted)] if sampling is not None else None, setup)

    def _propose_device(self, missing: list[int], last: int, max_len: int, p_min: float, t0: float) -> Draft:
        """Sampling with the filters on the device: each decode returns q (the kept candidates, or a dense row
        when nothing truncates) and the device's draw from it; Python only copies q out of llama.cpp's buffer."""
        q = self.ctx.eval_dists(missing + [last])[0]
        setup = (time.perf_counter() - t0) if len(missing) > 2 else 0.0
        rows = self._probs.rows(max_len)
        drafted: list[int] = []
        dists = []
        for i in range(max_len):
            token = q.draw
            if (p_min > 0 and q.max_prob() < p_min) or not 0 <= token < self.n_vocab_target or q.prob(token) <= 0:
                break  # unsure, a token the target lacks, or (rounding on the device) a draw q gives no mass
            dists.append(q.copy(into=rows[i]))  # outlives the next decode
            drafted.append(token)
            if i + 1 == max_len:
                break
            q = self.ctx.eval_dists([token])[0]
        return Draft(drafted, dists, setup)

    def _propose_argmax(self, missing: list[int], last: int, max_len: int, t0: float) -> Draft:
        """Greedy drafting without a confidence stop: llama.cpp takes each argmax on the device, no logits move."""
        token = self.ctx.eval_argmax(missing + [last])[0]
        self.ctx.checkpoint()
        setup = (time.perf_counter() - t0) if len(missing) > 2 else 0.0
        drafted = [token]
        while len(drafted) < max_len and token < self.n_vocab_target:
            token = self.ctx.eval_argmax([token])[0]
            drafted.append(token)
        return Draft(drafted if drafted[-1] < self.n_vocab_target else drafted[:-1], None, setup)
