"""Synthetic acceptance (benchmarks only): accepted lengths follow the rates, passes stay real, and no request can
reach it."""
import inspect

import numpy as np
import pytest

from support.chisq import assert_follows
from support.fakes import fake_pair
from llamaspec.bench.synthetic import LABEL, SyntheticAcceptance, conditional, mean_length, resolve_rates
from llamaspec.engine import Pair
from llamaspec.errors import InvalidParameterError
from llamaspec.policy import FixedPolicy

PROMPT = [5, 9, 11, 3]


def length_probs(rates):
    """P(exactly n accepted) for n = 0..k from the unconditional rates P(>= n + 1)."""
    at_least = [1.0] + list(rates) + [0.0]
    return np.array([at_least[n] - at_least[n + 1] for n in range(len(rates) + 1)])


@pytest.mark.parametrize("disagree", [0.0, 0.9])   # the real acceptance (all, almost none) must not show through
def test_accepted_lengths_follow_the_rates(disagree):
    rates = [0.8, 0.5, 0.3, 0.1]
    pair = fake_pair(disagree, FixedPolicy(4))
    with SyntheticAcceptance(pair, rates, seed=1) as synth:
        for i in range(6):
            pair.reset()
            pair.generate(PROMPT + [i + 2], max_tokens=400)
    steps = [n for n in synth.lengths]
    full = np.bincount(steps, minlength=5)
    assert full.sum() > 500
    assert_follows(full, length_probs(rates))
    assert abs(1 + np.mean(steps) - mean_length(rates)) < 0.15


def test_a_mean_length_resolves_as_llama_cpp_does():
    for k, length in ((3, 2.0), (5, 3.0), (7, 4.0)):
        rates = resolve_rates(k, length=length)
        assert abs(mean_length(rates) - length) < 1e-6
        p = rates[0]
        assert np.allclose(rates, [p ** (i + 1) for i in range(k)])
        assert np.allclose(conditional(rates), p)   # geometric: every position accepted with the same chance
    assert resolve_rates(3, length=4.0) == [1.0, 1.0, 1.0]
    assert resolve_rates(3, length=1.0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kwargs, match", [
    ({"rates": [0.5, 0.6]}, "non-increasing"), ({"rates": [0.5]}, "contain 2 values"),
    ({"rates": [1.5, 0.2]}, r"within \[0, 1\]"), ({"length": 3.5}, r"within \[1, 3\]"), ({}, "one of the two")])
def test_bad_rates_are_refused_with_llama_cpp_checks(kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        resolve_rates(2, **kwargs)


def test_every_pass_and_rollback_is_real():
    """The target verifies every drafted token and keeps exactly the history the synthetic verdicts made."""
    pair = fake_pair(0.5, FixedPolicy(3))
    with SyntheticAcceptance(pair, [0.9, 0.9, 0.9], seed=3):
        c = pair.generate(PROMPT, max_tokens=60)
    s = c.stats
    assert len(pair.target_ctx.decoded) == len(PROMPT) - 1 + s.target_passes + s.drafted
    assert pair.target_ctx.tokens == PROMPT + c.tokens[:-1]
    assert s.accepted > 0.6 * s.drafted   # far above the draft's real agreement at disagree=0.5 over 3 positions


def test_the_pair_is_normal_again_after_the_block():
    pair = fake_pair(0.9, FixedPolicy(3))
    with SyntheticAcceptance(pair, [1.0, 1.0, 1.0]):
        forced = pair.generate(PROMPT, max_tokens=40).stats.acceptance_rate
    pair.reset()
    real = pair.generate(PROMPT, max_tokens=40).stats.acceptance_rate
    assert forced == 1.0 and real < 0.5
    assert "_verifier" not in vars(pair)


def test_sampling_mode_also_follows_the_rates():
    pair = fake_pair(0.9, FixedPolicy(2))
    with SyntheticAcceptance(pair, [0.7, 0.7], seed=2) as synth:
        pair.generate(PROMPT, max_tokens=300, temperature=0.8, seed=5)
    counts = np.bincount(synth.lengths, minlength=3)
    assert_follows(counts, length_probs([0.7, 0.7]))


def test_it_is_labelled():
    synth = SyntheticAcceptance(fake_pair(0.0, FixedPolicy(2)), [0.9, 0.5])
    assert synth.label.startswith(LABEL) and "mean length 2.40" in synth.label


# -- unreachable from a request -----------------------------------------------------------------------------------
def _names(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_no_request_parameter_reaches_it():
    from llamaspec import load_pair
    from llamaspec.config import LoadConfig
    import dataclasses

    public = [Pair.stream, Pair.generate, Pair.generate_tokens, Pair.chat, Pair.chat_stream, Pair.__init__,
              load_pair]
    for fn in public:
        assert not [n for n in _names(fn) if "synth" in n or "rate" in n], fn.__qualname__
    fields = {f.name for f in dataclasses.fields(LoadConfig)}
    for f in dataclasses.fields(LoadConfig):
        if dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else None):
            fields |= {g.name for g in dataclasses.fields(f.type)}
    assert not [n for n in fields if "synth" in n]


@pytest.mark.parametrize("field", ["synthetic_rates", "spec_synth_rates", "synth_len", "spec_synth_len"])
def test_no_server_field_or_cli_flag_reaches_it(field):
    from llamaspec.cli import main
    from llamaspec.server import validation
    from llamaspec.server.apierror import APIError

    for fields in (validation.CHAT_FIELDS, validation.COMPLETION_FIELDS, validation.POLICY_FIELDS):
        assert not [f for f in fields if "synth" in f or "rate" in f]
    with pytest.raises(APIError, match=field):   # refused as unknown (a 400), not ignored
        validation.parse_completion({"prompt": "hi", field: [1.0]})
    with pytest.raises(APIError, match=field):
        validation.parse_chat({"messages": [{"role": "user", "content": "hi"}], field: 3.0})
    for name in ("chat", "run", "serve", "bench"):
        cmd = main.commands[name]
        flags = [o for p in cmd.params for o in p.opts]
        assert not [f for f in flags if "synth" in f], name


def test_nothing_outside_the_benchmarks_imports_it():
    import pathlib

    import llamaspec

    root = pathlib.Path(llamaspec.__file__).parent
    users = [p.relative_to(root) for p in root.rglob("*.py")
             if p.name != "synthetic.py" and "synthetic" in p.read_text()]
    assert users == [], users
