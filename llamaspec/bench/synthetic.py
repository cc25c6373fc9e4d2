"""Synthetic acceptance, for benchmarks only: how fast a drafter would run at an acceptance it does not reach here.

Every draft pass, verification pass and rollback runs for real; only the choice of how many draft tokens stand is
drawn from given per-position rates instead of the acceptance rule (llama.cpp's `--spec-synth-rates P0,P1,..` /
`--spec-synth-len L`, common/speculative.cpp and tools/server/server-context.cpp). Rate P_i is unconditional: the
chance that at least i + 1 draft tokens stand; position i is accepted with P_i / P_(i-1) once i were, a drafted
end-of-generation token never is, and after the accepted ones comes the target's own token at that row (its argmax,
or a draw from its distribution). The text it produces is not the target's: it is for timing only.

Not reachable from a request: no parameter of Pair.stream/generate, no server field, no chat/run/serve flag; a
benchmark wraps a loaded pair in `SyntheticAcceptance(pair, rates)` for the generations it times, and labels every
line it prints with LABEL.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import InvalidParameterError
from ..sampling import as_dist, sample

LABEL = "synthetic acceptance"


def resolve_rates(k: int, rates=None, length: float | None = None) -> list[float]:
    """The unconditional rates for draft length k, from k rates or a mean acceptance length L (tokens per target
    pass, the target's own included): rates p, p^2, .., p^k with p chosen so that 1 + sum = L. llama.cpp's
    common_speculative_synth_rates_resolve, with its checks."""
    if (rates is None) == (length is None):
        raise InvalidParameterError("synthetic acceptance takes rates or a mean length, one of the two")
    if k < 1:
        raise InvalidParameterError("synthetic acceptance needs a draft length of at least 1")
    if rates is not None:
        try:
            rates = [float(r) for r in rates]
        except (TypeError, ValueError):
            raise InvalidParameterError(f"synthetic acceptance rates must be numbers, got {rates!r}") from None
        if len(rates) != k:
            raise InvalidParameterError(f"synthetic acceptance rates must contain {k} values (the draft length), "
                                        f"got {len(rates)}")
        if any(not math.isfinite(r) or not 0.0 <= r <= 1.0 for r in rates):
            raise InvalidParameterError("synthetic acceptance rates must be finite and within [0, 1]")
        if any(b > a for a, b in zip(rates, rates[1:])):
            raise InvalidParameterError("synthetic acceptance rates must be non-increasing")
        return rates
    if not math.isfinite(length) or not 1.0 <= length <= k + 1:
        raise InvalidParameterError(f"synthetic acceptance length must be within [1, {k + 1}] at draft length {k}")
    if length == k + 1:
        p = 1.0
    else:   # bisection on sum_{i=1..k} p^i = L - 1, as llama.cpp does (32 halvings)
        lo, hi = 0.0, 1.0
        for _ in range(32):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if sum(mid ** i for i in range(1, k + 1)) < length - 1.0 else (lo, mid)
        p = 0.5 * (lo + hi) if length > 1.0 else 0.0
    return [p ** i for i in range(1, k + 1)]


def conditional(rates: list[float]) -> list[float]:
    """P(position i stands | positions < i stood) = P_i / P_(i-1), with P_-1 = 1."""
    out, prev = [], 1.0
    for r in rates:
        out.append(r / prev if prev > 0.0 else 0.0)
        prev = r
    return out


def mean_length(rates: list[float]) -> float:
    """Expected tokens per target pass when every draft is as long as the rates: 1 + sum(P_i)."""
    return 1.0 + sum(rates)


def parse_rates(text: str) -> list[float]:
    """'0.9,0.7,0.5' -> [0.9, 0.7, 0.5]."""
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidParameterError(f"synthetic acceptance rates look like 0.9,0.7,0.5; got {text!r}") from None


def draw_accepted(probs: list[float], drafted, rng: np.random.Generator, is_eog) -> int:
    """How many of `drafted` stand: position i with probability probs[i] once i stood; an end-of-generation draft
    token never (it would end the generation early)."""
    for i, token in enumerate(drafted):
        if i >= len(probs) or rng.random() >= probs[i] or is_eog(token):
            return i
    return len(drafted)


class SyntheticAcceptance:
    """While active (a `with` block), `pair`'s generations keep draft tokens by the rates, not by the target.

    It replaces the pair's choice of verifier for the requests made inside the block: the verification pass is the
    one the request's mode makes (greedy: every row's argmax; sampling: the mode's own pass and rejection rule,
    whose verdict is then overridden), so its cost is real. `lengths` counts accepted draft tokens per step."""

    def __init__(self, pair, rates: list[float], seed: int = 0):
        self.pair, self.rates = pair, resolve_rates(len(rates), rates=list(rates))   # llama.cpp's checks
        self.probs = conditional(self.rates)
        self.rng = np.random.default_rng(seed)
        self.lengths: list[int] = []

    def __enter__(self):
        pair = self.pair
        if pair.verifier_wrap is not None:
            raise InvalidParameterError("this pair already runs with synthetic acceptance or another verifier")
        pair.verifier_wrap = self._verifier   # the engine's seam: each request's own verifier, wrapped
        return self

    def __exit__(self, *exc):
        self.pair.verifier_wrap = None

    @property
    def label(self) -> str:
        return f"{LABEL} (rates {', '.join(f'{r:.3g}' for r in self.rates)}; mean length {mean_length(self.rates):.2f})"

    def _verifier(self, chosen, sampling, shaper, scratch):
        """The request's own verifier (its pass, and for sampling its rejection rule, run for real) with the verdict
        drawn from the rates."""
        if shaper is not None:
            raise InvalidParameterError(f"{LABEL} runs without grammars, penalties or log-probabilities")
        is_eog = self.pair.target.is_eog

        def judge(rows, history, tokens, drafted, draft_probs):
            if sampling is None:   # greedy: the pass the greedy mode makes, every row's argmax
                n = draw_accepted(self.probs, drafted, self.rng, is_eog)
                self.lengths.append(n)
                return n, int(rows[n]), None
            n_real, token, target_probs = chosen.judge(rows, history, tokens, drafted, draft_probs)
            n = draw_accepted(self.probs, drafted, self.rng, is_eog)
            self.lengths.append(n)
            if n != n_real:   # the target's own token after the synthetic prefix: a draw from its row n
                token = sample(as_dist(target_probs(n)), sampling.rng)
            return n, token, target_probs

        return dataclasses.replace(chosen, judge=judge)
