"""Draft-length policies: each answers one question ("how many tokens next?") and learns from one thing
("this many were drafted, this many accepted, this long it took").

`p_min` is the confidence stop every policy may carry: the engine stops drafting early once the draft's top
probability falls below it (llama.cpp's --draft-p-min). Policies know nothing about models or tokens.
"""
from __future__ import annotations

import abc
from collections import deque

from .config import POLICY_NAMES  # noqa: F401  (re-exported)
from .errors import InvalidParameterError


class DraftPolicy(abc.ABC):
    """What every policy answers and learns from; subclass it for your own."""

    name = "base"
    p_min = 0.0
    k_max = 0

    @abc.abstractmethod
    def next_draft_len(self) -> int:
        """How many tokens to draft next (0 = plain decoding)."""

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """One speculative step is done: `drafted` proposed, `accepted` kept, and what each phase cost."""

    def describe(self) -> dict:
        return {"policy": self.name, "draft_len": self.next_draft_len(), "p_min": self.p_min}


def _check_k(name: str, value: int, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
    return value


def _check_p(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not (0.0 <= value < 1.0):
        raise InvalidParameterError(f"{name} must be in [0, 1), got {value!r}", param=name)
    return float(value)


class FixedPolicy(DraftPolicy):
    """Always draft k tokens (k = 0 is plain decoding)."""

    name = "fixed"

    def __init__(self, k: int = 4, p_min: float = 0.0):
        self.k = self.k_max = _check_k("k", k)
        self.p_min = _check_p("p_min", p_min)

    def next_draft_len(self) -> int:
        return self.k


class ConfidencePolicy(FixedPolicy):
    """Draft up to k_max tokens, stopping as soon as the draft's top probability falls below p_min."""

    name = "confidence"

    def __init__(self, k_max: int = 8, p_min: float = 0.75):
        super().__init__(k_max, p_min)


class ThresholdPolicy(DraftPolicy):
    """Acceptance over the last `window` steps below `low` lowers k by one; above `high` raises it by one."""

    name = "threshold"

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 8, window: int = 4,
                 low: float = 0.40, high: float = 0.75, p_min: float = 0.0):
        self.k_min = _check_k("k_min", k_min)
        self.k_max = _check_k("k_max", k_max, max(1, k_min))
        self.k = min(max(_check_k("k", k), self.k_min), self.k_max)
        self.window = _check_k("window", window, 1)
        if not 0.0 <= low <= high <= 1.0:
            raise InvalidParameterError(f"need 0 <= low <= high <= 1, got low={low!r} high={high!r}")
        self.low, self.high, self.p_min = low, high, _check_p("p_min", p_min)
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.window)

    def next_draft_len(self) -> int:
        return self.k

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        if drafted == 0:
            return
        self._recent.append((drafted, accepted))
        if len(self._recent) < self.window:
            return
        rate = sum(a for _, a in self._recent) / sum(d for d, _ in self._recent)
        if rate < self.low and self.k > self.k_min:
            self.k -= 1
            self._recent.clear()
        elif rate > self.high and self.k < self.k_max:
            self.k += 1
            self._recent.clear()


class AutoPolicy(DraftPolicy):
    """Pick k to maximise expected tokens per second under a measured cost model.

    tokens(k) = 1 + sum_{j<=k} prod_{i<=j} a_i          (a_i: acceptance at draft position i, given i-1 accepted)
    time(k)   = k * t_draft + t_verify(k + 1)            (t_verify(n): one target pass over n tokens)
    k = argmax tokens(k) / time(k) over 0..k_max; k = 0 is plain decoding. When plain decoding wins, a short
    draft is still tried now and then (after `probe_every` steps, the interval doubling while probes confirm it;
    only every `max_probe_interval` steps when even a perfect draft could not pay on this machine), so the
    estimates recover when the text gets easier.
    All estimates are exponentially decayed averages, so the policy follows changes within a request.
    """

    name = "auto"

    def __init__(self, k_max: int = 12, p_min: float = 0.0, k_start: int = 3, probe_every: int = 16,
                 max_probe_interval: int = 1024, decay: float = 0.95):
        self.k_max = _check_k("k_max", k_max, 1)
        self.p_min = _check_p("p_min", p_min)
        self.k_start = min(_check_k("k_start", k_start, 1), self.k_max)
        self.probe_every = _check_k("probe_every", probe_every, 1)
        self.max_probe_interval = max(_check_k("max_probe_interval", max_probe_interval, 1), self.probe_every)
        self._probe_interval = self.probe_every
        self.decay = decay
        # acceptance at each draft position: decayed (accepted, tried) counts with a weak prior of 0.6
        self._prior_weight = 0.5
        self._acc = [0.6 * self._prior_weight] * (self.k_max + 1)
        self._tried = [self._prior_weight] * (self.k_max + 1)
        self._t_draft: float | None = None          # seconds per drafted token
        self._t_verify: dict[int, float] = {}       # batch size -> seconds per target pass
        self._steps = 0
        self._since_probe = 0
        self._k = self.k_start

    # -- estimates ---------------------------------------------------------------------------------------------
    def acceptance(self, position: int, optimistic: bool = False) -> float:
        """Acceptance at a draft position given the earlier ones were accepted; a position never tried borrows
        the estimate of the one before it (acceptance changes slowly along a draft). `optimistic` adds an
        upper-confidence bonus that shrinks as a position is tried, so rarely reached positions get tried."""
        while position > 1 and self._tried[position] <= self._prior_weight:
            position -= 1
        tried = self._tried[position]
        estimate = self._acc[position] / tried
        # position 1 is judged at every draft, so it needs no bonus (and must not keep a useless draft alive)
        return min(1.0, estimate + 0.3 / tried ** 0.5) if optimistic and position > 1 else estimate

    def verify_time(self, n: int, optimistic: bool = False) -> float | None:
        """t_verify(n): measured when seen; otherwise a line through the measured points (at least the slope
        implied by one point and a 10% cost per extra token, never cheaper than a smaller measured batch).
        Beyond the largest measured batch, `optimistic` halves the slope: verify cost usually flattens (a GPU
        verifies 9 tokens for little more than 5), and the only way to learn that is to try a longer draft."""
        seen = self._t_verify
        if not seen:
            return None
        if n in seen:
            return seen[n]
        xs = sorted(seen)
        if len(xs) == 1:
            x0 = xs[0]
            return seen[x0] * (1.0 + 0.1 * (n - x0) / x0) if n > x0 else seen[x0] * n / x0
        lo = max((x for x in xs if x < n), default=None)
        hi = min((x for x in xs if x > n), default=None)
        if lo is not None and hi is not None:
            w = (n - lo) / (hi - lo)
            return seen[lo] * (1 - w) + seen[hi] * w
        a, b = (xs[-2], xs[-1]) if hi is None else (xs[0], xs[1])
        slope = max((seen[b] - seen[a]) / (b - a), 0.0) * (0.5 if optimistic and hi is None else 1.0)
        base = seen[a] if hi is not None else seen[b]
        anchor = a if hi is not None else b
        return max(base + slope * (n - anchor), 1e-9)

    def _speeds(self, k_max: int, optimistic: bool):
        """(k, expected tokens per second) for k = 0..k_max, as far as the estimates reach, in one pass:
        tokens(k) grows by the chance of accepting all of d_1..d_k."""
        if not self._t_verify:
            return
        t_draft = self._t_draft or 0.0
        tokens, run = 1.0, 1.0
        for k in range(k_max + 1):
            if k > 0:
                if self._t_draft is None:
                    return
                run *= self.acceptance(k, optimistic)
                tokens += run
            yield k, tokens / (k * t_draft + self.verify_time(k + 1, optimistic))

    def expected_speed(self, k: int, optimistic: bool = False) -> float | None:
        last = None
        for j, speed in self._speeds(k, optimistic):
            last = speed if j == k else None
        return last

    def _best_k(self) -> int:
        """argmax_k expected_speed(k, optimistic=True) (ties go to the longer draft)."""
        if not self._t_verify:
            return self.k_start
        return max(self._speeds(self.k_max, optimistic=True), key=lambda ks: (ks[1], ks[0]))[0]

    def perfect_draft_gain(self) -> float | None:
        """Best speed-up over plain decoding if every draft token were accepted: below 1, speculation cannot pay
        on this machine whatever the text, and probing acceptance is pointless."""
        plain = self.verify_time(1)
        if plain is None or self._t_draft is None:
            return None
        best = max((k + 1) / (k * self._t_draft + self.verify_time(k + 1)) for k in range(1, self.k_max + 1))
        return best * plain

    # -- the two questions ----------------------------------------------------------------------------------
    def next_draft_len(self) -> int:
        return self._k

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        self._steps += 1
        d = self.decay
        n = drafted + 1
        old = self._t_verify.get(n)
        self._t_verify[n] = verify_seconds if old is None else d * old + (1 - d) * verify_seconds
        if drafted:
            per_token = draft_seconds / drafted
            self._t_draft = per_token if self._t_draft is None else d * self._t_draft + (1 - d) * per_token
            for j in range(1, drafted + 1):
                if j > accepted + 1:
                    break  # positions after the first rejection were never judged
                self._tried[j] = d * self._tried[j] + 1.0
                self._acc[j] = d * self._acc[j] + (1.0 if j <= accepted else 0.0)

        if self._steps == 1 and 1 not in self._t_verify:
            self._k = 0  # measure one plain pass early: every comparison is against it
            return
        best = self._best_k()
        if best > 0:
            self._since_probe, self._probe_interval = 0, self.probe_every
            self._k = best
            return
        # Speculation does not pay now. Probe again later, less and less often while probes keep confirming it;
        # when even a perfect draft could not pay (the machine's costs), probe rarely: only costs could change.
        self._since_probe += 1
        if drafted:
            self._probe_interval = min(self._probe_interval * 2, self.max_probe_interval)
        gain = self.perfect_draft_gain()
        interval = self.max_probe_interval if gain is not None and gain < 1.0 else self._probe_interval
        if self._since_probe >= interval:
            self._since_probe, self._k = 0, min(2, self.k_max)
        else:
            self._k = 0


def make_policy(name: str = "auto", *, k: int | None = None, k_min: int | None = None,
                p_min: float | None = None) -> DraftPolicy:
    """Build a policy from CLI/server style settings: k is the draft length (fixed) or its maximum (others)."""
    if name == "fixed":
        return FixedPolicy(4 if k is None else k, 0.0 if p_min is None else p_min)
    if name == "confidence":
        return ConfidencePolicy(8 if k is None else k, 0.75 if p_min is None else p_min)
    if name == "threshold":
        k_max = 8 if k is None else k
        return ThresholdPolicy(k=min(4, k_max), k_min=1 if k_min is None else k_min, k_max=k_max,
                               p_min=0.0 if p_min is None else p_min)
    if name == "auto":
        return AutoPolicy(k_max=12 if k is None else max(k, 1), p_min=0.0 if p_min is None else p_min)
    raise InvalidParameterError(f"unknown draft policy {name!r}; choose one of {', '.join(POLICY_NAMES)}",
                                param="policy")
