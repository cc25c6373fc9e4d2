"""The stateless and the threshold policies: fixed, confidence, threshold."""
from __future__ import annotations

from collections import deque

from ..errors import InvalidParameterError
from .base import DraftPolicy, check_k, check_p


class FixedPolicy(DraftPolicy):
    """Always draft draft_max tokens (0 is plain decoding)."""

    name = "fixed"

    def __init__(self, draft_max: int = 4, draft_p_min: float = 0.0):
        self.draft_max = check_k("draft_max", draft_max)
        self.draft_p_min = check_p("draft_p_min", draft_p_min)

    def next_draft_len(self) -> int:
        return self.draft_max


class ConfidencePolicy(FixedPolicy):
    """Draft up to draft_max tokens, stopping as soon as the draft's top probability falls below draft_p_min."""

    name = "confidence"

    def __init__(self, draft_max: int = 8, draft_p_min: float = 0.75):
        super().__init__(draft_max, draft_p_min)


class ThresholdPolicy(DraftPolicy):
    """Starting at `draft_len`: acceptance over the last `window` steps below `low` lowers the length by one, above
    `high` raises it by one, within [draft_min, draft_max]."""

    name = "threshold"

    def __init__(self, draft_len: int = 4, draft_min: int = 1, draft_max: int = 8, window: int = 4,
                 low: float = 0.40, high: float = 0.75, draft_p_min: float = 0.0):
        self.draft_min = check_k("draft_min", draft_min)
        self.draft_max = check_k("draft_max", draft_max, max(1, draft_min))
        self.k = min(max(check_k("draft_len", draft_len), self.draft_min), self.draft_max)   # the current length
        self.window = check_k("window", window, 1)
        if not 0.0 <= low <= high <= 1.0:
            raise InvalidParameterError(f"need 0 <= low <= high <= 1, got low={low!r} high={high!r}")
        self.low, self.high, self.draft_p_min = low, high, check_p("draft_p_min", draft_p_min)
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
        if rate < self.low and self.k > self.draft_min:
            self.k -= 1
            self._recent.clear()
        elif rate > self.high and self.k < self.draft_max:
            self.k += 1
            self._recent.clear()
