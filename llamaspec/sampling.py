"""Sampler settings and filtered next-token distributions, as pure numpy.

The rule (the same for draft and target, which is what keeps rejection sampling exact) comes in two orders:
- "openai": temperature -> top-k -> top-p -> min-p -> renormalise (OpenAI's API, Hugging Face);
- "llama.cpp": top-k -> top-p -> min-p on the untempered distribution (temperature 1), then temperature over the
  kept tokens -> renormalise (llama.cpp's default chain, `--samplers top_k;top_p;min_p;temperature`).
top-p's mass is measured after top-k, min-p's threshold is relative to the most likely token. The orders differ
only where top-p or min-p cut and T != 1 (top-k keeps the same tokens at any temperature). Temperature 0 means
greedy (argmax) and no distribution is ever built. Nothing here knows about models or tokens beyond their ids.

- `filtered_probs`: the rule written plainly over one dense row (the reference the tests hold the fast paths to).
- `filter_logits`: the same rule as a `Dist` without vocabulary-wide passes the settings do not need: top-k and
  min-p never exponentiate the whole vocabulary and come back sparse (only the kept ids); top-p alone needs the
  whole vocabulary's mass (one exp pass) but comes back sparse; temperature alone is a dense row.
- `Dist`: a filtered distribution, dense or sparse, possibly with a draw already made from it (llama.cpp's
  sampler chain on the device fills Dists too: backend/context.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from . import bounds
from .errors import InvalidParameterError

# top-p first looks for the nucleus among this many best candidates before sorting the whole vocabulary.
_NUCLEUS_CANDIDATES = 256

# A drafter filtering on the device, or drafting for a slot of the batch engine, draws from at most this many
# candidates (draft_filters)
DRAFT_TOP_K = 64

OPENAI, LLAMA_CPP = "openai", "llama.cpp"
SAMPLER_ORDERS = (OPENAI, LLAMA_CPP)    # temperature first / temperature last
# llama.cpp's --samplers names (and its aliases) of the filters llamaspec has
_SAMPLER_NAMES = {"top_k": "top_k", "top-k": "top_k", "topk": "top_k", "top_p": "top_p", "top-p": "top_p",
                  "topp": "top_p", "nucleus": "top_p", "min_p": "min_p", "min-p": "min_p", "minp": "min_p",
                  "temperature": "temperature", "temp": "temperature"}
# samplers of llama.cpp's default chain that do nothing at their default settings, which llamaspec cannot change:
# its default --samplers list is accepted as it is
_SAMPLERS_OFF = {"penalties", "dry", "top_n_sigma", "top-n-sigma", "topnsigma", "typ_p", "typ-p", "typp", "typ",
                 "xtc"}


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1 = off
    min_p: float = 0.0      # 0 = off
    seed: int | None = None
    order: str = OPENAI     # OPENAI: temperature first; LLAMA_CPP: truncation on the untempered distribution

    def __post_init__(self):
        validate_sampler(self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.order)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampler(temperature, top_k, top_p, min_p, seed, order=OPENAI) -> None:
    """Raise InvalidParameterError naming the first bad value (the ranges: bounds.py)."""
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        bounds.check(name, value)
    if seed is not None:
        bounds.check("seed", seed)
    if order not in SAMPLER_ORDERS:
        raise InvalidParameterError(f"sampler_order must be one of {', '.join(SAMPLER_ORDERS)}, got {order!r}",
                                    param="sampler_order")


def draft_filters(cfg: SamplerConfig) -> SamplerConfig:
    """The filters of a drafter's rows on the device (and of the batch engine's drafters, in numpy): the request's,
    cut to the DRAFT_TOP_K best candidates.
    Rejection sampling is exact with whatever distribution q the draft token is drawn from (q is what the test
    reads), so the cut changes acceptance only (0.01% on the real pair at T=0.8: benchmarks/probes/draft_top_k.py),
    while a row with nothing cut (temperature only, min-p alone) would come back dense: a vocabulary of floats
    copied out of llama.cpp's buffer for every drafted token (in numpy: exponentiated, summed and drawn from; cut, one
    threshold pass, and a rejection's residual needs no pass of its own). Filters that already keep fewer are left
    alone."""
    return cfg if 0 < cfg.top_k <= DRAFT_TOP_K else replace(cfg, top_k=DRAFT_TOP_K)


def parse_samplers(spec: "str | list") -> tuple[str, frozenset]:
    """llama.cpp's --samplers list (`top_k;top_p;min_p;temperature`, or a list of names; its aliases too) as
    (order, the filters it names): a filter left out is off, as in llama.cpp. llamaspec samples the lists that name
    temperature, with top-p before min-p and temperature before both (OPENAI) or after both (LLAMA_CPP); top-k
    commutes with temperature. Anything else raises InvalidParameterError with the reason."""
    names = spec if isinstance(spec, list) else str(spec).replace(",", ";").split(";")
    if not names or not all(isinstance(n, str) for n in names):
        raise InvalidParameterError(f"samplers must be names such as top_k;top_p;min_p;temperature, got {spec!r}",
                                    param="samplers")
    chain = []
    for raw in names:
        if raw.strip().lower() in _SAMPLERS_OFF:
            continue
        name = _SAMPLER_NAMES.get(raw.strip().lower())
        if name is None:
            raise InvalidParameterError(f"samplers: {raw.strip()!r} is not a sampler llamaspec has (it has "
                                        "top_k, top_p, min_p and temperature; penalties, dry, top_n_sigma, typ_p "
                                        "and xtc are accepted and stay off)", param="samplers")
        if name in chain:
            raise InvalidParameterError(f"samplers: {name} is named twice", param="samplers")
        chain.append(name)
    if "temperature" not in chain:
        raise InvalidParameterError("samplers: the list must name temperature (first or last)", param="samplers")
    cuts = [chain.index(n) for n in ("top_p", "min_p") if n in chain]
    if cuts != sorted(cuts):
        raise InvalidParameterError("samplers: min_p before top_p is not supported (top_p;min_p is)",
                                    param="samplers")
    where = chain.index("temperature")
    if any(c < where for c in cuts) and any(c > where for c in cuts):
        raise InvalidParameterError("samplers: temperature must come before both top_p and min_p or after both",
                                    param="samplers")
    first = where < min(cuts) if cuts else where == 0   # without top-p/min-p the order changes nothing
    return (OPENAI if first else LLAMA_CPP), frozenset(chain)


@dataclass(frozen=True)
class Sampling:
    """Sampling mode of a generation: the filter settings and the random stream (greedy has none). `device`: every
    context filters on the device (llama.cpp's sampler chains, Context.eval_dists), draft and target alike."""

    config: SamplerConfig
    rng: np.random.Generator
    device: bool = False


def filtered_probs(logits: np.ndarray, cfg: SamplerConfig, out: np.ndarray | None = None) -> np.ndarray:
    """The rule, plainly: probabilities after temperature, top-k, top-p and min-p; zeros outside the kept set.
    Sums to 1. Several passes over the vocabulary: the reference for tests, not the hot path (`filter_logits`).

    `logits` is read, never written (it may be a view into llama.cpp's buffer); `out` is reused when given.
    """
    if cfg.order == LLAMA_CPP and cfg.temperature != 1.0:  # the cut at temperature 1, then temperature on what stays
        kept = filtered_probs(logits, SamplerConfig(1.0, cfg.top_k, cfg.top_p, cfg.min_p), out) > 0
        probs = np.multiply(logits, np.float32(1.0 / cfg.temperature), out=out, dtype=np.float32)
        probs -= probs[kept].max()
        np.exp(probs, out=probs)
        probs[~kept] = 0.0
        probs /= probs.sum(dtype=np.float64)
        return probs
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


class Dist:
    """A filtered next-token distribution, dense or sparse.

    Token `ids[j]` has probability `weights[j] / total`. `ids` None means dense: the token id is the index, and ids
    past the end have probability 0 (a draft vocabulary shorter than the target's). `total` is computed when first
    needed (a dense row's sum is a vocabulary pass; sampling computes it on the way). `draw`: a token already drawn
    from this distribution with randomness of its own (llama.cpp's sampler chain), or -1; `sample` uses it once.
    Weights may be views into llama.cpp's buffers: `copy` what must outlive the next decode. A long dense row's
    total is the sum of its block sums (`block_sums`), which a draw from it then reuses: the vocabulary is summed once.
    """

    __slots__ = ("ids", "weights", "_total", "peak", "draw", "_known", "_sums")

    def __init__(self, ids: np.ndarray | None, weights: np.ndarray, total: float | None = None,
                 peak: float | None = None, draw: int = -1):
        self.ids, self.weights, self._total, self.peak, self.draw = ids, weights, total, peak, draw
        self._known = (-1, 0.0)   # a sparse row's last prob(token) (a draft token's q(x) is asked twice a step)
        self._sums: np.ndarray | None = None

    @property
    def total(self) -> float:
        if self._total is None:
            sums = self.block_sums()
            self._total = float(sums.sum() if sums is not None else self.weights.sum(dtype=np.float64))
        return self._total

    def block_sums(self) -> np.ndarray | None:
        """A long dense row's mass in blocks of ids (float64, read-only: shared with copies), computed once: the
        total and a draw (`_sample_dense`) both need them. None for a sparse or short row."""
        if self._sums is None and self.ids is None and len(self.weights) > 4 * _SAMPLE_BLOCK:
            self._sums = _block_sums(self.weights)
        return self._sums

    def prob(self, token: int) -> float:
        if self.ids is None:
            weight = self.weights[token] if token < len(self.weights) else 0.0
            return float(weight) / self.total
        if self._known[0] == token:
            return self._known[1]
        # a few candidates: one compare, its first match (argmax of booleans), no index array
        hit = self.ids == token
        j = hit.argmax() if len(hit) else -1
        weight = self.weights[j] if j >= 0 and hit[j] else 0.0
        self._known = (token, float(weight) / self.total)
        return self._known[1]

    def probs_at(self, tokens: np.ndarray) -> np.ndarray:
        """The probabilities of many token ids (float64), e.g. q over p's support for the residual."""
        if self.ids is None:
            out = np.zeros(len(tokens))
            inside = tokens < len(self.weights)
            out[inside] = self.weights[tokens[inside]]
        else:
            order = np.argsort(self.ids)
            sorted_ids = self.ids[order]
            pos = np.minimum(np.searchsorted(sorted_ids, tokens), len(sorted_ids) - 1)
            out = np.where(sorted_ids[pos] == tokens, self.weights[order[pos]], 0.0)
        return out / self.total

    def max_prob(self) -> float:
        peak = self.peak if self.peak is not None else float(self.weights.max())
        return peak / self.total

    def dense(self, n_vocab: int) -> np.ndarray:
        """As a probability vector over n_vocab ids (float64; for tests and tools, not the hot path)."""
        out = np.zeros(n_vocab)
        if self.ids is None:
            out[:len(self.weights)] = self.weights
        else:
            out[self.ids] = self.weights
        return out / self.total

    def copy(self, into: np.ndarray | None = None) -> "Dist":
        """A copy that outlives llama.cpp's buffers (without the draw); a dense row goes into `into` when given."""
        if self.ids is None and into is not None:
            weights = into[:len(self.weights)]
            weights[:] = self.weights
        else:
            weights = self.weights.copy()
        out = Dist(None if self.ids is None else self.ids.copy(), weights, self._total, self.peak)
        out._sums = self._sums
        return out


def as_dist(probs: "Dist | np.ndarray") -> Dist:
    """A Dist as is; a probability vector over the vocabulary as a dense Dist."""
    return probs if isinstance(probs, Dist) else Dist(None, probs)


def filter_logits(logits: np.ndarray, cfg: SamplerConfig, scratch: np.ndarray | None = None) -> Dist:
    """`filtered_probs`'s rule as a Dist, touching the vocabulary only as much as the settings need.

    top-k: a threshold pass finds a small superset of the k best logits, then only those are exponentiated.
    min-p alone: it keeps the logits within T*ln(1/min_p) of the best, found by one comparison pass. top-p without
    top-k: one exp pass for the vocabulary's mass, then the nucleus among the best logits. Temperature alone: a
    dense row of unnormalised weights (written into `scratch` when given; its sum is left for when it is needed).
    In llama.cpp's order the cut is made at temperature 1 and the kept ids are weighted at T (they are few).
    `logits` is read, never written. Weights are exp((logit - best) / T): the best token's weight is 1.
    """
    n_vocab = logits.shape[0]
    top_k = cfg.top_k if 0 < cfg.top_k < n_vocab else 0
    # the best logit: among top-k's few ids (they hold it), else one pass
    ids = _top_k_ids(logits, top_k) if top_k else None
    best = float(logits[ids].max() if top_k else logits.max())
    if not top_k and cfg.top_p >= 1.0 and cfg.min_p <= 0.0:
        return Dist(None, _exp_row(logits, best, 1.0 / cfg.temperature, scratch), peak=1.0)
    # the temperature the cut sees: llama.cpp cuts the untempered distribution (top-k alone: the same ids at any T)
    cut_t = 1.0 if cfg.order == LLAMA_CPP and (cfg.top_p < 1.0 or cfg.min_p > 0.0) else cfg.temperature
    ids, weights = _kept(logits, best, cut_t, ids, cfg.top_p, cfg.min_p, scratch)
    if cut_t != cfg.temperature:  # temperature last, over the kept ids (still sorted: T keeps the order)
        weights = np.exp((logits[ids] - best) * (1.0 / cfg.temperature))
    return Dist(ids, weights, peak=1.0)


def _kept(logits: np.ndarray, best: float, temperature: float, top_ids: np.ndarray | None, top_p: float,
          min_p: float, scratch: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The ids top-k (its ids `top_ids`, or None), top-p and min-p keep at `temperature` (best first) and their
    weights exp((l - best) / T)."""
    inv_t = 1.0 / temperature
    total = None
    if top_ids is not None:
        ids = top_ids
        weights = np.exp((logits[ids] - best) * inv_t)
    elif top_p < 1.0:
        dense = _exp_row(logits, best, inv_t, scratch)
        total = float(dense.sum(dtype=np.float64))
        ids = _nucleus_ids(logits, dense, best, top_p * total, temperature)
        weights = dense[ids]
    else:
        # exp((l - best) / T) >= min_p  <=>  l >= best + T ln(min_p); the exact test is on the weights below
        ids = np.flatnonzero(logits >= best + temperature * math.log(min_p) - 1e-3)
        weights = np.exp((logits[ids] - best) * inv_t)

    # best first, then top-p's prefix and min-p's prefix of the sorted weights
    order = np.argsort(-weights, kind="stable")
    ids, weights = ids[order], weights[order]
    if top_p < 1.0:
        cumulative = np.cumsum(weights, dtype=np.float64)
        target = top_p * (cumulative[-1] if total is None else total)  # top-p's mass is after top-k
        n_keep = min(int(np.searchsorted(cumulative, target)) + 1, len(ids))  # include the token crossing top_p
        ids, weights = ids[:n_keep], weights[:n_keep]
    if min_p > 0.0:
        n_keep = int(np.count_nonzero(weights >= np.float32(min_p)))  # relative to the best token's weight 1
        ids, weights = ids[:n_keep], weights[:n_keep]
    return ids, weights


def _exp_row(logits: np.ndarray, best: float, inv_t: float, out: np.ndarray | None) -> np.ndarray:
    row = np.subtract(logits, np.float32(best), out=out, dtype=np.float32)
    row *= np.float32(inv_t)
    return np.exp(row, out=row)


def _top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits. A threshold from every 32nd logit (the value ranked about 2k / 32 + 8 there)
    keeps a few times k ids in one comparison pass, then a partition among those few; if the threshold kept
    fewer than k (a rare, lopsided row), the partition runs over the whole row."""
    n = logits.shape[0]
    sample = logits[::32]
    rank = min(len(sample) - 1, 2 * k // 32 + 8)
    if rank < len(sample) - 1:
        threshold = np.partition(sample, len(sample) - 1 - rank)[len(sample) - 1 - rank]
        ids = np.flatnonzero(logits >= threshold)  # every id above the k-th largest when there are >= k
        if len(ids) >= k:
            return ids[np.argpartition(logits[ids], len(ids) - k)[len(ids) - k:]] if len(ids) > k else ids
    return np.argpartition(logits, n - k)[n - k:]


def _nucleus_ids(logits: np.ndarray, weights: np.ndarray, best: float, target: float, temperature: float):
    """A set of the best tokens whose mass exceeds `target`: the nucleus (the best tokens up to the one that
    crosses it) lies inside, since the set holds every token above its logit threshold."""
    for ratio in (8.0, 16.0, 32.0, 64.0):  # tokens down to e^-ratio of the best probability
        ids = np.flatnonzero(logits >= best - ratio * temperature)
        if weights[ids].sum(dtype=np.float64) > target:
            return ids
    return np.arange(logits.shape[0])


def sample(dist: Dist, rng: np.random.Generator) -> int:
    """One token id from a Dist: its draw when it has one (used once), otherwise inverse-CDF sampling with rng."""
    if dist.draw >= 0:
        token, dist.draw = dist.draw, -1
        if dist.prob(token) > 0.0:  # a draw outside the support could only come from rounding in its sampler
            return token
    if dist.ids is None:
        token, dist._total = _sample_dense(dist.weights, rng, sums=dist.block_sums())
        return token
    cdf = np.cumsum(dist.weights, dtype=np.float64)
    return int(dist.ids[_first_above(cdf, rng.random() * cdf[-1], dist.weights)])


_SAMPLE_BLOCK = 1024


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a (possibly unnormalised) non-negative vector."""
    return _sample_dense(probs, rng)[0]


def _block_sums(probs: np.ndarray) -> np.ndarray:
    """The masses of a vector's blocks of _SAMPLE_BLOCK ids (the last block may be shorter), as float64. Each block
    is summed in the vector's own precision (pairwise: a float32 row's block sums are as exact as its weights, at
    half the time of a float64 pass); the blocks add up in float64."""
    n = probs.shape[0]
    n_full = n - n % _SAMPLE_BLOCK
    sums = probs[:n_full].reshape(-1, _SAMPLE_BLOCK).sum(axis=1).astype(np.float64)
    return np.append(sums, float(probs[n_full:].sum())) if n_full < n else sums


def _sample_dense(probs: np.ndarray, rng: np.random.Generator, scale: float = 1.0, at: np.ndarray | None = None,
                  values: np.ndarray | None = None, sums: np.ndarray | None = None) -> tuple[int, float]:
    """One id drawn from a non-negative vector, and the vector's sum; (-1, 0.0) when the vector is all zeros.

    Inverse-CDF sampling in two levels: pick a block of 1024 ids by the blocks' masses, then the id inside it.
    A cumulative sum over the whole vocabulary is sequential (about 2 ms for 152k ids on a slow core); block sums
    vectorise, and only one block needs a cumulative sum (0.1 ms). Ids of probability 0 are never drawn.
    With `at` (distinct ids) the vector is `scale * probs` but `values` at those ids: a residual that is the
    target's row but at a draft's few candidates, drawn with no vector of the vocabulary's size written (the block
    sums of probs, corrected at those ids, then the one block the draw falls in). `sums`: probs' block sums where
    they are known (`Dist.block_sums`; read, never written).
    """
    n = probs.shape[0]
    if at is not None and n <= 4 * _SAMPLE_BLOCK:
        probs = probs * np.float64(scale)
        probs[at] = values
        at = None
    if n <= 4 * _SAMPLE_BLOCK:
        cdf = np.cumsum(probs, dtype=np.float64)
        if cdf[-1] <= 0.0:
            return -1, 0.0
        return _first_above(cdf, rng.random() * cdf[-1], probs), float(cdf[-1])
    sums = _block_sums(probs) if sums is None else sums.copy() if at is not None else sums
    if at is not None:
        sums *= scale
        np.add.at(sums, at // _SAMPLE_BLOCK, values - probs[at] * np.float64(scale))
        np.maximum(sums, 0.0, out=sums)   # (a block of those ids alone: rounding may leave it a hair below 0)
    cdf = np.cumsum(sums)
    if cdf[-1] <= 0.0:
        return -1, 0.0
    u = rng.random() * cdf[-1]
    b = min(int(np.searchsorted(cdf, u, side="right")), len(sums) - 1)
    while sums[b] <= 0.0:  # rounding put u on an empty block's edge: take the nearest earlier non-empty one
        b -= 1
    lo = b * _SAMPLE_BLOCK
    block = probs[lo:lo + _SAMPLE_BLOCK]
    if at is not None:
        block = block * np.float64(scale)
        here = (at >= lo) & (at < lo + len(block))
        block[at[here] - lo] = values[here]
    inner = np.cumsum(block, dtype=np.float64)
    if inner[-1] <= 0.0:   # a block whose corrected sum only rounding kept above 0: nothing to draw here
        return -1, 0.0
    # u's place in the block, on the scale of the block's own cumulative sum (its sum above was rounded apart)
    u_in = (u - (cdf[b - 1] if b else 0.0)) * (inner[-1] / sums[b])
    return lo + _first_above(inner, u_in, block), float(cdf[-1])


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
