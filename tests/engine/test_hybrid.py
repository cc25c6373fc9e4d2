"""Speculation with hybrid and recurrent targets and drafts, exactly as without it.

The models are llama.cpp's own tiny random-weight models of real archs (tests/support/arch_models.py; stdev 0.5, so the
recurrent state matters to the logits): qwen35 (hybrid with rollback snapshots: bounded rollback), qwen3next and
mamba2 (recurrent state without snapshots: checkpoint and replay), llama (attention KV: the control). All share
one 128-token vocabulary without EOS, so any two form a pair: the same file drafts itself (mostly accepted),
another seed disagrees (a rollback at almost every step). Tests skip when test-llama-archs is absent.
"""
from __future__ import annotations

import re
import time

import numpy as np
import pytest
from click.testing import CliRunner

from support.arch_models import make_arch_model, require_test_llama_archs
from support.fakes import FakeContext, FakeModel
from support.mtp_models import add_mtp_block
from llamaspec import load_pair
from llamaspec.backend import Context, Model
from llamaspec.backend.native import llama_cpp
from llamaspec.backend.rollback import PARTIAL_ONLY, NoRollback
from llamaspec.config import ModelConfig
from llamaspec.drafters import make_drafter
from llamaspec.engine import Pair
from llamaspec.errors import UnsupportedModelError
from llamaspec.gguf.memory import Settings, kv_cache_bytes, model_memory
from llamaspec.gguf.reader import read_model_info
from llamaspec.targets import TURN_TAIL
from llamaspec.gguf.recurrent import HYBRID_ARCHS, RECURRENT_ARCHS, recurrent_state_bytes, rollback_kind
from llamaspec.kinds import KINDS
from llamaspec.policy import AutoPolicy, FixedPolicy, make_policy
from llamaspec.sampling import SamplerConfig, filtered_probs

KIND = {"qwen35": "bounded", "lfm2": "bounded", "qwen3next": "checkpoint", "mamba2": "checkpoint", "llama": "kv"}
N_RS_SEQ = 4          # draft_max of the pairs below: the bounded target keeps this many snapshots
PROMPT = [3, 17, 42, 99, 5, 64, 23, 8, 77, 120, 31, 2, 56, 90, 14, 71, 39, 101, 66, 12]
SETTINGS = dict(n_ctx=256, n_batch=64, no_repack=True)


@pytest.fixture(scope="session")
def arch_dir(tmp_path_factory):
    require_test_llama_archs()
    return tmp_path_factory.mktemp("arch-models")


def arch_file(arch_dir, arch, seed=1):
    return make_arch_model(arch, arch_dir, seed=seed, stdev=0.5)


@pytest.fixture(scope="module")
def pairs(arch_dir):
    """(target arch, draft arch, draft seed) -> a loaded pair (draft None: the target alone), loaded once."""
    loaded = {}

    def get(target, draft=None, seed=1):
        key = (target, draft, seed)
        if key not in loaded:
            loaded[key] = load_pair(arch_file(arch_dir, target),
                                    arch_file(arch_dir, draft, seed) if draft else None,
                                    policy="fixed", draft_max=N_RS_SEQ, **SETTINGS)
        return loaded[key]

    yield get
    for pair in loaded.values():
        pair.close()


def plain_tokens(pairs, arch, prompt=PROMPT, max_tokens=40):
    """Plain decoding with the target alone, from an empty cache."""
    pair = pairs(arch)
    pair.reset()
    return pair.generate(prompt, max_tokens=max_tokens).tokens


def assert_same_or_near_tie(pairs, arch, prompt, got, expected):
    """Token for token, except at a near-tie: where the target's top two logits differ by less than the batched
    vs one-token rounding noise measured there (and both tokens are those two)."""
    if got == expected:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
    ctx = pairs(arch).target_ctx
    ctx.clear()
    context = list(prompt) + expected[:i]
    batched = np.array(ctx.eval(context, logits="all")[-1])
    ctx.clear()
    ctx.eval(context[:-1], logits="none")
    single = np.array(ctx.eval(context[-1:], logits="last")[0])
    ctx.clear()
    noise = float(np.abs(batched - single).max())
    top2 = np.argsort(single)[-2:]
    gap = float(single[top2[1]] - single[top2[0]])
    assert gap <= 2 * noise + 1e-6 and {got[i], expected[i]} <= set(top2.tolist()), (
        f"diverged at token {i}: top-2 gap {gap:.2e}, rounding noise {noise:.2e}")


# ---------------------------------------------------------------------------------------------------------------
# which rollback each memory gets
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", KIND)
def test_each_memory_kind_gets_its_rollback(pairs, arch, arch_dir):
    pair = pairs(arch, arch)
    assert pair.target_ctx.rollback.name == KIND[arch]
    assert rollback_kind(read_model_info(arch_file(arch_dir, arch))) == KIND[arch]   # what check/doctor say
    # a draft decodes one token at a time: snapshots cannot undo those, so a recurrent draft checkpoints
    assert pair.draft_ctx.rollback.name == ("kv" if KIND[arch] == "kv" else "checkpoint")
    if KIND[arch] == "bounded":
        assert pair.target_ctx.rollback.n_rs_seq == N_RS_SEQ == int(llama_cpp.llama_n_rs_seq(pair.target_ctx._ptr))


@pytest.mark.parametrize("arch", sorted(RECURRENT_ARCHS | HYBRID_ARCHS))
def test_the_header_table_says_what_llama_cpp_does(arch_dir, arch):
    """check/doctor's arch table (gguf/recurrent.py) against the rollback a loaded context really gets."""
    try:
        path = arch_file(arch_dir, arch)
    except RuntimeError:
        pytest.skip(f"test-llama-archs cannot write {arch}")
    options = ModelConfig(n_ctx=256, n_batch=64, n_rs_seq=N_RS_SEQ, no_repack=True)
    model = Model(path, options)
    ctx = Context(model, options)
    try:
        assert ctx.rollback.name == rollback_kind(read_model_info(path))
    finally:
        ctx.close()
        model.close()


def test_snapshots_are_clamped_to_the_batch_instead_of_aborting(arch_dir):
    # llama.cpp aborts the process on the first decode unless n_ubatch >= n_rs_seq + 2 (a draft of 3 wants 3
    # snapshots; a batch of 4 holds 2); a longer draft than the batch holds is refused (bounds.py)
    with load_pair(arch_file(arch_dir, "qwen35"), arch_file(arch_dir, "qwen35", 2), policy="fixed", draft_max=3,
                   n_ctx=256, n_batch=4, no_repack=True) as pair:
        assert pair.target_ctx.rollback.n_rs_seq == 2
        c = pair.generate(PROMPT, max_tokens=12)
        pair.set_policy(FixedPolicy(0))
        assert c.tokens == pair.generate(PROMPT, max_tokens=12).tokens


@pytest.mark.parametrize("target, drafter, draft, settings, reach", [
    ("qwen35", "model", "qwen35", {}, KINDS["model"].snapshot_k_max),    # open reach: the kind's on snapshots
    ("qwen35", "mtp", None, {}, KINDS["mtp"].snapshot_k_max),
    ("qwen35", "model", "qwen35", {"draft_max": 7}, 7),                  # a reach asked for is kept
    ("qwen35", "model", "qwen35", {"policy": "fixed", "draft_max": 2}, 2),
    ("llama", "model", "llama", {}, make_policy("auto").draft_max),          # no snapshots: auto's own reach
])
def test_open_draft_reach_on_snapshot_targets_is_the_kinds(arch_dir, target, drafter, draft, settings, reach):
    # every snapshot is written on every decode, plain steps too: auto's 12-token reach would keep 12 of them
    path = arch_file(arch_dir, target)
    if drafter == "mtp":
        path = add_mtp_block(path, arch_dir / f"{target}-mtp.gguf")
    with load_pair(path, arch_file(arch_dir, draft, 2) if draft else None, drafter=drafter,
                   **{**SETTINGS, **settings}) as pair:
        assert pair.policy.draft_max == reach
        if KIND[target] == "bounded":
            assert pair.config.drafting.draft_max == reach == pair.target_ctx.rollback.n_rs_seq
        else:
            assert pair.config.drafting.draft_max == settings.get("draft_max")


def test_a_memory_that_cannot_roll_back_refuses_speculation_and_runs_plainly(arch_dir, monkeypatch):
    monkeypatch.setattr("llamaspec.backend.context.choose_rollback", lambda ctx, n_turns: NoRollback())
    with pytest.raises(UnsupportedModelError) as err:
        load_pair(arch_file(arch_dir, "mamba2"), arch_file(arch_dir, "mamba2", 2), **SETTINGS)
    assert "\n" not in str(err.value) and "without a draft" in str(err.value)
    with load_pair(arch_file(arch_dir, "mamba2"), **SETTINGS) as pair:
        assert len(pair.generate(PROMPT, max_tokens=4).tokens) == 4


# ---------------------------------------------------------------------------------------------------------------
# greedy: exactly plain decoding
# ---------------------------------------------------------------------------------------------------------------
# the last two: a hybrid whose checkpoints carry its sliding-window KV; an attention target with a hybrid draft
DRAFTS = [("qwen35", "qwen35"), ("qwen3next", "qwen3next"), ("mamba2", "mamba2"), ("llama", "llama"),
          pytest.param("lfm2", "lfm2", marks=pytest.mark.slow), ("llama", "qwen35")]


@pytest.mark.parametrize("target, draft", DRAFTS)
@pytest.mark.parametrize("seed", [1, 2], ids=["self-draft", "disagreeing-draft"])
def test_greedy_speculation_equals_plain_decoding(pairs, target, draft, seed):
    expected = plain_tokens(pairs, target)
    pair = pairs(target, draft, seed)
    pair.reset()
    for policy in (FixedPolicy(1), FixedPolicy(N_RS_SEQ), FixedPolicy(N_RS_SEQ + 3), make_policy("auto")):
        pair.set_policy(policy)
        pair.reset()   # each from an empty cache: no replay of the prompt (its turn checkpoint is TURN_TAIL back)
        replayed_before = pair.target_ctx.replayed_tokens
        got = pair.generate(PROMPT, max_tokens=40)
        assert_same_or_near_tie(pairs, target, PROMPT, got.tokens, expected)
        s = got.stats
        if policy.name == "auto":
            continue
        assert s.drafted > 0
        if target == draft and seed == 1:
            assert s.acceptance_rate > 0.9
            continue
        assert s.acceptance_rate < 0.5   # rollbacks at nearly every step
        target_replays = pair.target_ctx.replayed_tokens - replayed_before
        if KIND[target] == "checkpoint":
            assert target_replays > 0    # restored and replayed
        elif KIND[target] == "bounded":
            # within the snapshots seq_rm drops the rejected tokens; a longer draft goes back by checkpoint
            assert (target_replays > 0) == (policy.draft_max > N_RS_SEQ)
        else:
            assert target_replays == 0


# ---------------------------------------------------------------------------------------------------------------
# sampling: the target's distribution
# ---------------------------------------------------------------------------------------------------------------
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_0001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
                  10: 29.59, 11: 31.26, 12: 32.91}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over bins with expected count >= 5 (the rest pooled into one bin)."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.array(list(counts[big]) + [counts[~big].sum()])
    exp = np.array(list(expected[big]) + [expected[~big].sum()])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("device", ["0", "1"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
@pytest.mark.slow
def test_sampled_tokens_after_a_rollback_follow_the_target_distribution(pairs, arch, device, monkeypatch):
    """The joint law of the first two tokens: with a disagreeing one-token draft the second token is mostly
    sampled after the first draft token was rejected and the recurrent state went back. Filtered by numpy (0) and
    by llama.cpp's sampler chain (1: the device path, here on the CPU backend), whose rows must follow a replay
    that a checkpoint restore put in front of the batch."""
    monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", device)
    cfg = SamplerConfig(temperature=1.5, top_k=3)
    ctx = pairs(arch).target_ctx
    ctx.clear()
    p1 = filtered_probs(np.array(ctx.eval(PROMPT, logits="last")[0]), cfg).astype(np.float64)
    joint = np.zeros((len(p1), len(p1)))
    for t in np.flatnonzero(p1):
        ctx.clear()
        joint[t] = p1[t] * filtered_probs(np.array(ctx.eval(PROMPT + [int(t)], logits="last")[0]), cfg)
    ctx.clear()

    pair = pairs(arch, arch, 2)
    pair.set_policy(FixedPolicy(1))
    counts = np.zeros_like(joint)
    rejected = 0
    for seed in range(300):
        c = pair.generate(PROMPT, max_tokens=2, temperature=1.5, top_k=3, seed=seed)
        counts[c.tokens[0], c.tokens[1]] += 1
        rejected += c.stats.drafted - c.stats.accepted
    assert rejected > 100                          # the second token mostly came after a rollback
    assert pair.target_ctx.device_sampler == (device == "1")
    assert counts[joint == 0].sum() == 0           # nothing outside the target's top-k
    stat, dof = chi_square(counts.ravel(), joint.ravel() / joint.sum())
    assert dof >= 2
    assert stat < CHI2_CRIT_0001[dof], f"chi2={stat:.1f} with {dof} dof"


# ---------------------------------------------------------------------------------------------------------------
# interruptions and multi-turn reuse
# ---------------------------------------------------------------------------------------------------------------
def assert_caches_consistent(pair):
    for ctx in (pair.target_ctx, *pair.drafter.contexts):
        assert ctx.memory_len() == ctx.n_in_memory


def continue_matches_fresh(pairs, pair, arch, prompt):
    """Generating from `prompt` on this pair's caches gives what a pair with empty caches gives."""
    got = pair.generate(prompt, max_tokens=12).tokens
    pair.reset()
    assert_same_or_near_tie(pairs, arch, prompt, got, pair.generate(prompt, max_tokens=12).tokens)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
@pytest.mark.slow
def test_device_filtering_follows_rollbacks_and_replays(pairs, arch, monkeypatch):
    """Long sampled replies on llama.cpp's sampler chain with a draft that is mostly rejected: every restore and
    replay (a single token included) lands at the right positions, and the caches end as recorded."""
    monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", "1")
    pair = pairs(arch, arch, 2)
    pair.set_policy(FixedPolicy(N_RS_SEQ))
    for seed in range(4):
        pair.reset()
        c = pair.generate(PROMPT, max_tokens=60, temperature=0.8, seed=seed)
        assert len(c.tokens) == 60 and pair.target_ctx.device_sampler
        assert_caches_consistent(pair)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next", "llama"])
def test_interrupted_steps_leave_the_caches_consistent(pairs, arch, monkeypatch):
    """Ctrl-C lands after a decode and before it is recorded (the worst moment); the conversation then goes on
    with what was emitted, as a chat does."""
    pair = pairs(arch, arch, 2)
    pair.set_policy(FixedPolicy(3))
    real_decode = llama_cpp.llama_decode
    for n_decodes in (3, 6, 9, 12):
        calls, emitted = [0], []

        def interrupting(ctx, batch):
            rc = real_decode(ctx, batch)
            calls[0] += 1
            if calls[0] == n_decodes:
                raise KeyboardInterrupt
            return rc

        monkeypatch.setattr(llama_cpp, "llama_decode", interrupting)
        with pytest.raises(KeyboardInterrupt):
            for token, _ in pair.generate_tokens(PROMPT, 24, SamplerConfig()):
                emitted.append(token)
        monkeypatch.setattr(llama_cpp, "llama_decode", real_decode)
        assert_caches_consistent(pair)
        continue_matches_fresh(pairs, pair, arch, PROMPT + emitted + [7])
    # a consumer that stops early (a closed generator) between two multi-token steps
    stream = pair.generate_tokens(PROMPT, 24, SamplerConfig())
    emitted = [next(stream)[0] for _ in range(5)]
    stream.close()
    assert_caches_consistent(pair)
    continue_matches_fresh(pairs, pair, arch, PROMPT + emitted + [7])


def test_plain_steps_are_never_undone_by_snapshots(pairs):
    """After one-token decodes the snapshots are stale (llama.cpp's seq_rm says True and leaves a wrong state):
    a prompt that drops the last two tokens of a plain generation must go back by checkpoint."""
    pair = pairs("qwen35", "qwen35", 2)
    pair.set_policy(FixedPolicy(0))
    pair.reset()
    first = pair.generate(PROMPT, max_tokens=8).tokens
    pair.set_policy(FixedPolicy(3))
    continue_matches_fresh(pairs, pair, "qwen35", PROMPT + first[:5] + [(first[5] + 1) % 128])


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_a_prompt_saves_one_turn_checkpoint(pairs, arch):
    """A recurrent state's turn checkpoint is a copy of the whole state (150 MiB for a 27B hybrid): one a prompt,
    TURN_TAIL tokens before its end, where a re-rendered answer leaves it; one at its very end too would cost a
    copy on every request to save a later prompt three tokens of its prefill. A prompt the cache held but for its
    last few tokens saves its end."""
    pair = pairs(arch, arch, 2)
    pair.set_policy(FixedPolicy(2))
    pair.reset()
    turns = lambda: sorted(t.pos for t in pair.target_ctx.rollback._turns)   # noqa: E731
    first = pair.generate(PROMPT, max_tokens=6).tokens
    assert turns() == [len(PROMPT) - TURN_TAIL]
    again = PROMPT + first + list(range(30, 40))   # extends what the cache holds: prefilled from there
    second = pair.generate(again, max_tokens=6).tokens
    assert turns() == [len(PROMPT) - TURN_TAIL, len(again) - TURN_TAIL]
    last = again + second + [9]   # the cache holds all but its last token or two: its end is saved
    pair.generate(last, max_tokens=4)
    assert turns()[:2] == [len(PROMPT) - TURN_TAIL, len(again) - TURN_TAIL] and len(turns()) == 3
    assert len(last) - TURN_TAIL < turns()[2] < len(last)


def test_the_prompts_checkpoint_is_prompt_processing_not_a_steps_rollback(pairs, monkeypatch):
    """Plain decoding rolls nothing back: the prompt's turn checkpoint (a copy of the whole recurrent state) counts in
    time_prefill, not in time_rollback, which python_overhead takes out of the generation's time (on the H200 the
    checkpoints of a 27B hybrid's prompt read as 0.3 ms of rollback a step and hid as much Python time)."""
    from llamaspec.backend.rollback import BoundedRollback

    pair = pairs("qwen35", "qwen35", 2)
    pair.set_policy(FixedPolicy(0))
    pair.reset()
    save = BoundedRollback.checkpoint

    def slow_save(self, ctx, turn=False):
        time.sleep(0.05)
        return save(self, ctx, turn)

    monkeypatch.setattr(BoundedRollback, "checkpoint", slow_save)
    stats = pair.generate(PROMPT, max_tokens=8).stats
    assert stats.time_prefill >= 0.05 and stats.time_rollback < 0.01, (stats.time_prefill, stats.time_rollback)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next", "mamba2", "llama"])
def test_later_turns_reuse_earlier_ones_and_equal_a_fresh_pair(pairs, arch):
    pair = pairs(arch, arch, 2)
    pair.set_policy(FixedPolicy(3))
    pair.reset()
    first = pair.generate(PROMPT, max_tokens=16)
    second_prompt = PROMPT + first.tokens + [7, 8, 9]
    second = pair.generate(second_prompt, max_tokens=16)
    # the end of the first generation was kept: at most the last step's replay is decoded again
    assert second.stats.prompt_tokens_cached >= len(PROMPT) + len(first.tokens) - 1 - (3 + 1)
    # a prompt that leaves the first answer early: a recurrent memory restarts from the first prompt's end
    third_prompt = PROMPT + first.tokens[:4] + [(first.tokens[4] + 1) % 128]
    third = pair.generate(third_prompt, max_tokens=16)
    # (a recurrent memory's one turn checkpoint is TURN_TAIL tokens before the first prompt's end)
    reused = len(PROMPT) + 4 if KIND[arch] == "kv" else len(PROMPT) - TURN_TAIL
    assert third.stats.prompt_tokens_cached == reused
    for prompt, got in ((second_prompt, second), (third_prompt, third)):
        pair.reset()
        fresh = pair.generate(prompt, max_tokens=16)
        assert fresh.stats.prompt_tokens_cached == 0
        assert got.tokens == fresh.tokens


# ---------------------------------------------------------------------------------------------------------------
# the memory plan and the CLI
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen35", "qwen3next", "mamba2", "lfm2", "nemotron_h"])
def test_the_recurrent_state_estimate_matches_llama_cpp(arch_dir, arch):
    path = arch_file(arch_dir, arch)
    info = read_model_info(path)
    options = ModelConfig(n_ctx=256, n_batch=64, n_rs_seq=N_RS_SEQ, no_repack=True)
    model = Model(path, options)
    ctx = Context(model, options)
    try:
        ctx.eval(PROMPT[:4], logits="none")  # an empty memory saves only a header
        checkpoint = int(llama_cpp.llama_state_seq_get_size_ext(ctx._ptr, 0, PARTIAL_ONLY))
        state = recurrent_state_bytes(info)
        # a checkpoint = the state + a header (lfm2's also carries the sliding-window KV of its 4 tokens)
        window_kv = kv_cache_bytes(info, Settings(n_ctx=4)) if arch == "lfm2" else 0
        assert state > 0 and 0 <= checkpoint - state - window_kv < 512
        n_rs_seq = int(llama_cpp.llama_n_rs_seq(ctx._ptr))
        logged = float(re.search(r"RS buffer size =\s*([\d.]+) MiB", ctx.load_log).group(1)) * 2**20
        assert abs(logged - state * (1 + n_rs_seq)) < 0.006 * 2**20  # with its snapshots (MiB, 2 decimals)
        kv = re.search(r"KV buffer size =\s*([\d.]+) MiB", ctx.load_log)
        settings = Settings(n_ctx=ctx.n_ctx, speculative=True, n_rs_seq=n_rs_seq)
        assert abs(kv_cache_bytes(info, settings) - (float(kv.group(1)) * 2**20 if kv else 0)) < 0.006 * 2**20
        plan = model_memory(info, settings)
        copies = 1 + n_rs_seq + (rollback_kind(info) == "checkpoint")   # + the step checkpoint's device copy
        assert plan.recurrent == copies * state and plan.checkpoints == settings.n_checkpoints * state
    finally:
        ctx.close()
        model.close()


def test_check_and_doctor_say_which_rollback_a_model_uses(arch_dir):
    from llamaspec.cli import main

    target, draft = arch_file(arch_dir, "qwen35"), arch_file(arch_dir, "qwen35", 2)
    result = CliRunner().invoke(main, ["check", str(target), str(draft), "-c", "256", "--vram", "8"])
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines() if "rollback:" in line]
    assert lines[0].startswith("rollback: bounded") and lines[1].startswith("rollback: checkpoint")
    assert re.search(r"weights\s+KV cache\s+state", result.output)
    result = CliRunner().invoke(main, ["doctor", "-m", str(arch_file(arch_dir, "mamba2")),
                                       "-m", str(arch_file(arch_dir, "llama"))])
    assert "rollback: checkpoint" in result.output and "rollback: kv" in result.output


# ---------------------------------------------------------------------------------------------------------------
# the cost model sees the rollback
# ---------------------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class CostedContext(FakeContext):
    """A fake cache on a fake clock: a pass costs 1 + 0.02 per token (a GPU verifies a few tokens for about the
    price of one); dropping tokens costs `rollback` (a checkpoint restore and replay)."""

    def __init__(self, model, clock, per_pass, rollback=0.0):
        super().__init__(model)
        self.clock, self.per_pass, self.rollback = clock, per_pass, rollback

    def eval(self, tokens, logits="last"):
        self.clock.now += self.per_pass * (1 + 0.02 * len(tokens))
        return super().eval(tokens, logits)

    def keep(self, n):
        if n < self.n_past:
            self.clock.now += self.rollback
        return super().keep(n)


def test_auto_drafts_less_where_rolling_back_is_expensive(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("llamaspec.slots.time", clock)

    def mean_draft_len(rollback_cost: float) -> float:
        target, draft = FakeModel(), FakeModel(disagree=0.4, salt=3)
        pair = Pair(target, CostedContext(target, clock, 1.0, rollback_cost),
                    make_drafter("model", target, CostedContext(draft, clock, 0.05)), AutoPolicy(draft_max=8))
        stats = pair.generate([5, 6, 7], max_tokens=200).stats
        return stats.drafted / stats.target_passes

    cheap, expensive = mean_draft_len(0.0), mean_draft_len(3.0)
    assert cheap > 1.0 and expensive < 0.5 * cheap
