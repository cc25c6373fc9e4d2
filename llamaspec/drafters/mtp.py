"""Drafting with the target's own multi-token-prediction (MTP) head: no draft model, the head reads the target's
hidden state.

The head at position p reads (x_p, h_{p-1}) and predicts x_{p+1}; its cache must hold, for every position of the
history, the entry made of that token and the target's final hidden state of the position before.
- Following the target: after every target decode (prefill chunks, verifications, replays) `_follow` (hooked on
  the target context's `on_decode`) keeps that decode's hidden rows in a ring indexed by position, and drops the
  head's entries the target has just overwritten with other tokens. The head catches up from the ring lazily.
- Drafting: `propose` decodes, in one batch, the entries the head is behind on (the tokens accepted since the last
  draft) and (last, h_{P-1}) at P, whose output is d_1; then (d_1, the head's own output state) at P+1 gives d_2,
  and so on. A step thus costs the head k decodes for k drafts, and rejected tokens are never caught up on.
- Entries made from target states are "valid" (`_valid`): the drafted ones after them are dropped before the next
  decode ("rollback is keep() on both contexts"; the head's cache is a plain KV cache).
When the head is far behind (prompt lookup drafting, plain-decoding stretches of `auto`), `_follow` catches up at
once, so the ring never loses a row the head still needs; a regenerated reply starts inside what the target holds
and still finds its first state there.
"""
from __future__ import annotations

import numpy as np

from ..sampling import Sampling, draft_filters, filter_logits, max_prob, sample
from .base import Draft, Drafter, ProbsBuffer, common_prefix_len

RING_ROWS = 1024
BEHIND_MAX = 16     # positions the head may lag behind the target before _follow catches up



class HiddenRing:
    """The target's hidden state of position q at row q % rows, and which position each row holds: what an MTP head
    reads when it catches up (one per sequence; MTPDrafter and the batched heads of drafters/batched_mtp.py)."""

    def __init__(self, rows: int, n_embd: int):
        self.rows = np.zeros((rows, n_embd), dtype=np.float32)
        self.pos = np.full(rows, -1, dtype=np.int64)
        self._offsets = np.arange(rows, dtype=np.int64)

    def remember(self, rows: np.ndarray, first_position: int) -> None:
        n, size = len(rows), len(self.rows)
        start = first_position % size
        if start + n <= size:                   # the usual case: one slice, no index arrays
            self.rows[start:start + n] = rows
            self.pos[start:start + n] = self._offsets[:n]
            self.pos[start:start + n] += first_position
        else:
            slots = (first_position + np.arange(n)) % size
            self.rows[slots] = rows
            self.pos[slots] = first_position + np.arange(n)

    def states(self, first: int, n: int) -> np.ndarray | None:
        """The states at positions first..first+n-1 (zeros for position -1: none before the first), or None when one
        was lost. Where they lie in one stretch of the ring (every step's case) a view of it, valid until the ring
        is next written; its reader copies it into a batch at once."""
        size = len(self.rows)
        start = first % size
        if first >= 0 and start + n <= size:
            held = self.pos[start:start + n]
            if (held[0] == first) if n == 1 else (held - first == self._offsets[:n]).all():
                return self.rows[start:start + n]
            return None
        positions = np.arange(first, first + n)
        slots = positions % size
        known = (self.pos[slots] == positions) | (positions < 0)
        if not known.all():
            return None
        states = self.rows[slots]               # a copy (fancy indexing)
        states[positions < 0] = 0.0
        return states

    def clear(self) -> None:
        self.pos[:] = -1

    def saved(self) -> dict:
        """Copies of its rows and positions, for a saved state (`load` puts them back)."""
        return {"ring_rows": self.rows.copy(), "ring_pos": self.pos.copy()}

    def load(self, saved: dict) -> None:
        self.rows, self.pos = saved["ring_rows"], saved["ring_pos"]
        if len(self._offsets) != len(self.rows):
            self._offsets = np.arange(len(self.rows), dtype=np.int64)

    def pending(self, head, valid: int, tokens, end: int, last: int | None = None):
        """What a head's cache (`keep`, `n_past`: an MTP context, or one sequence of a shared one) lacks up to `end`,
        after it drops what it holds past `valid` (entries made while drafting) and past `end`: the entries for
        positions n_past..end-1 (tokens[p] with h_{p-1}) and, with `last`, (last, h_{end-1}); and their states, None
        where the ring no longer has one."""
        head.keep(valid)
        if head.n_past > end:
            head.keep(end)
        start = head.n_past
        entries = list(tokens[start:end]) + ([last] if last is not None else [])
        return entries, self.states(start - 1, len(entries))

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
        self._filters = None   # the request's filters cut to the draft's best candidates (draft_filters)
        self._probs = ProbsBuffer(n_vocab_target)
        self._scratch = np.empty(n_vocab_target, dtype=np.float32)    # for the confidence stop
        # the ring holds what the head may be behind on plus one decode
        rows = max(ring_rows, self.target.n_batch + 2 * BEHIND_MAX + 2)
        self._ring = HiddenRing(rows, ctx.n_embd)
        self.target.on_decode = self._follow

    # -- following the target ----------------------------------------------------------------------------------
    def _follow(self, tokens, first_position: int) -> None:
        """The target decoded `tokens` at first_position..: keep their hidden states; the head catches up later."""
        n = len(tokens)
        if first_position < self._valid:        # the target went back: keep the head's entries that still match
            self._valid = first_position + common_prefix_len(self.ctx.tokens[first_position:self._valid], tokens)
            self.ctx.keep(self._valid)
        self._ring.remember(self.target.hidden_rows(n), first_position)
        if first_position + n - self._valid > BEHIND_MAX:
            self._catch_up(self.target.tokens, first_position + n)

    def _catch_up(self, tokens, end: int, last: int | None = None, output: str | None = None) -> None:
        """Decode the head's entries for positions n_past..end-1 (tokens[p] with h_{p-1}) and, when `last` is given,
        (last, h_{end-1}) at `end` with `output` of it. States the ring no longer has: the head starts over at end."""
        ctx = self.ctx
        entries, states = self._ring.pending(ctx, self._valid, tokens, end, last)
        if not entries:
            return
        if states is None:                                  # lost: begin a fresh cache at `end`
            ctx.restart_at(end)
            entries = [last] if last is not None else []
            states = self._ring.states(end - 1, 1)
            if not entries:
                self._valid = end
                return
            if states is None:
                states = np.zeros((1, ctx.n_embd), dtype=np.float32)
        for a in range(0, len(entries), ctx.n_batch):
            b = min(a + ctx.n_batch, len(entries))
            ctx.decode(entries[a:b], states[a], states[a + 1:b], output=output if b == len(entries) else None)
        self._valid = ctx.n_past

    def sync(self, history) -> None:
        """Catch the head up on the whole history now (it otherwise does so when it drafts)."""
        self._valid = min(self._valid, len(history))
        self._catch_up(history, len(history))

    # -- the contract ------------------------------------------------------------------------------------------
    def begin(self, history, sampling, p_min, prefill) -> None:
        # the target's prefill has been recorded; greedy without a confidence stop needs argmaxes only
        self._sampling = sampling
        self._filters = draft_filters(sampling.config) if sampling is not None else None
        self.ctx.set_device_argmax(sampling is None and p_min <= 0)

    def propose(self, history, last, max_len, p_min) -> Draft:
        ctx, position = self.ctx, len(history)
        self._valid = min(self._valid, position)         # past the history: rejected tokens
        self._base = position
        sampling = self._sampling
        if sampling is None:
            output = "argmax" if p_min <= 0 and ctx.device_argmax else "logits"
        else:   # the filters on the device (the engine attached the chain) or in numpy on the logits
            output = "dist" if sampling.device and ctx.device_sampler else "logits"
        self._catch_up(history, position, last, output)  # ..., then (last, h_{P-1}): d_1
        rows = self._probs.rows(max_len) if sampling is not None else None
        drafted: list[int] = []
        dists = []
        for i in range(max_len):
            if output == "argmax":
                token, confidence = ctx.last_argmax(), 1.0
            elif sampling is None:
                logits = ctx.last_logits()
                token = int(logits.argmax())
                confidence = max_prob(logits, self._scratch, logits[token]) if p_min > 0 else 1.0
            else:
                if output == "dist":                    # q and the device's draw from it
                    q = ctx.last_dist()
                    token = q.draw
                    q = q.copy(into=rows[i])            # outlives the next decode
                    if q.prob(token) <= 0:              # rounding on the device: a draw q gives no mass
                        break
                else:
                    q = filter_logits(ctx.last_logits(), self._filters, rows[i])
                    token = sample(q, sampling.rng)
                confidence = q.max_prob() if p_min > 0 else 1.0
                dists.append(q)
            if confidence < p_min or not 0 <= token < self.n_vocab:
                break                                   # unsure (llama.cpp's p_min rule), or not a target token
            drafted.append(token)
            if i + 1 == max_len:
                break
            ctx.decode([token], ctx.last_hidden(), output=output)   # chain: the head's own state stands in for h
        return Draft(drafted, dists[:len(drafted)] if sampling is not None else None)

    def accepted(self, n_accepted: int) -> None:
        # the accepted drafts' entries were made from the head's own states: they are caught up on properly later
        self.ctx.keep(min(self._base + 1, self.ctx.n_past))

    saves_state = True

    def save_state(self):
        # the head's cache, how far it is made from target states, and the states it may still catch up from
        return self.ctx.save_state(valid=self._valid, **self._ring.saved())

    def restore_state(self, saved) -> bool:
        if saved is None or not self.ctx.restore_state(saved):
            self.reset()
            return saved is None
        self._valid = saved.extra["valid"]
        self._ring.load(saved.extra)
        return True

    def reset(self) -> None:
        self.ctx.clear()
        self._valid = 0
        self._ring.clear()

    def close(self) -> None:
        if self.target.on_decode == self._follow:
            self.target.on_decode = None
        self.ctx.close()                                # the model is the target's: the pair closes it
