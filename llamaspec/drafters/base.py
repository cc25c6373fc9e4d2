"""The drafter contract and what it hands back."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from ..kinds import KINDS
from ..sampling import Dist, Sampling


@dataclass
class Draft:
    """Proposed tokens; in sampling mode, `probs[i]` is the distribution token i was drawn from (the q of the
    rejection rule): a sampling.Dist, or a probability vector over the target's vocabulary. `setup_seconds`: time
    spent catching up on the history, not a per-token cost (the policy leaves it out)."""

    tokens: list[int]
    probs: list | np.ndarray | None = None
    setup_seconds: float = 0.0

    def split(self, k: int) -> tuple["Draft", "Draft"]:
        """The first k tokens (the draft) and the rest (a tail probe's token: judged, never verified)."""
        probs = self.probs
        return (Draft(self.tokens[:k], None if probs is None else probs[:k], self.setup_seconds),
                Draft(self.tokens[k:], None if probs is None else probs[k:]))


NO_DRAFT = Draft([])
_ONE = np.ones(1, dtype=np.float32)


def point_masses(drafted: list[int]) -> list[Dist]:
    """q for tokens proposed deterministically (a lookup, an argmax): a point mass on each, exact under the rejection
    rule; sparse, nothing vocabulary-sized."""
    return [Dist(np.array([t]), _ONE, 1.0, peak=1.0) for t in drafted]


class Drafter(abc.ABC):
    """One source of draft tokens. Per generation: `begin`, then per step `propose` and `accepted`."""

    kind = "base"            # its name in kinds.KINDS
    contexts: tuple = ()     # llama.cpp contexts it owns (their decode time counts as the engine's)

    @property
    def draft_cost(self) -> str:
        """How drafting time grows with the draft length, as its kind's descriptor says: "per_token" (one pass per
        token, a draft model) or "per_pass" (the whole draft in one pass, DFlash: c(n) is nearly flat in n)."""
        kind = KINDS.get(self.kind)
        return kind.draft_cost if kind is not None else "per_token"

    def begin(self, history: list[int], sampling: Sampling | None, p_min: float, prefill: bool) -> None:
        """A generation starts after `history` (already in the target's cache). `prefill`: catch up now, the
        first step will draft; otherwise catch up lazily when first asked."""

    @abc.abstractmethod
    def propose(self, history: list[int], last: int, max_len: int, p_min: float) -> Draft:
        """Up to `max_len` tokens to follow history + [last]; stop early below confidence `p_min` (if it can)."""

    def accepted(self, n_accepted: int) -> None:
        """The target kept the first `n_accepted` proposed tokens: drop what followed them."""

    # whether `save_state` / `restore_state` keep this drafter's cache beside the target's in a host-memory cache
    # (backend/state_cache.py); a target whose drafter cannot keeps no such cache
    saves_state = False

    def save_state(self):
        """Its cache as a backend SavedSeq (its context's state and the bookkeeping that goes with it), or None when
        it keeps nothing that the history does not give back. Called between requests."""
        return None

    def restore_state(self, saved) -> bool:
        """Back to what `save_state` returned (None: start its cache over); False when the backend refused."""
        self.reset()
        return True

    def reset(self) -> None:
        """Forget everything cached (the conversation was reset)."""

    def close(self) -> None:
        """Free what it holds."""


_SHORT = 32


def common_prefix_len(a, b, start: int = 0) -> int:
    """Length of the common prefix of two token sequences, assuming the first `start` tokens are known equal."""
    n = min(len(a), len(b))
    start = min(start, n)
    if start == n:
        return n
    if n - start <= _SHORT:   # a step's few tokens: a loop costs less than two arrays
        for i in range(start, n):
            if a[i] != b[i]:
                return i
        return n
    x = np.asarray(a[start:n], dtype=np.int64)
    y = np.asarray(b[start:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return start + (int(diff[0]) if len(diff) else n - start)


class ProbsBuffer:
    """Rows of draft distributions over the target's vocabulary, allocated once and grown when a longer draft
    needs more rows."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self._rows = np.zeros((0, n_vocab), dtype=np.float32)

    def rows(self, n: int) -> np.ndarray:
        if self._rows.shape[0] < n:
            self._rows = np.zeros((max(n, 2 * self._rows.shape[0], 8), self.n_vocab), dtype=np.float32)
        return self._rows
