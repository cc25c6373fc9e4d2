"""Shaped rows (shaping.py) on the fake backend: a grammar, penalties and log-probabilities keep speculation exact.
Greedy: the same tokens and log-probabilities as plain decoding; sampling: the shaped distribution, including after
draft tokens the grammar refuses."""
from __future__ import annotations

import numpy as np
import pytest

from support.chisq import assert_follows
from support.fakes import FakeContext, FakeModel, fake_pair, plain_pair
from llamaspec.drafters import make_drafter
from llamaspec.engine import Pair
from llamaspec.errors import InvalidParameterError
from llamaspec.policy import FixedPolicy
from llamaspec.sampling import SamplerConfig, filtered_probs
from llamaspec.shaping import Penalties, Shaping, token_logprob

PROMPT = "shaped rows"


class ModGrammar:
    """A stateful grammar: after n accepted tokens, token t is allowed when t % period != n % period (and t >= 2);
    `only`, when given, further restricts it to the tokens in only[n % 2]."""

    def __init__(self, period: int = 3, only=None, n: int = 0, log=None):
        self.period, self.only, self.n = period, only, n
        self.log = log if log is not None else []

    def clone(self):
        return ModGrammar(self.period, self.only, self.n, self.log)

    def allows(self, token: int) -> bool:
        ok = token >= 2 and token % self.period != self.n % self.period
        return ok and (self.only is None or token in self.only[self.n % 2])

    def accept(self, token: int) -> None:
        assert self.allows(token), f"accept of a refused token {token}"
        self.log.append(token)
        self.n += 1

    def mask(self, row: np.ndarray) -> None:
        ids = np.arange(len(row))
        allowed = np.array([self.allows(int(t)) for t in ids])
        row[~allowed] = -np.inf


def shaped(grammar=None, penalties=None, top_logprobs=None) -> Shaping:
    return Shaping(grammar=grammar, penalties=penalties, top_logprobs=top_logprobs)


def shaped_row(model, context: list[int], n_generated: int, grammar: ModGrammar | None, penalties: Penalties | None):
    """What plain decoding's row is: penalties over the context, then the grammar's mask."""
    row = model.logits(context).astype(np.float32)
    if penalties is not None:
        penalties.apply(row, context)
    if grammar is not None:
        ModGrammar(grammar.period, grammar.only, n_generated).mask(row)
    return row


@pytest.mark.parametrize("disagree", [0.0, 0.4, 1.0])
def test_greedy_shaped_speculation_equals_shaped_plain_decoding(disagree):
    penalties = Penalties(repeat=1.3, frequency=0.2, presence=0.4, last_n=16)
    plain = plain_pair().generate(PROMPT, max_tokens=60, shaping=(ref := shaped(ModGrammar(), penalties, 2)))
    spec_pair = fake_pair(disagree, FixedPolicy(4))
    spec = spec_pair.generate(PROMPT, max_tokens=60, shaping=(got := shaped(ModGrammar(), penalties, 2)))
    assert spec.tokens == plain.tokens
    assert spec_pair.last_stats.drafted > 0
    if disagree == 0.0:
        assert spec_pair.last_stats.accepted > 0   # drafts the grammar allows are accepted too
    # every token is the grammar's, and the log-probabilities match plain decoding's, token for token
    assert all(ModGrammar(n=i).allows(t) for i, t in enumerate(spec.tokens))
    assert [(x.token, x.logprob, x.top) for x in got.logprobs] == [(x.token, x.logprob, x.top)
                                                                   for x in ref.logprobs]


def test_greedy_shaped_rows_are_the_argmax_of_the_penalised_masked_row():
    penalties = Penalties(repeat=1.5, presence=0.3)
    pair = plain_pair()
    out = pair.generate(PROMPT, max_tokens=20, shaping=shaped(ModGrammar(), penalties))
    context = pair.tokenize(PROMPT)
    for i, token in enumerate(out.tokens):
        assert token == int(shaped_row(pair.target, context, i, ModGrammar(), penalties).argmax())
        context.append(token)


def test_logprobs_are_the_targets_log_softmax_whether_drafted_or_not():
    pair = fake_pair(0.3, FixedPolicy(3))
    shaping = shaped(top_logprobs=3)
    out = pair.generate(PROMPT, max_tokens=30, shaping=shaping)
    assert pair.last_stats.accepted > 0
    context = pair.tokenize(PROMPT)
    assert [x.token for x in shaping.logprobs[:len(out.tokens)]] == out.tokens
    for x in shaping.logprobs[:len(out.tokens)]:
        row = pair.target.logits(context).astype(np.float64)
        log_p = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert x.logprob == pytest.approx(log_p[x.token], abs=1e-5)
        best = np.argsort(-log_p)[:3]
        assert [t for t, _ in x.top] == best.tolist()
        assert [lp for _, lp in x.top] == pytest.approx(log_p[best], abs=1e-5)
        context.append(x.token)


def test_logprobs_of_a_greedy_reply_are_unchanged_by_speculation_without_a_grammar():
    a, b = shaped(top_logprobs=0), shaped(top_logprobs=0)
    plain = plain_pair().generate(PROMPT, max_tokens=25, shaping=a)
    spec = fake_pair(0.5, FixedPolicy(3)).generate(PROMPT, max_tokens=25, shaping=b)
    assert spec.tokens == plain.tokens
    assert [(x.token, x.logprob) for x in a.logprobs] == [(x.token, x.logprob) for x in b.logprobs]
    assert all(x.top == [] for x in b.logprobs)


def test_sampled_shaped_speculation_keeps_the_shaped_distribution():
    """The first two tokens follow plain decoding's penalised, masked, filtered distribution jointly, with a sharp
    draft that puts most of its mass on one allowed token and the rest mostly outside the grammar: a refused draft
    token must still be rejected by the rule (its residual), not dropped before it."""
    cfg = SamplerConfig(temperature=1.2, top_p=0.95)
    penalties = Penalties(repeat=1.4, presence=0.3)
    target, draft = FakeModel(sharpness=1.5), FakeModel(sharpness=5.0)
    pair = Pair(target, FakeContext(target), make_drafter("model", target, FakeContext(draft)), FixedPolicy(2))
    context = pair.tokenize(PROMPT)
    only = ({target.true_next(context), 2, 3, 4, 5}, {7, 8, 9, 10, 11})
    n = 2500
    counts = np.zeros((pair.n_vocab, pair.n_vocab))
    drafted = accepted = 0
    for seed in range(n):
        c = pair.generate(PROMPT, max_tokens=2, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed,
                          shaping=shaped(ModGrammar(only=only), penalties))
        counts[c.tokens[0], c.tokens[1]] += 1
        drafted += pair.last_stats.drafted
        accepted += pair.last_stats.accepted
    assert drafted == n and 0 < accepted < drafted * 0.8   # one draft token per reply, often refused
    grammar = ModGrammar(only=only)
    p1 = filtered_probs(shaped_row(target, context, 0, grammar, penalties), cfg).astype(np.float64)
    joint = np.zeros_like(counts)
    for t1 in np.flatnonzero(p1):
        row = shaped_row(target, context + [int(t1)], 1, grammar, penalties)
        joint[t1] = p1[t1] * filtered_probs(row, cfg)
    assert_follows(counts.ravel(), joint.ravel())


def test_a_grammar_that_allows_nothing_is_a_clear_error():
    class Nothing(ModGrammar):
        def allows(self, token):
            return False

        def clone(self):
            return Nothing()

    with pytest.raises(InvalidParameterError, match="grammar allows no token"):
        fake_pair(0.0, FixedPolicy(2)).generate(PROMPT, max_tokens=3, shaping=shaped(Nothing()))


def test_plain_requests_build_no_shaper():
    pair = fake_pair(0.0, FixedPolicy(2))
    shaping = shaped(penalties=Penalties())   # default penalties change nothing: the fast path stays
    assert not shaping.active
    assert pair.generate(PROMPT, max_tokens=10, shaping=shaping).tokens == \
        pair.generate(PROMPT, max_tokens=10).tokens


@pytest.mark.parametrize("kwargs,param", [({"repeat": 0}, "repeat_penalty"), ({"frequency": 3}, "frequency_penalty"),
                                          ({"presence": float("nan")}, "presence_penalty"),
                                          ({"last_n": -2}, "repeat_last_n")])
def test_bad_penalties_name_the_field(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        Penalties(**kwargs)
    assert e.value.param == param


def test_token_logprob_matches_a_plain_log_softmax():
    rng = np.random.default_rng(0)
    row = rng.standard_normal(1000).astype(np.float32) * 4
    x = token_logprob(row, 17, 5)
    ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    assert x.logprob == pytest.approx(ref[17], abs=1e-5)
    assert [t for t, _ in x.top] == np.argsort(-ref)[:5].tolist()
