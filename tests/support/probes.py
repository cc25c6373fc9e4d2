"""A policy that asks the engine for a tail probe on every step, for the engine's tests of them."""
from __future__ import annotations

from llamaspec.policy import FixedPolicy


class TailEvery(FixedPolicy):
    """k=1 with a tail probe (one token past the draft, never verified) every step, as auto's `_tail_due` asks one;
    records what the engine reports: each probe's chance (None where the draft token was rejected) and each step."""

    name = "tail-test"

    def __init__(self):
        super().__init__(1)
        self.results: list = []
        self.updates: list[tuple[int, int]] = []

    def shadow_len(self) -> int:
        return 1

    def shadow(self, accepted, seconds) -> None:
        self.results.append(accepted)

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        self.updates.append((drafted, accepted))
