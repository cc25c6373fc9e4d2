"""The draft lengths of several sequences verified in one target pass, chosen together (batch.py's slots).

    tokens = sum_i tokens_i(k_i)                        (tokens_i: costs.expected_tokens with slot i's acceptance)
    time   = t_draft(rounds) + t_pass(N)                (N = sum_i (k_i + 1) rows; rounds = max_i k_i)

t_pass(N) is one shared target pass over N rows (a CostModel keyed by rows, seeded from the single-sequence costs
measured at load: n rows of one sequence are a first guess for n rows of several, an upper one on a hybrid, where
the recurrent layers take a sequence's rows one after another; only warm passes count, and past the largest size
measured the guess is optimistic, so a size is judged by its own passes once tried); t_draft(r) = t_start +
r * t_round is the batched drafter's r rounds (one decode each, holding the next token of every sequence still
drafting: a k-token draft takes k rounds whoever else drafts; the first also carries what each drafter catches up
on, the tokens accepted at the last step: `DraftRounds`). `allocate` maximises tokens / time. For at most r rounds,
the best N rows are the N largest marginals prod_{j<=k} a_ij over all (slot, position j <= r) pairs (each slot's
are non-increasing in k, so the largest N always form a prefix of every slot's draft): one sort, and a scan of its
prefixes per r, gives the exact optimum. A recurrent / hybrid target pads every run to one width w, so a slot
drafts min(w - 1, cap) in rows computed anyway and the choice is w alone.

A slot given k = 0 decodes plainly and its acceptance goes stale: a one-token shadow probe every `probe_every` of
its plain steps re-measures it, the interval doubling while probes fail, or pass and the slot still gets no draft
(the cost, not the acceptance, keeps it plain), up to `max_probe_interval` (AutoTuning).
Slots whose own policy chose their length (fixed k: the user asked for it) are fixed rows here. Knows nothing about
models, contexts or tokens: only counts, acceptance estimates and seconds.
"""
from __future__ import annotations

from dataclasses import dataclass

from .auto import AutoPolicy
from .base import Costs
from .costs import CostModel, expected_tokens
from .tuning import AutoTuning


class DraftRounds:
    """t_draft(r) = t_start + r * t_round, a least-squares line through the (rounds, seconds) of past drafting steps,
    each weighted `decay` less a step; with too few round counts seen to tell the two apart, t_start = 0."""

    def __init__(self, decay: float):
        self.decay = decay
        self.sums = [0.0] * 5   # decayed sums of 1, r, r^2, t, r t

    def add(self, rounds: int, seconds: float) -> None:
        self.sums = [self.decay * s + x for s, x in zip(self.sums, (1.0, rounds, rounds * rounds, seconds,
                                                                      rounds * seconds))]

    def line(self) -> tuple[float, float] | None:
        """(t_start, t_round); None before any sample."""
        n, r, r2, t, rt = self.sums
        if not n:
            return None
        spread = n * r2 - r * r
        if spread > 0.05 * n * n:
            slope = max((n * rt - r * t) / spread, 0.0)
            start = (t - slope * r) / n
            if start >= 0.0:
                return start, slope
        return 0.0, t / r


@dataclass
class Ask:
    """One slot's question: at most `cap` draft tokens; `acceptances` (a_1..a_n, index 0 unused) where the batch
    chooses its length, None where its own policy chose `k` already (then a fixed run of k + 1 rows)."""

    cap: int
    acceptances: list[float] | None = None
    k: int = 0


class BatchPolicy:
    """Draft lengths for every slot of one step under a cost model of the shared pass (see the module's docstring).
    One per Engine: the machine's costs do not change between requests."""

    def __init__(self, tuning: AutoTuning | None = None, costs: Costs | None = None, free_drafts: bool = False):
        self.tuning = tuning or AutoTuning()
        self.model = CostModel(self.tuning)   # verify[N]: the shared pass over N rows
        self.rounds = DraftRounds(self.tuning.decay)
        self.free_drafts = free_drafts        # prompt lookup: a round costs nothing worth measuring
        if costs is not None:
            self.model.calibrate(costs)
            # one sequence's drafting steps as the load timed them (each length's, else k drafted tokens): the
            # rounds' first guess, with the step's own cost where two or more lengths were timed
            steps = costs.drafts or ({1: costs.draft, 2: 2 * costs.draft} if costs.draft is not None else {})
            for _ in range(self.tuning.plain_samples):
                for rounds, seconds in steps.items():
                    self.rounds.add(rounds, seconds)
        self.hopeless: set[int] = set()          # asks of the last allocation that not even a perfect draft pays
        self._curve = None                       # its verify curve (None: nothing measured yet)
        self._probes: dict[int, list[int]] = {}   # slot -> [plain steps since its last probe, probe interval,
        #                                           1 while a passed probe waits to be judged by the next allocation]
        self.steps = self.decided = 0            # steps learnt from; steps whose lengths this policy chose
        self.slot_steps = self.k_total = 0       # slot-steps it chose lengths for, and their draft tokens
        self.plain_slot_steps = 0                # ... of them given k = 0

    # -- learning -------------------------------------------------------------------------------------------
    def record_step(self, rows: int, seconds: float, rounds: int = 0, draft_seconds: float = 0.0,
                    held: int = 0) -> None:
        """A step's target pass over `rows` rows took `seconds`, its sequences holding `held` tokens in all (the
        context it read: costs.Depth); its drafting took `rounds` draft rounds and `draft_seconds`."""
        self.steps += 1
        self.model.held(held)   # a size last timed at another depth is priced at this one (refit as it goes)
        self.model.record_pass(rows, seconds)
        if rounds > 0 and not self.free_drafts:
            self.rounds.add(rounds, draft_seconds)

    def t_draft(self, rounds: int) -> float | None:
        """Seconds the batched drafter takes for `rounds` rounds (0 for none, or for drafts that cost nothing)."""
        if not rounds or self.free_drafts:
            return 0.0
        line = self.rounds.line()
        return line[0] + rounds * line[1] if line is not None else None

    def t_pass(self, rows: int) -> float | None:
        """Seconds of a shared pass over `rows` rows, as `allocate` judges it."""
        curve = self.model.verify_curve(rows, True, True)
        return curve[rows] if curve else None

    # -- deciding -------------------------------------------------------------------------------------------
    def lengths(self, slots: list[int], policies: list, caps: list[int], recurrent: bool = False
                ) -> tuple[list[int], list[bool], list[bool]]:
        """For each slot (an id, its own policy, its cap): its draft length, whether this policy chose it (for the
        `auto` ones while two or more slots share the pass; otherwise the slot's own next_draft_len, as alone), and
        whether a slot it gave no draft takes a shadow probe now."""
        together = [len(policies) > 1 and isinstance(p, AutoPolicy) for p in policies]
        if not any(together):
            return [max(min(p.next_draft_len(), cap), 0) for p, cap in zip(policies, caps)], together, together
        asks = [Ask(min(cap, p.draft_max), p.accept.estimates()) if chosen else Ask(cap, None, p.next_draft_len())
                for p, cap, chosen in zip(policies, caps, together)]
        ks = self.allocate(asks, recurrent)
        probes = [chosen and i not in self.hopeless and self.probe_due(slot, k)
                  for i, (slot, k, chosen) in enumerate(zip(slots, ks, together))]
        for i, (k, chosen) in enumerate(zip(ks, together)):
            if chosen and k == 1:
                probes[i] = self._tail_due(i, policies[i], asks, ks, recurrent)
        return ks, together, probes

    def allocate(self, asks: list[Ask], recurrent: bool = False) -> list[int]:
        """The draft length of each slot (see the module's docstring); each within its cap."""
        ks = [max(min(a.k, a.cap), 0) if a.acceptances is None else 0 for a in asks]
        chosen = [i for i, a in enumerate(asks) if a.acceptances is not None and a.cap > 0]
        caps = {i: min(asks[i].cap, len(asks[i].acceptances) - 1) for i in chosen}
        self.hopeless, self._curve = set(), None
        if chosen:
            # sizes measured warm only, beyond the largest at half the slope of the last two: a size tried once, cold,
            # or never (on a hybrid, n rows of one sequence, the costs from load, cost more than n rows of several)
            # is judged by the passes it gets once chosen, not kept out by a guess
            curve = self.model.verify_curve(len(asks) * (max(max(a.cap, a.k) for a in asks) + 1), True, True)
            if not curve or self.t_draft(1) is None:   # nothing measured yet: auto's measuring draft for all
                for i in chosen:
                    ks[i] = min(self.tuning.k_start, caps[i])
            else:
                self._curve = curve
                pick = self._widths if recurrent else self._greedy
                for i, k in pick(asks, ks, caps, curve).items():
                    ks[i] = k
                self.hopeless = self._hopeless(asks, ks, caps, curve, recurrent)
        self.decided += 1
        self.slot_steps += len(chosen)
        self.k_total += sum(ks[i] for i in chosen)
        self.plain_slot_steps += sum(not ks[i] for i in chosen)
        return ks

    def _tokens(self, asks: list[Ask], ks: list[int]) -> float:
        """Expected tokens of every slot at its length: a fixed slot's at the acceptance assumed before any is seen."""
        prior = [1.0] + [self.tuning.prior] * max(ks + [0])
        return sum(expected_tokens(prior if a.acceptances is None else a.acceptances, k) for a, k in zip(asks, ks))

    def _seconds(self, lens: list[int], curve, recurrent: bool) -> float:
        """A step's time with these lengths: the draft rounds and the shared pass (a recurrent target's padded)."""
        rows = len(lens) * (max(lens) + 1) if recurrent else sum(k + 1 for k in lens)
        return self.t_draft(max(lens)) + curve[rows]

    def _hopeless(self, asks, ks, caps, curve, recurrent) -> set[int]:
        """The chosen slots given no draft for which even a draft that is always right would not pay beside the
        others' lengths: a probe of their acceptance cannot change the verdict (the cost keeps them plain)."""
        tokens, now = self._tokens(asks, ks), self._seconds(ks, curve, recurrent)
        return {i for i, cap in caps.items() if not ks[i] and not any(
            (tokens + j) * now > tokens * self._seconds(ks[:i] + [j] + ks[i + 1:], curve, recurrent)
            for j in range(1, cap + 1))}

    def _tail_due(self, i: int, policy, asks: list[Ask], ks: list[int], recurrent: bool) -> bool:
        """Whether slot i, given one token, drafts one more to judge position 2 (the engine drafts it with the
        first and never verifies it; AutoPolicy._tail_due's rule, beside the others' lengths): while position 2 is
        unsure (AutoPolicy.position_two_unsure), and two tokens for this slot would beat one were position 2 as good
        as position 1 (on a recurrent target, whose runs share one width, every slot drafting one would draft two).
        Without it a slot the batch keeps at one token never judges position 2 again."""
        ask, curve = asks[i], self._curve
        if curve is None or ask.cap < 2 or not policy.position_two_unsure(ask.acceptances, self.tuning):
            return False
        tokens, two, hoped = self._tokens(asks, ks), list(ks), 0.0
        for j, (other, k) in enumerate(zip(asks, ks)):
            if j == i or recurrent and k == 1 and other.acceptances is not None and other.cap >= 2:
                b = other.acceptances
                two[j], hoped = 2, hoped + b[1] * (b[1] if j == i else b[2])   # position 2 behind an accepted first
        return (tokens + hoped) * self._seconds(ks, curve, recurrent) > tokens * self._seconds(two, curve, recurrent)

    def _greedy(self, asks, ks, caps, curve) -> dict[int, int]:
        fixed_rows, fixed_rounds = sum(k + 1 for k in ks), max(ks)   # the chosen slots' k are 0 here
        base = self._tokens(asks, ks)
        items = []   # (-marginal tokens of position j, slot, j): every position of every slot, largest first
        for i, cap in caps.items():
            run = 1.0
            for j in range(1, cap + 1):
                run *= asks[i].acceptances[j]
                items.append((-run, i, j))
        items.sort()   # a tie within a slot keeps j ascending: every prefix is a prefix of each slot's draft
        best_speed, best = base / (self.t_draft(fixed_rounds) + curve[fixed_rows]), (0, 0)   # (rounds, rows taken)
        for r in range(1, max(caps.values(), default=0) + 1):   # at most r rounds: positions j <= r only
            seconds_r, tokens, taken = self.t_draft(max(r, fixed_rounds)), base, 0
            for minus_gain, i, j in items:
                if j <= r:
                    tokens, taken = tokens - minus_gain, taken + 1
                    speed = tokens / (seconds_r + curve[fixed_rows + taken])
                    if speed > best_speed:   # ties keep fewer rows and rounds
                        best_speed, best = speed, (r, taken)
        r, taken = best
        lens = dict.fromkeys(caps, 0)
        for _, i, j in [item for item in items if item[2] <= r][:taken]:
            lens[i] = j
        return lens

    def _widths(self, asks, ks, caps, curve) -> dict[int, int]:
        """One width w for all runs: argmax_w sum_i tokens_i(min(w - 1, cap_i)) / (t_pass(n w) + t_draft(rounds))."""
        n, fixed = len(asks), max(ks)
        base = self._tokens(asks, ks) - len(caps)   # the chosen slots' tokens are counted below
        best_speed, best = -1.0, {}
        for w in range(fixed + 1, max(list(caps.values()) + [fixed]) + 2):
            lens = {i: min(w - 1, cap) for i, cap in caps.items()}
            tokens = base + sum(expected_tokens(asks[i].acceptances, k) for i, k in lens.items())
            speed = tokens / (curve[n * w] + self.t_draft(max(list(lens.values()) + [fixed])))
            if speed > best_speed:
                best_speed, best = speed, lens
        return best

    # -- probes for slots given no draft ---------------------------------------------------------------------
    def _probe_state(self, slot: int) -> list[int]:
        return self._probes.setdefault(slot, [0, self.tuning.probe_every, 0])

    def new_request(self, slot: int) -> None:
        self._probes[slot] = [0, self.tuning.probe_every, 0]

    def probe_due(self, slot: int, k: int) -> bool:
        """Whether slot `slot`, given k tokens this step, takes a one-token shadow probe now."""
        state, t = self._probe_state(slot), self.tuning
        if k:
            state[:] = 0, t.probe_every, 0
            return False
        if state[2]:   # the last probe passed, yet no draft: it was not acceptance that kept the slot plain
            state[1], state[2] = min(2 * state[1], t.max_probe_interval), 0
        state[0] += 1
        if state[0] < state[1]:
            return False
        state[0] = 0
        return True

    def probed(self, slot: int, chance: float) -> None:
        """A probe's result: accepted with `chance`. A failed one doubles the wait before the next; a passed one
        too, unless the slot drafts at its next step."""
        state, t = self._probe_state(slot), self.tuning
        if chance >= t.accept_enough:
            state[2] = 1
        else:
            state[1] = min(2 * state[1], t.max_probe_interval)

    def slot_step(self, slot: int, policy, drafted: int, accepted: int, probe: float | None = None,
                  tail: bool = False) -> None:
        """What the auto policy of a slot whose length was chosen here learns from its step: acceptance only (the
        pass's timings are the batch's: record_step). `probe`: a shadow probe's chance, which also sets its
        back-off, or with `tail` a tail probe's (position drafted + 1; None where a rejection came first)."""
        if probe is not None and not tail:
            policy.accept.record_first(probe)
            self.probed(slot, probe)
        if drafted:
            policy.accept.record_draft(drafted, accepted, probe if tail else None)

    def probe_interval(self, slot: int) -> int:
        return self._probe_state(slot)[1]

    # -- statistics ------------------------------------------------------------------------------------------
    def describe(self, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> str:
        """One line: what it chose, and the pass costs it learnt."""
        mean = self.k_total / self.slot_steps if self.slot_steps else 0.0
        plain = self.plain_slot_steps / self.slot_steps if self.slot_steps else 0.0
        line = (f"batch policy: {self.decided} steps decided, mean k {mean:.2f} per slot-step ({plain:.0%} plain); "
                f"learnt from {self.steps} steps")
        if self.model.sizes:
            reach = max(self.model.sizes)
            shown = [n for n in sizes if n <= reach] + ([reach] if reach not in sizes else [])
            line += "; t_pass(N) " + ", ".join(f"{n}: {1e3 * self.t_pass(n):.1f} ms" for n in shown)
        line_ = None if self.free_drafts else self.rounds.line()
        if line_ is not None:
            line += f"; t_draft(r) {1e3 * line_[0]:.2f} + r x {1e3 * line_[1]:.2f} ms"
        return line
