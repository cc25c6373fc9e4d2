"""Draft-length policies: each answers one question ("how many tokens next?") and learns from one thing
("this many were drafted, this many accepted, this long it took").

`p_min` is the confidence stop every policy may carry: the engine stops drafting early once the draft's top
probability falls below it (llama.cpp's --draft-p-min). Policies know nothing about models or tokens.
"""
from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, field

from .config import POLICY_NAMES  # noqa: F401  (re-exported)
from . import bounds
from .errors import InvalidParameterError


@dataclass
class Costs:
    """What a pair's passes cost on this machine, measured at load (Pair.warm_up), in seconds: the warm target pass
    over n tokens (`verify[n]`), a drafted token (a draft pass, for a "per_pass" drafter), and what the first two
    passes after a change of batch size took beyond a warm one (`excess`, one entry per pass)."""

    verify: dict = field(default_factory=dict)
    draft: float | None = None
    excess: list = field(default_factory=list)


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

    def new_request(self) -> None:
        """A request's prompt was just processed (the engine says it before the first step): a batch of another size
        ran since the last step."""

    def shadow_len(self) -> int:
        """Tokens (0 or 1) to draft on the next plain step without verifying them: a shadow probe. The target's
        pass stays one token; the draft token is judged against the token the target emits."""
        return 0

    def shadow(self, accepted: float, seconds: float) -> None:
        """A shadow probe's result, before that step's update(): `accepted` is the chance the draft token would
        have been accepted (0 or 1 greedy, min(1, p/q) sampling), `seconds` what drafting it took, catch-up
        included."""

    def enable_shadow_probes(self) -> None:
        """The engine can run shadow probes (it says so when it takes the policy)."""

    def calibrate(self, costs: Costs) -> None:
        """The pair's costs as measured at load (the engine gives them when it takes the policy, where it has
        them): a policy may start from them instead of measuring its first drafts."""

    def set_draft_cost(self, kind: str) -> None:
        """How the drafter's time grows with the draft length: "per_token" (a draft model, an MTP head: one pass per
        token) or "per_pass" (DFlash: one pass for the whole block). The engine says it when it takes the policy."""


def _check_k(name: str, value: int, low: int = 0) -> int:
    # a draft length (and any count a policy keeps per length) is at most what one batch verifies (bounds.py)
    high = bounds.MAX_BATCH - 1
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidParameterError(f"{name} must be an integer in [{low}, {high}], got {value!r}"[:120], param=name)
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


def make_policy(name: str = "auto", *, k: int | None = None, k_min: int | None = None,
                p_min: float | None = None, n_batch: int | None = None) -> DraftPolicy:
    """Build a policy from CLI/server style settings: k is the draft length (fixed) or its maximum (others),
    within what one batch of `n_batch` tokens verifies (the ranges: bounds.py)."""
    known = {"n_batch": n_batch} if n_batch else {}
    for param, value in (("draft_max", k), ("draft_min", k_min), ("draft_p_min", p_min)):
        if value is not None:
            bounds.check(param, value, known)
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


from .auto_policy import AutoPolicy  # noqa: E402  (re-exported: it builds on DraftPolicy above)
