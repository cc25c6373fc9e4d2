"""The stateless and the threshold policies: fixed, confidence, threshold."""
from __future__ import annotations

from collections import deque

from ..errors import InvalidParameterError
from .base import DraftPolicy, check_k, check_p


class FixedPolicy(DraftPolicy):
    """Always draft k tokens (k = 0 is plain decoding)."""

    name = "fixed"

    def __init__(self, k: int = 4, p_min: float = 0.0):
        self.k = self.k_max = check_k("k", k)
        self.p_min = check_p("p_min", p_min)

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
        self.k_min = check_k("k_min", k_min)
        self.k_max = check_k("k_max", k_max, max(1, k_min))
        self.k = min(max(check_k("k", k), self.k_min), self.k_max)
        self.window = check_k("window", window, 1)
        if not 0.0 <= low <= high <= 1.0:
            raise InvalidParameterError(f"need 0 <= low <= high <= 1, got low={low!r} high={high!r}")
        self.low, self.high, self.p_min = low, high, check_p("p_min", p_min)
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
