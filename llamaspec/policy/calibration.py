"""Load-time calibration: run every draft length on a pair, time its passes, keep them as `Costs` for the policies
(Pair.warm_up). On a GPU the first pass of each batch size loads its kernels and builds its graphs, which would
otherwise be timed by the first request (and could make `auto` judge that no draft pays)."""
from __future__ import annotations

from statistics import median

from .base import Costs, DraftPolicy, check_k

_LONGEST = 16   # the longest draft a warm-up runs
# warm passes timed of each size (their median kept): with one, a pass 3% off on a GPU could price a draft length
# `auto` does not run for a whole request (results/auto-policy-notes.md, "calibration"); taken in three sweeps over
# the sizes, two warm passes of a size each, so that a slow stretch of the machine while one size is timed (an H100
# load priced a 3-token pass 6% high, its neighbours within 1%) prices nothing: it holds two of six
_SWEEPS, _WARM_A_SWEEP = 3, 2
_WARM_SAMPLES = _SWEEPS * _WARM_A_SWEEP


class Sweep(DraftPolicy):
    """Draft draft_max tokens, then one fewer down to plain decoding, each length `repeats` steps in a row, `sweeps`
    times. From the third pass of a size in a row on, its passes run warm: costs() tells what those took (the median of
    all of a size's, over the sweeps), and how much more the first two took."""

    name = "sweep"

    def __init__(self, draft_max: int, repeats: int = 1, sweeps: int = 1):
        self.k = self.draft_max = draft_max   # k: the current length
        self.repeats = self._left = repeats
        self._sweeps_left = sweeps - 1
        self.done = False
        self._last_n = self._run = 0
        self._warm: dict[int, list[float]] = {}
        self._cold: list[tuple[int, float]] = []   # (size, seconds) of each cold pass, in the order they ran
        self._draft: list[float] = []
        self._steps: dict[int, list[float]] = {}   # draft length -> warm drafting steps' seconds

    def next_draft_len(self) -> int:
        return self.k

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        n = drafted + 1
        self._run = self._run + 1 if n == self._last_n else 1
        self._last_n = n
        if self._run >= 3:
            self._warm.setdefault(n, []).append(verify_seconds)
            if drafted:
                self._draft.append(draft_seconds / drafted)
                self._steps.setdefault(drafted, []).append(draft_seconds)
        else:
            self._cold.append((n, verify_seconds))
        self._left -= 1
        if not self._left:
            self.k, self._left = self.k - 1, self.repeats
            if self.k < 0 and self._sweeps_left:   # the next sweep, from the longest draft again
                self.k, self._sweeps_left = self.draft_max, self._sweeps_left - 1
            self.done = self.k < 0
            self.k = max(self.k, 0)

    def costs(self) -> Costs:
        verify = {n: median(seconds) for n, seconds in sorted(self._warm.items())}
        excess = [c - verify[n] for n, c in self._cold if n in verify]   # a change's first pass, then its second
        return Costs(verify, median(self._draft) if self._draft else None, excess,
                     {k: median(seconds) for k, seconds in sorted(self._steps.items())})


def measure_costs(pair, draft_max: int | None = None) -> Costs | None:
    """Run every draft length up to draft_max (the pair's policy's) on `pair`, greedy in _SWEEPS sweeps of
    _WARM_A_SWEEP + 2 steps a length, then sampled once each, and forget the text; from the third greedy step of a
    length in a row on its passes run warm, and the medians of what those took are returned. The pair is left with a
    sweep policy: the caller sets its own back."""
    if draft_max is not None:
        check_k("draft_max", draft_max, 1)
    draft_max = min(draft_max or getattr(pair.policy, "draft_max", 0) or 1, _LONGEST)
    prompt = pair.tokenize("warm up")
    costs = None
    try:
        for temperature, repeats, sweeps in ((0.0, _WARM_A_SWEEP + 2, _SWEEPS), (0.8, 1, 1)):
            sweep = Sweep(draft_max, repeats, sweeps)
            pair.set_policy(sweep)
            for _ in range(3):   # a reply that stops early (an end-of-text token) leaves the rest to the next
                for _ in pair.stream(prompt, max_tokens=sweeps * repeats * (draft_max + 1) ** 2,
                                     temperature=temperature, seed=1):
                    if sweep.done:
                        break
                if sweep.done:
                    break
            if repeats > 1:
                costs = sweep.costs()
    finally:
        pair.reset()
        pair.last_stats = None
    return costs
