"""Drafting with the target's own multi-token-prediction (MTP) head: no draft model, the head reads the target's
hidden state.

The head at position p reads (x_p, h_{p-1}) and predicts x_{p+1}. Two things keep its cache right:
- following the target: after every target decode (prefill chunks, verifications, replays) the head decodes the
  same tokens at the same positions, token k paired with the target's hidden state of the position before it
  (`_follow`, hooked on the target context's `on_decode`). Positions whose entries were made from the target's
  own states are "valid" (`_valid`): they hold for as long as the target keeps those tokens.
- drafting: from (last, h_{P-1}) at P the head proposes d_1, then (d_1, its own output state) at P+1 proposes
  d_2, and so on. The first entry is exactly what following would decode, so it stays valid; the later ones are
  dropped before the next decode ("rollback is keep() on both contexts").
The target's hidden states of recent positions are kept in a ring (`RING_ROWS` rows), so a generation that starts
inside what the target already holds (a regenerated reply) still pairs its first token with the right state.
"""
from __future__ import annotations

import numpy as np

from ..sampling import filtered_probs, max_prob, sample_from
from .base import Draft, Drafter, ProbsBuffer, Sampling, common_prefix_len

RING_ROWS = 1024


class MTPDrafter(Drafter):
    """Drafts with the MTP head of the target (a backend MTPContext, which knows its target context)."""

    kind = "mtp"

    def __init__(self, ctx, n_vocab_target: int, ring_rows: int = RING_ROWS):
        self.ctx = ctx
        self.contexts = (ctx,)
        self.target = ctx.target
        self.n_vocab = n_vocab_target
        self._valid = 0                         # ctx positions < _valid hold entries made from target states
        self._base = 0                          # len(history) at the last proposal
        self._sampling: Sampling | None = None
        self._probs = ProbsBuffer(n_vocab_target)
        self._scratch = np.empty(n_vocab_target, dtype=np.float32)    # for the confidence stop
        rows = max(1, min(ring_rows, self.target.n_ctx))
        self._ring = np.zeros((rows, ctx.n_embd), dtype=np.float32)   # target hidden state of position q at q % rows
        self._ring_pos = np.full(rows, -1, dtype=np.int64)             # which position each ring row holds
        self._zeros = np.zeros(ctx.n_embd, dtype=np.float32)
        self.target.on_decode = self._follow

    # -- following the target ----------------------------------------------------------------------------------
    def _target_hidden(self, position: int) -> np.ndarray:
        """The target's hidden state at `position` (zeros before the start or when it is no longer known)."""
        slot = position % len(self._ring)
        return self._ring[slot] if position >= 0 and self._ring_pos[slot] == position else self._zeros

    def _follow(self, tokens, first_position: int) -> None:
        """After the target decoded `tokens` at first_position..: the head decodes them too."""
        n, ctx = len(tokens), self.ctx
        rows = self.target.hidden_rows(n)
        ctx.keep(min(ctx.n_past, self._valid))         # drop entries made while drafting
        start = 0
        if ctx.n_past > first_position:                 # a re-decode (replay): keep the entries of the same tokens
            start = common_prefix_len(ctx.tokens[first_position:first_position + n], tokens)
            ctx.keep(first_position + start)
        elif ctx.n_past < first_position:               # the states before are gone: the head starts over here
            ctx.restart_at(first_position)
        if start < n:
            first = rows[start - 1] if start else self._target_hidden(first_position - 1)
            ctx.decode(tokens[start:], first, rows[start:n - 1])
        self._valid = ctx.n_past
        self._remember(rows, first_position)

    def _remember(self, rows: np.ndarray, first_position: int) -> None:
        size = len(self._ring)
        if len(rows) > size:
            first_position += len(rows) - size
            rows = rows[-size:]
        slots = (first_position + np.arange(len(rows))) % size
        self._ring[slots] = rows
        self._ring_pos[slots] = first_position + np.arange(len(rows))

    # -- the contract ------------------------------------------------------------------------------------------
    def begin(self, history, sampling, p_min, prefill) -> None:
        # the target's prefill has already been followed; greedy without a confidence stop needs argmaxes only
        self._sampling = sampling
        self.ctx.set_device_argmax(sampling is None and p_min <= 0)

    def propose(self, history, last, max_len, p_min) -> Draft:
        ctx, position = self.ctx, len(history)
        ctx.keep(min(position, self._valid))            # past the history: last step's drafts and rejected tokens
        if ctx.n_past < position:
            ctx.restart_at(position)
        self._base = position
        sampling = self._sampling
        output = "argmax" if sampling is None and p_min <= 0 and ctx.device_argmax else "logits"
        ctx.decode([last], self._target_hidden(position - 1), output=output)
        self._valid = position + 1                      # (last, h_{P-1}): what following would have decoded
        probs = self._probs.rows(max_len) if sampling is not None else None
        drafted: list[int] = []
        for i in range(max_len):
            if output == "argmax":
                token, confidence = ctx.last_argmax(), 1.0
            elif sampling is None:
                logits = ctx.last_logits()
                token = int(logits.argmax())
                confidence = max_prob(logits, self._scratch, logits[token]) if p_min > 0 else 1.0
            else:
                q = probs[i]
                filtered_probs(ctx.last_logits(), sampling.config, out=q)
                token = sample_from(q, sampling.rng)
                confidence = float(q.max()) if p_min > 0 else 1.0
            if confidence < p_min or token >= self.n_vocab:
                break                                   # unsure (llama.cpp's p_min rule), or not a target token
            drafted.append(token)
            if i + 1 == max_len:
                break
            ctx.decode([token], ctx.hidden_row(0), output=output)   # chain: the head's own state stands in for h
        return Draft(drafted, probs[:len(drafted)] if probs is not None else None)

    def accepted(self, n_accepted: int) -> None:
        keep = self._base + 1 + n_accepted              # [last] and the accepted drafts
        self.ctx.keep(min(keep, self.ctx.n_past))
        self._valid = min(self._valid, keep)

    def reset(self) -> None:
        self.ctx.clear()
        self._valid = 0
        self._ring_pos[:] = -1

    def close(self) -> None:
        if self.target.on_decode == self._follow:
            self.target.on_decode = None
        self.ctx.close()                                # the model is the target's: the pair closes it
