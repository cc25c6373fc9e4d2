"""The speculative loop over a fake backend: bookkeeping, losslessness, stops, rollback."""
import numpy as np
import pytest

from support.chisq import assert_follows
from support.fakes import FakeContext, FakeModel, fake_device_pair, fake_pair, plain_pair
from support.probes import TailEvery
from llamaspec.drafters import Draft, make_drafter
from llamaspec.engine import Pair, StopMatcher, shadow_acceptance
from llamaspec.errors import ContextOverflowError, InvalidParameterError
from llamaspec.policy import DraftPolicy, FixedPolicy, ThresholdPolicy, make_policy
from llamaspec import sampling
from llamaspec.sampling import Dist, SamplerConfig, filtered_probs

PROMPT = [5, 9, 11, 3]


def test_greedy_speculative_equals_plain_decoding():
    expected = plain_pair().generate(PROMPT, max_tokens=60).tokens
    for disagree in (0.0, 0.3, 0.9):
        for k in (1, 3, 7):
            got = fake_pair(disagree, FixedPolicy(k)).generate(PROMPT, max_tokens=60).tokens
            assert got == expected, (disagree, k)


def test_identical_draft_is_always_accepted():
    pair = fake_pair(0.0, FixedPolicy(4))
    c = pair.generate(PROMPT, max_tokens=50)
    assert c.stats.acceptance_rate == 1.0
    assert c.stats.target_passes == 10  # 5 tokens per pass


def test_target_cache_holds_exactly_the_history_after_each_request():
    pair = fake_pair(0.5, FixedPolicy(4))
    c = pair.generate(PROMPT, max_tokens=30)
    # committed = prompt + every emitted token but the newest (still pending)
    assert pair.target_ctx.tokens == PROMPT + c.tokens[:-1]


def test_no_token_is_decoded_twice_by_the_target():
    pair = fake_pair(0.5, FixedPolicy(4))
    c = pair.generate(PROMPT, max_tokens=40)
    # each verify decodes [last] + drafts; rejected drafts are the only re-decoded positions
    decoded = len(pair.target_ctx.decoded)
    assert decoded == len(PROMPT) - 1 + c.stats.target_passes + c.stats.drafted


def test_draft_cache_never_redecodes_accepted_tokens():
    pair = fake_pair(0.0, FixedPolicy(3))
    c = pair.generate(PROMPT, max_tokens=40)
    # with everything accepted, the draft decodes the prompt once and each emitted token once (plus its own drafts)
    assert len(pair.draft_ctx.decoded) <= len(PROMPT) + c.stats.tokens_generated + c.stats.target_passes


def test_second_request_reuses_the_cached_prefix():
    pair = fake_pair(0.2, FixedPolicy(3))
    first = pair.generate(PROMPT, max_tokens=20)
    follow_up = PROMPT + first.tokens + [7, 8]
    second = pair.generate(follow_up, max_tokens=10)
    assert second.stats.prompt_tokens_cached == len(PROMPT) + len(first.tokens) - 1
    assert second.tokens == plain_pair().generate(follow_up, max_tokens=10).tokens


def test_max_tokens_respected_inside_an_accepted_run():
    for n in (1, 2, 7, 13):
        c = fake_pair(0.0, FixedPolicy(5)).generate(PROMPT, max_tokens=n)
        assert len(c.tokens) == n and c.finish_reason == "length"


def test_context_full_gives_a_clear_finish_reason():
    pair = fake_pair(0.0, FixedPolicy(4), n_ctx=30)
    c = pair.generate(PROMPT, max_tokens=100)
    assert c.finish_reason == "context"
    assert len(PROMPT) + len(c.tokens) - 1 == 30


def test_prompt_longer_than_context_is_refused():
    with pytest.raises(ContextOverflowError, match="prompt is 40 tokens"):
        fake_pair(n_ctx=32).generate(list(range(2, 42)), max_tokens=5)


def test_bad_generation_values_are_refused():
    pair = fake_pair()
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        pair.generate(PROMPT, max_tokens=0)
    with pytest.raises(InvalidParameterError, match="temperature"):
        pair.generate(PROMPT, temperature=-1)
    with pytest.raises(InvalidParameterError, match="empty"):
        pair.generate([], max_tokens=3)


def test_end_of_generation_token_stops_and_is_not_emitted():
    target = FakeModel()
    expected = plain_pair().generate(PROMPT, max_tokens=30).tokens
    target.eog = expected[10]  # pretend the 11th token ends the generation
    pair = Pair(target, FakeContext(target), make_drafter("model", target, FakeContext(FakeModel())), FixedPolicy(4))
    c = pair.generate(PROMPT, max_tokens=30)
    assert c.finish_reason == "stop" and c.tokens == expected[:10]


def test_stop_string_across_token_boundaries_is_not_emitted():
    plain = plain_pair().generate(PROMPT, max_tokens=20)
    text = plain.text  # pieces look like <12><34>...
    cut = text.index(">", 20) + 1
    stop = text[cut - 2:cut + 3]  # spans a token boundary
    c = fake_pair(0.3, FixedPolicy(3)).generate(PROMPT, max_tokens=20, stop=[stop, "never"])
    assert c.finish_reason == "stop"
    assert c.text == text[:text.index(stop)]


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["END"])
    assert m.push("abcE") == ("abc", False)
    assert m.push("N") == ("", False)
    assert m.push("x") == ("ENx", False)
    assert m.push("yyEND tail") == ("yy", True)


def test_seeded_sampling_is_reproducible():
    a = fake_pair(0.3, FixedPolicy(3), sharpness=1.0).generate(PROMPT, max_tokens=40, temperature=0.9, seed=7)
    b = fake_pair(0.3, FixedPolicy(3), sharpness=1.0).generate(PROMPT, max_tokens=40, temperature=0.9, seed=7)
    c = fake_pair(0.3, FixedPolicy(3), sharpness=1.0).generate(PROMPT, max_tokens=40, temperature=0.9, seed=8)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_closing_the_stream_early_leaves_caches_consistent():
    pair = fake_pair(0.3, FixedPolicy(4))
    gen = pair.stream(PROMPT, max_tokens=50)
    got = [next(gen).token for _ in range(7)]
    gen.close()
    assert pair.last_stats.finish_reason == "cancelled"
    assert pair.target_ctx.tokens == pair.history
    # the next request continues correctly from the cache
    again = pair.generate(PROMPT, max_tokens=12)
    assert again.tokens == plain_pair().generate(PROMPT, max_tokens=12).tokens
    assert got == again.tokens[:7]


def test_interrupt_mid_step_restores_consistency():
    pair = fake_pair(0.3, FixedPolicy(4))
    calls = {"n": 0}
    original = pair.target_ctx.eval

    def flaky_eval(tokens, logits="last"):
        calls["n"] += 1
        if calls["n"] == 4:
            original(tokens, logits)
            raise KeyboardInterrupt  # after llama_decode stored the batch, before the engine committed
        return original(tokens, logits)

    pair.target_ctx.eval = flaky_eval
    with pytest.raises(KeyboardInterrupt):
        pair.generate(PROMPT, max_tokens=40)
    pair.target_ctx.eval = original
    assert pair.target_ctx.tokens[:len(pair.history)] == pair.history
    assert pair.generate(PROMPT, max_tokens=15).tokens == plain_pair().generate(PROMPT, max_tokens=15).tokens


def test_stats_count_what_happened():
    pair = fake_pair(0.4, ThresholdPolicy(draft_len=3, window=2))
    c = pair.generate(PROMPT, max_tokens=60)
    s = c.stats
    assert s.tokens_generated == 60
    assert s.accepted <= s.drafted
    assert sum(s.draft_lengths.values()) == s.target_passes
    assert sum(n * steps for n, steps in s.accepted_lengths.items()) == s.accepted
    assert s.tokens_generated <= s.accepted + s.target_passes
    assert 0 < s.acceptance_rate < 1
    assert s.to_dict()["acceptance_rate"] == s.acceptance_rate


def test_drafts_count_only_up_to_where_the_reply_stopped():
    """A stop string inside an accepted run: the draft tokens verified past it are not in the reply, so they are
    neither drafted nor accepted for it (accepted <= generated)."""
    pair = fake_pair(0.0, FixedPolicy(4))
    full = pair.generate(PROMPT, max_tokens=5)
    assert full.stats.target_passes == 1 and (full.stats.drafted, full.stats.accepted) == (4, 4)
    second = pair.detokenize(full.tokens[1:2])   # the fake's token text "<n>" is unique within the reply
    assert second not in pair.detokenize(full.tokens[:1])

    c = pair.generate(PROMPT, max_tokens=5, stop=[second])
    s = c.stats
    assert c.finish_reason == "stop" and s.tokens_generated == 2
    assert (s.drafted, s.accepted) == (2, 2) and s.accepted <= s.tokens_generated
    assert s.accepted_lengths == {2: 1} and s.draft_lengths == {2: 1}
    assert s.to_dict()["acceptance_rate"] == 1.0


def test_drafts_count_only_up_to_an_accepted_end_of_generation_token():
    expected = plain_pair().generate(PROMPT, max_tokens=3).tokens
    pair = fake_pair(0.0, FixedPolicy(4), eog=expected[1])   # the second token ends the reply (not emitted)
    s = pair.generate(PROMPT, max_tokens=5).stats
    assert s.finish_reason == "stop" and s.tokens_generated == 2
    assert (s.drafted, s.accepted) == (2, 2)


def test_prompt_lookup_drafts_repeated_text():
    target = FakeModel()
    pair = Pair(target, FakeContext(target), make_drafter("lookup", target), FixedPolicy(4))
    prompt = PROMPT * 6  # the fake model's continuation of a repeated pattern often repeats too
    c = pair.generate(prompt, max_tokens=40)
    assert c.tokens == plain_pair().generate(prompt, max_tokens=40).tokens
    assert c.stats.drafted > 0


def test_prompt_lookup_keeps_its_buffer_in_step_with_the_history():
    from llamaspec.drafters import PromptLookupDrafter

    d = PromptLookupDrafter(ngram_max=3, ngram_min=2)
    fresh = PromptLookupDrafter(ngram_max=3, ngram_min=2)
    history = [5, 6, 7, 8, 9, 5, 6]
    for step in range(1500):  # grows past the initial buffer
        last = history[-1]
        want = fresh.lookup(np.asarray(history + [last], dtype=np.int64), 4)
        assert d.propose(history, last, 4, 0.0).tokens == want
        history.append((step * 7) % 11 if step % 5 else history[-3])
    # a new generation: a new list, shorter and different, is not mixed up with the old buffer
    other = [1, 2, 3, 1, 2]
    assert d.propose(other, 3, 4, 0.0).tokens == [1, 2, 3]  # [1, 2, 3, 1, 2, 3]: continue the repeat
    assert d.propose(other, 9, 4, 0.0).tokens == []


# -- sampling with the filters on the device (FakeDeviceContext stands in for llama.cpp's sampler chains) -------
def test_device_sampling_serves_draft_and_target_together():
    pair = fake_device_pair(0.3, FixedPolicy(3), sharpness=2.0)
    c = pair.generate(PROMPT, max_tokens=30, temperature=1.0, top_k=8, seed=1)
    assert c.stats.drafted > 0
    assert pair.target_ctx.dist_evals == c.stats.target_passes  # every verification read device rows
    assert pair.draft_ctx.dist_evals == c.stats.drafted  # each draft token is the device's draw (no early stop)


def test_device_sampling_is_all_or_nothing():
    """A draft context that cannot filter on the device: neither does the target (one rule for both)."""
    pair = fake_device_pair(0.3, FixedPolicy(3), draft_can_sample=False, sharpness=2.0)
    c = pair.generate(PROMPT, max_tokens=20, temperature=1.0, top_k=8, seed=1)
    assert c.stats.drafted > 0
    assert pair.target_ctx.dist_evals == 0 and pair.target_ctx.sampler is None


def _first_token_counts(pair, cfg: SamplerConfig, n: int) -> np.ndarray:
    counts = np.zeros(pair.n_vocab)
    for seed in range(n):
        c = pair.generate(PROMPT, max_tokens=2, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                          min_p=cfg.min_p, seed=seed, sampler_order=cfg.order)
        counts[c.tokens[0] if c.tokens else pair.target.eog] += 1   # an end-of-generation token is not kept
    return counts


@pytest.mark.parametrize("order", ["openai", "llama.cpp"])
@pytest.mark.parametrize("device", [True, False])
def test_sampled_speculation_keeps_the_target_distribution(device, order):
    """The first token after PROMPT, drafted by a draft that disagrees often, follows the target's filtered
    distribution, with the filters on the device and with numpy's, in either sampler order."""
    cfg = SamplerConfig(temperature=1.3, top_k=12, top_p=0.97, min_p=0.02, order=order)
    make = fake_device_pair if device else fake_pair
    pair = make(0.6, FixedPolicy(2), sharpness=1.5)
    counts = _first_token_counts(pair, cfg, 3000)
    assert pair.last_stats.drafted > 0
    assert (getattr(pair.target_ctx, "dist_evals", 0) >= 3000) == device  # every verification used its path
    p = filtered_probs(pair.target.logits(PROMPT), cfg).astype(np.float64)
    assert_follows(counts, p)


@pytest.mark.parametrize("device", [True, False], ids=["device", "numpy"])
@pytest.mark.parametrize("cfg", [SamplerConfig(1.3), SamplerConfig(1.1, top_p=0.97, order="llama.cpp")],
                         ids=["temperature", "top-p"])
def test_a_draft_cut_to_its_best_candidates_keeps_the_target_distribution(cfg, device, monkeypatch):
    """A drafter draws from its DRAFT_TOP_K best candidates (4 of 64 here), on the device or in numpy, while the
    target filters as asked: acceptance changes, the output's distribution does not."""
    from llamaspec.drafters import model

    monkeypatch.setattr(sampling, "DRAFT_TOP_K", 4)
    cut, real = [], model.filter_logits
    monkeypatch.setattr(model, "filter_logits", lambda row, c, out=None: (cut.append(c.top_k), real(row, c, out))[1])
    pair = (fake_device_pair if device else fake_pair)(0.6, FixedPolicy(2), sharpness=1.5)
    counts = _first_token_counts(pair, cfg, 3000)
    if device:
        assert pair.draft_ctx.sampler.top_k == 4 and pair.target_ctx.sampler.top_k == 0
        assert pair.target_ctx.dist_evals >= 3000 and not cut
    else:   # every drafted row was filtered in numpy, cut to its 4 best candidates
        assert cut and set(cut) == {4}
    assert pair.last_stats.drafted > 0
    assert_follows(counts, filtered_probs(pair.target.logits(PROMPT), cfg).astype(np.float64))


def test_draft_filters_cut_only_what_keeps_more_than_the_draft_needs():
    cut = sampling.draft_filters
    assert cut(SamplerConfig(0.8)) == SamplerConfig(0.8, top_k=sampling.DRAFT_TOP_K)
    assert cut(SamplerConfig(0.8, top_k=40, top_p=0.95, min_p=0.05)) == SamplerConfig(0.8, 40, 0.95, 0.05)
    assert cut(SamplerConfig(0.8, top_k=500, min_p=0.05, seed=3, order="llama.cpp")) == \
        SamplerConfig(0.8, sampling.DRAFT_TOP_K, 1.0, 0.05, 3, "llama.cpp")


class ShadowEvery(DraftPolicy):
    """Plain decoding with a shadow probe every `every` steps; records what the engine reports of each."""

    name = "shadow-test"

    def __init__(self, every: int):
        self.every, self.step, self.draft_max = every, 0, 1
        self.results: list[tuple[float, float]] = []

    def next_draft_len(self) -> int:
        return 0

    def shadow_len(self) -> int:
        return 1 if self.step % self.every == 0 else 0

    def shadow(self, accepted, seconds) -> None:
        self.results.append((accepted, seconds))

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        self.step += 1


@pytest.mark.parametrize("disagree", [0.0, 0.5, 1.0])
def test_shadow_probes_leave_output_and_target_batches_as_plain_decoding(disagree):
    expected = plain_pair().generate(PROMPT, max_tokens=40).tokens
    policy = ShadowEvery(3)
    pair = fake_pair(disagree, policy)
    c = pair.generate(PROMPT, max_tokens=40)
    assert c.tokens == expected
    assert pair.target_ctx.evals[0] == len(PROMPT) - 1 and set(pair.target_ctx.evals[1:]) == {1}
    assert c.stats.drafted == 0 and c.stats.shadow_probes == len(policy.results) == 14
    history = PROMPT + c.tokens[:-1]
    assert pair.draft_ctx.tokens == history[:len(pair.draft_ctx.tokens)]   # no probe token left behind
    rate = np.mean([a for a, _ in policy.results])
    assert {0.0: rate == 1.0, 0.5: 0.1 < rate < 0.9, 1.0: rate == 0.0}[disagree], rate


def test_shadow_acceptance_is_the_chance_of_the_rejection_rule():
    probe = Draft([3], [Dist(None, np.array([0.0, 0.0, 0.5, 0.5], np.float32))])
    p = Dist(np.array([3, 2]), np.array([0.2, 0.8], np.float32))
    assert shadow_acceptance(probe, 2, lambda i: p) == pytest.approx(0.2 / 0.5)
    p = Dist(np.array([3]), np.array([1.0], np.float32))
    assert shadow_acceptance(probe, 3, lambda i: p) == 1.0
    assert shadow_acceptance(Draft([5]), 5, None) == 1.0 and shadow_acceptance(Draft([5]), 6, None) == 0.0
    assert shadow_acceptance(Draft([]), 6, None) == 0.0


def test_shadow_probes_run_at_a_temperature_with_one_token_target_passes():
    policy = ShadowEvery(2)
    pair = fake_pair(0.3, policy)
    c = pair.generate(PROMPT, max_tokens=30, temperature=0.8, seed=4)
    assert len(c.tokens) == 30 and set(pair.target_ctx.evals[1:]) == {1}
    assert len(policy.results) == 15 and all(0.0 <= a <= 1.0 for a, _ in policy.results)


def test_warm_up_setting_is_true_false_or_none():
    from llamaspec.config import LoadConfig

    assert LoadConfig(warm_up=False).warm_up is False and LoadConfig().warm_up is None
    with pytest.raises(InvalidParameterError, match="warm_up"):
        LoadConfig.from_kwargs(warm_up="yes")
    for bad in (0, "3", 2.5):
        with pytest.raises(InvalidParameterError, match="draft_max"):
            fake_pair(0.0, FixedPolicy(2)).warm_up(bad)


def test_warm_up_runs_each_draft_length_measures_its_costs_and_forgets_the_text():
    policy = FixedPolicy(5)
    pair = fake_pair(0.0, policy)
    pair.warm_up()
    sizes = [n for n in pair.target_ctx.evals[1:] if n <= 6]   # after the prompt's (the sampled sweep's is longer)
    sweep = [n for n in range(6, 0, -1) for _ in range(4)]     # greedy: 4 steps of each k (2 warm), three times over
    assert sizes[:72] == sweep * 3
    assert sizes[72:78] == [6, 5, 4, 3, 2, 1]                                  # then sampled, once each
    assert pair.policy is policy and pair.target_ctx.tokens == [] and pair.draft_ctx.tokens == []
    assert sorted(pair.costs.verify) == [1, 2, 3, 4, 5, 6] and pair.costs.draft > 0
    assert len(pair.costs.excess) == 36                                    # two cold passes a size, each sweep
    assert sorted(pair.costs.drafts) == [1, 2, 3, 4, 5] and all(v > 0 for v in pair.costs.drafts.values())
    auto = make_policy("auto", draft_max=5)
    pair.set_policy(auto)   # every policy taken from here on starts from them
    assert auto.verify_time(6) == pytest.approx(pair.costs.verify[6])
    assert auto.t_draft == pytest.approx(pair.costs.draft)
    pair.set_policy(policy)
    assert pair.generate(PROMPT, max_tokens=20).tokens == plain_pair().generate(PROMPT, max_tokens=20).tokens


class HeldRecorder(ShadowEvery):
    """Plain decoding that records the tokens held the engine reports before each request's first step."""

    def __init__(self):
        super().__init__(every=10**9)
        self.held_at: list[int] = []

    def held(self, tokens: int) -> None:
        self.held_at.append(tokens)


def test_the_engine_tells_the_policy_how_many_tokens_each_request_follows():
    """`held` (auto prices a pass by the context it reads: policy/costs.py Depth) gets the tokens the target holds
    before a request's first step: the prompt but its last token, whatever of it the cache kept (a batch of sequences:
    tests/batch/test_batch.py)."""
    policy = HeldRecorder()
    pair = fake_pair(0.0, policy)
    first = pair.generate(PROMPT, max_tokens=8)
    pair.generate(PROMPT + first.tokens + [5, 6, 7], max_tokens=4)   # a next turn: most of it kept
    assert policy.held_at == [len(PROMPT) - 1, len(PROMPT) + len(first.tokens) + 2]


@pytest.mark.parametrize("disagree", [0.0, 0.5])
def test_a_tail_probe_is_drafted_and_judged_but_never_verified(disagree):
    """auto's tail probe (policy/auto.py _tail_due): the drafter proposes k + 1, the target verifies k, and the token
    the target emits after all k judges the last; the output is plain decoding's, every target batch k + 1 long."""
    expected = plain_pair().generate(PROMPT, max_tokens=40).tokens
    policy = TailEvery()
    pair = fake_pair(disagree, policy)
    c = pair.generate(PROMPT, max_tokens=40)
    assert c.tokens == expected
    assert set(pair.target_ctx.evals[1:]) <= {1, 2} and c.stats.drafted == sum(d for d, _ in policy.updates)
    assert c.stats.tail_probes == len(policy.results) == sum(1 for d, _ in policy.updates if d == 1)
    reached = [r for r, (d, a) in zip(policy.results, policy.updates) if d == 1 and a == 1]
    assert len(reached) == sum(r is not None for r in policy.results) > 0     # judged exactly where d_1 was kept
    history = PROMPT + c.tokens[:-1]
    assert pair.draft_ctx.tokens == history[:len(pair.draft_ctx.tokens)]       # no probe token left behind
    rate = np.mean(reached)
    assert {0.0: rate == 1.0, 0.5: 0.1 < rate < 0.9}[disagree], rate


@pytest.mark.parametrize("device", [True, False], ids=["device", "numpy"])
def test_sampled_tail_probes_keep_the_target_distribution(device):
    """The tail probe's token is drawn after the draft's, from the same generator, and judged with the rejection
    rule's chance on the target's row after the draft (min(1, p/q)): the first token still follows the target's
    filtered distribution, and the chances are those of a rule, not 0/1 judgements."""
    cfg = SamplerConfig(temperature=1.3, top_k=12, top_p=0.97, min_p=0.02, order="llama.cpp")
    policy = TailEvery()
    pair = (fake_device_pair if device else fake_pair)(0.6, policy, sharpness=1.5)
    counts = _first_token_counts(pair, cfg, 3000)
    assert pair.last_stats.tail_probes > 0
    assert_follows(counts, filtered_probs(pair.target.logits(PROMPT), cfg).astype(np.float64))
    chances = [r for r in policy.results if r is not None]
    assert chances and all(0.0 <= r <= 1.0 for r in chances) and 0.0 < np.mean(chances) < 1.0
    assert any(0.0 < r < 1.0 for r in chances)
