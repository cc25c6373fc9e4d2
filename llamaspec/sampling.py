"""Sampler settings and the filtered next-token distribution, as pure numpy over one row of logits.

Order of operations (the same for draft and target, which is what keeps rejection sampling exact):
temperature -> top-k -> top-p -> min-p -> renormalise. Temperature 0 means greedy (argmax) and no distribution
is ever built. Nothing here knows about models or tokens beyond their ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import InvalidParameterError

# top-p first looks for the nucleus among this many best candidates before sorting the whole vocabulary.
_NUCLEUS_CANDIDATES = 256


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1 = off
    min_p: float = 0.0      # 0 = off
    seed: int | None = None

    def __post_init__(self):
        validate_sampler(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampler(temperature, top_k, top_p, min_p, seed) -> None:
    """Raise InvalidParameterError naming the first bad value."""
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature) \
            or temperature < 0:
        raise InvalidParameterError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}",
                                    param="temperature")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise InvalidParameterError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}", param="top_k")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not (0.0 < top_p <= 1.0):
        raise InvalidParameterError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}", param="top_p")
    if not isinstance(min_p, (int, float)) or isinstance(min_p, bool) or not (0.0 <= min_p <= 1.0):
        raise InvalidParameterError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}", param="min_p")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise InvalidParameterError(f"seed must be a non-negative integer, got {seed!r}", param="seed")


def filtered_probs(logits: np.ndarray, cfg: SamplerConfig, out: np.ndarray | None = None) -> np.ndarray:
    """Probabilities after temperature, top-k, top-p and min-p; zeros outside the kept set. Sums to 1.

    `logits` is read, never written (it may be a view into llama.cpp's buffer); `out` is reused when given.
    """
    probs = np.multiply(logits, np.float32(1.0 / cfg.temperature), out=out, dtype=np.float32)
    probs -= probs.max()
    np.exp(probs, out=probs)  # unnormalised, max = 1

    n_vocab = probs.shape[0]
    if 0 < cfg.top_k < n_vocab:
        kth = np.partition(probs, n_vocab - cfg.top_k)[n_vocab - cfg.top_k]
        probs[probs < kth] = 0.0
    if cfg.top_p < 1.0:
        _apply_top_p(probs, cfg.top_p)
    if cfg.min_p > 0.0:
        probs[probs < cfg.min_p * probs.max()] = 0.0
    probs /= probs.sum(dtype=np.float64)
    return probs


def _apply_top_p(probs: np.ndarray, top_p: float) -> None:
    """Zero every token outside the smallest set whose mass reaches top_p (in place, unnormalised input)."""
    total = probs.sum(dtype=np.float64)
    target = top_p * total
    n_cand = min(_NUCLEUS_CANDIDATES, probs.shape[0])
    cand = np.argpartition(probs, probs.shape[0] - n_cand)[probs.shape[0] - n_cand:]
    if probs[cand].sum(dtype=np.float64) < target:
        cand = np.arange(probs.shape[0])  # the nucleus is wider than the candidates: sort everything
    order = cand[np.argsort(probs[cand])[::-1]]
    cumulative = np.cumsum(probs[order], dtype=np.float64)
    n_keep = min(int(np.searchsorted(cumulative, target)) + 1, len(order))  # include the token crossing top_p
    kept = order[:n_keep]
    values = probs[kept]
    probs[:] = 0.0
    probs[kept] = values


_SAMPLE_BLOCK = 1024


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a (possibly unnormalised) non-negative vector.

    Inverse-CDF sampling in two levels: pick a block of 1024 ids by the blocks' masses, then the id inside it.
    A cumulative sum over the whole vocabulary is sequential (about 2 ms for 152k ids on a slow core); block sums
    vectorise, and only one block needs a cumulative sum (0.1 ms). Ids of probability 0 are never drawn.
    """
    n = probs.shape[0]
    if n <= 4 * _SAMPLE_BLOCK:
        cdf = np.cumsum(probs, dtype=np.float64)
        return _first_above(cdf, rng.random() * cdf[-1], probs)
    n_full = n - n % _SAMPLE_BLOCK
    sums = probs[:n_full].reshape(-1, _SAMPLE_BLOCK).sum(axis=1, dtype=np.float64)
    if n_full < n:
        sums = np.append(sums, probs[n_full:].sum(dtype=np.float64))
    cdf = np.cumsum(sums)
    u = rng.random() * cdf[-1]
    b = min(int(np.searchsorted(cdf, u, side="right")), len(sums) - 1)
    while sums[b] <= 0.0:  # rounding put u on an empty block's edge: take the nearest earlier non-empty one
        b -= 1
    lo = b * _SAMPLE_BLOCK
    block = probs[lo:lo + _SAMPLE_BLOCK]
    inner = np.cumsum(block, dtype=np.float64)
    return lo + _first_above(inner, u - (cdf[b - 1] if b else 0.0), block)


def _first_above(cdf: np.ndarray, u: float, probs: np.ndarray) -> int:
    """The first index whose cumulative mass exceeds u; past the end (rounding), the last id with mass."""
    idx = int(np.searchsorted(cdf, u, side="right"))
    if idx >= len(cdf):
        idx = int(np.flatnonzero(probs)[-1])
    return idx


def max_prob(logits: np.ndarray, scratch: np.ndarray | None = None, top: float | None = None) -> float:
    """The largest softmax probability of a logits row (temperature 1): 1 / sum(exp(l - max)).

    Peaked rows (the usual case for a draft) need only the logits within 20 of the maximum: the rest add at most
    n_vocab * e^-20 (3e-4 for a 150k vocabulary) to a sum that is at least 1. Flat rows take the full exp pass.
    """
    if top is None:
        top = logits.max()
    near = logits[logits > top - 20.0]
    if len(near) < 4096:
        return float(1.0 / np.exp(near - top).sum(dtype=np.float64))
    scratch = np.subtract(logits, top, out=scratch, dtype=np.float32)
    np.exp(scratch, out=scratch)
    return float(1.0 / scratch.sum(dtype=np.float64))
