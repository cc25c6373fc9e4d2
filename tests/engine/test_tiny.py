"""The engine on tiny GGUF models written by the tests, loaded by the real llama.cpp."""
import numpy as np
import pytest

from support.probes import TailEvery
from llamaspec import load_pair
from llamaspec.errors import ContextOverflowError, IncompatiblePairError, InvalidParameterError, ModelFileError
from llamaspec.policy import FixedPolicy, make_policy

PROMPTS = ["def quicksort(arr):", "The history of the printing press", "Hello, my name is"]


@pytest.fixture(scope="module")
def same_pair(tiny_models):
    with load_pair(tiny_models["target"], tiny_models["draft"], n_ctx=512, policy="fixed", draft_max=4,
                   no_repack=True) as pair:
        yield pair


@pytest.fixture(scope="module")
def noisy_pair(tiny_models):
    with load_pair(tiny_models["target"], tiny_models["noisy"], n_ctx=512, policy="fixed", draft_max=3,
                   no_repack=True) as pair:
        yield pair


def plain(pair, prompt, **kw):
    saved = pair.policy
    pair.set_policy(FixedPolicy(0))
    try:
        return pair.generate(prompt, **kw)
    finally:
        pair.set_policy(saved)


def test_identical_draft_accepts_everything(same_pair):
    c = same_pair.generate(PROMPTS[0], max_tokens=48)
    assert c.stats.drafted > 0 and c.stats.acceptance_rate == 1.0
    assert c.stats.mean_accepted_length > 4.0


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.slow
def test_greedy_speculative_equals_plain_decoding(noisy_pair, prompt):
    expected = plain(noisy_pair, prompt, max_tokens=64)
    for policy in (FixedPolicy(1), FixedPolicy(5), make_policy("threshold"), make_policy("auto")):
        noisy_pair.set_policy(policy)
        got = noisy_pair.generate(prompt, max_tokens=64)
        assert got.tokens == expected.tokens, policy.name
    noisy_pair.set_policy(FixedPolicy(3))


@pytest.mark.slow
def test_noisy_draft_is_accepted_sometimes(noisy_pair):
    c = noisy_pair.generate(PROMPTS[1], max_tokens=64)
    assert 0.05 < c.stats.acceptance_rate < 0.98


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(noisy_pair):
    a = noisy_pair.generate(PROMPTS[2], max_tokens=32, temperature=1.0, seed=11)
    b = noisy_pair.generate(PROMPTS[2], max_tokens=32, temperature=1.0, seed=11)
    assert a.tokens == b.tokens


def test_kv_cache_reuse_across_requests(same_pair):
    first = same_pair.generate(PROMPTS[0], max_tokens=16)
    follow = same_pair.tokenize(PROMPTS[0]) + first.tokens + same_pair.tokenize(" more", add_special=False)
    second = same_pair.generate(follow, max_tokens=16)
    assert second.stats.prompt_tokens_cached >= len(follow) - 2
    same_pair.reset()
    assert second.tokens == same_pair.generate(follow, max_tokens=16).tokens


def test_prompt_longer_than_context_is_refused(same_pair):
    with pytest.raises(ContextOverflowError, match="context holds 512"):
        same_pair.generate("word " * 600, max_tokens=4)


def test_context_full_finishes_with_context(tiny_models):
    with load_pair(tiny_models["target"], tiny_models["draft"], n_ctx=64, policy="fixed", draft_max=4,
                   no_repack=True) as pair:
        c = pair.generate("one two three", max_tokens=500)
        assert c.finish_reason == "context"
        # llama.cpp may round the context up; the last emitted token is the one that no longer fits
        assert len(pair.tokenize("one two three")) + len(c.tokens) == pair.n_ctx + 1


def test_invalid_sampler_values_are_refused(same_pair):
    with pytest.raises(InvalidParameterError, match="top_p"):
        same_pair.generate("x", top_p=0)


def test_a_lone_surrogate_in_a_prompt_is_a_parameter_error(same_pair):
    with pytest.raises(InvalidParameterError, match="lone surrogate U\\+D800 at character 3"):
        same_pair.generate("abc\ud800", max_tokens=2)


def test_incompatible_pair_names_both_files_and_the_mismatch(tiny_models):
    with pytest.raises(IncompatiblePairError) as err:
        load_pair(tiny_models["target"], tiny_models["other"], no_repack=True)
    msg = str(err.value)
    assert str(tiny_models["target"]) in msg and str(tiny_models["other"]) in msg
    assert "vocabulary type" in msg and "'gpt2'" in msg and "'llama'" in msg


def test_missing_not_gguf_and_truncated_files_fail_clearly(tmp_path, tiny_models):
    with pytest.raises(ModelFileError, match="no such model file"):
        load_pair(tmp_path / "absent.gguf", no_repack=True)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"<html>not a model</html>" * 10)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_pair(junk, no_repack=True)
    data = tiny_models["target"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        load_pair(cut, no_repack=True)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:5000])
    with pytest.raises(ModelFileError, match="truncated"):
        load_pair(header_only, no_repack=True)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_draft_models_tail_probes_leave_its_cache_and_the_output_as_without_them(noisy_pair, temperature):
    """The draft model proposes two tokens where the target verifies one (auto's tail probe): greedy, the output is
    plain decoding's; sampled, a seeded run is reproducible; the draft's cache never keeps the probe's token and
    the next request's drafts start from the history."""
    policy = TailEvery()
    noisy_pair.set_policy(policy)
    try:
        got = noisy_pair.generate(PROMPTS[1], max_tokens=40, temperature=temperature, seed=5)
        again = noisy_pair.generate(PROMPTS[1], max_tokens=40, temperature=temperature, seed=5)
        history = noisy_pair.tokenize(PROMPTS[1]) + got.tokens[:-1]
        held = noisy_pair.draft_ctx.tokens
    finally:
        noisy_pair.set_policy(FixedPolicy(3))
    assert got.stats.tail_probes > 0 and any(r is not None for r in policy.results)
    assert held == history[:len(held)]
    assert again.tokens == got.tokens
    if not temperature:
        assert got.tokens == plain(noisy_pair, PROMPTS[1], max_tokens=40).tokens
