"""Draft-length policies, with plain integers and made-up timings."""
import numpy as np
import pytest

from llamaspec.errors import InvalidParameterError
from llamaspec.policy import AutoPolicy, ConfidencePolicy, FixedPolicy, ThresholdPolicy, make_policy


def test_fixed_policy_never_changes():
    p = FixedPolicy(5)
    for accepted in (0, 5, 2):
        p.update(5, accepted, 0.01, 0.02)
        assert p.next_draft_len() == 5


def test_confidence_policy_carries_p_min():
    p = ConfidencePolicy(k_max=6, p_min=0.8)
    assert (p.next_draft_len(), p.p_min) == (6, 0.8)


def test_threshold_lowers_k_below_40_percent_and_raises_above_75():
    p = ThresholdPolicy(k=4, k_min=2, k_max=6, window=2)
    p.update(4, 1, 0, 0)
    assert p.next_draft_len() == 4  # window not full yet
    p.update(4, 1, 0, 0)            # 25% < 40%
    assert p.next_draft_len() == 3
    for _ in range(10):
        p.update(3, 0, 0, 0)
    assert p.next_draft_len() == 2  # not below k_min
    for _ in range(20):
        p.update(p.next_draft_len(), p.next_draft_len(), 0, 0)
    assert p.next_draft_len() == 6  # not above k_max


def test_threshold_keeps_k_between_the_bounds_of_acceptance():
    p = ThresholdPolicy(k=4, window=2)
    for _ in range(10):
        p.update(4, 2, 0, 0)  # 50%: between 40% and 75%
    assert p.next_draft_len() == 4


def run_auto(acceptance: float, t_draft: float, verify, steps: int = 300) -> AutoPolicy:
    """Feed the policy a synthetic machine: per-position acceptance, draft cost per token, verify cost curve."""
    import random

    rng = random.Random(0)
    p = AutoPolicy(k_max=10, p_min=0.0)
    for _ in range(steps):
        k = p.next_draft_len()
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        p.update(k, accepted, k * t_draft, verify(k + 1))
    return p


def test_auto_turns_speculation_off_when_it_cannot_pay():
    costs = dict(t_draft=0.3, verify=lambda n: 1.0 + 0.3 * (n - 1))
    p = run_auto(acceptance=0.05, **costs)
    assert _lengths_after(p, 200, 0, **costs).count(0) >= 190


def test_auto_drafts_long_when_the_draft_is_cheap_and_right():
    p = run_auto(acceptance=0.95, t_draft=0.02, verify=lambda n: 1.0 + 0.02 * (n - 1))
    assert p.next_draft_len() >= 6


def test_auto_picks_a_moderate_length_for_a_moderate_draft():
    p = run_auto(acceptance=0.7, t_draft=0.05, verify=lambda n: 1.0 + 0.05 * (n - 1))
    # the analytic optimum of (1 - a^(k+1)) / ((1 - a)(k c + v(k))) is k = 4..6 here
    assert 2 <= p.next_draft_len() <= 7


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
    with pytest.raises(InvalidParameterError, match="p_min"):
        make_policy("confidence", p_min=1.5)
    with pytest.raises(InvalidParameterError, match="k"):
        FixedPolicy(-1)


# Verify cost v(n) / v(1) of a 32B-shaped Q4_0 target on an H200 (benchmarks/results/h200-cost-curve.json)
# and its 2-layer draft's cost per token relative to one target token.
H200_V = [1.0, 1.07, 1.23, 1.42, 1.58, 1.77, 1.89, 2.11, 2.26, 2.31, 2.31, 2.30, 2.33, 2.35, 2.34, 2.33, 2.55]
H200_C = 0.046


def _gpu_speed(k: int, acceptance: float) -> float:
    tokens = sum(acceptance ** j for j in range(k + 1))
    return tokens / (k * H200_C + H200_V[k])


@pytest.mark.parametrize("acceptance", [1.0, 0.9, 0.7])
def test_auto_reaches_the_best_fixed_length_on_a_gpu_cost_curve(acceptance):
    import random

    rng = random.Random(1)
    p = AutoPolicy(k_max=16, p_min=0.0)
    chosen = []
    for step in range(400):
        k = p.next_draft_len()
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        p.update(k, accepted, k * H200_C, H200_V[k])
        chosen.append(k)
    best = max(_gpu_speed(k, acceptance) for k in range(1, 17))
    achieved = sum(_gpu_speed(k, acceptance) for k in chosen[-200:]) / 200
    assert achieved >= 0.95 * best, (achieved / best, chosen[-20:])
