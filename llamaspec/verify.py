"""Acceptance rules: given draft tokens and the target's view of the same positions, how many are kept and which
token comes next. Pure numpy; the two rules are separate functions and are tested separately.

Row i of the target's output is its prediction for the position after token i of the verified batch
[last, d_1, ..., d_k], i.e. the target's opinion of d_{i+1}; row k gives the bonus token.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .sampling import Dist, _sample_dense, as_dist, sample


def accept_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """Keep draft tokens while they equal the target's argmax; then the target's own token.

    draft_tokens: (k,), target_argmax: (k+1,), lists or arrays (a draft is a few tokens: a loop, no arrays made).
    Returns (n_accepted, next_token).
    """
    k = len(draft_tokens)
    for i in range(k):
        if draft_tokens[i] != target_argmax[i]:
            return i, int(target_argmax[i])
    return k, int(target_argmax[k])


def accept_rejection(
    draft_tokens: Sequence[int],
    draft_probs: Sequence[Dist | np.ndarray] | np.ndarray | None,
    target_probs: Callable[[int], Dist | np.ndarray],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Leviathan/Chen speculative sampling: the output has exactly the target's distribution.

    draft_tokens: (k,), token i drawn from draft_probs[i] (a Dist, or a probability vector over the vocabulary).
    target_probs(i): the target's filtered distribution at row i, asked for lazily (rows past the first rejection
    are never needed). Only p(x) and q(x) are read per row; the residual is built once, at a rejection, over p's
    support (a sparse p never touches the vocabulary). Returns (n_accepted, next_token).
    """
    k = len(draft_tokens)
    for i in range(k):
        x = int(draft_tokens[i])
        p, q = as_dist(target_probs(i)), as_dist(draft_probs[i])
        # accept with probability min(1, p(x) / q(x)); q(x) > 0 because x was drawn from q
        if rng.random() * q.prob(x) < p.prob(x):
            continue
        return i, sample_residual(p, q, rng)
    return k, sample(as_dist(target_probs(k)), rng)


def sample_residual(p: Dist, q: Dist, rng: np.random.Generator) -> int:
    """A token from normalize(max(0, p - q)), after a rejection at p's row. Where p carries a draw of its own (the
    device's sampler drew y ~ p, independently of the rejection), y is kept with chance max(0, p(y) - q(y)) / p(y):
    y then has the residual's distribution, with total chance Z = sum max(0, p - q); otherwise the residual is
    sampled in full (a dense p with a sparse q: drawn from p's block sums corrected at q's ids, never built).
    Together: exactly the residual (Z of it one way, 1 - Z the other), and the vocabulary passes of building it are
    skipped in Z of the rejections, most of them where p and q disagree."""
    y, p.draw = p.draw, -1
    if y >= 0:
        py = p.prob(y)
        if py > 0.0 and rng.random() * py < py - q.prob(y):
            return y
    if p.ids is not None:
        return sample(residual(p, q), rng)
    # dense: the sampler's pass over the residual gives its mass too, so no pass of its own asks whether it vanished
    if q.ids is not None:   # a draft's few candidates: the residual is p but at their ids, drawn without building it
        inside = q.ids < len(p.weights)
        ids = q.ids[inside]
        p_at = p.weights[ids] * np.float64(1.0 / p.total)
        token, _ = _sample_dense(p.weights, rng, 1.0 / p.total, ids,
                                 np.maximum(p_at - q.weights[inside] * np.float64(1.0 / q.total), 0.0),
                                 sums=p.block_sums())
    else:
        token, _ = _sample_dense(_dense_residual(p, q), rng)
    return token if token >= 0 else sample(Dist(None, p.weights, p.total), rng)


def residual(p: Dist, q: Dist) -> Dist:
    """normalize(max(0, p - q)): nonzero only where p is, so it lives on p's support. When it vanishes (p == q up
    to rounding) the residual is p itself."""
    if p.ids is None:  # a dense target row: once per step at most
        r = _dense_residual(p, q)
    else:
        r = p.weights / p.total - q.probs_at(p.ids)
        np.maximum(r, 0.0, out=r)
    out = Dist(p.ids, r)
    if out.total <= 0.0:
        return Dist(p.ids, p.weights, p.total)  # without p's draw: that belongs to the bonus token only
    return out


def _dense_residual(p: Dist, q: Dist) -> np.ndarray:
    """max(0, p / p.total - q / q.total) over a dense p's ids (float32, unnormalised). A distribution that comes
    normalised (the device's rows: total 1) is not scaled, which changes no value (x * 1 == x): two passes over the
    vocabulary where both come normalised (subtract, clip), not four."""
    r = np.empty(len(p.weights), dtype=np.float32)
    if q.ids is None:
        n = min(len(q.weights), len(r))
        q_part = q.weights[:n] if q.total == 1.0 else q.weights[:n] * np.float32(1.0 / q.total)
        if p.total == 1.0 and p.weights.dtype == np.float32:
            np.subtract(p.weights[:n], q_part, out=r[:n])
            r[n:] = p.weights[n:]
        else:
            np.multiply(p.weights, np.float32(1.0 / p.total), out=r, dtype=np.float32)
            r[:n] -= q_part
    else:
        np.multiply(p.weights, np.float32(1.0 / p.total), out=r, dtype=np.float32)
        inside = q.ids < len(r)
        r[q.ids[inside]] -= q.weights[inside] / np.float32(q.total)  # ids are distinct: no accumulation needed
    return np.maximum(r, 0.0, out=r)
