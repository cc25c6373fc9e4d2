"""What EAGLE-3 and DFlash drafters share: they draft from the target's own hidden states.

The target's layer inputs exist only right after each of its decodes (prompt chunks and verifications alike), so
the drafter watches the target's context (`Context.on_decode`) and copies each decode's rows into a tail of
features not yet fed to the draft. The tail is fed lazily, when a draft is asked for: rejected draft tokens are
dropped from it first (they never reach the draft's cache), a pause in speculation costs only copies, and the
draft's work is counted as drafting. The tail holds at most one batch; a longer run of target decodes (a prompt)
is fed a batch at a time.

Position state: the draft's cache holds what it needs for target positions < `_fed`; the tail covers positions
[_fed, _fed + n). When the target goes back before `_fed` (a reused prompt that differs, a cancelled step), the
draft's cache is cut there (`_rewind`); when features are missing (should not happen) it starts over (`_restart`).
"""
from __future__ import annotations

import abc
import time

import numpy as np

from ..sampling import Sampling, draft_filters
from .base import Drafter, point_masses


class HiddenStateDrafter(Drafter):
    """The feature tail and the bookkeeping of one draft context (backend.hidden.HiddenDraftContext, whose `taps`
    read the target's layers)."""

    def __init__(self, ctx, n_vocab_target: int):
        self.ctx, self.taps = ctx, ctx.taps
        self.contexts = (ctx,)
        self.n_vocab = ctx.n_vocab
        self.n_vocab_target = n_vocab_target
        capacity = ctx.n_batch
        self._rows = np.zeros((capacity, self.taps.width), np.float32)
        self._tokens = np.zeros(capacity, np.int64)
        self._fed = 0            # target positions < _fed are in the draft's cache
        self._n = 0              # tail: positions _fed .. _fed + _n - 1
        self._sampling: Sampling | None = None
        self._filters = None     # the request's filters cut to the draft's best candidates (draft_filters)
        self._scratch = np.empty(ctx.n_vocab, dtype=np.float32)
        if ctx.target_ctx.on_decode is not None:
            raise RuntimeError("internal: the target context already has a decode observer")
        ctx.target_ctx.on_decode = self._target_decoded

    # -- what a kind implements ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def _feed(self, tokens: np.ndarray, rows: np.ndarray, first_pos: int) -> None:
        """Put the target's tokens and feature rows of positions first_pos.. into the draft's cache."""

    def _rewind(self, pos: int) -> None:
        """The target went back to `pos` tokens (< _fed): cut the draft's cache to match."""
        self.ctx.keep(pos)

    def _restart(self) -> None:
        """Forget the draft's cache (features are missing)."""
        self.ctx.clear()

    # -- following the target -----------------------------------------------------------------------------------
    def _cut(self, pos: int) -> bool:
        """Make cache + tail describe exactly the target positions < pos; False when features are missing."""
        end = self._fed + self._n
        if pos < self._fed:
            self._rewind(pos)
            self._fed, self._n = pos, 0
        elif pos <= end:
            self._n = pos - self._fed
        else:
            return False
        return True

    def _target_decoded(self, tokens, first_pos: int) -> None:
        m = len(tokens)
        if not self._cut(first_pos):  # a decode we did not see: start over from this one
            self._restart()
            self._fed, self._n = first_pos, 0
        if self._n + m > len(self._rows):
            self._flush()
        self.taps.copy_rows(m, self._rows[self._n:self._n + m])
        self._tokens[self._n:self._n + m] = tokens
        self._n += m

    def _flush(self) -> int:
        n = self._n
        if n:
            self._feed(self._tokens[:n], self._rows[:n], self._fed)
            self._fed, self._n = self._fed + n, 0
        return n

    def _catch_up(self, pos: int, max_len: int) -> tuple[bool, float]:
        """Feed the tail up to target position pos. Returns (ready, setup seconds): a catch-up longer than a normal
        step's (the accepted tokens) is set-up, not a per-token cost."""
        t0 = time.perf_counter()
        if not self._cut(pos):
            return False, 0.0
        n = self._flush()
        return True, (time.perf_counter() - t0) if n > max_len + 1 else 0.0

    # -- the contract -------------------------------------------------------------------------------------------
    def begin(self, history, sampling, p_min, prefill) -> None:
        self._sampling = sampling
        self._filters = draft_filters(sampling.config) if sampling is not None else None
        if prefill:
            self._catch_up(len(history), 0)

    def reset(self) -> None:
        self._restart()
        self._fed = self._n = 0

    def close(self) -> None:
        if self.ctx.target_ctx.on_decode == self._target_decoded:
            self.ctx.target_ctx.on_decode = None
        self.ctx.close()
        self.ctx.model.close()

    # -- shared by the kinds ------------------------------------------------------------------------------------
    def _point_masses(self, drafted: list[int]) -> list | None:
        """q for tokens chosen deterministically (argmax), in sampling mode."""
        return point_masses(drafted) if self._sampling is not None and drafted else None
