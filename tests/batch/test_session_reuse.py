"""Sessions that come back: a chat's next turn re-processes only what changed, and a session whose slot another
session took restores its saved state from the host-memory cache (backend/state_cache.py, `cache_ram`) instead of
processing its conversation again, with the reply a fresh cache gives; the cache's budget.

Conversations are rendered by llamaspec's chat template code with the real Qwen3.5 template (llama.cpp's
models/templates/Qwen3.5-4B.jinja, from the vendored llama.cpp under $LLAMASPEC_LLAMA_TOOLS/../src; skipped without
it): an earlier assistant turn carries a <think> block, which the template drops when it renders the turn again, so
the next prompt leaves the cached tokens where the generation prompt (`<|im_start|>assistant\\n<think>\\n`) began.
Targets: llama.cpp's tiny qwen35 (recurrent-state snapshots) and qwen3next (state saved and restored) from
tests/support/arch_models.py; their test tokenizer hashes text in 5-byte chunks.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import pytest

from support.arch_models import find_test_llama_archs, make_arch_model
from llamaspec import load_pair
from llamaspec.backend.state_cache import MIB, SavedSeq, StateCache
from llamaspec.chat_template import ChatTemplate
from llamaspec.drafters.base import common_prefix_len
from llamaspec.targets import TURN_TAIL

# Flash attention off: a shared cache then gives each sequence the rows it gets alone (test_batch's SETTINGS).
SETTINGS = dict(n_ctx=4096, n_batch=256, no_repack=True, n_threads=2, flash_attn="off")
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def qwen35_template() -> ChatTemplate:
    tools = os.environ.get("LLAMASPEC_LLAMA_TOOLS") or str(Path.home() / ".cache/llamaspec/llama-tools/bin")
    found = glob.glob(str(Path(tools).expanduser().parent / "src/*/vendor/llama.cpp/models/templates/Qwen3.5-4B.jinja"))
    if not found:
        pytest.skip("the Qwen3.5 chat template (llama.cpp's models/templates/Qwen3.5-4B.jinja) was not found next "
                    "to $LLAMASPEC_LLAMA_TOOLS: run benchmarks/build-llama-tools.sh")
    return ChatTemplate(Path(found[0]).read_text())


@pytest.fixture(scope="module")
def template():
    return qwen35_template()


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory):
    if find_test_llama_archs() is None:
        pytest.skip("llama.cpp's test-llama-archs not found: run benchmarks/build-llama-tools.sh")
    return tmp_path_factory.mktemp("session-models")


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 5) % len(WORDS)] for i in range(n))


def conversation(session: int, turns: int) -> list[dict]:
    """A session's messages for its turn `turns` (1-based): a system prompt of its own, then user questions and the
    assistant's earlier answers, each with a <think> block."""
    messages = [{"role": "system", "content": f"You are agent {session}. " + text(session, 260)}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} of {session}: " + text(session + t, 30)})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"<think>\nstep {t}: {text(t, 12)}\n</think>\n\n"
                                                             f"answer {t}: {text(session + 3 * t, 10)}"})
    return messages


def prompt(pair, template, session: int, turn: int) -> list[int]:
    return pair.tokenize(template.render(conversation(session, turn)))


def run(engine, tokens: list[int], max_tokens: int = 6):
    """One request through the engine: (its tokens, its stats)."""
    slot = engine.submit(tokens, max_tokens=max_tokens)
    out = [piece.token for piece in engine.pieces(slot) if piece.token is not None]
    return out, slot.stats


def fresh(pair, tokens: list[int], max_tokens: int = 6) -> list[int]:
    """The reply from empty caches: the pair's own contexts, reset, with nothing saved."""
    pair.reset()
    return pair.generate(tokens, max_tokens=max_tokens).tokens


# -- the budget ---------------------------------------------------------------------------------------------------
def saved(n_bytes: int, tokens) -> SavedSeq:
    return SavedSeq(np.zeros(n_bytes, dtype=np.uint8), list(tokens))


def test_the_budget_evicts_the_oldest_first_never_exceeds_its_mib_and_refuses_an_oversized_entry():
    cache = StateCache(budget_mib=1, min_tokens=4)
    quarter = MIB // 4 - 100
    for i in range(3):
        assert cache.put([i] * 10, [saved(quarter, [i] * 10)], any_prefix=True)
    assert [e.tokens[0] for e in cache.entries] == [0, 1, 2] and cache.nbytes <= MIB
    # a state of a third of the budget: the oldest goes (0), then the next oldest (1), until it fits
    assert cache.put([3] * 10, [saved(MIB // 3, [3] * 10), saved(MIB // 8, [3] * 10)], any_prefix=True)
    assert [e.tokens[0] for e in cache.entries] == [1, 2, 3]
    assert cache.nbytes <= MIB and cache.evictions == 1
    before = [e.tokens for e in cache.entries]
    assert not cache.put([9] * 10, [saved(MIB + 1, [9] * 10)], any_prefix=True)   # larger than the budget
    assert [e.tokens for e in cache.entries] == before and cache.refusals == 1
    for i in range(20):   # any sequence of stores stays within the budget
        cache.put([10 + i] * 5, [saved((i % 5 + 1) * MIB // 7, [10 + i] * 5)], any_prefix=True)
        assert cache.nbytes <= MIB
    assert cache.entries[-1].tokens[0] == 29


def test_an_entry_serves_a_prefix_an_attention_memory_any_and_a_recurrent_one_its_end_or_a_checkpoint():
    cache = StateCache(budget_mib=-1)
    cache.put([1, 2, 3, 4, 5, 6], [saved(10, [])], any_prefix=True)
    cache.put([7, 8, 9, 10, 11, 12], [saved(10, [])], marks=[3], any_prefix=False)
    assert cache.best([1, 2, 3, 9]) == (cache.entries[0], 3)            # attention: the common prefix
    assert cache.best([7, 8, 9, 10, 0])[1] == 3                          # recurrent: its checkpoint within it
    assert cache.best([7, 8, 0])[1] == 0                                 # nothing it can restore to
    assert cache.best([7, 8, 9, 10, 11, 12, 13])[1] == 6                 # its whole state
    assert cache.covers([1, 2, 3]) and not cache.covers([7, 8, 9, 10])
    cache.put([1, 2, 3, 4, 5, 6, 7, 8], [saved(10, [])], any_prefix=True)   # serves the first entry in full
    assert [e.tokens[:2] for e in cache.entries] == [[7, 8], [1, 2]]
    assert cache.wants(held=300, kept=100) and not cache.wants(held=300, kept=200)
    assert not cache.wants(held=100, kept=0)                             # too short to be worth a save
    assert not StateCache(budget_mib=0).wants(held=10_000, kept=0)


# -- turns and sessions through the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen35", "qwen3next"])
def target(request, arch_dir):
    return make_arch_model(request.param, arch_dir, seed=1, stdev=0.5)


@pytest.mark.parametrize("n_seq", [1, 2])
def test_turn_two_reprocesses_only_the_delta_and_equals_a_fresh_run(target, template, n_seq):
    with load_pair(str(target), **SETTINGS) as p:
        engine = p.engine(n_seq, SETTINGS["n_ctx"] * n_seq)
        first = prompt(p, template, 1, 1)
        run(engine, first)
        second = prompt(p, template, 1, 2)
        shared = common_prefix_len(first, second)   # where the re-rendered answer begins
        assert shared < len(first) - 1               # the template did re-render: the prompt's end is not reusable
        got, stats = run(engine, second)
        # processed again: the delta and the re-rendered answer, and at most the generation prompt's few tokens
        assert stats.prompt_tokens_cached >= shared - TURN_TAIL, (stats.prompt_tokens_cached, shared)
        assert got == fresh(p, second)


def test_sessions_taking_turns_on_one_slot_come_back_from_the_cache(target, template):
    """A, B, A, B on one slot: each second turn restores its session's saved state."""
    with load_pair(str(target), **SETTINGS) as p:
        engine = p.engine(1)
        a1, b1, a2, b2 = (prompt(p, template, s, t) for s, t in ((1, 1), (2, 1), (1, 2), (2, 2)))
        run(engine, a1)
        run(engine, b1)
        cache = engine.target.cache
        assert cache.saves == 1   # A's state, before B took the slot
        got_a, stats_a = run(engine, a2)
        got_b, stats_b = run(engine, b2)
        assert cache.restores == 2 and cache.nbytes <= p.config.cache_ram * MIB
        for first, second, stats in ((a1, a2, stats_a), (b1, b2, stats_b)):
            assert stats.prompt_tokens_cached >= common_prefix_len(first, second) - TURN_TAIL
        assert got_a == fresh(p, a2) and got_b == fresh(p, b2)


def test_three_sessions_on_two_slots_come_back_from_the_cache(target, template):
    with load_pair(str(target), **SETTINGS) as p:
        engine = p.engine(2, SETTINGS["n_ctx"] * 2)
        firsts = {s: prompt(p, template, s, 1) for s in (1, 2, 3)}
        for s in (1, 2, 3):
            run(engine, firsts[s])
        replies = {}
        for s in (1, 2, 3):
            second = prompt(p, template, s, 2)
            replies[s], stats = run(engine, second)
            assert stats.prompt_tokens_cached >= common_prefix_len(firsts[s], second) - TURN_TAIL, s
            replies[s] = (second, replies[s])
        assert engine.target.cache.restores >= 1
        for s, (second, got) in replies.items():
            assert got == fresh(p, second), s


def test_without_cache_ram_a_session_whose_slot_was_taken_starts_over(target, template):
    """cache_ram=0: nothing is saved (the setting's meaning, llama-server's)."""
    with load_pair(str(target), cache_ram=0, **SETTINGS) as p:
        engine = p.engine(1)
        assert engine.target.cache is None
        run(engine, prompt(p, template, 1, 1))
        run(engine, prompt(p, template, 2, 1))
        _, stats = run(engine, prompt(p, template, 1, 2))
        assert stats.prompt_tokens_cached < 20   # the system prompts differ after a few tokens


# -- the drafter's state comes back with the target's -------------------------------------------------------------
def counted_decodes(ctx) -> dict:
    """Count the tokens (entries) every decode of `ctx` holds from now on."""
    count, decode = {"tokens": 0}, ctx._timed_decode

    def counting(batch, n, *args, **kwargs):
        count["tokens"] += n
        return decode(batch, n, *args, **kwargs)

    ctx._timed_decode = counting
    return count


@pytest.mark.parametrize("n_seq", [1, 2])
@pytest.mark.parametrize("drafter", ["model", "mtp"])
def test_a_restored_session_drafts_on_without_a_drafter_prefill(arch_dir, template, drafter, n_seq):
    """A session comes back to its slot from the cache: its drafter (a draft model's cache, an MTP head's cache and
    hidden states) comes back with the target's, so the drafter decodes only what the target does (the delta) and
    its cache holds the restored prefix; the greedy reply is plain decoding's."""
    from support.mtp_models import make_mtp_model

    if drafter == "mtp":
        target, draft = make_mtp_model("qwen35", arch_dir, head="agree", trunk_mix=0.1), None
    else:
        target, draft = make_arch_model("qwen35", arch_dir, seed=1, stdev=0.5), \
            make_arch_model("llama", arch_dir, seed=1, stdev=0.5)   # attention: a shared context holds it
    with load_pair(str(target), None if draft is None else str(draft), drafter=drafter, policy="fixed", draft_max=3,
                   **SETTINGS) as p:
        engine = p.engine(n_seq, SETTINGS["n_ctx"] * n_seq)
        for session in range(1, n_seq + 2):   # one session more than slots: the first one's slot is taken
            run(engine, prompt(p, template, session, 1))
        if n_seq == 1:
            draft_ctx = p.drafter.contexts[0]
        else:
            draft_ctx = engine.target.draft_ctx if drafter == "model" else engine.target.mtp.ctx
        decoded = counted_decodes(draft_ctx)
        second = prompt(p, template, 1, 2)
        max_tokens = 8
        got, stats = run(engine, second, max_tokens)
        assert engine.target.cache.restores == 1
        cached = stats.prompt_tokens_cached
        assert cached >= common_prefix_len(prompt(p, template, 1, 1), second) - TURN_TAIL
        # the delta, a draft of up to 3 tokens and its last token per step; a prefill of the restored prefix is more
        assert decoded["tokens"] <= len(second) - cached + 4 * max_tokens + 8 < cached, (decoded, cached)
        if drafter == "mtp":   # the head's entries for the restored prefix are there (not a restart past them)
            slot = next(s for s in engine.slots if s.stats is stats)
            head = p.drafter.ctx.tokens if n_seq == 1 else slot.draft.seq.tokens
            assert head[:cached - TURN_TAIL] == second[:cached - TURN_TAIL]
    with load_pair(str(target), **SETTINGS) as plain:
        assert got == plain.generate(second, max_tokens=max_tokens).tokens


# -- through the server -------------------------------------------------------------------------------------------
def test_the_server_reports_a_second_turn_s_reused_tokens_in_timings_cache_n(arch_dir, template):
    """`serve --parallel 2` on a hybrid, sessions A, B, then A's second turn over the chat endpoint: the reply's
    timings count the reused prompt tokens (`cache_n`) and only the rest as processed (`prompt_n`)."""
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.server import ServerConfig, create_app

    target = make_arch_model("qwen35", arch_dir, seed=1, stdev=0.5)
    with load_pair(str(target), **SETTINGS) as p:
        app = create_app(p, ServerConfig(model_id="tiny", parallel=2))
        service = app.state.service
        service.template = service.worker.template = template
        with TestClient(app, base_url="http://localhost") as client:
            def chat(session: int, turn: int) -> dict:
                r = client.post("/v1/chat/completions", json={"messages": conversation(session, turn),
                                                              "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()
            chat(1, 1)
            chat(2, 1)
            reply = chat(1, 2)
        first, second = prompt(p, template, 1, 1), prompt(p, template, 1, 2)
        timings = reply["timings"]
        assert reply["usage"]["prompt_tokens"] == len(second)
        assert timings["cache_n"] >= common_prefix_len(first, second) - TURN_TAIL
        assert timings["prompt_n"] == len(second) - timings["cache_n"]
        service.stop()


# -- a prompt alone in a shared engine ----------------------------------------------------------------------------
def test_a_prompt_alone_in_a_shared_engine_is_read_a_batch_at_a_time_by_target_and_draft(tiny_models):
    """With no other slot generating, a joining prompt is decoded a batch (n_batch) per step, not a chunk
    (prefill_chunk), by the target and by the draft model alike: the draft holds the whole prompt when drafting
    starts, rather than falling behind and restarting on its last window of tokens."""
    with load_pair(str(tiny_models["target"]), str(tiny_models["draft"]), policy="fixed", draft_max=3, n_ctx=2048,
                   n_batch=256, no_repack=True, n_threads=2, flash_attn="off", cache_ram=0) as p:
        engine = p.engine(2, 4096)
        tokens = p.tokenize(" ".join(f"item {i} of the list;" for i in range(200)))[:1200]
        slot = engine.submit(tokens, max_tokens=4)
        steps = 0
        while not slot.prefilled:
            engine.step()
            steps += 1
        assert steps == -(-(len(tokens) - 1) // 256)   # a batch a step, not prefill_chunk (128)
        list(engine.pieces(slot))
        assert slot.draft.offset == 0 and slot.draft.seq.tokens[:len(tokens)] == tokens
        assert slot.stats.accepted == slot.stats.drafted > 0   # the same weights: every draft token agrees


# -- the option ---------------------------------------------------------------------------------------------------
def test_check_plans_the_cache_ram_and_serve_takes_it(tiny_models):
    """`check` says what one full context's saved state takes and how many fit in --cache-ram (or that it is off);
    `serve --cache-ram` has llama-server's spelling and range, and the library reads the same setting."""
    import re

    from click.testing import CliRunner

    from llamaspec.cli import main
    from llamaspec.config import LoadConfig
    from llamaspec.errors import InvalidParameterError
    from llamaspec.gguf.memory import Settings, kv_cache_bytes
    from llamaspec.gguf.reader import read_model_info

    runner = CliRunner()
    out = runner.invoke(main, ["check", str(tiny_models["target"]), "-c", "2048", "--vram", "24", "-cram", "64"])
    assert out.exit_code == 0, out.output
    state = kv_cache_bytes(read_model_info(str(tiny_models["target"])), Settings(n_ctx=2048))
    fits = re.search(r"up to 64 MiB; a full context's state is .*, (\d+) of them fit", out.output)
    assert fits and int(fits.group(1)) == 64 * 2**20 // state, out.output
    off = runner.invoke(main, ["check", str(tiny_models["target"]), "--vram", "24", "--cache-ram", "0"])
    assert "saved slot states: off" in off.output
    assert "--cache-ram" in runner.invoke(main, ["serve", "--help"]).output
    assert runner.invoke(main, ["serve", "-m", "x.gguf", "--cache-ram", "-2"]).exit_code == 2
    assert LoadConfig().cache_ram == 8192 and LoadConfig.from_kwargs(cache_ram=0).cache_ram == 0
    with pytest.raises(InvalidParameterError, match="cache_ram"):
        LoadConfig.from_kwargs(cache_ram=-5)


def agent_turn(rounds: int, asked: int) -> list[dict]:
    """An agent's conversation: a user task, `rounds` assistant steps (thinking, then a tool call's text) each
    answered by a tool result, and with `asked` a second user message after them. Qwen's template keeps the thinking
    of the steps after the last user message only, so the second user message re-renders every step: the prompt
    leaves the cache where the first step began, `rounds` prompts back."""
    messages = [{"role": "system", "content": "You are an agent. " + text(9, 200)},
                {"role": "user", "content": "task: " + text(4, 20)}]
    for r in range(rounds):
        messages.append({"role": "assistant", "content": f"<think>\nround {r}: {text(r, 10)}\n</think>\n\n"
                                                         f"read file {r}"})
        messages.append({"role": "tool", "content": f"file {r}: " + text(r + 11, 40)})
    if asked:
        messages.append({"role": "user", "content": "now: " + text(5, 15)})
    return messages


@pytest.mark.parametrize("n_seq", [1, 2])
def test_a_new_user_message_after_many_tool_rounds_restarts_at_the_first_round(target, template, n_seq):
    """Each round's prompt is a turn checkpoint (TURN_TAIL before its end); the one a new user message needs is
    `rounds` checkpoints back, beyond the 4 this engine kept before (the default is now llama-server's 32:
    --ctx-checkpoints)."""
    rounds = 6
    with load_pair(str(target), **SETTINGS) as p:
        engine = p.engine(n_seq, SETTINGS["n_ctx"] * n_seq)
        prompts = [p.tokenize(template.render(agent_turn(r, 0))) for r in range(rounds + 1)]
        for tokens in prompts:
            run(engine, tokens, max_tokens=2)
        last = p.tokenize(template.render(agent_turn(rounds, 1)))
        shared = common_prefix_len(prompts[-1], last)
        assert shared <= len(prompts[0])             # the template re-rendered every round
        got, stats = run(engine, last)
        assert stats.prompt_tokens_cached >= shared - TURN_TAIL, (stats.prompt_tokens_cached, shared, len(last))
        assert got == fresh(p, last)
