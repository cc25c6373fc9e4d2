"""The one timed decode (backend Context._timed_decode): every caller's failure keeps its error and its memory,
and decode_seconds / decode_calls count each decode with its device sync, as the benchmarks read them."""
import time
from types import SimpleNamespace

import numpy as np
import pytest

from llamaspec import backend
from llamaspec.backend.context import Context
from llamaspec.backend.native import llama_cpp
from llamaspec.backend.sequences import shared_like
from llamaspec.config import ModelConfig
from llamaspec.errors import Cancelled, ContextOverflowError, DecodeError

PAUSE = 0.02   # what a fake decode takes


def _failing(rc: int):
    def decode(*args):
        time.sleep(PAUSE)
        return rc
    return decode


@pytest.fixture()
def ctx(tiny_models):
    model = backend.Model(tiny_models["target"], ModelConfig(no_repack=True))
    context = backend.Context(model, ModelConfig(n_ctx=256, n_threads=1))
    yield context
    context.close()
    model.close()


def test_a_named_batch_fails_with_its_name_after_its_undo_and_is_counted(monkeypatch):
    """Through the helper alone (a stand-in context): the caller's text, with n filled in, its undo run first, the
    failed call timed and counted; llama_process for an extended batch."""
    undone = []
    fake = SimpleNamespace(_ptr=None, decode_seconds=0.0, decode_calls=0, resync=lambda: undone.append("resync"))
    monkeypatch.setattr(llama_cpp, "llama_decode", _failing(-3))
    with pytest.raises(DecodeError, match=r"^llama_decode failed with code -3 on a shared batch of 7 tokens$"):
        Context._timed_decode(fake, None, 7, llama_cpp.llama_get_logits, undo=lambda: undone.append("undo"),
                              what="a shared batch of {n} tokens")
    assert undone == ["undo"] and fake.decode_calls == 1 and fake.decode_seconds >= PAUSE
    monkeypatch.setattr(llama_cpp, "llama_process", _failing(5))
    with pytest.raises(DecodeError, match=r"^llama_process failed with code 5 on the draft's batch of 3 entries$"):
        Context._timed_decode(fake, None, 3, what="the draft's batch of {n} entries", process=1)
    assert undone == ["undo", "resync"] and fake.decode_calls == 2 and fake.decode_seconds >= 2 * PAUSE


def test_a_successful_decode_counts_its_sync_and_returns_what_it_read(monkeypatch):
    fake = SimpleNamespace(_ptr="ctx", decode_seconds=0.0, decode_calls=0, resync=None)
    monkeypatch.setattr(llama_cpp, "llama_decode", lambda ptr, batch: 0)

    def sync(ptr):
        time.sleep(PAUSE)   # reading the logits waits for the device: part of the decode's time
        return f"rows of {ptr}"

    assert Context._timed_decode(fake, None, 1, sync) == "rows of ctx"
    assert Context._timed_decode(fake, None, 1) is None
    assert fake.decode_calls == 2 and PAUSE <= fake.decode_seconds < 1


@pytest.mark.parametrize("rc, error, text", [
    (1, ContextOverflowError, r"^no KV cache slot for 3 tokens at position 2 \(context 256\)$"),
    (2, Cancelled, r"^stopped while decoding 3 tokens$"),
    (-1, DecodeError, r"^llama_decode failed with code -1$"),
])
def test_one_sequences_failed_eval_says_why_and_leaves_the_cache_as_it_was(ctx, monkeypatch, rc, error, text):
    ctx.eval([11, 12], "last")
    calls, seconds = ctx.decode_calls, ctx.decode_seconds
    monkeypatch.setattr(llama_cpp, "llama_decode", _failing(rc))
    with pytest.raises(error, match=text):
        ctx.eval([13, 14, 15], "all")
    with pytest.raises(error):
        ctx.eval([13], "last")   # the one-token path goes through the same helper
    monkeypatch.undo()
    assert ctx.tokens == [11, 12] and ctx.memory_len() == 2
    assert ctx.decode_calls == calls + 2 and ctx.decode_seconds >= seconds + 2 * PAUSE


def test_a_decode_whose_rows_a_follower_reads_at_once_is_timed_to_the_end_of_its_device_work(ctx, monkeypatch):
    """An MTP head follows the target through on_decode and reads the decode's hidden rows at once, which waits for
    the device: a verification with no logits asked (its tokens sampled on the device) returned from llama_decode
    before the device was done, and the wait, 137 us a pass of the 27B on an H100, was counted as Python's. With a
    follower the decode syncs inside its timed span, before the follower runs; without one it stays asynchronous."""
    events = []
    real_sync = llama_cpp.llama_synchronize

    def slow_sync(ptr):
        time.sleep(PAUSE)   # the device finishing the pass
        events.append("sync")
        return real_sync(ptr)

    monkeypatch.setattr(llama_cpp, "llama_synchronize", slow_sync)
    ctx.eval([11, 12, 13], "none")
    assert events == []   # no follower: nothing waits
    ctx.on_decode = lambda tokens, first: events.append(("follow", list(tokens), first))
    seconds = ctx.decode_seconds
    ctx.eval([14, 15], "none")
    assert events == ["sync", ("follow", [14, 15], 3)] and ctx.decode_seconds >= seconds + PAUSE
    shared = shared_like(ctx, 2)   # the batch engine's shared context, its MTP heads following through on_runs
    try:
        s0, s1 = shared.sequences
        events.clear()
        shared.decode([shared.Run(s0, [21, 22], "none"), shared.Run(s1, [31], "none")])
        assert events == []
        shared.on_runs = lambda runs: events.append(("follow", [len(r.tokens) for r in runs]))
        seconds = shared.decode_seconds
        shared.decode([shared.Run(s0, [23], "none"), shared.Run(s1, [32, 33], "none")])
        assert events == ["sync", ("follow", [1, 2])] and shared.decode_seconds >= seconds + PAUSE
    finally:
        shared.close()


def test_every_chunk_of_a_long_eval_is_one_counted_decode(tiny_models):
    model = backend.Model(tiny_models["target"], ModelConfig(no_repack=True))
    ctx = backend.Context(model, ModelConfig(n_ctx=128, n_batch=32, n_threads=1))
    try:
        ctx.eval(list(range(100, 100 + 2 * ctx.n_batch + 5)), "last")
        assert ctx.n_batch == 32 and ctx.decode_calls == 3 and ctx.decode_seconds > 0
    finally:
        ctx.close()
        model.close()


def test_a_failed_shared_batch_names_itself_and_leaves_every_sequence_as_it_was(ctx, monkeypatch):
    shared = shared_like(ctx, 2)
    try:
        s0, s1 = shared.sequences
        shared.decode([shared.Run(s0, [21, 22], "none"), shared.Run(s1, [31], "none")])
        before = shared.decode_calls
        monkeypatch.setattr(llama_cpp, "llama_decode", _failing(-2))
        with pytest.raises(DecodeError, match=r"^llama_decode failed with code -2 on a shared batch of 3 tokens$"):
            shared.decode([shared.Run(s0, [23], "last"), shared.Run(s1, [32, 33], "all")])
        monkeypatch.undo()
        assert (s0.tokens, s1.tokens) == ([21, 22], [31]) and shared.decode_calls == before + 1
        rows = shared.decode([shared.Run(s0, [23], "last"), shared.Run(s1, [32, 33], "all")])
        assert rows[0].shape == (1, shared.n_vocab) and rows[1].shape == (2, shared.n_vocab)
        assert np.isfinite(rows[1]).all() and shared.decode_calls == before + 2
    finally:
        shared.close()


def test_a_failed_tree_pass_drops_its_branches_and_keeps_the_committed_sequence(tiny_models, monkeypatch):
    from llamaspec.backend.tree import TreeContext

    model = backend.Model(tiny_models["target"], ModelConfig(no_repack=True))
    tree = TreeContext(model, ModelConfig(n_ctx=128, n_threads=1), 3)
    try:
        tree.eval([41, 42, 43], "last")
        monkeypatch.setattr(llama_cpp, "llama_decode", _failing(-5))
        with pytest.raises(DecodeError, match=r"^llama_decode failed with code -5$"):
            tree.eval_tree([44, 45, 46], [(1, 47), (2, 48)])
        monkeypatch.undo()
        assert tree.tokens == [41, 42, 43] and tree.memory_len() == 3 and tree.decode_calls == 2
        assert [int(llama_cpp.llama_memory_seq_pos_max(tree.memory, s)) for s in (1, 2)] == [-1, -1]
        rows = tree.eval_tree([44, 45, 46], [(1, 47), (2, 48)])   # the same pass again works
        assert rows.shape == (5, tree.n_vocab) and tree.tokens == [41, 42, 43, 44, 45, 46]
    finally:
        tree.close()
        model.close()


def test_the_mtp_heads_failed_decodes_keep_their_text_and_their_cache(tmp_path, monkeypatch):
    """The lone head (MTPContext.decode) and the batched one (SharedMTPContext.decode_runs) through the same helper:
    llama.cpp's tiny qwen35 with an MTP head (skipped without test-llama-archs)."""
    from support.mtp_models import make_mtp_model
    from llamaspec import load_pair

    target = make_mtp_model("qwen35", tmp_path, head="agree", trunk_mix=0.1)
    settings = dict(n_ctx=256, n_batch=64, no_repack=True, n_threads=1, flash_attn="off")
    with load_pair(str(target), drafter="mtp", policy="fixed", draft_max=2, **settings) as p:
        p.generate([5, 6, 7, 8], max_tokens=4)
        p.generate_batch([[5, 6, 7], [9, 10]], n_seq=2, max_tokens=3)
        head, shared = p.draft_ctx, p._shared.target.mtp.ctx
        seq = shared.sequences[0]
        lone = (list(head.tokens), head.decode_calls)
        batched = (list(seq.tokens), shared.decode_calls)
        state = np.zeros(shared.n_embd, np.float32)
        monkeypatch.setattr(llama_cpp, "llama_decode", _failing(-4))
        with pytest.raises(DecodeError, match=r"^llama_decode failed with code -4$"):
            head.decode([11], state, output="logits")
        with pytest.raises(DecodeError, match=r"^llama_decode failed with code -4 on the MTP head's batch of 2 "
                                              r"entries$"):
            shared.decode_runs([(seq, [11, 12], np.stack([state, state]), True)])
        monkeypatch.undo()
        assert (head.tokens, head.decode_calls) == (lone[0], lone[1] + 1)
        assert (seq.tokens, shared.decode_calls) == (batched[0], batched[1] + 1)
        assert head.memory_len() == head.n_past
        rows = shared.decode_runs([(seq, [11, 12], np.stack([state, state]), True)])   # and it decodes again
        assert rows[0][0].shape == (shared.n_vocab,) and seq.tokens == batched[0] + [11, 12]


def test_python_ms_per_step_is_the_share_python_overhead_counts_over_the_target_passes():
    from llamaspec.stats import GenerationStats

    s = GenerationStats(time_total=1.2, time_prefill=0.2, time_in_decode=0.85, time_rollback=0.05, target_passes=50)
    assert s.python_ms_per_step == pytest.approx(1000 * 0.1 / 50)                    # rollback and prefill left out
    assert s.python_ms_per_step * s.target_passes / 1000 == pytest.approx(s.python_overhead * 1.0)   # busy 1.0 s
