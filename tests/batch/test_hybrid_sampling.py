"""Sampling under concurrency on a hybrid target: several requests share the target passes of a qwen35 model (each
its own recurrent state and rollback snapshots), and each one's sampled tokens still follow the target's
distribution. llama.cpp's tiny qwen35 (tests/support/arch_models.py; skipped without test-llama-archs)."""
from __future__ import annotations

import numpy as np

from support.arch_models import make_arch_model, require_test_llama_archs
from support.chisq import assert_follows
from llamaspec import load_pair
from llamaspec.targets import batch_support
from llamaspec.sampling import SamplerConfig, filtered_probs

SETTINGS = dict(n_ctx=256, n_batch=64, no_repack=True, n_threads=1, flash_attn="off")
# a prompt that repeats what this model continues it with (49, 52, ...): prompt lookup drafts 52 49 52, which the
# target (p(52) about 0.46 here) accepts only in part
PROMPT = [9, 4, 9, 4, 9, 4, 9, 4, 50, 9, 4, 9, 4, 9, 49, 52, 49, 52, 49]


def test_sampled_tokens_on_a_hybrid_under_concurrency_follow_the_target_distribution(tmp_path):
    """The first sampled token of 160 requests, four at a time with their own seeds: drafted by prompt lookup and
    accepted with probability p(x), or drawn from the residual after a rejection (each rejection rolled back on that
    request's own sequence): chi-square against the target's filtered row, and the later tokens too at position 2
    (after a rollback of the first step's rejected tail)."""
    require_test_llama_archs()
    target = make_arch_model("qwen35", tmp_path, seed=1, stdev=0.5)
    cfg = SamplerConfig(temperature=1.0, top_k=8)
    with load_pair(target, drafter="lookup", policy="fixed", draft_max=3, **SETTINGS) as pair:
        assert batch_support(pair) is None
        ctx = pair.target_ctx
        ctx.clear()
        p = filtered_probs(np.array(ctx.eval(PROMPT, logits="last")[0]), cfg).astype(np.float64)
        ctx.clear()
        n = 160
        got = pair.generate_batch([PROMPT] * n, n_seq=4, requests=[
            dict(max_tokens=4, temperature=1.0, top_k=8, seed=s) for s in range(n)])
        engine = pair._shared
        assert engine.target.ctx.recurrent and engine.target.ctx.n_rs_seq >= 3
        drafted, accepted = sum(c.stats.drafted for c in got), sum(c.stats.accepted for c in got)
        assert 0 < accepted < drafted       # drafts stood and were rejected: rollbacks on the shared context
        counts = np.bincount([c.tokens[0] for c in got], minlength=len(p)).astype(np.float64)
        assert_follows(counts, p)
        # the second token after one fixed first token: the target's row after PROMPT + [first]
        first = int(np.argmax(counts))
        ctx.clear()
        p2 = filtered_probs(np.array(ctx.eval(PROMPT + [first], logits="last")[0]), cfg).astype(np.float64)
        second = [c.tokens[1] for c in got if c.tokens[0] == first and len(c.tokens) > 1]
        assert len(second) >= 60   # enough draws behind the most frequent first token (seeds are fixed)
        assert_follows(np.bincount(second, minlength=len(p2)).astype(np.float64), p2)
