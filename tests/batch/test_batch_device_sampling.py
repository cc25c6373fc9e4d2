"""Sampled slots of the batch engine filtering and drawing on the device (LLAMASPEC_BATCH_DEVICE_SAMPLING=1): each
slot's sequence gets a llama.cpp sampling chain of its request's filters and seed from its first verification to its
end (SharedContext.set_seq_sampler), so the target's pass copies no logits for it and the verifier reads the
device's filtered rows. On this CPU the device path is forced (LLAMASPEC_DEVICE_SAMPLING=1). Sampled tokens keep
the target's distribution, greedy slots beside them keep their tokens, and every chain is gone when its slot ends."""
from __future__ import annotations

import numpy as np
import pytest

from support.chisq import assert_follows
from llamaspec import load_pair
from llamaspec.backend import sequences
from llamaspec.backend.sequences import SharedContext, shared_like
from llamaspec.sampling import SamplerConfig, filtered_probs

PROMPTS = ["def quicksort(arr):", "The history of the printing press begins", "fn fibonacci(n: u64) -> u64 {",
           "Once upon a time, in a small village by the sea,", "SELECT name FROM"]
SETTINGS = dict(n_ctx=256, n_batch=64, no_repack=True, n_threads=1, flash_attn="off")


@pytest.fixture(scope="module")
def pair(tiny_models):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLAMASPEC_BATCH_DEVICE_SAMPLING", "1")
        mp.setenv("LLAMASPEC_DEVICE_SAMPLING", "1")
        with load_pair(tiny_models["target"], tiny_models["noisy"], policy="fixed", draft_max=4, **SETTINGS) as p:
            p.generate_batch(PROMPTS[:4], n_seq=4, max_tokens=2, temperature=1.0, seed=0)   # the engine, with the flag
            assert p._shared.target.device_sampling
            yield p


def target_row(pair, prompt, cfg):
    ctx = pair.target_ctx
    ctx.clear()
    return filtered_probs(np.array(ctx.eval(prompt, logits="last")[0]), cfg).astype(np.float64)


def counting(pair, monkeypatch):
    """How often each kind of row came back from the shared target's decodes (not the draft's: numpy's rows)."""
    seen = {"dists": 0, "logits": 0}
    real, target = SharedContext.decode, pair._shared.target.ctx

    def decode(self, runs):
        out = real(self, runs)
        for rows in out if self is target else ():
            if isinstance(rows, sequences.LazyRows):
                seen["dists"] += 1
            elif isinstance(rows, np.ndarray):
                seen["logits"] += 1
        return out

    monkeypatch.setattr(SharedContext, "decode", decode)
    return seen


@pytest.mark.parametrize("filters", [dict(temperature=1.0, top_k=8), dict(temperature=2.0),
                                     dict(temperature=2.0, top_p=0.95)])
def test_sampled_slots_draw_on_the_device_and_keep_the_target_distribution(pair, monkeypatch, filters):
    """The first token of 160 requests, four at a time with their own seeds: chi-square against the target's filtered
    row; the target's rows of those slots came from their chains (top-k: k candidates; temperature only: the whole
    vocabulary; top-p alone: the sorted candidates, cut at the end), no logits."""
    cfg = SamplerConfig(**filters)
    prompt = pair.tokenize(PROMPTS[3])
    p = target_row(pair, prompt, cfg)
    seen = counting(pair, monkeypatch)
    n = 160
    got = pair.generate_batch([prompt] * n, n_seq=4, requests=[dict(max_tokens=3, seed=s, **filters)
                                                                 for s in range(n)])
    assert seen["dists"] > 0 and seen["logits"] == 0, seen
    assert sum(c.stats.accepted for c in got) > 0
    assert_follows(np.bincount([c.tokens[0] for c in got], minlength=len(p)).astype(np.float64), p)
    assert not pair._shared.target.ctx._sample_chains   # every slot's chain went when it ended


def test_greedy_and_sampled_requests_of_mixed_lengths_share_the_passes(pair):
    """60 requests, half greedy (equal to each alone) and half sampled at T=0.8 with llama.cpp's filters, lengths
    from 2 to 24, through four slots: greedy slots' samplers and sampled slots' chains side by side in the same
    passes, chains coming and going as requests end; every token in the vocabulary."""
    requests, expected = [], {}
    for i in range(60):
        prompt, n = PROMPTS[i % len(PROMPTS)], 2 + (7 * i) % 23
        if i % 2:
            requests.append(dict(max_tokens=n, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=i))
        else:
            requests.append(dict(max_tokens=n))
            expected[i] = (prompt, n)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(60)]
    got = pair.generate_batch(prompts, n_seq=4, requests=requests)
    assert pair._shared.target.device_sampling
    alone = {i: pair.generate(prompt, max_tokens=n).tokens for i, (prompt, n) in expected.items()}
    assert all(got[i].tokens == tokens for i, tokens in alone.items())
    n_vocab = pair.n_vocab
    assert all(0 <= t < n_vocab for c in got for t in c.tokens)
    assert sum(c.stats.drafted for i, c in enumerate(got) if i % 2) > 0
    assert not pair._shared.target.ctx._sample_chains


def test_a_chain_the_device_refuses_leaves_the_slot_on_the_logits(pair, monkeypatch):
    """Where llama.cpp cannot run a chain (attach refuses it), the slot's rows are its logits, filtered as numpy
    does: the same distribution."""
    monkeypatch.setattr(sequences, "attach", lambda ctx, seq_id, chain: False)
    cfg = SamplerConfig(temperature=1.0, top_k=8)
    prompt = pair.tokenize(PROMPTS[3])
    p = target_row(pair, prompt, cfg)
    seen = counting(pair, monkeypatch)
    n = 120
    got = pair.generate_batch([prompt] * n, n_seq=4, requests=[dict(max_tokens=2, temperature=1.0, top_k=8, seed=s)
                                                                 for s in range(n)])
    assert seen["dists"] == 0 and seen["logits"] > 0, seen
    assert_follows(np.bincount([c.tokens[0] for c in got], minlength=len(p)).astype(np.float64), p)


def test_a_sequences_device_draws_are_fresh_at_every_decode(pair):
    """One sequence's run of two rows decoded again and again in a shared context: its chain's draws are new at
    each decode (llama.cpp replays uncommitted draws where a sequence has several outputs) and follow the rows'
    probabilities."""
    shared = shared_like(pair.target_ctx, 2)
    try:
        tokens = pair.tokenize(PROMPTS[3])
        seq = shared.sequences[0]
        shared.decode([shared.Run(seq, tokens[:-1], "none")])
        assert shared.set_seq_sampler(0, SamplerConfig(temperature=2.0), seed=3)
        counts, probs = np.zeros(pair.n_vocab), None
        for _ in range(300):
            seq.keep(len(tokens) - 1)
            rows = shared.decode([shared.Run(seq, [tokens[-1], tokens[0]], "all")])[0]
            probs = rows[0].dense(pair.n_vocab) if probs is None else probs
            counts[rows[0].draw] += 1
        assert np.count_nonzero(counts) > 3
        assert_follows(counts, probs)
    finally:
        shared.close()
