"""Drafting without a model: prompt lookup (n-grams of the text so far), and lookup first with a draft model behind
it."""
from __future__ import annotations

import numpy as np

from .base import NO_DRAFT, Draft, Drafter, point_masses


class PromptLookupDrafter(Drafter):
    """Proposes the continuation of the most recent earlier occurrence of the last n tokens (n = ngram_max..min).

    No model: it shines on input-grounded output (editing code, quoting, reformatting) where the text repeats.
    Its proposals are deterministic, so in sampling mode q is a point mass on each proposed token.
    """

    kind = "lookup"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2, n_vocab: int = 0):
        self.ngram_max, self.ngram_min, self.n_vocab = ngram_max, ngram_min, n_vocab
        # the text so far as a growing int64 array: history only grows within a generation (and the engine gives
        # each generation a new list), so each step appends the new tokens instead of copying the whole history
        self._buf = np.empty(1024, dtype=np.int64)
        self._len = 0
        self._source: list[int] | None = None
        self._sampling = False

    def begin(self, history, sampling, p_min, prefill) -> None:
        self._source, self._len = None, 0
        self._sampling = sampling is not None

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

    saves_state = True   # it keeps nothing the history does not give back

    def propose(self, history, last, max_len, p_min) -> Draft:
        drafted = self.lookup(self._tokens(history, last), max_len)
        if not drafted:
            return NO_DRAFT
        return Draft(drafted, point_masses(drafted) if self._sampling else None)


class CombinedDrafter(Drafter):
    """Prompt lookup first; the draft model (or the target's MTP head) when lookup finds nothing."""

    kind = "lookup+model"

    def __init__(self, lookup: PromptLookupDrafter, model: Drafter, kind: str = "lookup+model"):
        self.lookup, self.model, self.kind = lookup, model, kind
        self.contexts = model.contexts
        self._from_model = False

    def begin(self, history, sampling, p_min, prefill) -> None:
        self.lookup.begin(history, sampling, p_min, prefill)
        self.model.begin(history, sampling, p_min, prefill)

    def propose(self, history, last, max_len, p_min) -> Draft:
        draft = self.lookup.propose(history, last, max_len, p_min)
        self._from_model = not draft.tokens
        return self.model.propose(history, last, max_len, p_min) if self._from_model else draft

    def accepted(self, n_accepted: int) -> None:
        if self._from_model:
            self.model.accepted(n_accepted)

    @property
    def saves_state(self) -> bool:
        return self.model.saves_state

    def save_state(self):
        return self.model.save_state()

    def restore_state(self, saved) -> bool:
        return self.model.restore_state(saved)

    def reset(self) -> None:
        self.model.reset()

    def close(self) -> None:
        self.model.close()
