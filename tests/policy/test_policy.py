"""Draft-length policies, with plain integers and made-up timings."""
import dataclasses
import itertools
from collections import Counter

import numpy as np
import pytest

from llamaspec.errors import InvalidParameterError
from llamaspec.policy import (AutoPolicy, AutoTuning, ConfidencePolicy, Costs, FixedPolicy, Phase, ThresholdPolicy,
                              make_policy)


def test_fixed_policy_never_changes():
    p = FixedPolicy(5)
    for accepted in (0, 5, 2):
        p.update(5, accepted, 0.01, 0.02)
        assert p.next_draft_len() == 5


def test_confidence_policy_carries_p_min():
    p = ConfidencePolicy(draft_max=6, draft_p_min=0.8)
    assert (p.next_draft_len(), p.draft_p_min) == (6, 0.8)


def test_threshold_lowers_k_below_40_percent_and_raises_above_75():
    p = ThresholdPolicy(draft_len=4, draft_min=2, draft_max=6, window=2)
    p.update(4, 1, 0, 0)
    assert p.next_draft_len() == 4  # window not full yet
    p.update(4, 1, 0, 0)            # 25% < 40%
    assert p.next_draft_len() == 3
    for _ in range(10):
        p.update(3, 0, 0, 0)
    assert p.next_draft_len() == 2  # not below draft_min
    for _ in range(20):
        p.update(p.next_draft_len(), p.next_draft_len(), 0, 0)
    assert p.next_draft_len() == 6  # not above draft_max


def test_threshold_keeps_k_between_the_bounds_of_acceptance():
    p = ThresholdPolicy(draft_len=4, window=2)
    for _ in range(10):
        p.update(4, 2, 0, 0)  # 50%: between 40% and 75%
    assert p.next_draft_len() == 4


def run_auto(acceptance: float, t_draft: float, verify, steps: int = 300, chosen: list | None = None) -> AutoPolicy:
    """Feed the policy a synthetic machine: per-position acceptance, draft cost per token, verify cost curve."""
    import random

    rng = random.Random(0)
    p = AutoPolicy(draft_max=10, draft_p_min=0.0)
    for _ in range(steps):
        k = p.next_draft_len()
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        p.update(k, accepted, k * t_draft, verify(k + 1))
        if chosen is not None:
            chosen.append(k)
    return p


def test_auto_turns_speculation_off_when_it_cannot_pay():
    costs = dict(t_draft=0.3, verify=lambda n: 1.0 + 0.3 * (n - 1))
    p = run_auto(acceptance=0.05, **costs)
    assert _lengths_after(p, 200, 0, **costs).count(0) >= 190


def test_auto_drafts_long_when_the_draft_is_cheap_and_right():
    p = run_auto(acceptance=0.95, t_draft=0.02, verify=lambda n: 1.0 + 0.02 * (n - 1))
    assert p.next_draft_len() >= 6


def test_auto_picks_a_moderate_length_for_a_moderate_draft():
    chosen = []
    run_auto(acceptance=0.7, t_draft=0.05, verify=lambda n: 1.0 + 0.05 * (n - 1), chosen=chosen)
    # the analytic optimum of (1 - a^(k+1)) / ((1 - a)(k c + v(k))) is k = 3..5 here; longer ones are explored
    most_chosen = Counter(chosen[-100:]).most_common(1)[0][0]
    assert 2 <= most_chosen <= 7


def _lengths_after(p, steps, accepted, t_draft, verify):
    lengths = []
    for _ in range(steps):
        k = p.next_draft_len()
        lengths.append(k)
        p.update(k, min(k, accepted), k * t_draft, verify(k + 1))
    return lengths


def test_auto_probes_less_and_less_while_the_draft_keeps_failing():
    cheap = dict(t_draft=0.01, verify=lambda n: 1.0 + 0.01 * (n - 1))
    p = run_auto(acceptance=0.0, steps=20, **cheap)
    lengths = _lengths_after(p, 400, 0, **cheap)
    probes = [i for i, k in enumerate(lengths) if k > 0]
    assert lengths.count(0) >= 380 and len(probes) >= 3
    gaps = np.diff(probes)
    assert gaps[-1] > gaps[0]  # backing off


def test_auto_recovers_when_the_draft_becomes_good():
    cheap = dict(t_draft=0.01, verify=lambda n: 1.0 + 0.01 * (n - 1))
    p = run_auto(acceptance=0.0, steps=60, **cheap)
    assert p.next_draft_len() in (0, 2)
    lengths = _lengths_after(p, 200, 99, **cheap)  # now every draft token is right
    assert lengths[-1] >= 6


def test_auto_stays_off_when_even_a_perfect_draft_cannot_pay():
    # a CPU where verifying n tokens costs n plain passes and the draft costs half the target
    costly = dict(t_draft=0.5, verify=lambda n: float(n))
    p = run_auto(acceptance=1.0, steps=10, **costly)
    assert p.perfect_draft_gain() < 1.0
    lengths = _lengths_after(p, 500, 99, **costly)
    assert lengths.count(0) >= 499


def test_make_policy_rejects_unknown_names_and_bad_values():
    with pytest.raises(InvalidParameterError, match="unknown draft policy"):
        make_policy("fastest")
    with pytest.raises(InvalidParameterError, match="draft_p_min"):
        make_policy("confidence", draft_p_min=1.5)
    with pytest.raises(InvalidParameterError, match="draft_max"):
        FixedPolicy(-1)


# Verify cost v(n) / v(1) of a 32B-shaped Q4_0 target on an H200 (benchmarks/results/h200-cost-curve.json)
# and its 2-layer draft's cost per token relative to one target token.
H200_V = [1.0, 1.07, 1.23, 1.42, 1.58, 1.77, 1.89, 2.11, 2.26, 2.31, 2.31, 2.30, 2.33, 2.35, 2.34, 2.33, 2.55]
H200_C = 0.046


def _gpu_speed(k: int, acceptance: float) -> float:
    tokens = sum(acceptance ** j for j in range(k + 1))
    return tokens / (k * H200_C + H200_V[k])


def _run_on_curve(policy, acceptance: float, draft_seconds, steps: int = 400) -> list[int]:
    """The draft lengths `policy` chose over `steps` steps on the H200 verify curve, with acceptance a Bernoulli run
    per position (seed 1) and draft_seconds(k) for a k-token draft."""
    import random

    rng, chosen = random.Random(1), []
    for _ in range(steps):
        k = policy.next_draft_len()
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        policy.update(k, accepted, draft_seconds(k), H200_V[k])
        chosen.append(k)
    return chosen


@pytest.mark.parametrize("acceptance", [1.0, 0.9, 0.7])
def test_auto_reaches_the_best_fixed_length_on_a_gpu_cost_curve(acceptance):
    chosen = _run_on_curve(AutoPolicy(draft_max=16, draft_p_min=0.0), acceptance, lambda k: k * H200_C)
    best = max(_gpu_speed(k, acceptance) for k in range(1, 17))
    achieved = sum(_gpu_speed(k, acceptance) for k in chosen[-200:]) / 200
    assert achieved >= 0.95 * best, (achieved / best, chosen[-20:])


@pytest.mark.parametrize("acceptance", [0.9, 0.8, 0.6])
def test_auto_prices_a_block_drafter_per_pass(acceptance):
    """DFlash drafts a whole block in one pass (cost 0.3 of a target pass here, whatever its length): priced per
    token, long drafts look k times too dear and auto settles on k=1 at 80% (0.71x of the best fixed length)."""
    block_pass = 0.3

    def speed(k):
        return sum(acceptance ** j for j in range(k + 1)) / ((block_pass if k else 0.0) + H200_V[k])

    p = AutoPolicy(draft_max=15)
    p.attach("per_pass")
    chosen = _run_on_curve(p, acceptance, lambda k: block_pass if k else 0.0)
    best = max(speed(k) for k in range(1, 16))
    assert sum(speed(k) for k in chosen[-200:]) / 200 >= 0.95 * best, chosen[-20:]
    with pytest.raises(InvalidParameterError, match="per_pass"):
        p.attach("per_block")


# -- auto on simulated machines: the engine's step on a fake clock (policy_sim.py) ---------------------------------
from support.policy_sim import CPU, GPU, H200_GRAPHS, H200_GRAPHS_BIG_DRAFT, SHARED_CPU, compare, simulate  # noqa: E402

SEEDS = range(5)


def test_auto_starts_plain_then_measures_a_short_draft():
    p = make_policy("auto")
    assert p.next_draft_len() == 0  # the first token waits for no draft prefill
    p.update(0, 0, 0.0, 0.05)
    assert p.next_draft_len() == p.k_start == 3


@pytest.mark.parametrize("acceptance", [1.0, 0.7, 0.0])
def test_auto_is_not_slower_than_plain_where_no_draft_can_pay(acceptance):
    # v(n) = n, c = 0.3: even a draft that is always right loses; 12 chat-sized requests share one policy
    for seed in SEEDS:
        auto = simulate(make_policy("auto"), CPU, acceptance, seed=seed)
        plain = simulate(FixedPolicy(0), CPU, acceptance, seed=seed)
        assert auto.throughput >= 0.97 * plain.throughput, seed
        assert max(a / b for a, b in zip(auto.ttft, plain.ttft)) <= 1.05, seed


@pytest.mark.parametrize("acceptance", [1.0, 0.7])
def test_auto_keeps_the_gain_of_the_best_fixed_length_where_drafts_pay(acceptance):
    # v(n) = 1 + 0.12 (n - 1), c = 0.05 (a GPU); the best fixed k is the best of k = 1..12 in the same simulation
    ratios = []
    for seed in SEEDS:
        runs = compare(GPU, acceptance, seed=seed, requests=4, max_tokens=128)
        ratios.append(runs["runs"]["auto"].throughput / runs["runs"][runs["best_fixed"]].throughput)
    assert np.mean(ratios) >= 0.95 and min(ratios) >= 0.9, ratios


def test_auto_costs_little_with_a_useless_draft_on_a_machine_where_drafts_could_pay():
    for seed in SEEDS:
        auto = simulate(make_policy("auto"), GPU, 0.0, seed=seed, requests=4, max_tokens=128)
        plain = simulate(FixedPolicy(0), GPU, 0.0, seed=seed, requests=4, max_tokens=128)
        assert auto.throughput >= 0.98 * plain.throughput, seed


def test_auto_keeps_what_it_learnt_across_requests():
    p = make_policy("auto")
    first = simulate(p, CPU, 1.0, requests=1)
    rest = simulate(p, CPU, 1.0, requests=11, seed=1)
    assert first.drafted == p.k_start  # one measuring draft, in the first request only
    assert rest.drafted == 0 and rest.draft_prefills == 0


def test_auto_recovers_on_a_later_request_when_the_text_gets_easier():
    ratios = []
    for seed in range(6):
        p = make_policy("auto")
        simulate(p, GPU, 0.0, requests=2, max_tokens=128, seed=seed)   # a useless draft: probes back off
        later = simulate(p, GPU, 0.9, requests=4, max_tokens=128, seed=seed + 1)
        best = max(simulate(FixedPolicy(k), GPU, 0.9, requests=4, max_tokens=128, seed=seed + 1).throughput
                   for k in (5, 7, 9))
        ratios.append(later.throughput / best)
    # plain decoding throughout would be about 0.36 of the best here; an unlucky probe or two delays recovery
    assert np.median(ratios) >= 0.9 and min(ratios) >= 0.5, ratios


@pytest.mark.parametrize("acceptance", [0.9, 0.5])
def test_auto_holds_the_floor_on_a_shared_noisy_machine(acceptance):
    # +-30% timing noise and 2% of moments five times slower (other processes on the cores)
    ratios = [simulate(make_policy("auto"), SHARED_CPU, acceptance, seed=seed).throughput
              / simulate(FixedPolicy(0), SHARED_CPU, acceptance, seed=seed).throughput for seed in range(8)]
    assert np.median(ratios) >= 0.97 and min(ratios) >= 0.93, ratios


def test_plain_steps_do_no_search(monkeypatch):
    p = make_policy("auto")
    simulate(p, CPU, 0.0, requests=1)  # learns that no draft pays here
    searched = []
    monkeypatch.setattr(p.model, "verify_curve", lambda *args: searched.append(args) or [])
    for _ in range(500):
        p.update(0, 0, 0.0, 1.0)
    assert p.next_draft_len() == 0 and not searched


def test_one_slow_step_does_not_move_the_cost_model():
    p = make_policy("auto")
    for _ in range(10):
        p.update(0, 0, 0.0, 1.0)
    p.update(0, 0, 0.0, 50.0)  # another process took the cores for this step
    assert p.verify_time(1) < 1.2  # a plain average would say 5.6


def test_a_larger_batch_is_never_taken_as_cheaper_than_a_smaller_one():
    p = make_policy("auto")
    p.update(0, 0, 0.0, 2.0)   # a slow plain pass
    p.update(3, 3, 0.1, 1.0)   # then a 4-token pass measured faster
    assert p.verify_time(1) <= p.verify_time(2) <= p.verify_time(4) == 1.0


# -- a GPU where a change of batch size costs: llama.cpp re-captures its CUDA graph ------------------------------------
def test_cold_passes_are_learnt_apart_from_warm_ones():
    p = make_policy("auto")
    p.attach()
    for _ in range(4):
        p.update(0, 0, 0.0, 1.0)
    p.update(3, 0, 0.6, 1.9)          # a draft; the two plain passes after it run cold
    p.update(0, 0, 0.0, 1.3)
    p.update(0, 0, 0.0, 1.5)
    for _ in range(3):
        p.update(0, 0, 0.0, 1.0)
    assert p.verify_time(1) == pytest.approx(1.0)
    assert p.switch_cost == pytest.approx(0.4)


def test_a_change_is_priced_by_its_first_and_its_second_cold_pass_apart():
    """llama.cpp runs the first pass after a change of batch size without a CUDA graph and captures one on the
    second: on the H200 (the synthetic 27B hybrid, 11.2 ms plain passes) 5 ms and 13 ms beyond a warm pass. A probe's
    one pass and the way back add first passes only, so one median over every cold pass priced a change at 2 x 5 ms
    where it cost 18; and the load's, whose first size also paid the process's first passes (232 ms), at 2 x 15."""
    from llamaspec.policy.costs import CostModel
    from llamaspec.policy.tuning import AutoTuning

    load = CostModel(AutoTuning())   # the load's cold passes at 7beabe5, size by size from the longest draft's
    load.calibrate(Costs({1: 0.0112, 2: 0.0123, 3: 0.0152, 4: 0.0178}, 0.001,
                         [0.2326, 0.0225, 0.0042, 0.0157, 0.0130, 0.0313, 0.0058, 0.0152]))
    assert 2 * load.switch_cost == pytest.approx(0.0058 + 0.0157)

    model = CostModel(AutoTuning())
    model.calibrate(Costs({2: 0.0123, 3: 0.0152}, 0.001, []))
    def passes(*sizes_and_extra):
        for n, extra in sizes_and_extra:
            model.record_pass(n, {2: 0.0123, 3: 0.0152}[n] + extra)
    passes((3, 0.005), (3, 0.013), (3, 0.0), (3, 0.0), (3, 0.0))
    for _ in range(4):   # a one-pass excursion to size 2 and back: three cold passes, two of them first ones
        passes((2, 0.005), (3, 0.005), (3, 0.013), (3, 0.0), (3, 0.0))
    assert 2 * model.switch_cost == pytest.approx(0.018)


def test_a_new_draft_length_is_kept_until_it_runs_warm():
    # each k the policy changes to while drafting is asked for at least 3 steps in a row (its third pass is warm),
    # where the costs were not measured at load (warm_up=False)
    for seed in SEEDS:
        p, asked = make_policy("auto"), []
        update = p.update
        p.update = lambda *step: (asked.append(p.next_draft_len()), update(*step))
        simulate(p, dataclasses.replace(H200_GRAPHS, gpu=False), 0.7, seed=seed, requests=2, max_tokens=96)
        runs = [(k, len(list(g))) for k, g in itertools.groupby(asked)]
        changes = [n for (before, _), (k, n) in zip(runs, runs[1:-1]) if before and k]
        assert changes and min(changes) >= 3, runs


@pytest.mark.parametrize("calibrated", [True, False])
def test_a_useless_draft_is_probed_in_the_shadow_where_changes_cost(calibrated):
    # measured on the H200: a 1-token probe cost about 1.9 plain passes there, the two passes after it included.
    # With the costs measured at load no draft is ever verified; without, one measuring draft.
    machine = dataclasses.replace(H200_GRAPHS_BIG_DRAFT, gpu=calibrated)
    for seed in SEEDS:
        auto = simulate(make_policy("auto"), machine, 0.0, seed=seed, requests=2, max_tokens=96)
        plain = simulate(FixedPolicy(0), machine, 0.0, seed=seed, requests=2, max_tokens=96)
        assert auto.drafted == (0 if calibrated else make_policy("auto").k_start) and auto.shadows >= 1, seed
        assert auto.throughput >= (0.99 if calibrated else 0.985) * plain.throughput, seed


def test_calibrated_costs_replace_the_measuring_draft():
    p = make_policy("auto", draft_max=4)
    p.attach()
    p.calibrate(Costs({n: 1.0 + 0.3 * (n - 1) for n in range(1, 6)}, 0.05, [0.4, 0.5] * 5))
    assert [round(p.verify_time(n), 6) for n in range(1, 6)] == [1.0, 1.3, 1.6, 1.9, 2.2]
    assert p.t_draft == pytest.approx(0.05) and 0.4 <= p.switch_cost <= 0.5
    p.calibrate(Costs({1: 9.0}, 9.0, [9.0]))   # once: a later call (the same policy set again) changes nothing
    assert p.verify_time(1) == pytest.approx(1.0)
    p.new_request()
    p.update(0, 0, 0.0, 1.4)                   # the first step after a prompt (cold): plain
    assert p.next_draft_len() == 0 and p.shadow_len() == 1   # acceptance is asked in the shadow first
    p.shadow(1.0, 0.06)
    p.update(0, 0, 0.0, 1.5)
    assert p.next_draft_len() > 0              # accepted: now a draft pays
    q = make_policy("auto", draft_max=4)
    q.attach()
    q.calibrate(Costs({n: 1.0 + 0.3 * (n - 1) for n in range(1, 6)}, 0.05, [0.4, 0.5] * 5))
    q.update(0, 0, 0.0, 1.0)
    q.shadow(0.0, 0.06)
    q.update(0, 0, 0.0, 1.0)
    assert q.next_draft_len() == 0 and q.shadow_len() == 0
    q.update(0, 0, 0.0, 1.0)                   # rejected once: asked again by the next shadow probe
    assert q.shadow_len() == 1


def test_calibrated_costs_that_no_draft_can_repay_keep_auto_plain():
    p = make_policy("auto", draft_max=4)
    p.attach()
    p.calibrate(Costs({n: float(n) for n in range(1, 6)}, 0.5, [0.0] * 10))   # a CPU: n tokens cost n passes
    for _ in range(200):
        p.update(p.next_draft_len(), 0, 0.0, 1.0)
        assert p.next_draft_len() == 0 and p.shadow_len() == 0


def test_a_70_percent_draft_recovers_from_a_failed_first_draft_where_changes_cost():
    ratios = []
    for seed in range(8):
        runs = compare(H200_GRAPHS, 0.7, seed=seed, requests=2, max_tokens=96)
        ratios.append(runs["runs"]["auto"].throughput / runs["runs"][runs["best_fixed"]].throughput)
    # without shadow probes, a first draft rejected at its first token left auto plain for the whole run (0.63)
    assert np.mean(ratios) >= 0.85 and min(ratios) >= 0.72, ratios


# -- the cost model alone (policy/costs.py) ------------------------------------------------------------------------
def _model(verify: dict, t_draft: float | None, per_pass: bool = False):
    from llamaspec.policy.costs import CostModel

    model = CostModel(AutoTuning(), per_pass=per_pass)
    model.calibrate(Costs(verify, t_draft, []))
    return model


def test_tokens_per_pass_is_one_plus_the_chance_of_each_accepted_prefix():
    from llamaspec.policy.costs import expected_tokens

    a = [0.0, 0.5, 0.5, 0.5]
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_step_time_is_the_draft_plus_one_verification():
    model = _model({1: 1.0, 3: 1.4}, 0.1)
    assert model.step_time(0) == pytest.approx(1.0)
    assert model.step_time(2) == pytest.approx(2 * 0.1 + 1.4)
    assert model.verify_time(2) == pytest.approx(1.2)   # between two measured sizes: the line through both
    assert model.verify_time(5) == pytest.approx(1.8)   # beyond the largest: the chord from the smallest
    block = _model({1: 1.0, 3: 1.4}, 0.3, per_pass=True)
    assert block.step_time(2) == pytest.approx(0.3 + 1.4)   # one pass for the whole block


def test_a_kept_verify_curve_is_dropped_when_a_pass_is_recorded():
    # one step's decisions ask the curve several times and get one computation; the next pass must change it
    model = _model({1: 1.0, 3: 1.4}, 0.1)
    assert model.verify_time(5) == pytest.approx(1.8)
    assert model.verify_curve(2, False)[5] == pytest.approx(1.8)   # the longest asked so far comes back
    for _ in range(4):                                              # size 5 measured warm: 2.2, not the chord's 1.8
        model.record_pass(5, 2.2)
    assert model.verify_time(5) == pytest.approx(2.2)
    assert model.verify_time(4) == pytest.approx(1.8)              # between 3 and 5 now
    assert model.verify_time(7, optimistic=True) != model.verify_time(7)   # each flag its own curve
    model.calibrate(Costs({1: 0.5, 3: 0.7}, 0.05, []))             # costs from load come in: dropped too
    assert model.verify_time(1) < 1.0


def test_optimism_changes_the_curve_only_past_the_largest_size_measured():
    # one curve serves both flags within the measured sizes (a step asks both); past them each keeps its own slope
    model = _model({1: 1.0, 2: 1.1, 3: 1.4}, 0.1)
    plain = model.verify_curve(3, False)
    assert model.verify_curve(3, True)[1:4] == plain[1:4] == pytest.approx([1.0, 1.1, 1.4])
    assert model.verify_time(5, optimistic=True) == pytest.approx(1.4 + 2 * 0.1)    # half the chord's slope
    assert model.verify_time(5) == pytest.approx(1.4 + 2 * 0.2)                     # the chord from the smallest
    model.record_pass(3, 1.4)
    assert model.verify_time(5, optimistic=True) == pytest.approx(1.6)   # a new pass: both drawn again


def test_optimism_past_the_largest_size_is_not_tilted_by_its_last_two_points():
    # timing noise made sizes 3 and 4 cost the same: a longer draft still costs half the chord's slope a token more,
    # not nothing (a 2-core CPU jumped from k=1 to k=12 on such a curve and ran three 13-token passes at 5x a plain one)
    model = _model({1: 1.0, 2: 1.2, 3: 1.6, 4: 1.6}, 0.01)
    assert model.verify_time(13, optimistic=True) == pytest.approx(1.6 + 9 * 0.5 * 0.2)
    a = [0.0, 0.98] + [0.7] * 12
    speeds = dict(model.speeds(a, 12, True))
    assert max(speeds, key=speeds.get) < 12


def test_speeds_pick_the_k_that_maximises_tokens_per_second():
    model = _model({n: 1.0 + 0.05 * (n - 1) for n in range(1, 12)}, 0.05)
    a = [0.0] + [0.7] * 10
    speeds = dict(model.speeds(a, 10, False))
    best = max(range(1, 11), key=lambda k: (1 - 0.7 ** (k + 1)) / (0.3 * (0.05 * k + 1.0 + 0.05 * k)))
    assert model.best_k(a, 10, False) == best
    assert speeds[best] == pytest.approx((1 - 0.7 ** (best + 1)) / 0.3 / (0.05 * best + 1.0 + 0.05 * best))
    assert model.perfect_draft_gain(10) == pytest.approx(11 / (0.5 + 1.5))


def test_acceptance_estimates_lean_on_the_position_before():
    from llamaspec.policy.costs import Acceptance

    acc = Acceptance(4, AutoTuning())
    assert acc.estimates()[1:] == [pytest.approx(0.6)] * 4         # the prior before any draft
    for _ in range(20):
        acc.record_draft(4, 0)                                     # rejected at position 1: later ones unjudged
    a = acc.estimates()
    assert a[1] < 0.05 and a[2] < a[1] + 0.05 and acc.tried[2] == 0


def test_tuning_is_validated_once_and_frozen():
    with pytest.raises(InvalidParameterError, match="min_gain"):
        AutoPolicy(min_gain=0.5)
    with pytest.raises(InvalidParameterError, match="k_start"):
        AutoTuning(k_start=0)
    with pytest.raises(InvalidParameterError, match="request_fade"):
        AutoTuning(request_fade=0.0)
    with pytest.raises(InvalidParameterError, match="surprise_fade"):
        AutoTuning(surprise_fade=1.5)
    assert AutoTuning(surprise_fade=0.0, surprise_llr=0.0).surprise_fade == 0.0   # 0: forget at once; 0: never
    with pytest.raises(dataclasses.FrozenInstanceError):
        AutoTuning().decay = 0.5
    assert AutoPolicy(draft_max=2).k_start == 2                   # clipped to draft_max


def test_phases_on_a_machine_where_no_draft_pays():
    p = make_policy("auto")
    assert p.phase is Phase.START
    p.update(0, 0, 0.0, 1.0)
    assert p.phase is Phase.MEASURE and p.next_draft_len() == p.k_start
    p.update(3, 3, 3 * 0.5, 4.0)                                   # a CPU: n tokens cost n passes, draft 0.5
    for _ in range(4):                                             # two cold plain passes, then warm ones
        p.update(p.next_draft_len(), 0, 0.0, 1.0)
    assert p.phase is Phase.OFF and p.next_draft_len() == 0


# -- the drafting settings (config.DraftSettings) ------------------------------------------------------------------
def test_draft_settings_are_checked_once_and_change_by_replace():
    from llamaspec.config import DraftSettings, LoadConfig
    from llamaspec.policy import policy_for

    config = LoadConfig.from_kwargs(policy="threshold", draft_max=6, draft_min=2, draft_p_min=0.5, n_ctx=1024)
    assert config.drafting == DraftSettings("threshold", 6, 2, 0.5)
    assert config.replace(n_ctx=2048).drafting is config.drafting        # other settings leave it as it is
    p = policy_for(config.drafting)                                      # the same names, to the constructor
    assert (p.name, p.draft_min, p.draft_max, p.draft_p_min) == ("threshold", 2, 6, 0.5)
    changed = dataclasses.replace(config.drafting, policy="fixed")
    assert policy_for(changed).draft_max == 6 and LoadConfig(policy="fixed", draft_max=6).drafting.draft_max == 6
    assert dataclasses.replace(config.drafting, draft_max=None).policy_settings() == \
        {"policy": "threshold", "draft_max": None, "draft_min": 2, "draft_p_min": 0.5}
    for bad in (dict(policy="fastest"), dict(draft_max=-1), dict(drafter="telepathy"), dict(draft_min=1.5)):
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            LoadConfig.from_kwargs(**bad)


# -- the recorded H200 runs (benchmarks/results/h200-peers-mtp27b-k123.md), replayed ------------------------------
# qwen35 27B + its MTP head: warm verification of 1..4 tokens in 1.00, 1.11, 1.345, 1.60 plain passes (11.15 ms),
# a drafted token 0.099 of a pass, a cold pass ~0.45 slower; T=0.8 temperature only: acceptance by position 0.82,
# 0.71, 0.66 (fixed k=1, 2, 3 made 1.82, 2.40, 2.78 tokens a pass). Fixed k=2 was the fastest (132.3 tok/s).
MTP_T1 = 0.01115
MTP_V = {1: 1.0, 2: 1.11, 3: 1.345, 4: 1.60}


def _mtp_policy():
    p = make_policy("auto", draft_max=3)
    p.attach("per_token", Costs({n: v * MTP_T1 for n, v in MTP_V.items()}, 0.099 * MTP_T1,
                                [0.45 * MTP_T1] * 8))
    return p


def test_one_inflated_pass_does_not_price_a_draft_length_out_for_good():
    """The recorded trace: `auto` drafted k=2 for three steps, one warm pass of it took ~2.4 plain passes, and its
    v(3) read 1.61 from then on (1.31-1.34 in every other run): k=2 looked 14% slower than k=1 and was never drafted
    again (0.90x the best fixed k). One such pass may move the estimate a little, not decide."""
    import random

    rng, p = random.Random(3), _mtp_policy()
    p.new_request()
    p.update(0, 0, 0.0, MTP_T1)
    for k_then, verify in [(2, 1.345), (2, 1.345), (2, 2.38)] + [(1, 1.11)] * 40:
        accepted = 0
        while accepted < k_then and rng.random() < (0.82, 0.71, 0.66)[accepted]:
            accepted += 1
        p.update(k_then, accepted, k_then * 0.099 * MTP_T1, verify * MTP_T1)
    assert p.verify_time(3) / MTP_T1 < 1.345 * 1.05
    a = [0.0, 0.82, 0.71, 0.66]
    speeds = dict(p.model.speeds(a, 3, False))
    assert speeds[2] > speeds[1], speeds    # with the recorded acceptance, k=2 stays the faster (as measured)


@pytest.mark.parametrize("acceptance", [(0.69, 0.70, 0.69), (0.82, 0.71, 0.66)])
def test_auto_keeps_the_best_fixed_length_on_the_recorded_mtp_costs(acceptance):
    """The recorded costs and acceptance by position (greedy; T=0.8 temperature only) on the simulator: `auto`
    against the best fixed k of 1..3, a fresh policy (cold) and after one request (warm)."""
    from support.policy_sim import Machine, cold_and_warm

    v = [1.0, 1.11, 1.345, 1.60]
    machine = Machine("h200 qwen35 27B + MTP, recorded", lambda n: v[n - 1], 0.099, 0.01, switch=(0.45, 0.45),
                      draft_switch=0.1, gpu=True)
    cold, warm = cold_and_warm(machine, list(acceptance), 3)
    assert np.mean(cold) >= 0.97 and np.mean(warm) >= 0.975 and min(cold + warm) >= 0.94, (cold, warm)


def test_a_mixed_session_changes_acceptance_per_request_and_auto_follows_it():
    """The simulator's mixed session (one request per (acceptance, tokens)): a fixed k=1 is judged at each request's
    own rate, and `auto` over sessions of rates 0.95/0.7/0.4/0.1 on the recorded MTP costs keeps the best fixed k's
    speed on average (measured 0.991; the goal of issue 37, 1.10x, is not reached: the head's k <= 3 leaves little
    between k=1 and the best k)."""
    from support.policy_sim import MTP_RECORDED, mixed_session, simulate

    session = [(1.0, 64), (0.0, 64)]
    one = simulate(FixedPolicy(1), MTP_RECORDED, 0.5, session=session, seed=0)
    assert one.tokens == 128 and one.drafted == 32 + 63     # all accepted: 2 tokens a step; none: 1
    assert simulate(FixedPolicy(1), MTP_RECORDED, 0.5, session=session[:1], seed=0).tokens == 64
    ratios = []
    for seed in range(12):
        s = mixed_session(seed)
        best = max(simulate(FixedPolicy(k), MTP_RECORDED, 0.0, session=s, seed=seed).throughput for k in (1, 2, 3))
        ratios.append(simulate(make_policy("auto", draft_max=3), MTP_RECORDED, 0.0, session=s,
                               seed=seed).throughput / best)
    assert np.mean(ratios) >= 0.97 and min(ratios) >= 0.88, ratios


def test_after_a_request_with_a_poor_draft_auto_drafts_again_soon_when_the_next_one_agrees():
    """Requests of changing character (0.7, then 0.15, then three at 0.55) on the recorded MTP costs: while plain,
    what was judged before fades (idle_decay), so a shadow probe that is accepted after a poor request is trusted
    and drafting resumes. Without the fading (idle_decay=1.0) the 0.55 requests ran plain for 96 steps on average
    (12 seeds, up to 305) and auto made 0.952 of the best fixed k; with it 31 steps and 0.977. With the surprise
    rule (surprise_llr; the 0.15 request goes plain sooner) 29 steps and 0.979 over 48 seeds, 24 and 0.980 without
    it: from one seed to the next the plain stretches vary from 0 to 133 steps, so 12 seeds do not tell."""
    from support.policy_sim import MTP_RECORDED, simulate

    session = [(0.7, 128), (0.15, 128), (0.55, 128), (0.55, 32), (0.55, 256)]
    ratios, plain = [], []
    for seed in range(48):
        policy, steps = make_policy("auto", draft_max=3), []
        update, new_request = policy.update, policy.new_request
        policy.update = lambda drafted, *rest: (steps.append(drafted), update(drafted, *rest))
        policy.new_request = lambda: (steps.append("|"), new_request())
        result = simulate(policy, MTP_RECORDED, 0.0, session=session, seed=seed)
        best = max(simulate(FixedPolicy(k), MTP_RECORDED, 0.0, session=session, seed=seed).throughput
                   for k in (1, 2, 3))
        ratios.append(result.throughput / best)
        requests = "".join(str(s) for s in steps).split("|")[1:]
        plain.append("".join(requests[2:]).count("0"))
    assert np.mean(ratios) >= 0.97 and np.mean(plain) <= 45, (ratios, plain)


def test_a_request_its_estimate_cannot_explain_lets_go_of_position_one_from_before():
    """After a request drafted 3 tokens and had all accepted for 30 steps, the next one's drafts are rejected at
    position 1 three times: under the estimate the request began with (about 0.96) that has a log-likelihood ratio
    of about 9, above surprise_llr (5), so position 1's judgements from before keep a tenth of their weight and its
    estimate follows the new text; the later positions' counts stay. Judgements the estimate explains change
    nothing."""
    from llamaspec.policy.costs import Acceptance
    from llamaspec.policy.tuning import AutoTuning

    def after(tuning, new_request):
        accept = Acceptance(3, tuning)
        for _ in range(30):
            accept.record_draft(3, 3)
        accept.fade(tuning.request_fade)
        for drafted, accepted in new_request:
            accept.record_draft(drafted, accepted)
        return accept

    on, off = after(AutoTuning(), [(3, 0)] * 3), after(AutoTuning(surprise_llr=0.0), [(3, 0)] * 3)
    assert on.surprised and not off.surprised
    assert on.estimates()[1] < 0.35 < 0.65 < off.estimates()[1], (on.estimates(), off.estimates())
    assert (on.acc[2], on.tried[2]) == (off.acc[2], off.tried[2])
    usual = after(AutoTuning(), [(3, 3), (3, 1), (3, 3)])
    assert not usual.surprised and usual.estimates()[1] > 0.9
    one = after(AutoTuning(), [(3, 0)])   # one rejection alone never: at least two judgements
    assert not one.surprised


def test_the_surprise_rule_pays_on_the_32b_pairs_mixed_sessions_and_not_less_elsewhere():
    """The 32B pair's mixed sessions (synth_pair.py's runs of agreement, MIXED_PAIR: code at 95%, then prose at
    10%, ...) on its recorded costs: with the surprise rule `auto` stops drafting into the prose within a few steps
    instead of a few dozen. Measured (8 seeds each): 0.994 -> 1.014 and 0.995 -> 1.014 of the best fixed k; the
    recorded uniform cases moved by at most 0.4% either way over four seed sets."""
    from support.policy_sim import D70_RECORDED, MIXED_PAIR, RECORDED, simulate

    def ratio(session, seed, **tuning):
        best = max(simulate(FixedPolicy(k), D70_RECORDED, 0.0, session=session, seed=seed).throughput
                   for k in range(1, 13))
        return simulate(AutoPolicy(draft_max=12, **tuning), D70_RECORDED, 0.0, session=session,
                        seed=seed).throughput / best

    for session in MIXED_PAIR.values():
        on = [ratio(session, seed) for seed in range(8)]
        off = [ratio(session, seed, surprise_llr=0.0) for seed in range(8)]
        assert np.mean(on) >= 1.0 and np.mean(on) >= np.mean(off) + 0.01, (on, off)
    name, machine, acceptance, k_max = RECORDED[3]   # the 32B pair at a flat 0.7: nothing to be surprised by
    flat = [[simulate(AutoPolicy(draft_max=k_max, **tuning), machine, acceptance, requests=4, max_tokens=128,
                      seed=seed).throughput for seed in range(6)] for tuning in ({}, {"surprise_llr": 0.0})]
    assert np.mean(flat[0]) >= 0.99 * np.mean(flat[1]), (name, flat)


def test_after_a_poor_request_the_next_one_is_asked_at_its_first_plain_step():
    """A request that agrees in long runs after one whose drafts failed (the H200's mixed sessions: the copy-heavy
    edit after the prose): the failed drafting spent the credit, and a shadow probe waited until it cost 1% of the
    plain time since the last one, 21 and 42 plain steps in two of 12 seeds (the H200 showed 22-25). A new request's
    probes, while accepted and cheap (new_text_probe), ask no credit: at most 7 plain steps, and auto made 1.046x the
    best fixed k against 1.041x; new_text_probe=0 brings the waits back."""
    from support.policy_sim import MTP_RECORDED, GreedyRuns, simulate

    good = GreedyRuns(0.95, 0.95)
    session = [(good, 128), (0.1, 128), (good, 128)]

    def waits(**tuning):
        out = []
        for seed in range(12):
            policy, steps = AutoPolicy(draft_max=3, **tuning), []
            update, new_request = policy.update, policy.new_request
            policy.update = lambda drafted, *rest: (steps.append(drafted), update(drafted, *rest))
            policy.new_request = lambda: (steps.append("|"), new_request())
            simulate(policy, MTP_RECORDED, 0.0, session=session, seed=seed)
            third = "".join(str(s) for s in steps).split("|")[3]
            out.append(len(third) - len(third.lstrip("0")))   # plain steps before its first draft
        return out

    assert max(waits()) <= 8, waits()
    # the surprise rule alone keeps them short too (the prose's drafts stop sooner and spend less credit)
    assert max(waits(new_text_probe=0.0, surprise_llr=0.0)) >= 20


def test_a_new_request_fades_what_the_last_one_showed_without_moving_an_estimate():
    from llamaspec.policy.costs import Acceptance
    from llamaspec.policy.tuning import AutoTuning

    seen, faded = Acceptance(3, AutoTuning()), Acceptance(3, AutoTuning())
    for a in (seen, faded):
        for _ in range(20):
            a.record_draft(3, 3)
    faded.fade(0.5)
    assert faded.estimates() == pytest.approx(seen.estimates())
    for a in (seen, faded):
        a.record_draft(3, 0)
    assert faded.estimates()[1] < seen.estimates()[1] - 0.01   # the new request's rejection weighs more


def test_auto_follows_the_recorded_mixed_session_request_by_request():
    """The H200's greedy mixed session (requests at about 95, 10, 95, 40 and 95% agreement; the best k per request
    makes 1.15x the best single k on the simulator): with what each request showed fading at the next
    (request_fade 0.5) and a plain policy asking a new request at the first step its credit allows, auto made
    1.041x the best single k on average; when the evidence of earlier requests weighed in full, 1.016x."""
    from support.policy_sim import MIXED_RECORDED, MTP_RECORDED, simulate

    ratios = []
    for seed in range(20):
        best = max(simulate(FixedPolicy(k), MTP_RECORDED, 0.0, session=MIXED_RECORDED, seed=seed).throughput
                   for k in (1, 2, 3))
        ratios.append(simulate(make_policy("auto", draft_max=3), MTP_RECORDED, 0.0, session=MIXED_RECORDED,
                               seed=seed).throughput / best)
    assert np.mean(ratios) >= 1.03 and min(ratios) >= 0.97, ratios


def test_one_costly_first_shadow_probe_does_not_keep_auto_plain_for_the_session():
    """The 32B pair's recorded costs, where a request's first draft costs 3 plain passes more (its sampler chain
    attached: llama.cpp reserves its graphs at the draft context's next decode) and the first shadow probe is
    rejected in 3 of 8 seeds: that one costly probe priced the next ones at ~300 plain passes, and `auto` drafted
    293-312 tokens of a 16 + 4 x 256-token session where it drafts 813-1002 without the extra cost (0 with 10 plain
    passes more: plain for the whole session, as an H200 run of profile_step showed). With the costs measured at
    load, the first probes are weighed against their estimate."""
    from support.policy_sim import D70_RECORDED, simulate

    session = [(0.7, 16)] + [(0.7, 256)] * 4
    costly = dataclasses.replace(D70_RECORDED, first_draft=3.0)
    for seed in range(8):
        plain = simulate(make_policy("auto", draft_max=12), D70_RECORDED, 0.7, session=session, seed=seed).drafted
        first = simulate(make_policy("auto", draft_max=12), costly, 0.7, session=session, seed=seed).drafted
        assert first >= 0.85 * plain, (seed, first, plain)


def test_the_first_shadow_probes_are_weighed_against_the_calibrated_estimate():
    t_plain, t_draft = 0.010, 0.001
    policy = AutoPolicy(draft_max=4)
    policy.attach("per_token", Costs({n: t_plain * (1 + 0.1 * (n - 1)) for n in range(1, 6)}, t_draft, [0.002] * 6))
    assert policy._shadow_loss() == pytest.approx(2 * t_draft)
    policy.shadow(0.0, 0.050)   # the first probe paid for something once
    assert policy._shadow_loss() == pytest.approx(2 * t_draft)
    for _ in range(3):          # measured probes replace the estimate once there are enough
        policy.shadow(1.0, 0.004)
    assert policy._shadow_loss() == pytest.approx(0.004)
    uncalibrated = AutoPolicy(draft_max=4)
    uncalibrated.attach("per_token")
    uncalibrated.shadow(0.0, 0.050)
    assert uncalibrated._shadow_loss() == pytest.approx(0.050)   # nothing to weigh it against: as measured


def test_a_recorded_greedy_trace_replays_exactly_at_any_draft_length():
    """A greedy trace recorded on a real pair (1: the draft's argmax is the target's token): a draft from position i
    keeps the run of agreements from i, so the simulator's fixed k takes the passes that walking the trace does."""
    from support.policy_sim import D70_RECORDED, Trace, recorded_session, simulate

    session = recorded_session("code", "greedy")
    assert len(session) == 2 and all(isinstance(t, Trace) and n == len(t.chances) for t, n in session)
    assert 0.9 < np.mean([c for t, _ in session for c in t.chances]) < 1.0   # the code answers mostly agree
    for k in (1, 3, 6):
        walked = 0
        for trace, n in session:
            pos = 0
            while pos < n:
                run = 0
                while run < min(k, n - pos - 1) and trace.at(pos + run):
                    run += 1
                pos, walked = pos + run + 1, walked + 1
        policy, passes = FixedPolicy(k), []
        update = policy.update
        policy.update = lambda *args: (passes.append(args), update(*args))
        result = simulate(policy, D70_RECORDED, 0.0, session=session, seed=0)
        assert result.tokens == sum(n for _, n in session) and len(passes) == walked, (k, len(passes), walked)


def test_auto_keeps_its_share_on_acceptance_recorded_on_a_real_pair():
    """Acceptance recorded on the real Qwen2.5-Coder 1.5B + 0.5B pair (tests/support/recorded_acceptance.json:
    bench_engine's mixed session and its code and prose sets, greedy agreement and T=0.8 chances per position)
    replayed with the H200's recorded costs of a cheap draft and of a 0.5B-shaped one: `auto` against the best fixed
    k of 1..8, cold and warm. Measured when the traces were added: geometric mean 0.965 of the best fixed k over the
    48 runs, greedy runs 0.967 or more; a policy that trusts a shorter past (decay 0.8) made 0.945 and 0.945, a
    lower prior (0.3) 0.965 and 0.949. (request_fade: 0.966 and 0.968 without it.)"""
    import math

    from support.policy_sim import D70_RECORDED, H200_GRAPHS_BIG_DRAFT, recorded_session, simulate

    ratios, greedy = [], []
    for machine in (D70_RECORDED, H200_GRAPHS_BIG_DRAFT):
        for set_name in ("mixed", "code", "prose"):
            for mode in ("greedy", "sampled"):
                session = recorded_session(set_name, mode)
                for seed in range(4):
                    best = max(simulate(FixedPolicy(k), machine, 0.0, session=session, seed=seed).throughput
                               for k in range(1, 9))
                    cold = simulate(make_policy("auto", draft_max=8), machine, 0.0, session=session, seed=seed)
                    policy = make_policy("auto", draft_max=8)
                    simulate(policy, machine, 0.0, session=session[:1], seed=seed + 100)
                    warm = simulate(policy, machine, 0.0, session=session, seed=seed)
                    pair = [cold.throughput / best, warm.throughput / best]
                    ratios += pair
                    if mode == "greedy":
                        greedy += pair
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert geo >= 0.955 and min(greedy) >= 0.955, (geo, min(greedy))


def test_greedy_runs_reproduce_the_recorded_tokens_per_pass_and_auto_keeps_its_share_of_them():
    """Greedy agreement comes in runs (policy_sim.GreedyRuns): a step that starts inside a run sees the rest of it,
    one after a disagreement draws a new one. GreedyRuns(0.55, 0.93) gives the tokens a pass that fixed k=3 and k=5
    measured on the 32B pair's greedy answers (3.20 and 4.27, results/h200-uniform-32b-draft70-at-b907a91.md), which
    a Bernoulli draw per position with the same acceptance does not; auto on it, cold, keeps at least what it made
    when the model was added (0.948 of the best fixed k over 16 seeds; the real run made 0.844 of the best of k=3
    and k=5, at k=1 for most of its first two requests after rejections in its first drafts; 0.957 of the best
    of k=3-5 in a second run)."""
    import random

    from support.policy_sim import D70_GREEDY, D70_RECORDED, simulate

    def tokens_per_pass(k: int, runs, steps: int = 20000) -> float:
        rng = random.Random(1)
        run, tokens = runs.draw(rng), 0
        for _ in range(steps):
            tokens += min(k, run) + 1
            run = run - k - 1 if run > k else runs.draw(rng)
        return tokens / steps

    assert tokens_per_pass(3, D70_GREEDY) == pytest.approx(3.20, abs=0.05)
    assert tokens_per_pass(5, D70_GREEDY) == pytest.approx(4.27, abs=0.05)
    # the simulator's steps see the same runs: a fixed k=5 makes the tokens a pass computed above
    result = simulate(FixedPolicy(5), D70_RECORDED, D70_GREEDY, requests=8, max_tokens=512, seed=3)
    assert result.tokens / (result.drafted / 5) == pytest.approx(4.27, rel=0.05)
    ratios = []
    for seed in range(16):
        best = max(simulate(FixedPolicy(k), D70_RECORDED, D70_GREEDY, requests=4, max_tokens=128, seed=seed).throughput
                   for k in range(1, 13))
        ratios.append(simulate(make_policy("auto", draft_max=12), D70_RECORDED, D70_GREEDY, requests=4,
                               max_tokens=128, seed=seed).throughput / best)
    assert np.mean(ratios) >= 0.94, ratios


# -- a real run's choices replayed in the simulator (policy_sim.py --replay REPORT) ---------------------------------
REPORT_ROWS = """| engine / mode | tok/s | vs plain | vs best peer | drafted | acceptance | tokens/pass | Python |
|---|---|---|---|---|---|---|---|
| llamaspec plain | 86.00 | 1.00x | 1.00x | 0 | 0.0% | 1.00 | 1.5% |
| llamaspec fixed k=1 | 119.00 | 1.38x | 1.00x | 300 | 66.0% | 1.66 | 1.8% |
| llamaspec fixed k=2 | 123.00 | 1.43x | 1.00x | 460 | 59.0% | 2.18 | 2.0% |
| llamaspec fixed k=3 | 116.00 | 1.35x | 1.00x | 600 | 51.0% | 2.52 | 2.1% |
| llamaspec auto | 120.00 | 1.40x | 1.00x | 400 | 60.0% | 2.10 | 2.9% |
- auto's cost model at the end: t_verify(1) 11.5 ms, draft/target cost per token 0.10, v(1)=1.00, \
v(2)=1.07, v(3)=1.31, v(4)=1.56; a cold pass 0.50 plain passes slower; perfect-draft gain 2.17; draft length by step \
(s/x: a shadow probe accepted/rejected, | a new request): `|{trace}`
"""


def test_a_reports_rows_give_acceptance_by_position_its_costs_and_auto_s_trace(tmp_path):
    from support.policy_sim import read_report

    report = tmp_path / "r.md"
    report.write_text(REPORT_ROWS.format(trace="0s0222|1111|2223|3"))
    got = read_report(report)
    # tokens a pass 1.66, 2.18, 2.52: a_1 = 0.66, a_1 a_2 = 0.52, a_1 a_2 a_3 = 0.34
    assert np.allclose(got["acceptance"], [0.66, 0.52 / 0.66, 0.34 / 0.52], atol=1e-6), got["acceptance"]
    auto = got["auto"]["auto"]
    assert auto["requests"] == ["0s0222", "1111", "2223", "3"] and auto["tps"] == 120.0
    assert auto["rounds"] == [auto["requests"]]
    assert auto["v"] == [1.0, 1.07, 1.31, 1.56] and auto["draft"] == 0.10 and auto["cold"] == 0.50
    assert auto["step"] == 0.0   # a report without a drafting step's own cost (before the draft line)
    stepped = tmp_path / "s.md"
    stepped.write_text(report.read_text().replace("cost per token 0.10,", "cost per token 0.05, a drafting step's own "
                                                  "cost 0.115,"))
    costs = read_report(stepped)["auto"]["auto"]
    assert costs["step"] == 0.115 and costs["draft"] == 0.05
    assert got["fixed"] == {1: 119.0, 2: 123.0, 3: 116.0}


def test_each_rounds_trace_is_read_and_a_warm_runs_warm_up_request_left_out(tmp_path):
    from support.policy_sim import read_report

    text = REPORT_ROWS.format(trace="0s02|11")
    text += text.splitlines()[-1].replace("end:", "end (round 2):").replace("`|0s02|11`", "`|0s03|22`") + "\n"
    warm = [line.replace("auto", "auto+warm") for line in text.splitlines() if "auto" in line]
    report = tmp_path / "r.md"
    report.write_text(text + "\n".join(warm).replace("`|0s02|11`", "`|3|0s02|11`") + "\n")
    got = read_report(report)["auto"]
    assert got["auto"]["rounds"] == [["0s02", "11"], ["0s03", "22"]]
    assert got["auto+warm"]["rounds"][0] == ["0s02", "11"]   # its first request warmed it up: not replayed


def test_a_gap_between_fixed_lengths_shares_one_rate_between_its_positions(tmp_path):
    from support.policy_sim import read_report

    report = tmp_path / "r.md"
    # k=1 and k=3 only: tokens 1.5, then 1.5 + 0.5 a + 0.5 a^2 = 2.0 for a = 0.618...
    rows = [line for line in REPORT_ROWS.splitlines(keepends=True) if "fixed k=2" not in line]
    report.write_text("".join(rows).replace("| 1.66 |", "| 1.50 |").replace("| 2.52 |", "| 2.00 |").format(trace="1"))
    a = read_report(report)["acceptance"]
    assert len(a) == 3 and a[0] == pytest.approx(0.5) and a[1] == a[2] == pytest.approx((5 ** 0.5 - 1) / 2, abs=1e-6)


def test_replaying_a_fixed_length_trace_is_that_fixed_length_in_the_simulator():
    """The replay drafts what the trace says, request by request (past its end the last length): a trace of k=2
    throughout costs what FixedPolicy(2) costs; a shadow probe's step is plain."""
    from support.policy_sim import MTP_SYNTH_H200, TraceReplay, simulate

    acceptance = [0.66, 0.79, 0.65]
    fixed = simulate(FixedPolicy(2), MTP_SYNTH_H200, acceptance, requests=4, max_tokens=128, seed=1)
    replayed = simulate(TraceReplay(["22", "2", "2", "2"], 3), MTP_SYNTH_H200, acceptance, requests=4,
                        max_tokens=128, seed=1)
    assert replayed.throughput == pytest.approx(fixed.throughput, rel=1e-9) and replayed.drafted == fixed.drafted
    plain_first = TraceReplay(["0s3"], 3)
    plain_first.new_request()
    lengths = []
    for _ in range(4):
        lengths.append(plain_first.next_draft_len())
        plain_first.update(lengths[-1], 0, 0.0, 0.01)
    assert lengths == [0, 0, 3, 3]


def test_auto_keeps_the_best_fixed_length_on_the_h200_synthetic_mtp_case():
    """The auto suite's synthetic MTP file on the H200 (policy_sim.MTP_SYNTH_H200, its costs and its fixed rows'
    acceptance by position): on the simulator `auto` keeps 0.97 of the best fixed k cold and 0.975 warm. The run
    itself made 0.934 and 0.985: `policy_sim.py --replay` on its report puts its cold choices at 0.960 here and the
    rest in what its steps cost beyond the simulator's (results/auto-policy-notes.md)."""
    from support.policy_sim import RECORDED, cold_and_warm

    name, machine, acceptance, k_max = next(case for case in RECORDED if case[1].name.startswith("h200 synthetic"))
    cold, warm = cold_and_warm(machine, acceptance, k_max)
    assert np.mean(cold) >= 0.97 and np.mean(warm) >= 0.975 and min(cold + warm) >= 0.94, (cold, warm)


# -- a drafting step's own cost (t_draft(k) = t_start + k t_token) ----------------------------------------------
def _timed(drafts: dict, draft: float = 0.001) -> AutoPolicy:
    p = AutoPolicy(draft_max=5)
    p.attach("per_token", Costs({n: 0.010 * (1 + 0.1 * (n - 1)) for n in range(1, 7)}, draft, [0.002] * 4, drafts))
    return p


def test_lengths_timed_at_load_draw_a_drafting_steps_cost_as_a_line():
    """The 32B pair's draft on the H200 (c25a40d): 2.70 ms for 3 tokens, 3.24-3.44 for 4, 3.70 for 5: a step pays
    about 1.2 ms whatever its length. With the lengths timed at load, t_draft(k) is the line through them."""
    p = _timed({1: 0.0017, 3: 0.0027, 5: 0.0037})
    start, per_token = p.model.draft_line()
    assert start == pytest.approx(0.0012) and per_token == pytest.approx(0.0005)
    assert p.model.draft_time(4) == pytest.approx(0.0032) and p.model.draft_time(0) == 0.0
    assert p.model.step_time(4) == pytest.approx(0.0032 + 0.010 * 1.4)
    speeds = dict(p.model.speeds([0.0] + [0.7] * 5, 5, False))
    tokens4 = 1 + sum(0.7 ** j for j in range(1, 5))
    assert speeds[4] == pytest.approx(tokens4 / (0.0032 + 0.014))
    # a drafting step measured later moves its own length's estimate, and the line with it
    p.update(0, 0, 0.0, 0.010)
    before = p.model.draft_time(5)
    for _ in range(3):
        p.model.record_draft(0.0040, 5, True, 5)
    assert p.model.draft_time(5) > before


def test_the_state_line_prints_the_drafting_steps_own_cost_where_the_line_has_one():
    from llamaspec.bench import auto_state

    p = _timed({1: 0.0017, 3: 0.0027, 5: 0.0037})
    p.update(0, 0, 0.0, 0.010)
    line = auto_state(p)
    assert "draft/target cost per token 0.05, a drafting step's own cost 0.120, v(1)=1.00" in line, line
    assert "own cost" not in auto_state(_timed({2: 0.002}))


def test_without_lengths_timed_at_load_a_draft_costs_k_times_a_token():
    """On a CPU (no warm-up at load) or with one length timed: k t_draft, as before; timings of several lengths
    measured while generating do not draw the line (on a shared CPU a few noisy ones drew long drafts too cheap)."""
    p = AutoPolicy(draft_max=5)
    p.attach("per_token", Costs({1: 0.010, 2: 0.011}, 0.001, [0.0] * 2))
    for k, seconds in ((1, 0.0017), (3, 0.0027), (5, 0.0037)) * 3:
        p.model.record_draft(seconds, k, True, k)
    assert p.model.draft_line()[0] == 0.0
    assert p.model.draft_time(4) == pytest.approx(4 * p.model.t_draft)
    one = _timed({2: 0.002})
    assert one.model.draft_line() == (0.0, pytest.approx(0.001)) and one.model.draft_time(3) == pytest.approx(0.003)
    # a line that would start below zero, or fall (noise: a busy CPU timed one token at 2.45 s and four at 0.39), is
    # a token's mean time instead
    odd = _timed({1: 0.0005, 2: 0.0030})
    assert odd.model.draft_line() == (0.0, pytest.approx(0.0035 / 3))
    falling = _timed({1: 2.45, 2: 4.75, 3: 7.14, 4: 0.39, 5: 0.53})
    assert falling.model.draft_line() == (0.0, pytest.approx((2.45 + 4.75 + 7.14 + 0.39 + 0.53) / 15))


def test_a_drafting_steps_own_cost_keeps_auto_near_the_best_length_on_the_32b_pair():
    """The 32B pair's draft as the H200 timed it (a step 0.115 of a target pass, a token 0.048; policy_sim's
    D70_STEP): priced k t_draft from the length it runs, long drafts looked dearer than they are and `auto` stopped
    short. Over 6 seeds, cold / warm: flat 0.7 acceptance 0.946 / 0.963 -> 0.965 / 0.990 with the line, the greedy
    runs 0.916 / 0.973 -> 0.964 / 0.972. (Since tail probes ask position 2 while one token is drafted until it has
    been judged 6 times, not 3, the proportional price's one-token drafts find position 2 too: flat 0.7 0.959 / 0.969
    against 0.965 / 0.993 with the line.)"""
    from support.policy_sim import D70_GREEDY, D70_STEP, cold_and_warm

    from llamaspec.policy.costs import CostModel

    proportional = CostModel.draft_line

    def both(acceptance):
        try:
            CostModel.draft_line = lambda self: None if self.t_draft is None else (0.0, self.t_draft)
            before = cold_and_warm(D70_STEP, acceptance, 12)
        finally:
            CostModel.draft_line = proportional
        return [np.mean(x) for x in before], [np.mean(x) for x in cold_and_warm(D70_STEP, acceptance, 12)]

    (cold0, warm0), (cold, warm) = both(0.7)
    assert cold >= cold0 + 0.005 and warm >= warm0 + 0.01 and min(cold, warm) >= 0.96, (cold0, warm0, cold, warm)
    (cold0, warm0), (cold, warm) = both(D70_GREEDY)
    assert cold >= cold0 + 0.03 and warm >= warm0 - 0.01 and min(cold, warm) >= 0.96, (cold0, warm0, cold, warm)


def test_replay_says_in_one_line_what_it_cannot_replay(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    sim = Path(__file__).resolve().parents[1] / "support" / "policy_sim.py"
    root = Path(__file__).resolve().parents[2]
    not_report, mixed = tmp_path / "notes.md", tmp_path / "mixed.md"
    not_report.write_text("# notes\n")
    mixed.write_text("# llamaspec engine benchmark\n\n- command: `bench_engine.py --workload mixed`\n")
    for args, says in ((["--replay"], "usage"), (["--replay", str(tmp_path / "none.md")], "no file"),
                       (["--replay", str(not_report)], "not a bench_engine report"),
                       (["--replay", str(mixed)], "a mixed session")):
        done = subprocess.run([sys.executable, str(sim), *args], capture_output=True, text=True, timeout=60,
                              cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_the_synthetic_files_own_answers_give_the_fixed_rows_the_run_measured():
    """The walk (benchmarks/probes/synth_walk.py) on the H100's costs: fixed k's tokens a pass and speeds relative to
    k=2 as the run at 93beae3 measured them (1.66, 2.18, 2.52 tokens a pass; k=1 0.958 and k=3 0.963 of k=2)."""
    from support.policy_sim import MTP_SYNTH_H100, walk_session

    session = walk_session()
    assert [n for _, n in session] == [128] * 4
    runs = {k: simulate(FixedPolicy(k), MTP_SYNTH_H100, 0.0, session=session) for k in (1, 2, 3)}
    assert [runs[k].drafted for k in (1, 2)] == [306, 466]                        # as the run's fixed rows drafted
    assert runs[1].throughput / runs[2].throughput == pytest.approx(0.958, abs=0.004)
    assert runs[3].throughput / runs[2].throughput == pytest.approx(0.963, abs=0.004)


def test_more_warm_passes_at_load_keep_auto_off_a_length_a_timing_error_priced_out():
    """A draft length `auto` does not run keeps the cost the load measured for it: one pass 2-3% off held the H100's
    cold runs at k=3 through a whole request and then at k=1 (results/auto-policy-notes.md). With the load's errors
    drawn at 3% a pass, the median of 6 warm passes in 3 sweeps (calibration.py) against one: a better mean and worst
    case."""
    from llamaspec.policy.calibration import _SWEEPS, _WARM_SAMPLES
    from support.policy_sim import walk_cold_and_warm

    assert _WARM_SAMPLES >= 5
    one, _ = walk_cold_and_warm(24, (0.03, 1))
    many, _ = walk_cold_and_warm(24, (0.03, _WARM_SAMPLES, _SWEEPS))
    exact, _ = walk_cold_and_warm(1)
    assert exact[0] >= 0.985
    assert np.mean(many) >= np.mean(one) + 0.004 and min(many) >= min(one) + 0.01, (np.mean(one), np.mean(many))


def test_a_runs_recorded_calls_replay_into_its_own_choices():
    """bench_engine's auto_events fed to a fresh policy (policy_sim --events): every length it chose is the run's
    (or the request's end cut it), and without the load's costs the same calls lead elsewhere."""
    import json

    from benchmarks.compare.bench_engine import record_steps
    from support.policy_sim import MTP_SYNTH_H100, load_against_run, replay_events, walk_session

    policy = make_policy("auto", draft_max=3)
    steps, events = record_steps(policy)
    simulate(policy, MTP_SYNTH_H100, 0.0, session=walk_session(), seed=1, calibration=(0.02, 1))
    events = json.loads(json.dumps(events))   # as the report's JSON holds them
    assert events[0] == ["policy", 3, 0.0] and events[1][0] == "attach" and events[1][2]["verify"]
    assert any(e[0] == "shadow" for e in events) and sum(e[0] == "request" for e in events) == 4
    replayed = replay_events(events)
    assert len(replayed) == sum(c.isdigit() for c in steps) and len({s["drafted"] for s in replayed}) >= 3
    for i, s in enumerate(replayed):
        last = i + 1 == len(replayed) or replayed[i + 1]["request"] != s["request"]
        assert s["chosen"] == s["drafted"] or (last and s["drafted"] < s["chosen"]), (i, s)
    assert set(replayed[-1]["speeds"]) == {0, 1, 2, 3} and len(replayed[-1]["estimates"]) == 3
    uncalibrated = replay_events([e if e[0] != "attach" else ["attach", e[1], None] for e in events])
    assert any(a["chosen"] != b["chosen"] for a, b in zip(replayed, uncalibrated))
    # what the load priced each pass at (here off by 2% errors) beside the run's warm passes (here exact)
    sizes = load_against_run(events)
    assert sorted(sizes) == [1, 2, 3, 4] and all(at_load is not None for at_load, _ in sizes.values())
    ran = {n: in_run for n, (_, in_run) in sizes.items() if in_run is not None}
    assert len(ran) >= 2 and all(t == pytest.approx(MTP_SYNTH_H100.verify(n)) for n, t in ran.items())
    assert any(at_load != pytest.approx(MTP_SYNTH_H100.verify(n), rel=1e-3) for n, (at_load, _) in sizes.items())


def test_recorded_tail_probes_replay_as_the_run_made_them():
    """A tail probe's recorded call (["shadow", chance or null, seconds] before a drafting step's update) replays as a
    tail probe: the replay asks shadow_len first, as the engine does (the H200's report at 7beabe5 failed at its first
    tail probe a rejection had cut short, null)."""
    import json

    from benchmarks.compare.bench_engine import record_steps
    from support.policy_sim import MTP_SYNTH_H100, replay_events, walk_session

    policy = make_policy("auto", draft_max=3)
    steps, events = record_steps(policy)
    simulate(policy, MTP_SYNTH_H100, 0.0, session=walk_session(("warm",)), seed=0)   # the warm lock: tail probes
    simulate(policy, MTP_SYNTH_H100, 0.0, session=walk_session(), seed=0)
    events = json.loads(json.dumps(events))
    tails = [e for e, after in zip(events, events[1:]) if e[0] == "shadow" and after[0] == "update" and after[1]]
    assert tails and any(e[1] is None for e in tails)
    replayed = replay_events(events)
    assert len(replayed) == sum(c.isdigit() for c in steps)
    for i, s in enumerate(replayed):
        last = i + 1 == len(replayed) or replayed[i + 1]["request"] != s["request"]
        assert s["chosen"] == s["drafted"] or (last and s["drafted"] < s["chosen"]), (i, s)


def test_events_says_in_one_line_what_it_cannot_read(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    sim = Path(__file__).resolve().parents[1] / "support" / "policy_sim.py"
    root = Path(__file__).resolve().parents[2]
    text, old = tmp_path / "r.md", tmp_path / "old.json"
    text.write_text("# llamaspec engine benchmark\n")
    old.write_text(json.dumps([{"engine": "llamaspec", "mode": "auto", "regime": "greedy"}]))
    for args, says in ((["--events"], "usage"), (["--events", str(tmp_path / "none.json")], "no file"),
                       (["--events", str(text)], "not a bench_engine JSON report"),
                       (["--events", str(old)], "no auto row with recorded steps"),
                       (["--events", str(old), "--every"], "usage")):
        done = subprocess.run([sys.executable, str(sim), *args], capture_output=True, text=True, timeout=60,
                              cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_the_load_keeps_the_median_of_each_sizes_warm_passes_over_three_sweeps():
    """calibration.Sweep as measure_costs runs it: every size in turn, three times over; the first two passes of a
    size in a row are cold (their excess kept, in the order they ran), the rest warm. A slow stretch of the machine
    while one sweep timed one size (both its warm passes there 6% slow, as an H100 load priced a 3-token pass) does not
    move that size's cost; in one sweep of five warm passes it did (the median of five slow ones)."""
    from llamaspec.policy.calibration import _SWEEPS, _WARM_A_SWEEP, Sweep

    assert (_SWEEPS, _WARM_A_SWEEP) == (3, 2)
    sweep = Sweep(1, _WARM_A_SWEEP + 2, _SWEEPS)
    warm = {2: 0.020, 1: 0.010}
    cold = {2: (0.030, 0.025), 1: (0.016, 0.013)}
    ran = []
    for i in range(_SWEEPS):
        for n in (2, 1):
            slow = 1.06 if (i, n) == (1, 2) else 1.0
            for seconds in (*cold[n], warm[n] * slow, warm[n] * slow):
                assert not sweep.done and sweep.next_draft_len() == n - 1
                sweep.update(n - 1, 0, 0.002 * (n - 1), seconds)
                ran.append(n)
    assert sweep.done and ran == [2] * 4 + [1] * 4 + [2] * 4 + [1] * 4 + [2] * 4 + [1] * 4
    costs = sweep.costs()
    assert costs.verify == {2: 0.020, 1: 0.010} and costs.drafts == {1: 0.002}
    assert [round(e, 3) for e in costs.excess] == [0.01, 0.005, 0.006, 0.003] * _SWEEPS   # first, second, ...

    one = Sweep(1, 5 + 2)   # the layout before: one sweep, five warm passes of a size in a row
    for n in (2, 1):
        for seconds in (*cold[n], *[warm[n] * (1.06 if n == 2 else 1.0)] * 5):
            one.update(n - 1, 0, 0.002 * (n - 1), seconds)
    assert one.done and one.costs().verify[2] == pytest.approx(0.0212)


def test_a_slow_stretch_at_load_costs_auto_nothing_timed_in_three_sweeps():
    """policy_sim's load with a slow stretch: one size (drawn) 6% slow in one sweep, 1% noise a pass besides. Timed
    as before (five warm passes of a size in a row) the stretch priced that size off for the whole run and `auto`
    lost cold and warm on the synthetic MTP file's answers and on the 32B pair's; timed in three sweeps of two
    (calibration.py) it loses nothing to it."""
    from llamaspec.policy.calibration import _SWEEPS, _WARM_SAMPLES
    from support.policy_sim import PAIR_SYNTH_H100, walk_cold_and_warm

    for kw in ({}, {"machine": PAIR_SYNTH_H100, "pair": True}):
        clean, clean_warm = walk_cold_and_warm(16, (0.01, _WARM_SAMPLES, _SWEEPS), **kw)
        before, before_warm = walk_cold_and_warm(16, (0.01, 5, 1, 0.06), **kw)
        now, now_warm = walk_cold_and_warm(16, (0.01, _WARM_SAMPLES, _SWEEPS, 0.06), **kw)
        assert min(before) < min(clean) - 0.02, (kw, min(before), min(clean))      # the stretch bites, timed as before
        assert np.mean(now) >= np.mean(clean) - 0.002 and min(now) >= min(clean) - 0.005, (kw, now, clean)
        assert np.mean(now_warm) >= np.mean(clean_warm) - 0.002, (kw, now_warm, clean_warm)
        assert np.mean(now) > np.mean(before) and min(now) > min(before) + 0.02


def test_a_size_last_timed_at_a_shallower_context_is_priced_at_this_one():
    """Depth (policy/costs.py): warm passes of one size at requests 30K, 33K and 36K tokens deep give the slope of a
    pass on the context, and a size last timed at the load's short prompt is priced with it at the depth now; where
    the times do not depend on the depth (noise of 1% a pass) no slope stands and every price stays as timed; a
    CPU's steep slope (a third more for 1.7K tokens) is used from the first warm pass of the deeper request."""
    from llamaspec.policy.costs import CostModel

    base, per_token, rng = {1: 0.0118, 2: 0.0129, 3: 0.0154}, 2e-8, np.random.default_rng(0)

    def session(depths, passes, slope=per_token, noise=0.0):   # the load's prices, then warm passes of 3 tokens
        model = CostModel(AutoTuning())
        model.calibrate(Costs(dict(base), 0.0012, [0.007] * 4))
        for held in depths:
            model.new_request()
            model.held(held)
            for _ in range(passes):
                model.record_pass(3, (base[3] + slope * held) * (1.0 + noise * rng.standard_normal()))
        return model

    flat = session((30_000, 33_000, 36_000), 40, slope=0.0, noise=0.01)
    assert flat.depth.slope == 0.0 and flat.size_time(2) == pytest.approx(base[2], rel=1e-9)

    deep = session((30_000, 33_000, 36_000), 40)
    deep.held(39_000)
    assert deep.depth.slope == pytest.approx(per_token, rel=0.05)
    assert deep.size_time(2) == pytest.approx(base[2] + per_token * 39_000, rel=0.002)   # timed at the load only
    assert deep.size_time(3) > base[3] + per_token * 33_000                             # its own recent passes
    deep.held(1_000)   # a shorter conversation next: a size last timed deep is priced down to it
    assert deep.size_time(3) < base[3] + per_token * 10_000

    cpu = session((2_300,), 30, slope=1.4e-5, noise=0.01)   # plain 68 ms at 2.3K, 92 at 4K (the 0.5B, 2 cores)
    assert cpu.depth.slope == 0.0
    cpu.new_request()
    cpu.held(4_000)
    for _ in range(3):   # after a prompt two passes run cold, then the first warm one
        cpu.record_pass(3, base[3] + 1.4e-5 * 4_000)
    assert cpu.depth.slope == pytest.approx(1.4e-5, rel=0.1)


def test_auto_told_the_depth_keeps_its_length_through_a_deep_agent_session():
    """An agent session 30K-87K tokens deep on the synthetic MTP file's own answers (policy_sim --deep): where every
    pass pays for its context, a policy that prices the sizes it does not run at the load's short prompt leaves k=2
    for a 2-token pass that looks cheaper than it is (and stays at one token); told the depth it keeps k=2."""
    from support.policy_sim import LOAD_ERRORS, MTP_SYNTH_H100_DEEP, agent_session

    session = agent_session()
    best = max(simulate(FixedPolicy(k), MTP_SYNTH_H100_DEEP, 0.0, session=session).throughput for k in (1, 2, 3))
    told, not_told = [], []
    for seed in range(6):
        for ratios, tell in ((told, True), (not_told, False)):
            policy = make_policy("auto", draft_max=3)
            if not tell:
                policy.held = lambda tokens: None
            ratios.append(simulate(policy, MTP_SYNTH_H100_DEEP, 0.0, session=session, seed=seed,
                                   calibration=LOAD_ERRORS).throughput / best)
    assert min(told) >= 0.985 and np.mean(told) >= np.mean(not_told) + 0.015, (told, not_told)


def test_a_tail_probe_judges_the_position_past_the_draft():
    """Acceptance.record_draft with a tail probe's chance: where all k were accepted, position k + 1 is judged with
    it (a fraction when sampled); where a rejection came first, or at the longest draft, nothing past it is."""
    from llamaspec.policy.costs import Acceptance

    a = Acceptance(3, AutoTuning())
    a.record_draft(1, 1, tail=0.25)
    assert a.tried[2] == 1.0 and a.acc[2] == 0.25 and a.acc[1] == 1.0
    a.record_draft(1, 0, tail=None)
    assert a.tried[2] == pytest.approx(AutoTuning().stale_decay)    # not judged: faded as a position not drafted
    b = Acceptance(1, AutoTuning())
    b.record_draft(1, 1, tail=1.0)                                   # k_max 1: no position 2 to judge
    assert b.tried == [0.0, 1.0]


def test_auto_asks_a_tail_probe_only_where_position_two_looks_worse_than_it_may_be():
    """At k=1 with position 2 judged poor on a few steps (the lock: one-token drafts never judge it again), auto asks
    a tail probe; with position 2 as good as position 1 (k=1 best on its costs) or judged often, or at its longest
    draft, or with a one-pass drafter, it does not; the probe's token counts in the step's draft time."""
    def at_k1(second: float, seen: float = 1.0, draft_max: int = 3, per_pass: bool = False) -> AutoPolicy:
        p = AutoPolicy(draft_max=draft_max)
        p.attach("per_pass" if per_pass else "per_token",
                 Costs({1: 1.0, 2: 1.08, 3: 1.3, 4: 1.55}, 0.1, [0.5] * 4))
        p.phase, p._k, p._since_draft = Phase.ON, 1, 0
        p.accept.acc[1], p.accept.tried[1], p.accept.seen[1] = 14.0, 20.0, 20.0
        if draft_max > 1:
            p.accept.acc[2], p.accept.tried[2], p.accept.seen[2] = second * seen, seen, seen
        return p

    assert at_k1(0.0).shadow_len() == 1
    assert at_k1(0.7).shadow_len() == 0                      # as good as position 1: nothing to learn
    assert at_k1(0.0, seen=10.0).shadow_len() == 0           # judged often enough
    assert at_k1(0.0, draft_max=1).shadow_len() == 0         # no k=2 to go to
    assert at_k1(0.0, per_pass=True).shadow_len() == 0       # a one-pass drafter's length is its own
    p = at_k1(0.0)
    assert p.shadow_len() == 1
    seen_before = p.accept.seen[2]
    p.shadow(1.0, 0.0)
    p.update(1, 1, 0.2, 1.1)
    assert p.accept.seen[2] > seen_before and p.accept.acc[2] > 0.0
    assert p.model.draft_cold.value == pytest.approx(0.1)   # 0.2 s for the draft token and the probe's


def test_tail_probes_free_auto_from_one_token_drafts_on_the_files_own_answers(monkeypatch):
    """The warm lock on the synthetic MTP file's own answers (auto-policy-notes.md): after the warm-up request auto
    sat at k=1 (position 2 judged on six steps, 0.37 where the answers give 0.79). Tail probes judge position 2 while
    at k=1: warm 0.957 -> 0.98 of the best fixed k, cold unchanged; without them the lock is back."""
    from support.policy_sim import walk_cold_and_warm

    cold, warm = walk_cold_and_warm(1)
    monkeypatch.setattr(AutoPolicy, "_tail_due", lambda self: False)
    cold_off, warm_off = walk_cold_and_warm(1)
    assert warm[0] >= 0.975 and warm_off[0] <= 0.96 and cold[0] >= cold_off[0] - 0.002, (cold, warm, cold_off, warm_off)


def test_a_faster_k_the_horizon_refuses_is_taken_once_its_gain_has_lasted(monkeypatch):
    """On the H200 (uniform MTP rows at 7beabe5) auto went to k=1 at the second request's second step and kept it for
    three requests while its own estimates had k=2 2.5% faster: too little to repay two cold passes within `horizon`
    steps, so no single decision changed. What the drafted steps since k=2 first looked faster would have saved at
    it now counts too: auto changes once that reaches the change's cost; where k=2 is slower it stays."""
    def at_k1(second: float) -> AutoPolicy:
        p = AutoPolicy(draft_max=3, tail_seen=0.0)   # no tail probe: the horizon's own question
        p.attach("per_token", Costs({1: 1.0, 2: 1.11, 3: 1.36, 4: 1.59}, 0.09, [0.44] * 8))
        p.phase, p._k, p._since_draft = Phase.ON, 1, 0
        p.accept.acc[1], p.accept.tried[1], p.accept.seen[1] = 16.0, 20.0, 20.0
        p.accept.acc[2], p.accept.tried[2], p.accept.seen[2] = second * 10.0, 10.0, 10.0
        return p

    def steps_to_leave_k1(p: AutoPolicy, limit: int = 200) -> int | None:
        for i in range(limit):
            assert p.shadow_len() == 0
            p.update(1, int(i % 5 != 4), 0.09, 1.11)   # 80% accepted, every pass at its calibrated price
            if p.next_draft_len() != 1:
                return i + 1
        return None

    p = at_k1(0.7)
    speeds = dict(p.model.speeds(p.accept.estimates(), 3, False))
    gain = speeds[2] / speeds[1] - 1.0
    assert 0.0 < gain < p.model.change_needs(2)              # k=2 faster, too little to change within the horizon
    left = steps_to_leave_k1(p)
    assert left is not None and left <= 60 and p.next_draft_len() == 2, left
    assert steps_to_leave_k1(at_k1(0.3)) is None              # k=2 slower: one-token drafts stay
    monkeypatch.setattr(AutoPolicy, "_repaid", lambda self, speeds, best, optimistic, drafting:
                        self.model.worth_changing(speeds, self._k, best, optimistic))
    alone = steps_to_leave_k1(at_k1(0.7))                     # the horizon alone: only once position 2's estimate
    assert alone is None or alone >= 2 * left, (left, alone)  # drifted up to position 1's (never judged at k=1)


def test_the_h200_runs_costs_on_the_files_own_answers_hold_their_floor():
    """The synthetic MTP file's greedy answers on the costs `auto` measured on the H200 at 7beabe5, where the real run
    kept one-token drafts from its first request on (0.957 of fixed k=2 cold, 0.970 warm): the simulator reproduces
    that lock on some of its draws of the load's errors. What it reaches there now is the floor a policy change must
    keep (deterministic: the seeds fix every draw). A change priced by its first and second cold pass apart (5 and
    13 ms there, not 2 x one median of both) took the mean from 0.970 to 0.976 cold and 0.971 to 0.989 warm; the
    lowest draw went from 0.960 to 0.948 cold and 0.967 to 0.964 warm."""
    from support.policy_sim import LOAD_ERRORS, MTP_SYNTH_H200, walk_cold_and_warm

    cold, warm = walk_cold_and_warm(12, LOAD_ERRORS, MTP_SYNTH_H200)
    assert np.mean(cold) >= 0.975 and min(cold) >= 0.945, cold
    assert np.mean(warm) >= 0.985 and min(warm) >= 0.96, warm


def test_the_pair_s_own_answers_give_the_fixed_rows_the_run_measured_and_auto_holds_its_floor():
    """The suite's synthetic 32B pair on the H100 at f19e918 (policy_sim.PAIR_SYNTH_H100, its fixed rows' costs, on
    the pair's own greedy answers: synth_walk.py --pair). Fixed k draft what the run's fixed rows drafted (918, 1410,
    1839, 2643, 3831 over three rounds) at the speeds it measured relative to k=2 (0.962, 0.971, 0.887, 0.896 there);
    what `auto` reaches with the load's errors drawn at 3% a pass is the floor a policy change must keep. The run made
    it 0.955 cold and 0.952 warm: one round in three kept one-token drafts from the first request's start (its first
    drafts met text the draft gets wrong, rejected at position 1); the simulator's worst draws do the same. Warm, with
    position 2 asked by tail probes until judged 6 times (3 before; the H100 at 64318dd, the same run: 0.958 -> 0.998
    of k=2): 0.958 -> 0.974 on average over these draws, 0.940 -> 0.911 at the worst, a draw where the load priced
    k=2's pass 2.8% high and k=2 never ran long enough to correct it (auto-policy-notes.md)."""
    from support.policy_sim import LOAD_ERRORS, PAIR_SYNTH_H100, PAIR_WALK_FILE, walk_cold_and_warm, walk_session

    session = walk_session(path=PAIR_WALK_FILE)
    assert [n for _, n in session] == [128] * 4
    runs = {k: simulate(FixedPolicy(k), PAIR_SYNTH_H100, 0.0, session=session) for k in (1, 2, 3, 5, 8)}
    assert [3 * runs[k].drafted for k in (1, 2, 3, 5, 8)] == [918, 1410, 1839, 2643, 3831]
    for k, measured in ((1, 0.962), (3, 0.971), (5, 0.887), (8, 0.896)):
        assert runs[k].throughput / runs[2].throughput == pytest.approx(measured, abs=0.015), k
    cold, warm = walk_cold_and_warm(12, LOAD_ERRORS, PAIR_SYNTH_H100, pair=True)
    assert np.mean(cold) >= 0.975 and min(cold) >= 0.94, cold
    assert np.mean(warm) >= 0.97 and min(warm) >= 0.91, warm


def test_a_lone_accepted_probe_after_requests_of_rejections_is_asked_again_before_any_draft():
    """A useless draft on the pair's H100 costs (the suite's useless-pair agrees 4%): plain steps fade what showed it
    useless (idle_decay), and a shadow probe it got right by chance made `auto` draft one token for 22 and 37 steps on
    the H100 at f19e918 (0.969 of plain, greedy cold). Where plain was fastest and position 1 has been judged
    doubt_seen times, an accepted probe is now asked once more before any draft. Not where a request ever ended
    drafting with position 1 at accept_enough: there a good probe after a poor stretch is a new text (the test of
    drafting again after a poor request fails without that exception). 24 seeds: 0.985 -> 0.988 of plain at 4%,
    0.972 -> 0.982 at 10%."""
    from support.policy_sim import LOAD_ERRORS, PAIR_SYNTH_H100

    def vs_plain(acceptance, **tuning):
        out = []
        for seed in range(24):
            plain = simulate(FixedPolicy(0), PAIR_SYNTH_H100, acceptance, requests=4, max_tokens=128, seed=seed)
            run = simulate(AutoPolicy(draft_max=12, **tuning), PAIR_SYNTH_H100, acceptance, requests=4,
                           max_tokens=128, seed=seed, calibration=LOAD_ERRORS)
            out.append(run.throughput / plain.throughput)
        return np.mean(out)

    for acceptance, floor, gain in ((0.04, 0.987, 0.002), (0.1, 0.978, 0.006)):
        asked, believed = vs_plain(acceptance), vs_plain(acceptance, doubt_seen=1e9)
        assert asked >= floor and asked >= believed + gain, (acceptance, asked, believed)
    assert vs_plain(0.5) == vs_plain(0.5, doubt_seen=1e9)   # a draft that pays: never doubted


def test_a_request_that_ended_drafting_a_useless_draft_does_not_vouch_for_the_next_lucky_probe():
    """The H100 run at a407c24 (useless-pair, T=0.8 temperature only, `auto` round 3; its recorded calls fed to a fresh
    policy): a lucky probe in request 2, before position 1 had been judged doubt_seen times, started one-token
    drafts that ran past the request's end (a change back to plain must repay its cold passes, and the model put k=1
    within 5% of plain); at a407c24 that request counted as one that "ended drafting", and in request 4 two
    accepted probes were believed: 24 more steps of k=1 at a few percent acceptance. A request ends drafting in that
    sense only where position 1's estimate stands at accept_enough: request 4's lucky probes are asked again."""
    import json
    from pathlib import Path

    from support.policy_sim import replay_events

    report = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / \
        "h100-auto-suite-useless-pair-temp-at-a407c24.json"
    row = next(r for r in json.loads(report.read_text()) if isinstance(r, dict) and r.get("mode") == "auto")
    events = row["auto_events"][2]
    steps = replay_events(events)   # one record an update, in order
    updates = [i for i, e in enumerate(events) if e[0] == "update"]
    assert len(steps) == len(updates)
    # the steps whose shadow probe the draft got right, on a plain step: what the policy does next
    lucky = [steps[n] for n, i in enumerate(updates)
             if events[i - 1][0] == "shadow" and (events[i - 1][1] or 0.0) >= 0.5 and not steps[n]["chosen"]]
    assert [s["request"] for s in lucky] == [2, 4, 4]   # the run's own sequence
    assert lucky[0]["next"] == 1                        # seen < doubt_seen: believed (by design)
    assert [s["next"] for s in lucky[1:]] == [0, 0], lucky[1:]   # asked again (a shadow probe), not drafted


def test_position_two_asked_while_one_token_is_drafted_takes_the_pair_to_two_after_its_warm_up():
    """The suite's 32B pair, greedy, on the H100 at 64318dd (auto+warm with tail_seen 6, tail_gap 0.05 beside the
    defaults then, 3, 0.1, in one run): the warm-up request drafted one token for 50 steps with position 2 judged on
    2-4 faded judgements and its estimate near position 1's (so no tail probe asked it: it was not 0.1 under), and the
    next two requests kept one token where two are 4% faster (0.958 of k=2). Asked until judged 6 times while 0.05
    under, position 2 showed itself in the warm-up and every timed request drafted two (0.998 of k=2, three rounds).
    Those tunings are the defaults now: the run's recorded calls fed to a fresh default policy choose what the run
    drafted (but where a request's end cut a draft short), and on the pair's own answers in the simulator the warm
    mean rises over the old tuning's."""
    import json
    from pathlib import Path

    from support.policy_sim import LOAD_ERRORS, PAIR_SYNTH_H100, replay_events, walk_cold_and_warm

    from llamaspec.policy import AutoTuning

    report = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / \
        "h100-auto-suite-uniform-pair-greedy-ab-at-64318dd.json"
    rows = {r["mode"]: r for r in json.loads(report.read_text()) if isinstance(r, dict) and "mode" in r}
    for events in rows["auto+warm:tail_seen=6:tail_gap=0.05"]["auto_events"]:   # three rounds
        by_request: dict = {}
        for step in replay_events(events):
            by_request.setdefault(step["request"], []).append(step)
        for request in by_request.values():   # the same choices, but a draft the request's last tokens cut short
            for i, step in enumerate(request):
                cut = step["drafted"] < step["chosen"] and i >= len(request) - 2
                assert step["chosen"] == step["drafted"] or cut, (i, step["chosen"], step["drafted"])
        warm_up, timed = by_request[1], [by_request[r] for r in sorted(by_request) if r > 1]
        assert warm_up[-1]["next"] == 2   # the warm-up ends on two-token drafts
        assert all(s["drafted"] == 2 for s in timed[0][:-2])   # the first timed request drafts two throughout
    old = AutoTuning(tail_seen=3.0, tail_gap=0.1)
    cold0, warm0 = walk_cold_and_warm(12, LOAD_ERRORS, PAIR_SYNTH_H100, pair=True, tuning=old)
    cold, warm = walk_cold_and_warm(12, LOAD_ERRORS, PAIR_SYNTH_H100, pair=True)
    assert np.mean(warm) >= np.mean(warm0) + 0.01 and np.mean(cold) >= np.mean(cold0) - 0.002, \
        (np.mean(cold0), np.mean(warm0), np.mean(cold), np.mean(warm))


def test_the_mtp_heads_recorded_runs_reach_the_best_fixed_k_in_the_first_request_and_keep_it():
    """The suite's 27B MTP file (70% head) on the H100 at 43795e6, three rounds each of greedy, T=0.8 with the
    filters and temperature only (auto 0.976-0.982 of the best fixed k cold, 0.976-0.992 warm): the run's recorded
    calls fed to a fresh default policy choose what the run drafted (but where a request's end cut a draft short),
    the first timed request ends on the best fixed k of the run (two tokens greedy and with the filters, one at
    temperature only) and every request after it drafts only that. A policy change that makes other choices on
    these calls fails here (a change of k asked to repay its cold passes within 64 steps, not 16, does: it keeps the
    first request's three-token drafts)."""
    import json
    from pathlib import Path

    from support.policy_sim import replay_events

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    for regime, best in (("greedy", 2), ("filters", 2), ("temp", 1)):
        report = results / f"h100-auto-suite-uniform-mtp-{regime}-at-43795e6.json"
        rows = {r["mode"]: r for r in json.loads(report.read_text()) if isinstance(r, dict) and "mode" in r}
        for mode, first_timed in (("auto", 1), ("auto+warm", 2)):
            for events in rows[mode]["auto_events"]:   # three rounds
                by_request: dict = {}
                for step in replay_events(events):
                    by_request.setdefault(step["request"], []).append(step)
                for request in by_request.values():
                    for i, step in enumerate(request):
                        cut = step["drafted"] < step["chosen"] and i >= len(request) - 2
                        assert step["chosen"] == step["drafted"] or cut, (regime, mode, i, step)
                assert by_request[first_timed][-1]["next"] == best, (regime, mode)
                later = [s for r in sorted(by_request) if r > first_timed for s in by_request[r][:-2]]
                assert later and all(s["drafted"] == best for s in later), \
                    (regime, mode, [s["drafted"] for s in later])


def test_the_pairs_recorded_run_takes_no_long_jump_on_what_its_warm_up_showed_deep_in_the_draft():
    """The H100 pair with the filters at 43795e6, warm (two rounds): its warm-up request agreed deep in the draft, and
    in the fourth timed request the policy of then jumped from two tokens to 9 on those positions' remembered estimates
    (that request 0.877 of fixed k=2). The run's recorded calls fed to a fresh default policy: in the timed requests no
    step drafting k chooses more than k + 2 (Acceptance.near: a much longer draft is taken on the positions next to
    the current one); the warm-up request, whose own drafts judged its deep positions, still climbs at once."""
    import json
    from pathlib import Path

    from support.policy_sim import replay_events

    report = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / \
        "h100-auto-suite-uniform-pair-filters-at-43795e6.json"
    rows = {r["mode"]: r for r in json.loads(report.read_text()) if isinstance(r, dict) and "mode" in r}
    for events in rows["auto+warm"]["auto_events"]:   # two rounds
        steps = replay_events(events)
        jumps = [(s["request"], s["drafted"], s["next"]) for s in steps if s["drafted"] and s["next"] > s["drafted"] + 2]
        assert jumps and all(request == 1 for request, _, _ in jumps), jumps


def test_the_pairs_cold_loss_at_2b2eeb2_followed_the_loads_price_of_a_three_token_pass():
    """The H100 pair with the filters at 2b2eeb2, run 1: `auto` cold made 0.929 of fixed k=2 (runs 2 and 3: 0.966,
    1.005). Its load priced a 3-token pass 6% above what the same process's warm 3-token passes took later, every other
    size within 2.5% (the other two loads: 1.285 and 1.289 plain passes, this one 1.379). Fed the run's recorded calls,
    the policy of this tree drafts what the run drafted; with the 3-token pass priced as the other loads priced it, it
    departs at the first request's fourth step (two tokens where the run drafted three, then held one: four requests
    of one-token drafts where two were 4% faster). What calibration.py's three sweeps are for."""
    import json
    from pathlib import Path

    from support.policy_sim import load_against_run, replay_events

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    rows = {r["mode"]: r for r in json.loads((results / "h100-auto-suite-uniform-pair-filters-at-2b2eeb2.json")
                                             .read_text()) if isinstance(r, dict) and "mode" in r}
    for events in rows["auto"]["auto_events"]:   # two cold rounds, one load
        load = [e for e in events if e[0] == "attach"][0][2]["verify"]
        assert load["3"] / load["1"] == pytest.approx(1.379, abs=0.001)
        steps = replay_events(events, until_departure=True)
        assert all(s["chosen"] == s["drafted"] or s["drafted"] < s["chosen"] for s in steps)   # the run's own choices
        assert [s["drafted"] for s in steps[:6]] == [0, 0, 11, 3, 3, 1]
        other = replay_events(events, {3: 1.289 * load["1"]}, until_departure=True)
        assert len(other) == 4 and (other[-1]["request"], other[-1]["drafted"], other[-1]["chosen"]) == (1, 3, 2)
    priced = {}   # size -> (the load's price, the run's warm median) where a round ran it warm
    for events in rows["auto"]["auto_events"] + rows["auto+warm"]["auto_events"]:
        priced.update({n: p for n, p in load_against_run(events).items() if p[1] is not None})
    assert sorted(priced) == [2, 3, 4, 5, 13]
    assert priced[3][0] / priced[3][1] == pytest.approx(1.063, abs=0.002)            # the load's 3 over the run's
    assert all(abs(a / b - 1) < 0.025 for n, (a, b) in priced.items() if n != 3), priced


def test_a_warm_up_agreeing_deep_in_the_draft_costs_the_pair_little_on_the_timed_requests():
    """The H100 pair with the filters at 43795e6 lost 3.7% warm (a warm-up agreeing deep in the draft sent `auto` to 9
    and then 4 tokens three requests later, auto-policy-notes.md's last section). The simulator's case of it, the
    pair's H100 costs and the run's rates by position: the floor it holds today (0.978 warm over 24 seeds, worst 0.943,
    since estimates past position k + 2 are held to the ones next to the draft, Acceptance.near; 0.973 and 0.920
    before; the control with the warm-up at the timed rates 0.990), for the next change to raise, not lower."""
    from support.policy_sim import PAIR_FILTERS_TIMED, deep_warm_up

    cold, warm = deep_warm_up()
    _, control = deep_warm_up(warm_up=PAIR_FILTERS_TIMED)
    assert np.mean(warm) >= 0.975 and min(warm) >= 0.93, (np.mean(warm), min(warm))
    assert np.mean(control) >= 0.98 and np.mean(cold) >= 0.95, (np.mean(control), np.mean(cold))
