"""Filtering on the device (llama.cpp's sampler chains; llama.cpp's CPU backend runs them here) against numpy's
filters: the same distributions from the same logits, fresh draws that follow them, and the engine on either path
keeping the target's distribution. Tiny generated models with the real Qwen2 vocabulary (151,936 ids)."""
import numpy as np
import pytest

from support.chisq import assert_follows
from support.gguf_factory import make_tiny_model
from llamaspec import load_pair
from llamaspec.backend import Context, Model, supports_gpu_offload
from llamaspec.config import ModelConfig
from llamaspec.policy import FixedPolicy
from llamaspec.sampling import DRAFT_TOP_K, SamplerConfig, filter_logits, filtered_probs

PROMPT = "def quicksort(arr):"
CONFIGS = [SamplerConfig(0.8), SamplerConfig(0.8, top_k=40), SamplerConfig(1.0, top_p=0.9),
           SamplerConfig(0.7, min_p=0.05), SamplerConfig(0.8, top_k=40, top_p=0.95, min_p=0.05),
           SamplerConfig(1.2, top_p=0.8, min_p=0.02)]
# llama.cpp's order: top-k/top-p/min-p on the untempered distribution, temperature last
CONFIGS += [SamplerConfig(c.temperature, c.top_k, c.top_p, c.min_p, order="llama.cpp") for c in CONFIGS
            if c.top_p < 1 or c.min_p > 0]
OPTIONS = ModelConfig(no_repack=True, n_ctx=256, n_threads=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory, vocab_dir):
    """logit_scale 25 spreads the next-token distribution like a real model's (best token about 0.24, a 0.9
    nucleus of some 600 ids); the draft's output matrix is perturbed so that it disagrees sometimes."""
    d = tmp_path_factory.mktemp("sampling-models")
    qwen = vocab_dir / "ggml-vocab-qwen2.gguf"
    return {"target": make_tiny_model(d / "target.gguf", qwen, seed=1, logit_scale=25.0),
            "draft": make_tiny_model(d / "draft.gguf", qwen, seed=1, logit_scale=25.0, output_noise=0.6,
                                     name="tiny-draft")}


@pytest.fixture(scope="module")
def ctx(models):
    model = Model(models["target"], OPTIONS)
    context = Context(model, OPTIONS)
    yield context
    context.close()
    model.close()


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}-m{c.min_p}-{c.order}")
def test_device_and_numpy_filters_agree_on_the_same_logits(ctx, cfg):
    tokens = ctx.model.tokenize(PROMPT)
    ctx.clear()
    logits = np.array(ctx.eval(tokens, logits="all"))
    ctx.clear()
    assert ctx.set_device_sampler(cfg, seed=1)
    dists = ctx.eval_dists(tokens, rows="all")
    assert len(dists) == len(tokens)
    for row, dist in zip(logits, dists):
        device = dist.dense(ctx.n_vocab)
        numpy_path = filter_logits(row, cfg).dense(ctx.n_vocab)
        assert np.count_nonzero(device) == np.count_nonzero(numpy_path)
        np.testing.assert_allclose(device, numpy_path, atol=1e-6, rtol=1e-4)
        np.testing.assert_allclose(device, filtered_probs(row, cfg), atol=1e-6, rtol=1e-4)
        assert device[dist.draw] > 0  # the device's draw lies in the kept set
    truncated = cfg.top_k or cfg.top_p < 1
    assert all((d.ids is not None) == bool(truncated) for d in dists)  # only the kept candidates came back
    ctx.set_device_sampler(None)


def test_a_chains_rows_are_read_with_the_lengths_llama_cpp_gives_each_row(ctx):
    """Row lengths are asked once per chain (its filters fix them): every row of a verification, and every row
    after a change of filters, has the lengths llama.cpp's count calls give for it."""
    from llamaspec.backend.native import llama_cpp

    tokens = ctx.model.tokenize(PROMPT)
    for cfg in (SamplerConfig(0.8, top_k=40), SamplerConfig(0.8, top_k=7), SamplerConfig(0.8),
                SamplerConfig(0.8, top_k=7)):
        ctx.clear()
        assert ctx.set_device_sampler(cfg, seed=1)
        rows = ctx.eval_dists(tokens, rows="all")
        for i, dist in enumerate(rows):
            n_probs = llama_cpp.llama_get_sampled_probs_count_ith(ctx._ptr, i)
            n_ids = llama_cpp.llama_get_sampled_candidates_count_ith(ctx._ptr, i)
            assert len(dist.weights) == n_probs == (cfg.top_k or ctx.n_vocab)
            assert (0 if dist.ids is None else len(dist.ids)) == n_ids
            assert dist.prob(dist.draw) > 0.0
    ctx.set_device_sampler(None)


@pytest.mark.slow
def test_device_draws_are_fresh_at_every_decode_and_follow_the_distribution(ctx):
    """The same row decoded again and again: each decode's draw is new (llama.cpp replays uncommitted draws of
    several-output contexts) and the draws follow the returned probabilities."""
    tokens = ctx.model.tokenize(PROMPT)
    ctx.clear()
    ctx.eval(tokens[:-1], logits="none")
    assert ctx.set_device_sampler(SamplerConfig(1.0, top_k=10), seed=3)
    counts = np.zeros(ctx.n_vocab)
    probs = None
    for _ in range(400):
        ctx.keep(len(tokens) - 1)
        dist = ctx.eval_dists(tokens[-1:])[0]
        probs = dist.dense(ctx.n_vocab) if probs is None else probs
        counts[dist.draw] += 1
    assert np.count_nonzero(counts) > 3
    assert_follows(counts, probs)
    ctx.set_device_sampler(None)


def test_rows_of_a_verification_are_read_only_when_asked_for(ctx, monkeypatch):
    """The rejection rule stops at the first rejection: the rows after it are never read out of llama.cpp."""
    tokens, cfg = ctx.model.tokenize(PROMPT), SamplerConfig(0.8, top_k=40)
    ctx.clear()
    expected = filter_logits(np.array(ctx.eval(tokens, logits="all"))[2], cfg).dense(ctx.n_vocab)
    ctx.clear()
    assert ctx.set_device_sampler(cfg, seed=1)
    read = []
    real = ctx._sampled_dist
    monkeypatch.setattr(ctx, "_sampled_dist", lambda i: read.append(i) or real(i))
    rows = ctx.eval_dists(tokens, rows="all")
    assert len(rows) == len(tokens) and read == []
    third = rows[2]
    assert rows[2] is third and rows[-1] is rows[len(tokens) - 1] and read == [2, len(tokens) - 1]
    np.testing.assert_allclose(third.dense(ctx.n_vocab), expected, atol=1e-6, rtol=1e-4)
    ctx.set_device_sampler(None)


def test_device_filtering_is_preferred_only_with_the_output_layer_on_a_gpu(ctx, monkeypatch):
    monkeypatch.delenv("LLAMASPEC_DEVICE_SAMPLING", raising=False)
    assert ctx.prefers_device_sampling == supports_gpu_offload()  # every layer offloaded (n_gpu_layers -1)
    monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", "1")
    assert ctx.prefers_device_sampling
    monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", "0")
    assert not ctx.prefers_device_sampling


def test_a_logits_eval_detaches_the_device_sampler(ctx):
    tokens = ctx.model.tokenize(PROMPT)
    ctx.clear()
    expected = np.array(ctx.eval(tokens, logits="last")[0])
    ctx.keep(len(tokens) - 1)
    assert ctx.set_device_sampler(SamplerConfig(0.8, top_k=5), seed=1) and ctx.device_sampler
    row = ctx.eval(tokens[-1:], logits="last")[0]
    assert not ctx.device_sampler
    np.testing.assert_allclose(row, expected, atol=1e-4)


@pytest.mark.slow
def test_engine_filters_on_the_device_for_draft_and_target_together(models, monkeypatch):
    with load_pair(models["target"], models["draft"], n_ctx=256, policy="fixed", draft_max=3, no_repack=True,
                   n_threads=2) as pair:
        monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", "1")
        a = pair.generate(PROMPT, max_tokens=24, temperature=0.8, top_k=40, seed=7)
        assert pair.target_ctx.device_sampler and pair.draft_ctx.device_sampler and a.stats.drafted > 0
        assert pair.generate(PROMPT, max_tokens=24, temperature=0.8, top_k=40, seed=7).tokens == a.tokens
        monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", "0")
        b = pair.generate(PROMPT, max_tokens=24, temperature=0.8, top_k=40, seed=7)
        assert not pair.target_ctx.device_sampler and not pair.draft_ctx.device_sampler and b.stats.drafted > 0
        greedy = pair.generate(PROMPT, max_tokens=8)  # after sampling: the argmax chain again
        assert pair.target_ctx.device_argmax and len(greedy.tokens) == 8


@pytest.mark.parametrize("device", ["1", "0"], ids=["device", "numpy"])
@pytest.mark.parametrize("cfg", [SamplerConfig(1.0, top_k=12), SamplerConfig(0.9, top_p=0.8),
                                 SamplerConfig(0.7, top_p=0.9, min_p=0.02, order="llama.cpp"), SamplerConfig(0.8)],
                         ids=["top_k", "top_p", "llama.cpp-order", "temperature"])
@pytest.mark.slow
def test_sampled_next_token_follows_the_target_distribution(models, ctx, monkeypatch, device, cfg):
    """Speculative sampling (3 drafted tokens, a draft that disagrees often) on either path: the first token
    follows the target's filtered distribution, by chi-square at the 0.1% level."""
    monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", device)
    tokens = ctx.model.tokenize(PROMPT)
    ctx.clear()
    p = filtered_probs(np.array(ctx.eval(tokens, logits="last")[0]), cfg).astype(np.float64)
    counts = np.zeros(len(p))
    drafted = accepted = 0
    with load_pair(models["target"], models["draft"], n_ctx=256, no_repack=True, n_threads=2) as pair:
        pair.set_policy(FixedPolicy(3))
        for seed in range(300):
            c = pair.generate(tokens, max_tokens=2, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                              min_p=cfg.min_p, sampler_order=cfg.order, seed=seed)
            counts[c.tokens[0]] += 1
            drafted += c.stats.drafted
            accepted += c.stats.accepted
        assert pair.target_ctx.device_sampler == (device == "1")
        if device == "1":   # the target filters as asked, the draft draws from at most DRAFT_TOP_K candidates
            assert pair.target_ctx._chain_key[1] == (cfg.top_k or 0)
            assert pair.draft_ctx._chain_key[1] == (cfg.top_k or DRAFT_TOP_K)
    assert drafted > 0 and 0 < accepted < drafted  # the draft's tokens were used, and some were rejected
    assert_follows(counts, p)


@pytest.mark.slow
def test_a_chain_with_the_same_filters_stays_attached_and_restarts(ctx):
    """Attaching a chain costs llama.cpp a graph re-reserve: the same filters keep theirs. From a seed the draws
    are exactly a fresh chain's (the first chain was attached with seed 7); without a seed they are new each time."""
    tokens = ctx.model.tokenize(PROMPT)
    cfg = SamplerConfig(1.0, top_k=50)

    def draws(seed, n=24):
        assert ctx.set_device_sampler(cfg, seed=seed)
        out = []
        for _ in range(n):
            ctx.clear()
            out.append(ctx.eval_dists(tokens)[0].draw)
        return out

    ctx.set_device_sampler(None)
    fresh7 = draws(7)
    chain = ctx._chain
    ctx.set_device_sampler(None)
    fresh8 = draws(8)
    assert fresh8 != fresh7
    chain = ctx._chain
    assert draws(7) == fresh7 and ctx._chain is chain            # kept, and drawing as a fresh chain of seed 7
    assert draws(8) == fresh8 and ctx._chain is chain            # ... of seed 8
    a = draws(None)
    b = draws(None)
    assert ctx._chain is chain and a != b != fresh8              # kept, reseeded at random
    assert draws(7) == fresh7 and ctx._chain is chain            # a seed after random ones: its own draws again
    assert ctx.set_device_sampler(SamplerConfig(0.9, top_k=50), seed=None) and ctx._chain is not chain
    ctx.set_device_sampler(None)


@pytest.mark.slow
def test_requests_keep_their_chains_and_seeded_ones_repeat(models, monkeypatch):
    """Draft and target keep their chains from request to request (no graph re-reserve): without a seed they draw
    afresh; with one, both follow it (a draft drawing the same in every request would bias the output across
    seeds), and the same seed gives the same output."""
    monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", "1")
    pair = load_pair(models["target"], models["draft"], no_repack=True, n_ctx=256, n_threads=2, policy="fixed",
                     draft_max=3)
    try:
        contexts = (pair.target_ctx, pair.draft_ctx)
        a = pair.generate(PROMPT, max_tokens=24, temperature=0.9)
        chains = [ctx._chain for ctx in contexts]
        assert all(ctx.device_sampler for ctx in contexts)
        b = pair.generate(PROMPT, max_tokens=24, temperature=0.9)
        assert [ctx._chain for ctx in contexts] == chains and a.tokens != b.tokens
        first = pair.generate(PROMPT, max_tokens=24, temperature=0.9, seed=5)
        other = pair.generate(PROMPT, max_tokens=24, temperature=0.9, seed=6)
        again = pair.generate(PROMPT, max_tokens=24, temperature=0.9, seed=5)
        assert again.tokens == first.tokens and other.tokens != first.tokens
        assert [ctx._chain for ctx in contexts] == chains
    finally:
        pair.close()
