"""EAGLE-3: a one-layer draft over the target's own features, drafting one token per step (llama.cpp's
common_speculative_impl_draft_eagle3, examples/speculative-simple).

The target's inputs of three layers at position P, concatenated, go through the draft's encoder (fc) to one row g_P.
The draft's decoder at position P takes the pair (token at P+1, g_P) and predicts the token at P+2; so the pair of
the newest position waits for the next token (the "deferred boundary"): the cache holds the pairs of positions <
_fed - 1, and row 0 of `_g` is g of position _fed - 1. A draft starts with (last, that row) at _fed - 1, goes on
from the draft's own pre-norm hidden rows; its entries are dropped afterwards (the verification's features replace
them). Drafting samples from the draft's distribution, so q is that distribution (the request's filters, cut to the
draft's DRAFT_TOP_K best candidates as every drafter's are).

The g rows of the last RING_ROWS positions are kept, so when the target goes back inside them (a regenerated reply,
a new conversation with the same system prompt) the pair at the new boundary is rebuilt exactly. Further back, the
pair before the boundary keeps the token that followed it then (the cache must stay contiguous) and the first
step cannot draft: the draft's view of that one position is off, which may cost acceptance, never correctness.
"""
from __future__ import annotations

import numpy as np

from ..sampling import filter_logits, max_prob, sample
from .base import NO_DRAFT, Draft
from .features import HiddenStateDrafter

RING_ROWS = 1024


class Eagle3Drafter(HiddenStateDrafter):
    kind = "eagle3"

    def __init__(self, ctx, n_vocab_target: int):
        super().__init__(ctx, n_vocab_target)
        # row 0: g of position _fed - 1 (the deferred pair's); rows 1..m: the encoder output of the batch being fed
        self._g = np.zeros((len(self._rows) + 1, ctx.n_embd), np.float32)
        self._has_g = False
        rows = max(1, min(RING_ROWS, ctx.n_ctx))
        self._ring = np.zeros((rows, ctx.n_embd), np.float32)   # g of position q at row q % rows
        self._ring_pos = np.full(rows, -1, np.int64)

    # -- feeding ------------------------------------------------------------------------------------------------
    def _feed(self, tokens, rows, first_pos) -> None:
        m = len(tokens)
        self.ctx.encode(rows, self._g[1:m + 1])
        if self._has_g:
            # pairs (tokens[j], g of first_pos + j - 1) at first_pos + j - 1, j = 0..m-1: the deferred pair first
            self.ctx.decode(tokens, first_pos - 1, self._g[:m])
        elif m > 1:
            self.ctx.decode(tokens[1:], first_pos, self._g[1:m])
        self._g[0] = self._g[m]
        self._has_g = True
        positions = first_pos + np.arange(m)
        self._ring[positions % len(self._ring)] = self._g[1:m + 1]
        self._ring_pos[positions % len(self._ring)] = positions

    def _rewind(self, pos: int) -> None:
        slot = (pos - 1) % len(self._ring)
        if pos > 0 and self._ring_pos[slot] == pos - 1:   # g of the new boundary is known: rebuild its pair
            self.ctx.keep(pos - 1)
            self._g[0] = self._ring[slot]
            self._has_g = True
            return
        # else the pair at pos - 1 stays, with the token that followed it then: llama.cpp wants each batch to start
        # right after the cached positions
        self.ctx.keep(pos)
        self._has_g = False

    def _restart(self) -> None:
        self.ctx.clear()
        self._has_g = False
        self._ring_pos[:] = -1

    # -- drafting -----------------------------------------------------------------------------------------------
    def propose(self, history, last, max_len, p_min) -> Draft:
        pos0 = len(history)
        ready, setup = self._catch_up(pos0, max_len)
        if not ready or not self._has_g or max_len <= 0:
            return NO_DRAFT
        ctx, sampling = self.ctx, self._sampling
        greedy = sampling is None and p_min <= 0
        ctx.set_device_argmax(greedy)   # argmaxes only: taken on the device, no logits copied
        dists, drafted = [], []
        ctx.decode([last], pos0 - 1, self._g[:1], outputs=1)   # completes the deferred pair
        for i in range(max_len):
            if greedy:
                token, confidence = ctx.argmax(1)[0], 1.0
            else:
                logits = ctx.logits(1)[0]
                if sampling is None:
                    token = int(logits.argmax())
                    confidence = max_prob(logits, self._scratch, logits[token])
                else:   # the request's filters cut to the draft's best candidates: no dense row a drafted token
                    q = filter_logits(logits, self._filters)
                    token = sample(q, sampling.rng)
                    confidence = q.max_prob() if p_min > 0 else 1.0
                    dists.append(q)
            if confidence < p_min or token >= self.n_vocab_target:
                break
            drafted.append(token)
            if i + 1 == max_len:
                break
            # the next pair: (drafted token, the draft's own pre-norm state at the previous position)
            ctx.decode([token], pos0 + i, ctx.hidden(-1)[None, :], outputs=1)
        ctx.keep(pos0 - 1)   # back to the pairs of the history; the verification brings the real features
        return Draft(drafted, dists[:len(drafted)] if sampling is not None else None, setup)
