"""Several sequences in one target pass (batch.py, backend/sequences.py): each prompt's output is the one it gets
alone, sampled tokens keep the target's distribution, each sequence rolls back on its own, and pairs that cannot
batch say why and run one prompt at a time.

Tiny models with a real tokenizer (conftest's tiny_models: a target and a noisy draft that agrees often) and, for the
hybrid fallback, llama.cpp's tiny qwen35 (tests/support/arch_models.py; skipped without test-llama-archs).
"""
from __future__ import annotations

import numpy as np
import pytest

from support.arch_models import make_arch_model
from support.chisq import assert_follows
from llamaspec import load_pair
from llamaspec.backend.sequences import SharedContext, shared_like
from llamaspec.batch import batch_support
from llamaspec.errors import InvalidParameterError, UnsupportedModelError
from llamaspec.sampling import SamplerConfig, filtered_probs

PROMPTS = ["def quicksort(arr):", "The history of the printing press begins", "fn fibonacci(n: u64) -> u64 {",
           "Once upon a time, in a small village by the sea,", "SELECT name FROM"]
# Flash attention off: llama.cpp's CPU flash-attention kernel accumulates in f16 in the order of the KV cells, and a
# shared cache interleaves the sequences' cells, so with it on a near-tie (a top-2 gap of ~0.02 on these models) can
# flip between a sequence alone and beside others. Off, each sequence's rows are bit-identical either way.
SETTINGS = dict(n_ctx=256, n_batch=64, no_repack=True, n_threads=1, flash_attn="off")


@pytest.fixture(scope="module")
def pair(tiny_models):
    with load_pair(tiny_models["target"], tiny_models["noisy"], policy="fixed", draft_max=4, **SETTINGS) as p:
        yield p


def alone(pair, prompts, **kw):
    return [pair.generate(p, **kw) for p in prompts]


def test_greedy_batch_equals_each_prompt_alone(pair):
    expected = alone(pair, PROMPTS[:4], max_tokens=24)
    got = pair.generate_batch(PROMPTS[:4], max_tokens=24)
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    assert [c.text for c in got] == [c.text for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    assert sum(c.stats.drafted for c in got) > 0 and sum(c.stats.accepted for c in got) > 0   # drafts were used
    # one target pass per step for all four: fewer passes than the four runs alone took together
    assert pair._batch.target.decode_calls < sum(c.stats.target_passes for c in expected)


def test_more_prompts_than_slots_each_get_their_own_reply(pair):
    """Five prompts through two slots, each with its own length and stop string: nothing lost or mixed up."""
    requests = [dict(max_tokens=8 + 3 * i, stop=["\n\n"]) for i in range(len(PROMPTS))]
    expected = [pair.generate(p, **kw) for p, kw in zip(PROMPTS, requests)]
    got = pair.generate_batch(PROMPTS, n_seq=2, requests=requests)
    assert [(c.text, c.finish_reason) for c in got] == [(c.text, c.finish_reason) for c in expected]
    assert pair._batch.n_seq == 2


@pytest.mark.parametrize("drafter", ["lookup", "none"])
def test_lookup_and_plain_pairs_batch_too(tiny_models, drafter):
    draft = None if drafter == "none" else tiny_models["noisy"]
    with load_pair(tiny_models["target"], draft, drafter="lookup", policy="fixed", draft_max=3, **SETTINGS) as p:
        prompts = ["a b c d a b c d a b c", *PROMPTS[:2]]
        assert batch_support(p) is None
        expected = alone(p, prompts, max_tokens=16)
        got = p.generate_batch(prompts, max_tokens=16)
        assert [c.tokens for c in got] == [c.tokens for c in expected]


def test_a_later_batch_reuses_each_slots_cache(pair):
    first = pair.generate_batch(PROMPTS[:2], max_tokens=6)
    again = pair.generate_batch([PROMPTS[0] + first[0].text, PROMPTS[1]], max_tokens=6)
    assert all(c.stats.prompt_tokens_cached > 0 for c in again)
    assert again[1].tokens == first[1].tokens


def test_shared_sequences_keep_their_own_tails(pair):
    """One decode of three sequences' runs; dropping one sequence's tail leaves the others' memory as it was, and
    decoding it again gives its rows again."""
    shared = shared_like(pair.target_ctx, 3)
    try:
        a, b, c = (pair.tokenize(p) for p in PROMPTS[:3])
        s0, s1, s2 = shared.sequences
        rows = shared.decode([shared.Run(s0, a, "last"), shared.Run(s1, b, "all"), shared.Run(s2, c, "none")])
        assert rows[0].shape == (1, pair.n_vocab) and rows[1].shape == (len(b), pair.n_vocab) and rows[2] is None
        first_b = np.array(rows[1])
        assert s1.keep(2)
        pos_max = [int(shared_ctx_pos_max(shared, s)) for s in (s0, s1, s2)]
        assert pos_max == [len(a) - 1, 1, len(c) - 1]
        again = shared.decode([shared.Run(s1, b[2:], "all")])[0]
        assert np.array_equal(again.argmax(axis=1), first_b[2:].argmax(axis=1))
        assert s1.tokens == b
    finally:
        shared.close()


def shared_ctx_pos_max(shared, seq) -> int:
    from llamaspec.backend.native import llama_cpp

    return llama_cpp.llama_memory_seq_pos_max(shared.memory, seq.seq_id)


def test_sampled_tokens_under_concurrency_follow_the_target_distribution(pair):
    """The first sampled token of 160 requests, four at a time with their own seeds, each beside others in the
    same passes (accepted from the draft or drawn on a rejection): chi-square against the target's filtered row."""
    cfg = SamplerConfig(temperature=1.0, top_k=8)
    prompt = pair.tokenize(PROMPTS[3])
    ctx = pair.target_ctx
    ctx.clear()
    p = filtered_probs(np.array(ctx.eval(prompt, logits="last")[0]), cfg).astype(np.float64)
    n = 160
    got = pair.generate_batch([prompt] * n, n_seq=4, requests=[dict(max_tokens=3, temperature=1.0, top_k=8, seed=s)
                                                                 for s in range(n)])
    counts = np.bincount([c.tokens[0] for c in got], minlength=len(p)).astype(np.float64)
    assert sum(c.stats.accepted for c in got) > 0   # draft tokens were accepted, not only drawn
    assert_follows(counts, p)


def test_a_bad_request_is_refused_before_anything_runs(pair):
    with pytest.raises(InvalidParameterError):
        pair.generate_batch(["fine", ""], max_tokens=4)
    with pytest.raises(InvalidParameterError):
        pair.generate_batch(["fine"], max_tokens=0)


def test_hybrid_targets_run_one_at_a_time_and_say_why(tmp_path):
    target = make_arch_model("qwen35", tmp_path, seed=1, stdev=0.5)
    with load_pair(target, target, policy="fixed", draft_max=3, **SETTINGS) as p:
        why = batch_support(p)
        assert why is not None and "recurrent" in why
        with pytest.raises(UnsupportedModelError):
            SharedContext(p.target, p.target_ctx.options, 2)
        prompts = [[3, 17, 42, 99, 5], [64, 23, 8, 77]]
        assert [c.tokens for c in p.generate_batch(prompts, max_tokens=8)] == \
            [c.tokens for c in alone(p, prompts, max_tokens=8)]


@pytest.mark.realmodel
def test_greedy_batch_equals_alone_on_the_real_pair(real_models):
    from conftest import REAL_DRAFT, REAL_TARGET

    with load_pair(real_models / REAL_TARGET, real_models / REAL_DRAFT, n_ctx=512, policy="fixed", draft_max=4,
                   no_repack=True, flash_attn="off") as p:
        prompts = [PROMPTS[0], PROMPTS[2], "class LRUCache:\n    def __init__(self, capacity):"]
        expected = alone(p, prompts, max_tokens=16)
        got = p.generate_batch(prompts, max_tokens=16)
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        assert sum(c.stats.accepted for c in got) > 0


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.realmodel
def test_shrinking_the_pairs_own_contexts_frees_their_kv_memory(real_models):
    """serve --parallel: the pair's own caches shrink to one batch before the shared ones are made, and the memory
    really goes (llama.cpp's context sizes, and the process's resident memory); the pair and the engine still
    give the same greedy tokens."""
    import sys

    from conftest import REAL_SMOLLM
    from llamaspec.backend.native import llama_cpp
    from llamaspec.batch import shrink_own_contexts
    from llamaspec.gguf.memory import Settings, kv_cache_bytes

    if not sys.platform.startswith("linux"):
        pytest.skip("reads the resident memory from /proc")
    smol, n_ctx, n_batch = real_models / REAL_SMOLLM, 4096, 256
    with load_pair(smol, smol, n_ctx=n_ctx, n_batch=n_batch, policy="fixed", draft_max=4, no_repack=True,
                   n_threads=1, flash_attn="off") as p:
        contexts = (p.target_ctx, p.draft_ctx)

        def sizes():
            return [int(llama_cpp.llama_n_ctx(c._ptr)) for c in contexts]

        assert sizes() == [n_ctx, n_ctx]
        prompts = [PROMPTS[0], PROMPTS[4]]
        expected = [c.tokens for c in alone(p, prompts, max_tokens=12)]
        per_token = kv_cache_bytes(p.target.info, Settings(n_ctx=1, type_k="f16", type_v="f16"))
        before = _rss_bytes()
        shrink_own_contexts(p)
        freed = before - _rss_bytes()
        assert sizes() == [n_batch, n_batch] and p.target_ctx.n_batch == n_batch
        assert freed > 0.75 * 2 * per_token * (n_ctx - n_batch), (freed, per_token)
        assert [c.tokens for c in alone(p, prompts, max_tokens=12)] == expected   # alone, within one batch
        got = p.generate_batch(prompts, n_ctx=n_ctx, max_tokens=12)
        assert p.batch_engine(2, n_ctx).target.n_ctx == n_ctx
        assert [c.tokens for c in got] == expected
