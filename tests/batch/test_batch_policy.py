"""The batch's draft lengths (policy/batch.py): chosen together under a cost model of the shared pass, with plain
decoding for a slot whose drafts do not pay; pure numbers, no model. The engine's use of it: test_batch.py."""
from __future__ import annotations

import itertools
import random

import pytest

from llamaspec.policy import AutoPolicy, AutoTuning, Costs, FixedPolicy
from llamaspec.policy.batch import Ask, BatchPolicy
from llamaspec.policy.costs import expected_tokens

GOOD = [0.0] + [0.8] * 12     # a_1..a_12 (index 0 unused)
POOR = [0.0] + [0.05] * 12


def policy(t_pass, t_round: float, n_max: int = 128, t_start: float = 0.0, **tuning) -> BatchPolicy:
    """A batch policy seeded with a synthetic cost curve t_pass(N) and a draft round's cost (t_start + r t_round for
    r rounds, where t_start is given)."""
    costs = Costs(verify={n: t_pass(n) for n in range(1, n_max + 1)}, draft=None if t_start else t_round)
    bp = BatchPolicy(AutoTuning(**tuning), costs)
    if t_start:
        for rounds in (1, 3) * 20:
            bp.record_step(1, t_pass(1), rounds, t_start + rounds * t_round)
    return bp


def speed(asks, ks, t_pass, t_round, recurrent=False, t_start=0.0) -> float:
    tokens = sum(expected_tokens(a.acceptances, k) for a, k in zip(asks, ks))
    rows = len(asks) * (max(ks) + 1) if recurrent else sum(k + 1 for k in ks)
    return tokens / (t_pass(rows) + (t_start + max(ks) * t_round if max(ks) else 0.0))


def test_a_steep_pass_cost_gives_four_slots_shorter_drafts_than_one():
    """With a pass's cost growing fast in its rows, verifying k more rows beside three other sequences buys less
    than alone: each of four slots drafts less than one slot with the same acceptance."""
    bp = policy(lambda n: 10 + 3.0 * n, 1.0)
    alone = bp.allocate([Ask(8, GOOD)])[0]
    four = bp.allocate([Ask(8, GOOD)] * 4)
    assert alone >= 2 and max(four) < alone


def test_a_slot_whose_drafts_do_not_pay_decodes_plainly_while_the_others_draft():
    bp = policy(lambda n: 10 + 1.0 * n, 1.0)
    ks = bp.allocate([Ask(8, GOOD), Ask(8, POOR), Ask(8, GOOD)])
    assert ks[1] == 0 and ks[0] > 0 and ks[2] > 0
    assert bp.plain_slot_steps == 1 and bp.slot_steps == 3


def test_a_flat_pass_cost_keeps_long_drafts():
    """A GPU at small batches: more rows cost next to nothing, so every slot drafts as far as it may."""
    bp = policy(lambda n: 10.0, 0.01)
    assert bp.allocate([Ask(8, GOOD)] * 4) == [8] * 4


def test_caps_are_honoured():
    bp = policy(lambda n: 10.0, 0.01)
    assert bp.allocate([Ask(0, GOOD), Ask(2, GOOD), Ask(8, GOOD), Ask(20, GOOD)]) == [0, 2, 8, 12]   # 12: a_1..a_12
    assert all(k <= 3 for k in policy(lambda n: 1 + n, 0.1).allocate([Ask(3, GOOD)] * 3))


def test_fixed_length_slots_keep_their_k_and_count_as_rows():
    bp = policy(lambda n: 10 + 1.0 * n, 1.0)
    ks = bp.allocate([Ask(6, None, k=5), Ask(3, None, k=5), Ask(8, GOOD)])
    assert ks[:2] == [5, 3]
    # the fixed slot's five rounds are paid anyway: the chosen slot drafts at least as far as beside a plain one
    assert ks[2] >= bp.allocate([Ask(6, None, k=0), Ask(8, GOOD)])[1]


@pytest.mark.parametrize("recurrent", [False, True])
def test_the_allocation_is_the_best_over_every_choice(recurrent):
    """Against brute force over all draft lengths, on random acceptances and cost curves."""
    rng = random.Random(3)
    for _ in range(40):
        base, per_row, t_round = rng.uniform(1, 10), rng.uniform(0, 2), rng.uniform(0, 2)
        t_start = rng.choice([0.0, rng.uniform(0, 3)])   # the first round's catch-up

        def t_pass(n):
            return base + per_row * n + 0.02 * n * n

        asks = []
        for _ in range(rng.randint(2, 3)):
            a = [0.0]
            for _ in range(5):
                a.append(rng.uniform(0.0, 1.0) * (a[-1] if len(a) > 1 else 1.0) ** 0.3)
            asks.append(Ask(rng.randint(0, 5), a))
        bp = policy(t_pass, t_round, t_start=t_start)
        assert bp.t_draft(2) == pytest.approx(t_start + 2 * t_round)
        got = bp.allocate(asks, recurrent)
        assert all(0 <= k <= a.cap for k, a in zip(got, asks))
        choices = itertools.product(*[range(a.cap + 1) for a in asks])
        if recurrent:   # one width: every slot drafts min(w - 1, cap)
            choices = [[min(w, a.cap) for a in asks] for w in range(max(a.cap for a in asks) + 1)]
            assert got in choices
        best = max(speed(asks, ks, t_pass, t_round, recurrent, t_start) for ks in choices)
        assert speed(asks, got, t_pass, t_round, recurrent, t_start) == pytest.approx(best, rel=1e-9)


def test_a_recurrent_target_pads_every_run_to_one_width():
    """Padding rows are computed anyway: a slot with poor acceptance drafts as far as the width the others pay
    for, and the width is the one that maximises tokens over time."""
    t_pass = lambda n: 10 + 1.0 * n   # noqa: E731
    bp = policy(t_pass, 1.0)
    asks = [Ask(8, GOOD), Ask(2, GOOD), Ask(8, POOR)]
    ks = bp.allocate(asks, recurrent=True)
    w = max(ks) + 1
    assert w > 1 and ks == [min(w - 1, 8), min(w - 1, 2), min(w - 1, 8)]
    widths = {v: speed(asks, [min(v - 1, a.cap) for a in asks], t_pass, 1.0, True) for v in range(1, 10)}
    assert max(widths, key=widths.get) == w
    assert bp.allocate([Ask(8, GOOD), Ask(8, POOR)])[1] == 0   # not padded: the poor slot would not draft


def test_before_anything_is_measured_every_chosen_slot_takes_the_measuring_draft():
    bp = BatchPolicy(AutoTuning(k_start=3))
    assert bp.allocate([Ask(8, GOOD), Ask(2, POOR)]) == [3, 2]
    bp.record_step(8, 0.08, rounds=3, draft_seconds=0.03)   # now both costs are known: it chooses
    assert bp.t_draft(3) == pytest.approx(0.03) and bp.t_pass(8) == pytest.approx(0.08)
    assert bp.allocate([Ask(8, GOOD), Ask(8, POOR)])[1] == 0


def test_it_learns_the_drafters_start_and_round_costs_apart():
    """The first round also carries each drafter's catch-up: a 1-round draft costs more than a round's share of a
    4-round one, and a ratio of seconds to rounds would price every round too high."""
    bp = BatchPolicy()
    for rounds in (1, 4, 2, 4, 1) * 6:
        bp.record_step(8, 0.1, rounds, 0.05 + 0.01 * rounds)
    start, per_round = bp.rounds.line()
    assert start == pytest.approx(0.05) and per_round == pytest.approx(0.01)
    assert bp.t_draft(0) == 0.0 and bp.t_draft(3) == pytest.approx(0.08)
    assert "t_draft(r) 50.00 + r x 10.00 ms" in bp.describe()


def test_the_drafting_steps_the_load_timed_give_the_rounds_start_and_round_costs_at_once():
    """Calibration keeps a sequence's warm drafting step of each length: the rounds' line starts there (a step's own
    cost included); with only a drafted token's time, two lengths of k tokens each, no start."""
    timed = BatchPolicy(costs=Costs({1: 0.01, 2: 0.011}, 0.0013, [], {1: 0.0017, 3: 0.0027, 5: 0.0037}))
    start, per_round = timed.rounds.line()
    assert start == pytest.approx(0.0012) and per_round == pytest.approx(0.0005)
    token_only = BatchPolicy(costs=Costs({1: 0.01, 2: 0.011}, 0.0013, []))
    assert token_only.rounds.line() == (0.0, pytest.approx(0.0013))


def test_it_learns_the_shared_pass_by_its_rows():
    bp = policy(lambda n: 1.0, 0.1, n_max=4)   # seeded: one sequence's passes of 1..4 rows
    for _ in range(20):
        bp.record_step(16, 4.0, rounds=3, draft_seconds=0.3)
    assert 16 in bp.model.sizes and bp.t_pass(16) == pytest.approx(4.0, rel=0.05)
    line = bp.describe()
    assert "t_pass(N)" in line and "16: 4000.0 ms" in line and "learnt from 20 steps" in line


def test_probes_of_a_plain_slot_back_off_while_they_fail():
    bp = BatchPolicy(AutoTuning(probe_every=2, max_probe_interval=8))
    bp.new_request(0)

    def steps_to_probe():
        n = 1
        while not bp.probe_due(0, 0):
            n += 1
        return n

    assert steps_to_probe() == 2
    bp.probed(0, 0.0)
    assert steps_to_probe() == 4
    bp.probed(0, 0.0)
    assert steps_to_probe() == 8
    bp.probed(0, 0.0)
    assert bp.probe_interval(0) == 8 and steps_to_probe() == 8   # at most max_probe_interval
    bp.probed(0, 1.0)   # accepted, and the slot drafts again: the back-off starts over
    assert not bp.probe_due(0, 3) and bp.probe_interval(0) == 2
    assert steps_to_probe() == 2
    bp.probed(0, 1.0)   # accepted, yet still plain (drafts cost more than they bring): no need to ask so often
    assert steps_to_probe() == 4 and bp.probe_interval(0) == 4


def test_a_slot_alone_or_with_another_policy_keeps_its_own_length():
    bp = policy(lambda n: 10 + 3.0 * n, 1.0)
    auto = AutoPolicy(draft_max=8)
    auto._k = 6   # what its own decisions reached
    assert bp.lengths([0], [auto], [8])[:2] == ([6], [False])
    assert bp.lengths([0, 1], [FixedPolicy(4), FixedPolicy(4)], [8, 2])[:2] == ([4, 2], [False, False])
    ks, together, _ = bp.lengths([0, 1], [auto, FixedPolicy(4)], [8, 8])
    assert together == [True, False] and ks[1] == 4 and ks[0] < 6


def test_a_plain_slot_is_probed_only_where_a_good_draft_would_pay():
    """Probes ask for acceptance: where even an always-right draft would not pay (a draft round costs as much as
    the target's pass), they cannot change the verdict and are not taken."""
    def plain_steps_probed(t_round):
        bp = policy(lambda n: 10 + 1.0 * n, t_round, probe_every=2)
        poor = [AutoPolicy(draft_max=8) for _ in range(2)]
        for p in poor:
            p.accept.record_draft(4, 0)
            p.accept.record_draft(4, 0)
        probed = 0
        for _ in range(8):
            ks, _, probes = bp.lengths([0, 1], poor, [8, 8])
            assert ks == [0, 0]
            probed += sum(probes)
        return probed

    assert plain_steps_probed(0.5) > 0
    assert plain_steps_probed(50.0) == 0


def test_a_size_seen_only_cold_does_not_keep_the_batch_off_it():
    """On the GPU a change of the pass's size runs cold (llama.cpp captures its graph again): a size seen once, cold
    and slow, must not keep the batch from it while warm passes say it pays; the cold sample is set aside until the
    size runs warm, and a warm pass then decides."""
    t_pass = lambda n: 0.010 + 0.001 * n            # noqa: E731  flat enough that 4 slots x 3 tokens pay
    bp = policy(t_pass, 0.0005, n_max=8)
    asks = [Ask(3, GOOD)] * 4
    assert bp.allocate(asks) == [3, 3, 3, 3]         # 16 rows: past the measured sizes, judged optimistically
    bp.model.record_pass(8, t_pass(8))               # a run of 8-row passes ...
    bp.model.record_pass(16, 0.060)                  # ... then one 16-row pass, cold and 2.3x its warm time
    assert 16 in bp.model.sizes and not bp.model.verify[16].samples
    assert bp.allocate(asks) == [3, 3, 3, 3]
    for _ in range(4):                               # warm 16-row passes that really are slow: the batch drafts less
        bp.model.record_pass(16, 0.080)
    assert sum(bp.allocate(asks)) < 12


def test_the_shared_pass_is_priced_at_the_context_its_sequences_hold():
    """Two agent sessions deep in one pass (serve --parallel 2): passes of 8 rows at 40K-70K tokens held in all give
    what a token of context costs a pass (costs.Depth), and a size last timed at the load's short prompt is priced
    with it; where the times do not depend on the depth, nothing moves."""
    base, per_token, rng = {n: 0.010 + 0.001 * n for n in range(1, 9)}, 2e-8, random.Random(0)

    def batch_at(depths, slope=per_token) -> BatchPolicy:
        bp = BatchPolicy(costs=Costs(dict(base), 0.001, [0.005] * 8))
        for held in depths:
            for _ in range(20):
                seconds = (base[8] + slope * held) * (1.0 + 0.01 * rng.gauss(0.0, 1.0))
                bp.record_step(8, seconds, rounds=3, draft_seconds=0.003, held=held)
        return bp

    flat = batch_at(range(40_000, 70_001, 3_000), slope=0.0)
    assert flat.model.depth.slope == 0.0 and flat.t_pass(4) == pytest.approx(base[4], rel=1e-9)
    deep = batch_at(range(40_000, 70_001, 3_000))
    assert deep.model.depth.slope == pytest.approx(per_token, rel=0.05)
    assert deep.t_pass(4) == pytest.approx(base[4] + per_token * 70_000, rel=0.01)


def test_a_slot_the_batch_keeps_at_one_token_asks_position_two_with_tail_probes():
    """Slots drafting together are given lengths here, not by their own policy: a slot held at one token by a
    poor early estimate of position 2 asks it with tail probes (one token drafted past the draft, judged by the
    target's next token) while position 2 is judged less than `tail_seen` times, its estimate `tail_gap` under
    position 1's, and two tokens would pay were it as good; the judgements raise it until the batch gives two.
    Without them (tail_seen=0) the slot stays at one token."""
    def held_at_one(steep, **tuning):
        bp = policy(lambda n: 10 + steep * n, 0.5, **tuning)
        slots = [AutoPolicy(draft_max=8) for _ in range(2)]
        for _ in range(3):
            slots[0].accept.record_draft(2, 1)   # position 2 rejected on its first judgements
        for _ in range(6):
            slots[1].accept.record_draft(3, 3)
        return bp, slots

    def run(steep, **tuning):
        bp, slots = held_at_one(steep, **tuning)
        seen, asked = [], 0
        for _ in range(12):
            ks, _, probes = bp.lengths([0, 1], slots, [8, 8])
            seen.append(ks[0])
            asked += probes[0]
            assert not probes[1]                  # drafting more than one: no tail probe
            bp.slot_step(0, slots[0], ks[0], ks[0], 1.0 if probes[0] else None, tail=True)
            bp.slot_step(1, slots[1], ks[1], ks[1], None, tail=True)
        return seen, asked

    seen, asked = run(3.0)
    assert seen[0] == 1 and asked >= 3 and seen[-1] >= 2
    seen, asked = run(3.0, tail_seen=0.0)
    assert seen == [1] * 12 and asked == 0
    bp, slots = held_at_one(40.0)   # a pass so steep that two tokens would not pay even at position 1's estimate
    assert bp.lengths([0, 1], slots, [8, 8])[::2] == ([1, 8], [False, False])
    bp, slots = held_at_one(3.0)
    for _ in range(5):
        slots[0].accept.record_draft(2, 1)   # position 2 judged poor often enough: believed
    assert slots[0].accept.seen[2] >= AutoTuning().tail_seen
    assert bp.lengths([0, 1], slots, [8, 8])[::2] == ([1, 8], [False, False])


def test_on_a_recurrent_target_a_tail_probe_asks_whether_one_wider_run_for_all_would_pay():
    """A hybrid target pads every run to one width: two tokens for a slot held at one means two for every slot
    drafting one, so the tail probe's question weighs all of them (the others at their own position 2)."""
    def probes(steep):
        bp = policy(lambda n: 10 + steep * n, 0.5)
        slots = [AutoPolicy(draft_max=8) for _ in range(3)]
        for p in slots:
            for _ in range(3):
                p.accept.record_draft(2, 1)
        ks, _, asked = bp.lengths([0, 1, 2], slots, [8, 8, 8], recurrent=True)
        assert ks == [1, 1, 1]
        return asked

    assert probes(1.0) == [True] * 3
    assert probes(3.0) == [False] * 3   # three more rows of the padded pass: not paid even at position 1's estimate


def test_a_tail_probe_judges_position_two_and_no_plain_probe_back_off():
    bp = BatchPolicy(AutoTuning(probe_every=2))
    slot = AutoPolicy(draft_max=4)
    bp.slot_step(0, slot, 1, 1, 1.0, tail=True)
    assert slot.accept.seen[1] == slot.accept.seen[2] == 1.0 and slot.accept.estimates()[2] > 0.5
    bp.slot_step(0, slot, 1, 0, None, tail=True)   # rejected first: position 2 not judged
    assert slot.accept.seen[2] < 1.0 and slot.accept.seen[1] > 1.0
    assert bp.probe_interval(0) == 2               # a tail probe's chance sets no shadow probe's back-off
