"""Several sequences in one target pass (targets.py SharedTarget, backend/sequences.py): each prompt's output is the one it gets
alone, sampled tokens keep the target's distribution, each sequence rolls back on its own, and pairs that cannot
batch say why and run one prompt at a time.

Tiny models with a real tokenizer (conftest's tiny_models: a target and a noisy draft that agrees often) and, for the
hybrid fallback, llama.cpp's tiny qwen35 (tests/support/arch_models.py; skipped without test-llama-archs).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from support.arch_models import make_arch_model
from support.chisq import assert_follows
from support.mtp_models import make_mtp_model, split_mtp_head
from support.near_tie import assert_same_or_near_tie
from llamaspec import load_pair
from llamaspec.backend.sequences import SharedContext, shared_like
from llamaspec.targets import TURN_TAIL, batch_support
from llamaspec.errors import InvalidParameterError, UnsupportedModelError
from llamaspec.policy import FixedPolicy
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
    assert sum(c.stats.accepted for c in got) < sum(c.stats.drafted for c in got)   # and rolled back where rejected
    # one target pass per step for all four: fewer passes than the four runs alone took together
    assert pair._shared.target.ctx.decode_calls < sum(c.stats.target_passes for c in expected)


def test_greedy_slots_take_their_argmax_on_the_device_and_copy_no_target_logits(pair, monkeypatch):
    """A greedy slot's sequence has a greedy sampler in llama.cpp's graph: a pass of greedy slots reads no logits
    of the shared target (llama.cpp then copies none out), and a sampled slot beside them still gets its rows
    while theirs stay the device's argmaxes."""
    from llamaspec.backend.native import llama_cpp

    expected = alone(pair, PROMPTS[:3], max_tokens=16)
    pair.generate_batch(PROMPTS[:3], max_tokens=2)   # the shared target of three sequences is made
    shared = pair._shared.target.ctx
    read, get_logits = [], llama_cpp.llama_get_logits
    monkeypatch.setattr(llama_cpp, "llama_get_logits", lambda ctx: (read.append(ctx is shared._ptr),
                                                                     get_logits(ctx))[1])
    got = pair.generate_batch(PROMPTS[:3], max_tokens=16)
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    assert read and not any(read)   # the draft model's rows were read, never the target's
    greedy = [shared.seq_argmax(s.seq_id) for s in shared.sequences]
    assert sum(greedy) >= 3   # (each sequence that took a request)
    read.clear()
    got = pair.generate_batch(PROMPTS[:3], requests=[dict(max_tokens=16), dict(max_tokens=16),
                                                     dict(max_tokens=16, temperature=0.8, seed=1)])
    assert [c.tokens for c in got[:2]] == [c.tokens for c in expected[:2]]
    assert any(read)   # the sampled slot's rows came from the logits
    assert sum(shared.seq_argmax(s.seq_id) for s in shared.sequences) == sum(greedy) - 1


def test_each_batched_reply_says_how_much_of_its_generation_ran_inside_llama_cpp(pair, monkeypatch):
    """The shared passes' time inside llama.cpp is each slot's while it generates (python_overhead, the Python share
    a benchmark reports for --parallel): every decode made slow here, the rest of a step is a small share of it."""
    from llamaspec.backend.native import llama_cpp

    decode = llama_cpp.llama_decode

    def slow_decode(ctx, batch):
        time.sleep(0.02)
        return decode(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", slow_decode)
    got = pair.generate_batch(PROMPTS[:3], max_tokens=12)
    for c in got:
        s = c.stats
        generating = s.time_total - s.time_prefill
        # every step of the slot's generation waited on at least one slow decode, and none before it counts
        assert 0.02 * s.target_passes <= s.time_in_decode <= generating, (s.time_in_decode, generating)
        assert s.python_overhead < 0.5, s.python_overhead


@pytest.mark.slow
def test_more_prompts_than_slots_each_get_their_own_reply(pair):
    """Five prompts through two slots, each with its own length and stop string: nothing lost or mixed up."""
    requests = [dict(max_tokens=8 + 3 * i, stop=["\n\n"]) for i in range(len(PROMPTS))]
    expected = [pair.generate(p, **kw) for p, kw in zip(PROMPTS, requests)]
    got = pair.generate_batch(PROMPTS, n_seq=2, requests=requests)
    assert [(c.text, c.finish_reason) for c in got] == [(c.text, c.finish_reason) for c in expected]
    assert pair._shared.n_seq == 2


@pytest.mark.slow
def test_many_greedy_requests_through_the_device_argmax_keep_their_tokens(pair):
    """Forty greedy requests of mixed lengths through four slots: each slot's sequence keeps its greedy sampler while
    it waits for the next request, beside slots that verify (llama.cpp builds every attached chain into each pass);
    every reply is the one it gets alone."""
    rnd = np.random.default_rng(0)
    prompts = [rnd.integers(100, 5000, int(rnd.integers(3, 30))).tolist() for _ in range(40)]
    requests = [dict(max_tokens=int(rnd.integers(4, 30))) for _ in prompts]
    expected = [pair.generate(p, **kw).tokens for p, kw in zip(prompts, requests)]
    got = pair.generate_batch(prompts, n_seq=4, requests=requests)
    assert [c.tokens for c in got] == expected
    assert all(pair._shared.target.ctx.seq_argmax(s.seq_id) for s in pair._shared.target.ctx.sequences)


@pytest.mark.parametrize("drafter", ["lookup", "none"])
@pytest.mark.slow
def test_lookup_and_plain_pairs_batch_too(tiny_models, drafter):
    draft = None if drafter == "none" else tiny_models["noisy"]
    with load_pair(tiny_models["target"], draft, drafter="lookup", policy="fixed", draft_max=3, **SETTINGS) as p:
        prompts = ["a b c d a b c d a b c", *PROMPTS[:2]]
        assert batch_support(p) is None
        expected = alone(p, prompts, max_tokens=16)
        got = p.generate_batch(prompts, max_tokens=16)
        assert [c.tokens for c in got] == [c.tokens for c in expected]


def decided_together(engine, k_max: int) -> bool:
    """The batch policy chose lengths, and learnt passes over more rows than one sequence's longest run."""
    return engine.policy.decided > 0 and engine.policy.slot_steps > 0 and max(engine.policy.model.sizes) > k_max + 1


@pytest.mark.slow
def test_greedy_auto_batch_equals_each_prompt_alone(tiny_models):
    """With the auto policy the batch's lengths are chosen together (policy/batch.py): other lengths than alone,
    the same tokens."""
    with load_pair(tiny_models["target"], tiny_models["noisy"], policy="auto", draft_max=4, **SETTINGS) as p:
        expected = alone(p, PROMPTS[:4], max_tokens=24)
        got = p.generate_batch(PROMPTS[:4], max_tokens=24)
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        assert decided_together(p._shared, 4), p._shared.policy.describe()
        assert sum(c.stats.drafted for c in got) > 0
        one = p.generate_batch(PROMPTS[:1], max_tokens=12)[0]   # a slot alone: its own policy decides, as alone
        assert one.tokens == expected[0].tokens[:12]
        assert p._lone.n_seq == 1 and p._lone.policy.decided == 0   # one prompt: a slot of the pair's own contexts


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_batched_draft_cut_to_its_best_candidates_keeps_the_target_distribution(pair, monkeypatch):
    """Temperature only: the batch engine's drafter draws from its DRAFT_TOP_K best candidates (4 here), as a drafter
    on the device does, while the target's rows are the whole vocabulary: acceptance changes, the output's
    distribution does not (the first token of 160 requests, four at a time)."""
    from llamaspec import sampling
    from llamaspec.drafters import batched

    monkeypatch.setattr(sampling, "DRAFT_TOP_K", 4)
    cut, real = [], batched.filter_logits
    monkeypatch.setattr(batched, "filter_logits", lambda row, cfg, out=None: (cut.append(cfg.top_k),
                                                                               real(row, cfg, out))[1])
    cfg = SamplerConfig(temperature=1.0)
    prompt = pair.tokenize(PROMPTS[3])
    ctx = pair.target_ctx
    ctx.clear()
    p = filtered_probs(np.array(ctx.eval(prompt, logits="last")[0]), cfg).astype(np.float64)
    n = 160
    got = pair.generate_batch([prompt] * n, n_seq=4, requests=[dict(max_tokens=3, temperature=1.0, seed=s)
                                                                 for s in range(n)])
    assert cut and set(cut) == {4}                       # every draft row was cut to its 4 best candidates
    assert sum(c.stats.accepted for c in got) > 0
    assert_follows(np.bincount([c.tokens[0] for c in got], minlength=len(p)).astype(np.float64), p)


def test_a_bad_request_is_refused_before_anything_runs(pair):
    with pytest.raises(InvalidParameterError):
        pair.generate_batch(["fine", ""], max_tokens=4)
    with pytest.raises(InvalidParameterError):
        pair.generate_batch(["fine"], max_tokens=0)


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("arch-models")


def hybrid(arch_dir, seed=1):
    """llama.cpp's tiny qwen35 (gated delta net + attention), with context-sensitive logits."""
    return make_arch_model("qwen35", arch_dir, seed=seed, stdev=0.5)


# Prompts of different lengths (one with repeats, for prompt lookup's drafts that the target partly accepts); the
# tiny archs share a 128-token vocabulary.
HYBRID_PROMPTS = [[3, 17, 42, 99, 5], [64, 23, 8, 77], [9, 4, 9, 4, 9, 4, 9, 4, 9, 4, 50, 9, 4, 9],
                  list(range(10, 40)), [1, 2]]


def test_a_shared_hybrid_context_rolls_each_sequence_back_on_its_own(arch_dir):
    """Runs with and without rows in one decode of a hybrid (llama.cpp splits it into equal-length ubatches): each
    sequence drops its own tail within its run's snapshots, not beyond, and its rows are those of the same history
    decoded alone, in the order the runs were given."""
    with load_pair(hybrid(arch_dir), drafter="lookup", policy="fixed", draft_max=4, **SETTINGS) as p:
        shared = shared_like(p.target_ctx, 3, n_rs_seq=4)
        try:
            assert shared.recurrent and shared.n_rs_seq == 4
            s0, s1, s2 = shared.sequences
            a, c = [3, 17, 42, 99, 5], list(range(10, 40))
            shared.decode([shared.Run(s1, [64, 23], "none")])
            assert (s0.undoable, s1.undoable, s2.undoable) == (0, 1, 0)
            first = shared.decode([shared.Run(s0, a, "all"), shared.Run(s1, [8, 77, 6, 50, 51], "all"),
                                   shared.Run(s2, c, "none")])
            assert [r is None or r.shape[0] for r in first] == [5, 5, True]
            got = [np.array(first[0]), np.array(first[1])]
            assert (s0.undoable, s1.undoable, s2.undoable) == (4, 4, 0)   # min(n_rs_seq, run - 1)
            assert not s1.keep(2) and s1.n_past == 7    # 4 of its run's 5 tokens undo, not 5: nothing changed
            assert s0.keep(2) and s1.keep(4)            # drop 3 of each run; s2 keeps all
            assert not s0.keep(1) and s0.n_past == 2    # one rollback per decode
            rows = shared.decode([shared.Run(s0, [7, 8], "all"), shared.Run(s1, [9], "all"),
                                  shared.Run(s2, [11, 12, 13], "all")])
            got += [np.array(r) for r in rows]
            # runs of different lengths may leave llama.cpp's ubatches in an order that moves a state away from
            # its snapshots: none of them undoes
            assert (s0.undoable, s1.undoable, s2.undoable) == (0, 0, 0) and not s2.keep(s2.n_past - 1)
        finally:
            shared.close()
        cases = [([], a), ([64, 23], [8, 77, 6, 50, 51]), ([3, 17], [7, 8]), ([64, 23, 8, 77], [9]),
                 (c, [11, 12, 13])]
        for (history, new), rows in zip(cases, got):
            ctx = p.target_ctx
            ctx.clear()
            if history:
                ctx.eval(history, logits="none")
            expected = ctx.eval(new, logits="all")
            assert np.allclose(rows, expected, atol=1e-4), np.abs(rows - expected).max()
            assert np.array_equal(rows.argmax(axis=1), expected.argmax(axis=1))


@pytest.mark.parametrize("drafter", ["none", "lookup", "model"])
def test_greedy_hybrid_batch_equals_each_prompt_alone(arch_dir, drafter):
    """A qwen35 target batches with no drafter, prompt lookup (drafts it partly accepts) or an attention draft model
    that disagrees (every draft rejected): each prompt's tokens are the ones it gets alone, over several steps."""
    draft = make_arch_model("llama", arch_dir, seed=2, stdev=0.5) if drafter == "model" else None
    with load_pair(hybrid(arch_dir), draft, drafter="lookup" if drafter == "lookup" else None, policy="fixed",
                   draft_max=4, **SETTINGS) as p:
        assert batch_support(p) is None
        expected = alone(p, HYBRID_PROMPTS, max_tokens=20)
        got = p.generate_batch(HYBRID_PROMPTS, n_seq=4, max_tokens=20)
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        assert len({tuple(c.tokens) for c in got}) == len(HYBRID_PROMPTS)
        engine = p._shared
        assert engine.target.ctx.recurrent and engine.target.ctx.n_rs_seq == (0 if drafter == "none" else 4)
        drafted, accepted = sum(c.stats.drafted for c in got), sum(c.stats.accepted for c in got)
        if drafter == "lookup":
            assert 0 < accepted < drafted   # partial acceptances: rolled back within the snapshots
        if drafter == "model":
            assert drafted > 0 and accepted < drafted   # rejections
        assert engine.target.ctx.decode_calls < sum(c.stats.target_passes for c in expected)


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_greedy_auto_hybrid_batch_equals_each_prompt_alone(arch_dir, drafter):
    """A qwen35 target pads every run to one width: the batch policy chooses that width for its auto slots, and each
    prompt's tokens are the ones it gets alone."""
    draft = make_arch_model("llama", arch_dir, seed=2, stdev=0.5) if drafter == "model" else None
    with load_pair(hybrid(arch_dir), draft, drafter="lookup" if drafter == "lookup" else None, policy="auto",
                   draft_max=4, **SETTINGS) as p:
        expected = alone(p, HYBRID_PROMPTS, max_tokens=20)
        got = p.generate_batch(HYBRID_PROMPTS, n_seq=4, max_tokens=20)
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        engine = p._shared
        assert engine.target.ctx.recurrent and decided_together(engine, 4), engine.policy.describe()


def test_a_hybrid_slot_reused_for_another_prompt_gives_its_alone_output(arch_dir):
    """A slot whose history the new prompt extends keeps its recurrent state; one whose history it does not
    extend (an unrelated prompt, or one that shares only a prefix) starts over; either way the reply is the one
    the prompt gets alone."""
    with load_pair(hybrid(arch_dir), drafter="lookup", policy="fixed", draft_max=4, **SETTINGS) as p:
        first = p.generate_batch(HYBRID_PROMPTS[:2], max_tokens=10)
        extended = HYBRID_PROMPTS[0] + first[0].tokens + [6, 6]
        prompts = [extended, HYBRID_PROMPTS[1][:2] + [100, 101, 102], HYBRID_PROMPTS[3]]
        again = p.generate_batch(prompts[:2], max_tokens=10)
        assert again[0].stats.prompt_tokens_cached >= len(HYBRID_PROMPTS[0]) + len(first[0].tokens) - 1
        assert again[1].stats.prompt_tokens_cached == 0
        third = p.generate_batch([prompts[2], prompts[0]], max_tokens=10)
        assert [c.tokens for c in again + third] == [c.tokens for c in alone(p, prompts[:2] + prompts[2:] +
                                                                             prompts[:1], max_tokens=10)]


def mtp_target(arch_dir):
    """The tiny qwen35 with an MTP head that agrees with it often but not always (test_mtp's AGREE_MIX)."""
    return make_mtp_model("qwen35", arch_dir, head="agree", trunk_mix=0.1)


@pytest.mark.parametrize("drafter", ["mtp", "lookup+mtp"])
def test_greedy_mtp_batch_equals_each_prompt_alone(arch_dir, drafter):
    """The target's MTP head drafts for every slot of a qwen35 batch (one head sequence per slot, following its
    slot's rows of the shared decodes): each prompt's tokens are the ones it gets alone, and so are its drafts (the
    same drafted and accepted counts: the head's cache of each slot holds what it holds alone); a later batch that
    extends the first one's replies reuses the slots' caches (the heads drop what the target overwrote)."""
    with load_pair(str(mtp_target(arch_dir)), drafter=drafter, policy="fixed", draft_max=3, **SETTINGS) as p:
        assert batch_support(p) is None
        head = p.draft_ctx
        calls = head.decode_calls
        expected = alone(p, HYBRID_PROMPTS, max_tokens=20)
        head_calls_alone = head.decode_calls - calls
        got = p.generate_batch(HYBRID_PROMPTS, n_seq=4, max_tokens=20)
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        assert [(c.stats.drafted, c.stats.accepted) for c in got] == \
            [(c.stats.drafted, c.stats.accepted) for c in expected]
        drafted, accepted = sum(c.stats.drafted for c in got), sum(c.stats.accepted for c in got)
        assert 0 < accepted < drafted   # drafts used, and rolled back within the snapshots where rejected
        engine = p._shared
        assert engine.target.mtp is not None and engine.target.ctx.recurrent
        assert engine.target.ctx.decode_calls < sum(c.stats.target_passes for c in expected)   # slots verified together
        assert engine.target.mtp.ctx.decode_calls < head_calls_alone                              # and drafted together
        # (the fifth prompt took the first one's slot: the first one, with no slot of its own, comes after the two
        # that have one, or it would take the least recently used slot, theirs)
        prompts = [q + c.tokens + [6, 6] for q, c in zip(HYBRID_PROMPTS[:3], got)][::-1] + [[7, 7, 8]]
        again = p.generate_batch(prompts, n_seq=4, max_tokens=12)
        # a hybrid slot is reused where the prompt extends all its sequence holds (accepted drafts past max_tokens
        # included): the head keeps its entries there and drops what the target overwrites elsewhere
        assert max(c.stats.prompt_tokens_cached for c in again) >= len(HYBRID_PROMPTS[0])
        assert [c.tokens for c in again] == [c.tokens for c in alone(p, prompts, max_tokens=12)]


def _recording_proposals(p, engine, monkeypatch):
    """Record every draft the pair's drafter makes alone and every one the engine's batched drafter makes, keyed by
    (history, last): a drafter that drafts the same at the same history holds the same cache."""
    solo, batched = {}, {}
    propose = p.drafter.propose

    def recording(history, last, max_len, p_min):
        draft = propose(history, last, max_len, p_min)
        solo[(*history, last)] = draft.tokens
        return draft

    monkeypatch.setattr(p.drafter, "propose", recording)
    if engine.target.mtp is not None:
        propose_all = engine.target.mtp.propose_all
        monkeypatch.setattr(engine.target.mtp, "propose_all",
                            lambda jobs, idle: _record(batched, jobs, propose_all(jobs, idle)))
    else:
        import llamaspec.targets as targets
        original = targets.propose_all
        monkeypatch.setattr(targets, "propose_all",
                            lambda ctx, jobs, prefills: _record(batched, jobs, original(ctx, jobs, prefills)))
    return solo, batched


def _record(into: dict, jobs, drafts):
    into.update({(*j.history, j.last): d.tokens for j, d in zip(jobs, drafts)})
    return drafts


@pytest.mark.parametrize("arch", ["qwen35", "glm4moe"])   # a hybrid target and an attention one
def test_each_slots_mtp_head_drafts_what_it_drafts_alone(arch_dir, arch, monkeypatch):
    """A random head (its drafts depend on the hidden states it reads and on its whole cache): every proposal a
    slot's head makes in a batch is the one the head makes alone at the same history, so each head sequence reads
    its own slot's rows of the shared decodes, at the right positions."""
    path = make_mtp_model(arch, arch_dir, head="random")
    with load_pair(str(path), drafter="mtp", policy="fixed", draft_max=3, **SETTINGS) as p:
        engine = p.engine(4, p.n_ctx * 4)
        solo, batched = _recording_proposals(p, engine, monkeypatch)
        expected = alone(p, HYBRID_PROMPTS, max_tokens=16)
        got = p.generate_batch(HYBRID_PROMPTS, n_seq=4, max_tokens=16)
        assert p._shared is engine
        p.set_policy(FixedPolicy(0))   # plain decoding: a random head's drafts are rejected at nearly every step
        plain = alone(p, HYBRID_PROMPTS, max_tokens=16)
    assert [c.tokens for c in got] == [c.tokens for c in expected] == [c.tokens for c in plain]
    assert sum(c.stats.accepted for c in got) < sum(c.stats.drafted for c in got) / 2
    assert len(batched) > 2 * len(HYBRID_PROMPTS) and batched == solo


def test_sampled_mtp_tokens_under_concurrency_follow_the_target_distribution(arch_dir):
    """The first sampled token of 200 requests, four at a time with their own seeds, drafted by the MTP head (draws
    from its filtered rows, those rows the q of rejection sampling): chi-square against the target's filtered row;
    and the second token behind the most frequent first one against the target's row after it."""
    cfg = SamplerConfig(temperature=1.0, top_k=8)
    prompt = HYBRID_PROMPTS[0]
    with load_pair(str(mtp_target(arch_dir)), drafter="mtp", policy="fixed", draft_max=3, **SETTINGS) as p:
        ctx = p.target_ctx
        ctx.clear()
        target = filtered_probs(np.array(ctx.eval(prompt, logits="last")[0]), cfg).astype(np.float64)
        ctx.clear()
        n = 200
        got = p.generate_batch([prompt] * n, n_seq=4, requests=[dict(max_tokens=3, temperature=1.0, top_k=8, seed=s)
                                                                  for s in range(n)])
        assert p._shared.target.mtp is not None
        counts = np.bincount([c.tokens[0] for c in got], minlength=len(target)).astype(np.float64)
        assert 0 < sum(c.stats.accepted for c in got) < sum(c.stats.drafted for c in got)   # accepted and rejected
        assert_follows(counts, target)
        # the second token behind the most frequent first one: drafted (or drawn) after that first step's rollback
        first = int(np.argmax(counts))
        ctx.clear()
        p2 = filtered_probs(np.array(ctx.eval(prompt + [first], logits="last")[0]), cfg).astype(np.float64)
        second = [c.tokens[1] for c in got if c.tokens[0] == first]
        assert len(second) >= 60, len(second)
        assert_follows(np.bincount(second, minlength=len(p2)).astype(np.float64), p2)


def test_an_mtp_head_files_pair_shrinks_and_still_batches(arch_dir, tmp_path):
    """serve --parallel with a head file (mtp-*.gguf beside the trunk): the pair's own target and head contexts are
    remade at one batch (the head's over the target's new context) and the pair still drafts alone; the engine's
    head context runs the head file's model, which stays open when the engine closes."""
    from llamaspec.targets import shrink_own_contexts

    trunk, head_file = tmp_path / "tiny.gguf", tmp_path / "mtp-tiny.gguf"
    split_mtp_head(mtp_target(arch_dir), trunk, head_file)
    n_ctx = 1024
    with load_pair(str(trunk), str(head_file), drafter="mtp", policy="fixed", draft_max=3,
                   **{**SETTINGS, "n_ctx": n_ctx}) as p:
        prompts = HYBRID_PROMPTS[:3]
        expected = alone(p, prompts, max_tokens=12)
        shrink_own_contexts(p)
        # llama.cpp makes a context of at least 256 tokens
        assert p.target_ctx.n_ctx == max(p.target_ctx.n_batch, 256) < n_ctx
        assert p.draft_ctx.n_ctx == p.target_ctx.n_ctx and p.draft_ctx.head is not None
        again = alone(p, prompts, max_tokens=12)
        assert [(c.tokens, c.stats.accepted) for c in again] == [(c.tokens, c.stats.accepted) for c in expected]
        got = p.generate_batch(prompts, n_ctx=n_ctx, max_tokens=12)
        assert p._shared.target.mtp is not None and sum(c.stats.accepted for c in got) > 0
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        p._shared.close()
        p._shared = None
        assert [c.tokens for c in alone(p, prompts[:1], max_tokens=12)] == [expected[0].tokens]   # head file open


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_pairs_that_cannot_batch_run_one_at_a_time_and_say_why(arch_dir, arch):
    """A recurrent draft model (qwen35 drafting for itself), and a recurrent target without rollback snapshots
    (mamba2) with a drafter, fall back to one prompt at a time with the same replies."""
    target = make_arch_model(arch, arch_dir, seed=1, stdev=0.5)
    kw = dict(draft=target) if arch == "qwen35" else dict(drafter="lookup")
    with load_pair(target, policy="fixed", draft_max=3, **kw, **SETTINGS) as p:
        why = batch_support(p)
        assert why is not None and "recurrent state" in why
        prompts = [[3, 17, 42, 99, 5], [64, 23, 8, 77]]
        assert [c.tokens for c in p.generate_batch(prompts, max_tokens=8)] == \
            [c.tokens for c in alone(p, prompts, max_tokens=8)]
        assert p._shared is None


@pytest.mark.realmodel
def test_greedy_batch_equals_alone_on_the_real_pair(real_models):
    from conftest import REAL_DRAFT, REAL_TARGET

    with load_pair(real_models / REAL_TARGET, real_models / REAL_DRAFT, n_ctx=512, policy="fixed", draft_max=4,
                   no_repack=True, flash_attn="off") as p:
        prompts = [PROMPTS[0], PROMPTS[2], "class LRUCache:\n    def __init__(self, capacity):"]
        expected = alone(p, prompts, max_tokens=16)
        got = p.generate_batch(prompts, max_tokens=16)
        for prompt, g, e in zip(prompts, got, expected):   # a real model's near-ties may round either way
            assert_same_or_near_tie(p.target_ctx, p.tokenize(prompt), g.tokens, e.tokens)
        assert sum(c.stats.accepted for c in got) > 0


@pytest.mark.realmodel
def test_greedy_auto_batch_equals_alone_on_the_real_pair(real_models):
    from conftest import REAL_DRAFT, REAL_TARGET

    with load_pair(real_models / REAL_TARGET, real_models / REAL_DRAFT, n_ctx=512, policy="auto", draft_max=6,
                   no_repack=True, flash_attn="off") as p:
        prompts = [PROMPTS[0], PROMPTS[2], "class LRUCache:\n    def __init__(self, capacity):", PROMPTS[4]]
        expected = alone(p, prompts, max_tokens=24)
        got = p.generate_batch(prompts, max_tokens=24)
        for prompt, g, e in zip(prompts, got, expected):
            assert_same_or_near_tie(p.target_ctx, p.tokenize(prompt), g.tokens, e.tokens)
        assert decided_together(p._shared, 6), p._shared.policy.describe()
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
    from llamaspec.targets import shrink_own_contexts
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
        assert p.engine(2, n_ctx).target.ctx.n_ctx == n_ctx
        assert [c.tokens for c in got] == expected


def test_a_hybrid_slot_comes_back_to_its_turn_checkpoint(arch_dir):
    """A re-rendered conversation (the last prompt, another answer than the one generated, a new question) on a
    qwen35 target in a shared context: the slot restores the recurrent state it saved at the end of the last prompt
    and decodes only what follows it, and the reply is the one a fresh cache gives."""
    with load_pair(hybrid(arch_dir), drafter="lookup", policy="fixed", draft_max=4, **SETTINGS) as p:
        p1 = list(range(10, 70)) + [5, 6, 7]
        first = p.generate_batch([p1, HYBRID_PROMPTS[1]], n_seq=2, max_tokens=8)
        p2 = p1 + [90, 91, 92, 93] + [7, 8, 9]   # not first[0].tokens: the client re-sends its own answer
        assert p2[len(p1):len(p1) + 4] != first[0].tokens[:4]
        again = p.generate_batch([p2, HYBRID_PROMPTS[1] + first[1].tokens + [3]], n_seq=2, max_tokens=8)
        # decoded again: only what follows the turn checkpoint, TURN_TAIL tokens before p1's end
        assert again[0].stats.prompt_tokens_cached == len(p1) - TURN_TAIL
        assert again[1].stats.prompt_tokens_cached >= len(HYBRID_PROMPTS[1])
        engine = p._shared
        assert sum(s.seq.restored_tokens for s in engine.slots) > 0
        p.reset()
        assert [c.tokens for c in again] == [c.tokens for c in alone(p, [p2, HYBRID_PROMPTS[1] + first[1].tokens + [3]],
                                                                    max_tokens=8)]


_HELD: list[int] = []   # outside the policy: each slot takes a copy of it


class _HeldRecorder(FixedPolicy):
    def held(self, tokens: int) -> None:
        _HELD.append(tokens)


def test_each_batched_request_tells_its_policy_the_tokens_it_follows(pair):
    """As alone (tests/engine/test_fake.py): `held` gets the prompt's tokens but its last, for each sequence's own
    policy (auto prices a pass by the context it reads)."""
    _HELD.clear()
    pair.set_policy(_HeldRecorder(2))
    try:
        pair.generate_batch(PROMPTS[:2], max_tokens=3)
    finally:
        pair.set_policy(FixedPolicy(4))
    assert sorted(_HELD) == sorted(len(pair.tokenize(p)) - 1 for p in PROMPTS[:2])


@pytest.mark.parametrize("model", ["draft", "mtp-qwen35", "mtp-glm4moe"])
def test_tail_probes_in_a_batch_draft_and_leave_each_cache_as_alone(tiny_models, arch_dir, model, monkeypatch):
    """A tail probe (one token drafted past k, judged by the target's next token, never verified: policy/auto.py
    _tail_due) in the shared engine: each slot's drafter proposes k + 1 in the batched decodes and the target
    verifies k. Every prompt's tokens are plain decoding's, every proposal is the one the drafter makes alone at
    the same history (its cache holds no probe token: a random MTP head shows a wrong entry), and the probes were
    judged where the draft token was kept."""
    from support.probes import TailEvery

    if model == "draft":
        kw, prompts = dict(target=tiny_models["target"], draft=tiny_models["noisy"]), PROMPTS[:4]
    else:
        path = make_mtp_model(model.split("-")[1], arch_dir, head="random")
        kw, prompts = dict(target=str(path), drafter="mtp"), HYBRID_PROMPTS[:4]
    with load_pair(**kw, policy="fixed", draft_max=3, **SETTINGS) as p:
        p.set_policy(FixedPolicy(0))
        plain = alone(p, prompts, max_tokens=16)
        p.set_policy(TailEvery())
        engine = p.engine(4, p.n_ctx * 4)
        solo, batched = _recording_proposals(p, engine, monkeypatch)
        expected = alone(p, prompts, max_tokens=16)
        got = p.generate_batch(prompts, n_seq=4, max_tokens=16)
        assert p._shared is engine
    assert [c.tokens for c in got] == [c.tokens for c in expected] == [c.tokens for c in plain]
    assert all(c.stats.tail_probes > 0 for c in got)
    assert [(c.stats.tail_probes, c.stats.drafted, c.stats.accepted) for c in got] == \
        [(c.stats.tail_probes, c.stats.drafted, c.stats.accepted) for c in expected]
    assert all(len(d) == 2 for d in batched.values()) and len(batched) > 2 * len(prompts)
    assert all(solo[key] == d for key, d in batched.items())


def test_slots_drafting_together_take_the_batch_policys_tail_probes(pair, monkeypatch):
    """`auto` slots sharing a pass get their lengths and probes from the batch policy (policy/batch.py
    _tail_due): where it gives a slot one token and asks a tail probe, the slot's drafter proposes two, the target
    verifies one, the output is the one alone, and the slot's own policy has position 2 judged by the probes."""
    from llamaspec.policy import AutoPolicy
    from llamaspec.policy.batch import BatchPolicy

    expected = alone(pair, PROMPTS[:3], max_tokens=20)
    monkeypatch.setattr(BatchPolicy, "allocate", lambda self, asks, recurrent=False: [min(1, a.cap) for a in asks])
    monkeypatch.setattr(BatchPolicy, "_tail_due", lambda self, *args: True)
    pair.set_policy(AutoPolicy(draft_max=4))
    try:
        got = pair.generate_batch(PROMPTS[:3], max_tokens=20)
        slots = pair._shared.slots
    finally:
        pair.set_policy(FixedPolicy(4))
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    assert all(c.stats.tail_probes > 0 for c in got) and sum(c.stats.accepted for c in got) > 0
    assert all(1 <= c.stats.drafted <= c.stats.target_passes for c in got)   # one token verified a step
    # position 2 judged wherever a first token was kept (a probe behind a rejection is not judged)
    assert [s.policy.accept.seen[2] > 0 for s in slots[:3]] == [c.stats.accepted > 0 for c in got]
