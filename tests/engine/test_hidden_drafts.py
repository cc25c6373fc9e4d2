"""EAGLE-3 and DFlash drafters on tiny llama.cpp models: a test-llama-archs qwen3 target (stdev 0.5) and drafts
written by tests/support/hidden_drafts.py.

Two kinds of draft: random ones (they almost never agree: the rejecting paths) and ones that compute the bigram map
of a target whose blocks were scaled down (they agree often: the accepting paths, partial acceptance, rollbacks).
"""
from __future__ import annotations

import numpy as np
import pytest
from support.arch_models import make_arch_model
from support.hidden_drafts import bigram_map, make_bigram_target, make_dflash_draft, make_eagle3_draft
from support.chisq import CHI2_CRIT_0001, chi_square

from llamaspec import load_pair
from llamaspec.errors import IncompatiblePairError, InvalidParameterError, UnsupportedModelError
from llamaspec.gguf.hidden_pair import hidden_draft_info, hidden_pair_mismatch
from llamaspec.gguf.reader import read_model_info
from llamaspec.policy import FixedPolicy, make_policy
from llamaspec.sampling import SamplerConfig, filtered_probs

# F32 cache and no flash attention: llama.cpp's CPU flash attention rounds through F16 differently for different
# batch sizes (2e-4 relative on these models' layer inputs), which the cache-consistency checks would see
SETTINGS = dict(n_ctx=256, n_batch=32, n_threads=2, no_repack=True, cache_type_k="f32", cache_type_v="f32",
                flash_attn="off")
KINDS = ("eagle3", "dflash")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hidden-drafts")
    base = make_arch_model("qwen3", d, seed=1, stdev=0.5)
    bigram, mask = make_bigram_target(d / "bigram.gguf", base, alpha=0.0)
    mixed, mask_mixed = make_bigram_target(d / "mixed.gguf", base, alpha=0.01)   # context matters a little
    assert mask == mask_mixed
    return {
        "dir": d, "base": base, "bigram": bigram, "mixed": mixed, "mask": mask,
        "eagle3": make_eagle3_draft(d / "e3.gguf", base, seed=3),
        "dflash": make_dflash_draft(d / "df.gguf", base, seed=3, mask_token_id=mask),
        "eagle3-emulate": make_eagle3_draft(d / "e3-emu.gguf", bigram, emulate=True),
        "dflash-emulate": make_dflash_draft(d / "df-emu.gguf", bigram, emulate=True, mask_token_id=mask),
        "eagle3-noisy": make_eagle3_draft(d / "e3-noisy.gguf", bigram, emulate=True, noise=0.2, seed=5),
    }


def prompt_for(models, n: int = 40) -> list[int]:
    """n token ids (never the mask token), deterministic; 40 > n_batch: the prompt is decoded in two chunks."""
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(0, 128, 3 * n) if t != models["mask"]][:n]


def plain_tokens(target, prompt, n: int) -> list[int]:
    with load_pair(str(target), **SETTINGS) as pair:
        return pair.generate(prompt, max_tokens=n).tokens


# -- the pair check, from the headers ------------------------------------------------------------------------------
def test_headers_describe_the_drafts(models):
    e3 = hidden_draft_info(read_model_info(models["eagle3"]))
    df = hidden_draft_info(read_model_info(models["dflash"]))
    assert (e3.kind, e3.target_layers, e3.target_hidden_size, e3.causal) == ("eagle3", (0, 1, 1), 256, True)
    assert (df.kind, df.target_layers, df.block_size, df.mask_token_id, df.causal) == \
        ("dflash", (1, 1), 8, models["mask"], False)
    assert not e3.has_token_embd and not e3.has_output   # both borrow the target's through ctx_other
    assert hidden_draft_info(read_model_info(models["base"])) is None


@pytest.mark.parametrize("change, reason", [
    (dict(target_layers=(0, 1, 5)), "taps target layer 5, but the target has 2 layers"),
    (dict(target_hidden_size=4096), "made for a target of hidden size 4096"),
    (dict(target_layers=(0, 1)), "exactly 3 target layers"),
    (dict(d2t=list(range(64)), own_output=False), "no output head of its own"),
    (dict(d2t=list(range(100, 164)), own_output=True), "outside the target's vocabulary"),
])
def test_an_eagle3_draft_for_another_target_is_refused_in_one_line(models, change, reason):
    bad = make_eagle3_draft(models["dir"] / "bad-e3.gguf", models["base"], **change)
    assert reason in hidden_pair_mismatch(read_model_info(models["base"]), read_model_info(bad))
    with pytest.raises(IncompatiblePairError) as err:
        load_pair(str(models["base"]), str(bad), **SETTINGS)
    message = str(err.value)
    assert str(bad) in message and str(models["base"]) in message and "\n" not in message


@pytest.mark.parametrize("change, reason", [
    (dict(mask_token_id=None), "mask token id"),
    (dict(block_size=1), "block_size is 1"),
    (dict(target_layers=(1, 2)), "taps target layer 2"),    # 2 = the last layer's output: not in qwen3's graph
    (dict(n_embd=128, own_embd=True, own_output=True), "hidden size 128"),
])
def test_a_dflash_draft_for_another_target_is_refused_in_one_line(models, change, reason):
    bad = make_dflash_draft(models["dir"] / "bad-df.gguf", models["base"], **change)
    with pytest.raises(IncompatiblePairError, match=reason) as err:
        load_pair(str(models["base"]), str(bad), **SETTINGS)
    assert "\n" not in str(err.value)


def test_a_target_whose_layers_llama_cpp_cannot_tap_is_refused_before_loading(models):
    other = make_arch_model("phi3", models["dir"], seed=1, stdev=0.5)   # asking llama.cpp would abort the process
    draft = make_eagle3_draft(models["dir"] / "e3-phi3.gguf", other)
    with pytest.raises(IncompatiblePairError, match="cannot read the hidden states of a 'phi3' target"):
        load_pair(str(other), str(draft), **SETTINGS)


def test_drafter_kind_and_draft_file_must_match(models):
    with pytest.raises(InvalidParameterError, match="use drafter 'eagle3', not 'lookup'"):
        load_pair(str(models["base"]), str(models["eagle3"]), drafter="lookup", **SETTINGS)
    with pytest.raises(InvalidParameterError, match="use drafter 'dflash', not 'eagle3'"):
        load_pair(str(models["base"]), str(models["dflash"]), drafter="eagle3", **SETTINGS)
    with pytest.raises(InvalidParameterError, match="needs a DFlash draft GGUF"):
        load_pair(str(models["base"]), str(models["base"]), drafter="dflash", **SETTINGS)
    with pytest.raises(InvalidParameterError, match="needs an EAGLE-3 draft GGUF: .* beside the target as eagle3-"):
        load_pair(str(models["base"]), drafter="eagle3", **SETTINGS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_draft_file_beside_the_target_is_found_by_its_sidecar_prefix(models, kind, tmp_path):
    """A local target with llama.cpp's sidecar names beside it (eagle3-/dflash-<model>.gguf, as in a Hugging Face
    repo): --spec-type draft-eagle3 / draft-dflash without -md drafts with the kind's file, of the model's quant."""
    import json
    import shutil

    from click.testing import CliRunner

    from llamaspec.cli import main

    target = tmp_path / "tiny-Q8_0.gguf"
    shutil.copy(models["bigram"], target)
    shutil.copy(models["eagle3-emulate"], tmp_path / "eagle3-tiny-Q8_0.gguf")
    shutil.copy(models["dflash-emulate"], tmp_path / "dflash-tiny-Q8_0.gguf")
    shutil.copy(models["dflash"], tmp_path / "dflash-tiny-Q4_0.gguf")      # random: would not be accepted
    result = CliRunner().invoke(main, ["run", "-m", str(target), "--spec-type", f"draft-{kind}", "-c", "256", "-t",
                                       "2", "--no-repack", "-n", "12", "--policy", "fixed", "--draft-max", "3",
                                       "--json", "tok_1 tok_2 tok_3"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["drafter"], out["draft"]) == (kind, str(tmp_path / f"{kind}-tiny-Q8_0.gguf"))
    assert out["stats"]["accepted"] > 0


# -- greedy: exactly the target's output -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target, draft", [("base", ""), ("mixed", "-emulate")])
def test_greedy_output_equals_plain_decoding(models, kind, target, draft):
    prompt = prompt_for(models)
    expected = plain_tokens(models[target], prompt, 40)
    with load_pair(str(models[target]), str(models[kind + draft]), policy="fixed", draft_max=4, **SETTINGS) as pair:
        assert pair.drafter_kind == kind               # the file picked its drafter
        for policy in (FixedPolicy(1), FixedPolicy(4), FixedPolicy(7), make_policy("auto")):
            pair.set_policy(policy)
            got = pair.generate(prompt, max_tokens=40)
            assert got.tokens == expected, policy.name
            if policy.name == "fixed":
                assert got.stats.drafted > 0
                if draft and policy.draft_max > 1:
                    assert 0 < got.stats.accepted < got.stats.drafted


def test_an_emulating_eagle3_draft_is_always_accepted(models):
    """The bigram target's own map, drafted one token at a time from the draft's own states: every token right."""
    prompt = prompt_for(models)
    with load_pair(str(models["bigram"]), str(models["eagle3-emulate"]), policy="fixed", draft_max=5,
                   **SETTINGS) as pair:
        c = pair.generate(prompt, max_tokens=36)
    nxt = bigram_map(models["bigram"])
    assert c.tokens[0] == nxt[prompt[-1]] and all(b == nxt[a] for a, b in zip(c.tokens, c.tokens[1:]))
    assert c.stats.drafted >= 30 and c.stats.accepted == c.stats.drafted


def test_a_dflash_block_is_one_pass_and_its_first_row_is_right(models):
    """Every row of the emulating DFlash block predicts the token after `last`: row 1 is always right, so each step
    keeps at least one drafted token; the block never exceeds block_size - 1 tokens."""
    prompt = prompt_for(models)
    with load_pair(str(models["bigram"]), str(models["dflash-emulate"]), policy="fixed", draft_max=12,
                   **SETTINGS) as pair:
        calls = pair.draft_ctx.decode_calls
        c = pair.generate(prompt, max_tokens=30)
        steps = c.stats.target_passes
        assert c.stats.accepted >= steps - 1 and c.stats.drafted <= 7 * steps   # block_size 8
        # per step: one block decode, plus the feed of the accepted tokens' features (prefill: 2 feeds)
        assert pair.draft_ctx.decode_calls - calls <= 2 * steps + 2
        pair.set_policy(make_policy("auto"))          # auto prices the block as one pass, not per token
        assert pair.policy.model.draft_units(7) == 1
    assert c.tokens == plain_tokens(models["bigram"], prompt, 30)


# -- caches stay consistent ---------------------------------------------------------------------------------------
def probe_logits(pair, history, token) -> np.ndarray:
    """The draft's logits for its first drafted position after history + [token] (through the drafter itself:
    catch up, propose one token on the logits path)."""
    drafter = pair.drafter
    drafter.begin(history, None, 1e-9, prefill=True)
    drafter.propose(history, token, 1, 1e-9)
    return drafter.ctx.logits(1)[0].copy()


def assert_draft_cache_is_the_one_pass_cache(pair, target, draft):
    """What the drafter would draft next equals what a fresh pair, fed the committed history in one batch, drafts."""
    history, token = list(pair.target_ctx.tokens), 9
    got = probe_logits(pair, history, token)
    with load_pair(str(target), str(draft), **{**SETTINGS, "n_batch": 256}) as ref:
        ref.target_ctx.eval(history, logits="none")
        expected = probe_logits(ref, history, token)
    assert np.abs(got - expected).max() < 1e-3 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_the_draft_cache_stays_the_one_pass_cache_over_rollbacks_turns_and_cancels(models, kind):
    """Random drafts (their attention over the cache matters, so a wrong entry shows in their logits): after
    rejected drafts and a chunked prompt, a next turn, a regeneration inside the cached text, a cancelled stream, a
    prompt that leaves the cached text and a reset, the draft's cache is the one a single pass over the history
    makes."""
    target, draft, prompt = models["base"], models[kind], prompt_for(models)
    with load_pair(str(target), str(draft), policy="fixed", draft_max=4, **SETTINGS) as pair:
        c1 = pair.generate(prompt, max_tokens=24)
        assert c1.stats.drafted > c1.stats.accepted
        assert_draft_cache_is_the_one_pass_cache(pair, target, draft)
        turn2 = prompt + c1.tokens + [5, 6, 7]
        c2 = pair.generate(turn2, max_tokens=16)
        assert c2.stats.prompt_tokens_cached >= len(prompt) + len(c1.tokens) - 1
        assert_draft_cache_is_the_one_pass_cache(pair, target, draft)
        assert pair.generate(turn2, max_tokens=16).tokens == c2.tokens     # regenerate inside the cache
        assert_draft_cache_is_the_one_pass_cache(pair, target, draft)
        stream = pair.generate_tokens(turn2, 20, SamplerConfig())
        for _ in range(3):
            next(stream)
        stream.close()                                                     # cancelled mid-generation
        assert_draft_cache_is_the_one_pass_cache(pair, target, draft)
        other = prompt[:30] + [9, 9, 9]
        assert pair.generate(other, max_tokens=8).tokens == plain_tokens(target, other, 8)
        assert_draft_cache_is_the_one_pass_cache(pair, target, draft)
        pair.reset()
        assert pair.generate(turn2, max_tokens=16).tokens == c2.tokens
        assert_draft_cache_is_the_one_pass_cache(pair, target, draft)
    assert c2.tokens == plain_tokens(target, turn2, 16)


@pytest.mark.parametrize("draft", ["eagle3-emulate", "dflash-emulate"])
def test_a_reused_conversation_drafts_as_a_fresh_one(models, draft):
    """Accepting drafts: a next turn on a reused cache drafts and accepts exactly what a fresh pair does."""
    def run(pair, prompt, n):
        c = pair.generate(prompt, max_tokens=n)
        return c.tokens, c.stats.drafted, c.stats.accepted

    prompt = prompt_for(models)
    with load_pair(str(models["mixed"]), str(models[draft]), policy="fixed", draft_max=4, **SETTINGS) as pair:
        c1 = pair.generate(prompt, max_tokens=24)
        assert 0 < c1.stats.accepted < c1.stats.drafted
        turn2 = prompt + c1.tokens + [5, 6, 7]
        reused = run(pair, turn2, 16)
    with load_pair(str(models["mixed"]), str(models[draft]), policy="fixed", draft_max=4, **SETTINGS) as fresh:
        assert reused == run(fresh, turn2, 16)


def test_closing_the_drafter_unhooks_the_target(models):
    pair = load_pair(str(models["base"]), str(models["eagle3"]), **SETTINGS)
    assert pair.target_ctx.on_decode is not None
    pair.close()
    assert pair.target_ctx.on_decode is None


def test_own_embeddings_head_and_a_reduced_vocabulary(models):
    """A draft with its own token_embd, output head and a d2t map (64 draft rows -> every other target id) drafts
    only mapped tokens, and the output is still the target's."""
    d2t = list(range(0, 128, 2))
    draft = make_eagle3_draft(models["dir"] / "e3-d2t.gguf", models["base"], own_embd=True, own_output=True, d2t=d2t)
    prompt = prompt_for(models)
    with load_pair(str(models["base"]), str(draft), policy="fixed", draft_max=3, **SETTINGS) as pair:
        history = prompt[:-1]
        pair.target_ctx.eval(history, logits="none")
        pair.drafter.begin(history, None, 0.0, prefill=True)
        proposal = pair.drafter.propose(history, prompt[-1], 3, 0.0)
        assert len(proposal.tokens) == 3 and all(t % 2 == 0 for t in proposal.tokens)
        pair.reset()
        assert pair.generate(prompt, max_tokens=20).tokens == plain_tokens(models["base"], prompt, 20)


# -- sampling: exactly the target's distribution -----------------------------------------------------------------
@pytest.mark.parametrize("top_k", [4, 0], ids=["top-k", "temperature-only"])
@pytest.mark.parametrize("draft", ["eagle3-noisy", "dflash-emulate"])
@pytest.mark.slow
def test_sampling_keeps_the_target_distribution_of_the_first_token(models, draft, top_k):
    """EAGLE-3 drafts from its own distribution q (with temperature only, cut to its DRAFT_TOP_K best candidates);
    DFlash drafts argmaxes, q = a point mass. Either way the first emitted token (accepted draft, or a residual draw
    after a rejection) follows the target's p."""
    cfg = SamplerConfig(temperature=1.0, top_k=top_k)
    prompt = prompt_for(models, 12)
    with load_pair(str(models["mixed"]), str(models[draft]), policy="fixed", draft_max=2, **SETTINGS) as pair:
        ctx = pair.target_ctx
        p = filtered_probs(ctx.eval(prompt)[0], cfg).astype(np.float64)
        pair.reset()
        counts = np.zeros(pair.n_vocab)
        drafted = accepted = 0
        for seed in range(300):
            c = pair.generate(prompt, max_tokens=3, temperature=1.0, top_k=top_k, seed=seed)
            counts[c.tokens[0]] += 1
            drafted += c.stats.drafted
            accepted += c.stats.accepted
    assert 0 < accepted < drafted                   # q was used, and rejections drew from the residual
    assert counts[p == 0].sum() == 0
    stat, dof = chi_square(counts, p)
    assert dof >= 2
    assert stat < CHI2_CRIT_0001[dof], f"chi2={stat:.1f} with {dof} dof"


def test_a_build_without_the_layer_input_functions_refuses_in_one_line(models, monkeypatch):
    from llamaspec.backend import hidden

    monkeypatch.setitem(hidden._EXT, "llama_get_embeddings_layer_inp", None)
    with pytest.raises(UnsupportedModelError, match="llama_get_embeddings_layer_inp") as err:
        load_pair(str(models["base"]), str(models["dflash"]), **SETTINGS)
    assert "\n" not in str(err.value)


def test_cli_runs_an_eagle3_and_a_dflash_draft(models):
    import json

    from click.testing import CliRunner

    from llamaspec.cli import main

    common = ["-c", "256", "-t", "2", "--no-repack", "-n", "12", "--policy", "fixed", "--draft-max", "3", "--json",
              "tok_1 tok_2 tok_3"]
    for draft, flags in (("eagle3-emulate", []), ("dflash-emulate", ["--drafter", "dflash"])):
        result = CliRunner().invoke(main, ["run", "-m", str(models["bigram"]), "-md", str(models[draft]),
                                           *flags, *common])
        assert result.exit_code == 0, result.output
        stats = json.loads(result.stdout)["stats"]
        assert stats["drafted"] > 0 and stats["accepted"] > 0, draft
    bad = CliRunner().invoke(main, ["run", "-m", str(models["bigram"]), "-md", str(models["eagle3-emulate"]),
                                    "--drafter", "dflash", *common])
    assert bad.exit_code != 0 and "use drafter 'eagle3', not 'dflash'" in bad.output
    assert "Traceback" not in bad.output
