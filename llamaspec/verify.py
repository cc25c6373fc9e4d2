"""Acceptance rules: given draft tokens and the target's view of the same positions, how many are kept and which
token comes next. Pure numpy; the two rules are separate functions and are tested separately.

Row i of the target's output is its prediction for the position after token i of the verified batch
[last, d_1, ..., d_k], i.e. the target's opinion of d_{i+1}; row k gives the bonus token.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .sampling import sample_from


def accept_greedy(draft_tokens: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """Keep draft tokens while they equal the target's argmax; then the target's own token.

    draft_tokens: (k,), target_argmax: (k+1,). Returns (n_accepted, next_token).
    """
    k = len(draft_tokens)
    mismatch = np.flatnonzero(draft_tokens != target_argmax[:k])
    n_accepted = int(mismatch[0]) if len(mismatch) else k
    return n_accepted, int(target_argmax[n_accepted])


def accept_rejection(
    draft_tokens: np.ndarray,
    draft_probs: np.ndarray,
    target_probs: Callable[[int], np.ndarray],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Leviathan/Chen speculative sampling: the output has exactly the target's distribution.

    draft_tokens: (k,), each drawn from the matching row of draft_probs (k, V); the row of a rejected token is
    overwritten with the residual (no vocabulary-sized allocation per step).
    target_probs(i): the target's filtered distribution at row i (computed lazily: rows past the first
    rejection are never needed). Returns (n_accepted, next_token).
    """
    k = len(draft_tokens)
    for i in range(k):
        x = int(draft_tokens[i])
        p = target_probs(i)
        q = draft_probs[i]
        # accept with probability min(1, p(x) / q(x)); q(x) > 0 because x was drawn from q
        if rng.random() * q[x] < p[x]:
            continue
        # rejected: draw from the residual normalize(max(0, p - q))
        residual = np.subtract(p, q, out=q)  # q's row is not needed again: reuse it
        np.maximum(residual, 0.0, out=residual)
        if residual.sum(dtype=np.float64) <= 0.0:  # p == q up to rounding: the residual is p itself
            residual = p
        return i, sample_from(residual, rng)
    return k, sample_from(target_probs(k), rng)
