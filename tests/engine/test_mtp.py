"""Drafting with the target's own multi-token-prediction head (the `mtp` drafter), on tiny random models with an
MTP block added by mtp_models.py.

glm4moe is attention-only; qwen35 and qwen35moe are hybrids with bounded rollback of the recurrent state, qwen3next
one that rolls back through checkpoints (speculation on them is skipped with that reason where this llamaspec
refuses hybrid targets); qwen3next's MTP graph keeps its state for output rows only (read masked). Two heads per arch:
"agree" (predicts what a context-free trunk would; with a little context mixed into the trunk it agrees often but
not always, so drafts are accepted and rejected) and "random" (its attention matters, so a wrong cache entry
shows in its logits).
"""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from support.arch_models import make_arch_model
from support.mtp_models import make_mtp_model
from support.chisq import CHI2_CRIT_0001, chi_square
from support.paths import REPO
from support.probes import TailEvery

from llamaspec import load_pair
from llamaspec.backend import Context
from llamaspec.backend.mtp import MTPContext
from llamaspec.errors import InvalidParameterError, UnsupportedModelError
from llamaspec.policy import FixedPolicy
from llamaspec.sampling import SamplerConfig, filtered_probs

ARCHS = ["glm4moe", "qwen35", "qwen35moe", "qwen3next"]
# trunk_mix giving the agreeing head an agreement of about 50-90 % (measured per arch: the trunks' activation
# scales differ by orders of magnitude)
AGREE_MIX = {"glm4moe": 1e-4, "qwen35": 0.1, "qwen35moe": 1e-3, "qwen3next": 1e-3}
SETTINGS = dict(no_repack=True, n_ctx=256, n_batch=16, n_threads=2)
PROMPT = [5, 17, 99, 3, 42, 8, 77, 21, 64, 2, 90, 33, 11, 120, 7, 58, 19, 101, 4, 66, 29, 13]   # > n_batch: chunked


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp-models")


def mtp_pair(path, drafter="mtp", k=3, p_min=0.0, **kwargs):
    """load_pair with the MTP drafter; skips where this build refuses speculation on hybrid targets."""
    try:
        pair = load_pair(str(path), drafter=drafter, **{**SETTINGS, **kwargs})
    except UnsupportedModelError as e:
        if "cannot drop rejected draft tokens" in str(e):
            pytest.skip(f"speculation on this hybrid target needs bounded rollback: {e}")
        raise
    pair.set_policy(FixedPolicy(k, p_min))
    return pair


_PLAIN: dict = {}


def plain_tokens(path, prompt, n):
    """Plain decoding's tokens (computed once per file, prompt and length)."""
    key = (str(path), tuple(prompt), n)
    if key not in _PLAIN:
        with load_pair(str(path), **SETTINGS) as pair:
            _PLAIN[key] = pair.generate(prompt, max_tokens=n).tokens
    return _PLAIN[key]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter, k, p_min", [pytest.param("mtp", 1, 0.0, marks=pytest.mark.slow), ("mtp", 3, 0.0),
                                               ("mtp", 3, 0.3),
                                               pytest.param("lookup+mtp", 3, 0.0, marks=pytest.mark.slow)])
def test_greedy_output_equals_plain_decoding_with_accepted_drafts(model_dir, arch, drafter, k, p_min):
    # p_min 0: llama.cpp takes the head's argmax on the device; p_min > 0: its logits come out for the stop rule
    path = make_mtp_model(arch, model_dir, head="agree", trunk_mix=AGREE_MIX[arch])
    expected = plain_tokens(path, PROMPT, 48)
    with mtp_pair(path, drafter, k, p_min) as pair:
        assert pair.drafter_kind == drafter
        c = pair.generate(PROMPT, max_tokens=48)
    assert c.tokens == expected
    assert c.stats.accepted > 0                           # the head's drafts were really used
    if k > 1:
        assert c.stats.accepted < c.stats.drafted         # ... and rejected: the rollback was exercised


def reference_probe(pair, history, token, chunk, corrupt=None):
    """The head's logits for `token` after `history`, from fresh caches: a target context decodes the history in
    chunks of `chunk` tokens, an MTP context decodes (x_i, h_{i-1}) for every position in the same chunks (with
    h_{corrupt-1} zeroed when `corrupt` is a position: one wrong entry)."""
    ref = Context(pair.target, pair.target_ctx.options)
    head = MTPContext(ref)
    try:
        h = np.zeros((len(history) + 1, head.n_embd), np.float32)        # h[i + 1] = the target's state at i
        for a in range(0, len(history), chunk):
            part = history[a:a + chunk]
            ref.eval(part, logits="none")
            h[a + 1:a + 1 + len(part)] = ref.hidden_rows(len(part))
        h_in = h.copy()
        if corrupt is not None:
            h_in[corrupt] = 0.0
        for a in range(0, len(history), chunk):
            b = min(a + chunk, len(history))
            head.decode(history[a:b], h_in[a], h_in[a + 1:b])
        head.decode([token], h[-1], output="logits")
        return head.last_logits().copy(), h[-1].copy()
    finally:
        head.close()
        ref.close()


def assert_head_cache_is_the_one_pass_cache(pair):
    """The drafter's head holds the entries a catch-up over the committed history would make. The tolerance is the
    rounding noise measured here (one-token against batched decoding); one wrong entry must exceed it tenfold."""
    history = list(pair.target_ctx.tokens)
    head = pair.draft_ctx
    pair.drafter.sync(history)                           # the head catches up lazily, when it drafts
    assert head.tokens == history
    token, chunk = 9, pair.target_ctx.n_batch
    expected, h_last = reference_probe(pair, history, token, chunk)
    noise = np.abs(reference_probe(pair, history, token, 1)[0] - expected).max()
    tolerance = max(3 * noise, 1e-5 * np.abs(expected).max())
    wrong = np.abs(reference_probe(pair, history, token, chunk, corrupt=len(history) // 2)[0] - expected).max()
    assert wrong > 10 * tolerance, f"the probe cannot tell a wrong entry ({wrong}) from noise ({tolerance})"
    head.decode([token], h_last, output="logits")
    got = head.last_logits().copy()
    head.keep(len(history))
    # A memory restored from a checkpoint replays tokens in batches of its own: on some CPUs those round 10-20 times
    # the split noise above (qwen3next: 5.5e-4 against 4e-5) while one wrong entry moves the logits by ~0.6; the
    # bound stays two orders of magnitude under a wrong entry.
    assert np.abs(got - expected).max() <= max(tolerance, wrong / 100)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_head_cache_stays_consistent_over_rollbacks_turns_and_regenerations(model_dir, arch):
    path = make_mtp_model(arch, model_dir, head="random")
    turn2 = None
    with mtp_pair(path, "mtp", 3) as pair:
        c1 = pair.generate(PROMPT, max_tokens=24)               # chunked prefill, then rejected drafts
        assert c1.stats.drafted > c1.stats.accepted
        assert_head_cache_is_the_one_pass_cache(pair)
        turn2 = PROMPT + c1.tokens + [50, 51, 52]               # the next turn extends the conversation
        c2 = pair.generate(turn2, max_tokens=16)
        assert_head_cache_is_the_one_pass_cache(pair)
        again = pair.generate(turn2, max_tokens=16)             # regenerate: starts inside what the caches hold
        assert again.tokens == c2.tokens
        assert_head_cache_is_the_one_pass_cache(pair)
        pair.reset()
        assert pair.draft_ctx.n_past == 0
        assert pair.generate(turn2, max_tokens=16).tokens == c2.tokens
    assert c1.tokens == plain_tokens(path, PROMPT, 24)
    assert c2.tokens == plain_tokens(path, turn2, 16)


@pytest.mark.parametrize("device", ["0", "1"])
@pytest.mark.parametrize("arch", ["glm4moe", "qwen35"])
@pytest.mark.slow
def test_sampling_keeps_the_target_distribution_of_the_first_two_tokens(model_dir, arch, device, monkeypatch):
    """Filtered in numpy (0) or by llama.cpp's sampler chains on target and head (1: the device path, here on the
    CPU backend): the head's q comes with the device's draw."""
    monkeypatch.setenv("LLAMASPEC_DEVICE_SAMPLING", device)
    path = make_mtp_model(arch, model_dir, head="agree", trunk_mix=AGREE_MIX[arch])
    cfg = SamplerConfig(temperature=1.0, top_k=3)
    prompt = PROMPT[:6]
    with mtp_pair(path, "mtp", 3) as pair:
        ref = Context(pair.target, pair.target_ctx.options)    # the target alone, a fresh cache per prefix
        p1 = filtered_probs(ref.eval(prompt)[0], cfg).astype(np.float64)    # p(x1 | prompt)
        joint = np.zeros((pair.n_vocab, pair.n_vocab))
        for x1 in np.flatnonzero(p1):                                         # p(x1, x2) = p(x1) p(x2 | x1)
            ref.clear()
            joint[x1] = p1[x1] * filtered_probs(ref.eval(prompt + [int(x1)])[0], cfg)
        ref.close()
        counts = np.zeros_like(joint)
        drafted = accepted = 0
        for seed in range(200):
            c = pair.generate(prompt, max_tokens=2, temperature=1.0, top_k=3, seed=seed)
            counts[c.tokens[0], c.tokens[1]] += 1
            drafted += c.stats.drafted
            accepted += c.stats.accepted
        assert pair.drafter.ctx.device_sampler == (device == "1")
    assert accepted > 0 and accepted < drafted       # q was used, and rejections drew from the residual
    assert counts[joint == 0].sum() == 0
    stat, dof = chi_square(counts.ravel(), joint.ravel())
    assert dof >= 3
    assert stat < CHI2_CRIT_0001[dof], f"chi2={stat:.1f} with {dof} dof"


def test_a_model_without_an_mtp_head_is_a_one_line_error(model_dir):
    plain = make_arch_model("glm4moe", model_dir, seed=1, stdev=0.5)
    with pytest.raises(UnsupportedModelError) as err:
        load_pair(str(plain), drafter="mtp", **SETTINGS)
    message = str(err.value)
    assert str(plain) in message and "no multi-token-prediction (MTP) head" in message and "\n" not in message


def test_mtp_with_a_draft_model_is_refused(model_dir):
    path = make_mtp_model("glm4moe", model_dir, head="random")
    with pytest.raises(InvalidParameterError, match="own MTP head"):
        load_pair(str(path), str(path), drafter="mtp", **SETTINGS)


def test_a_build_without_the_nextn_functions_refuses_mtp_but_decodes_plainly(model_dir, monkeypatch):
    from llamaspec.backend import native

    path = make_mtp_model("glm4moe", model_dir, head="random")
    monkeypatch.setattr(native, "_NEXTN", [(None, "this llama-cpp-python cannot run an MTP head (test)")])
    with pytest.raises(UnsupportedModelError, match="cannot run an MTP head"):
        load_pair(str(path), drafter="mtp", **SETTINGS)
    with load_pair(str(path), **SETTINGS) as pair:          # the same file still decodes without its head
        assert len(pair.generate(PROMPT, max_tokens=4).tokens) == 4


def test_closing_the_drafter_unhooks_the_target(model_dir):
    path = make_mtp_model("glm4moe", model_dir, head="random")
    pair = mtp_pair(path)
    assert pair.target_ctx.on_decode is not None
    pair.drafter.close()
    assert pair.target_ctx.on_decode is None
    pair.drafter = None
    pair.close()


def test_cli_spec_type_draft_mtp_runs_the_head(model_dir):
    import json

    from llamaspec.cli import main

    path = make_mtp_model("glm4moe", model_dir, head="agree", trunk_mix=AGREE_MIX["glm4moe"])
    args = ["run", "-m", str(path), "--spec-type", "draft-mtp", "--draft-max", "3", "--policy", "fixed",
            "-c", "256", "-t", "2", "--no-repack", "-n", "12", "--json", "tok_1 tok_2 tok_3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["drafter"] == "mtp" and out["stats"]["accepted"] > 0
    bad = CliRunner().invoke(main, ["run", "-m", str(make_arch_model("glm4moe", model_dir, seed=1, stdev=0.5)),
                                    "--spec-type", "draft-mtp", "--no-repack", "-n", "2", "x"])
    assert bad.exit_code == 1 and "no multi-token-prediction" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_check_reports_the_mtp_head_with_the_kv_cache_llama_cpp_allocates(model_dir):
    import re

    from llamaspec.backend import Model
    from llamaspec.cli import main
    from llamaspec.config import ModelConfig
    from llamaspec.gguf.memory import Settings, mtp_head_memory
    from llamaspec.gguf.reader import read_model_info

    path = make_mtp_model("qwen35", model_dir, head="random")
    head = mtp_head_memory(read_model_info(path), Settings(n_ctx=1024, n_ubatch=64))
    config = ModelConfig(n_ctx=1024, n_batch=64, n_threads=2, no_repack=True, load_mtp=True)
    model = Model(path, config)
    target = Context(model, config)
    mtp = MTPContext(target)
    allocated = float(re.search(r"llama_kv_cache: size =\s+([\d.]+) MiB", mtp.load_log).group(1))
    mtp.close(), target.close(), model.close()
    assert head.n_layers == 1 and abs(head.kv_cache / 2**20 - allocated) < 0.01
    out = CliRunner().invoke(main, ["check", str(path), "-c", "1024", "-b", "64", "--vram", "1"])
    assert out.exit_code == 0, out.output
    assert "MTP head: 1 nextn block(s)" in out.stdout and "drafting with the MTP head" in out.stdout
    plain = CliRunner().invoke(main, ["check", str(make_arch_model("qwen35", model_dir, seed=1, stdev=0.5)),
                                      "--vram", "1"])
    assert "MTP head: none" in plain.stdout and "drafting with the MTP head" not in plain.stdout


@pytest.mark.parametrize("arch, layers, message", [("llama", 1, "no MTP graph for the llama architecture"),
                                                   ("qwen35", 2, "2 chained MTP heads")])
def test_heads_llama_cpp_cannot_run_are_refused_from_the_header(model_dir, arch, layers, message):
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    src = make_arch_model(arch, model_dir, seed=1, stdev=0.5)
    dst = model_dir / f"{arch}-claims-{layers}-heads.gguf"
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        empty_array = field.types == [GGUFValueType.ARRAY]     # no element type to copy
        if key.startswith("GGUF.") or key == "general.architecture" or empty_array:
            continue
        value = layers if key == f"{arch}.nextn_predict_layers" else field.contents()
        w.add_key_value(key, value, field.types[0], sub_type=field.types[1] if len(field.types) > 1 else None)
    if f"{arch}.nextn_predict_layers" not in r.fields:
        w.add_uint32(f"{arch}.nextn_predict_layers", layers)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError, match=message):
        load_pair(str(dst), drafter="mtp", **SETTINGS)      # before any weights load: llama.cpp would abort


def test_server_drafts_with_the_head_and_says_so(model_dir, tmp_path):
    import os
    import re
    import subprocess
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    path = make_mtp_model("glm4moe", model_dir, head="agree", trunk_mix=AGREE_MIX["glm4moe"])
    repo = REPO
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "llamaspec", "serve", "-m", str(path), "--spec-type", "draft-mtp", "--policy",
           "fixed", "--draft-max", "3", "-c", "256", "-t", "1", "--no-repack", "--port", "0"]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        deadline = time.monotonic() + 90
        while not (found := re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = found.group(1)
        assert "drafter mtp" in log.read_text()
        info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["llamaspec"]
        assert info["drafter"] == "mtp" and info["draft"] is None
        r = httpx.post(f"{url}/v1/completions", json={"model": path.stem, "prompt": PROMPT, "max_tokens": 24,
                                                       "temperature": 0}, timeout=60).json()
        assert r["choices"][0]["text"] == plain_text(path, PROMPT, 24)
        assert r["llamaspec"]["accepted"] > 0
    finally:
        proc.terminate()
        proc.wait(15)


def plain_text(path, prompt, n):
    with load_pair(str(path), **SETTINGS) as pair:
        return pair.generate(prompt, max_tokens=n).text


def test_spec_type_names_map_onto_drafter_kinds():
    import click

    from llamaspec.cli.pair_choice import chosen_drafter, spec_type_drafter

    assert [spec_type_drafter(v) for v in ("draft-mtp", "draft-simple", "ngram-simple", "none")] == \
        ["mtp", "model", "lookup", None]
    assert spec_type_drafter("draft-mtp,ngram-simple") == spec_type_drafter("ngram-simple,draft-mtp") == "lookup+mtp"
    assert spec_type_drafter("ngram-simple,draft-simple") == "lookup+model"
    assert [spec_type_drafter(v) for v in ("draft-eagle3", "draft-dflash")] == ["eagle3", "dflash"]
    for bad, says in (("draft-dspark", "does not have"), ("draft-mtp,draft-simple", "one drafter"), ("x", "choose")):
        with pytest.raises(click.BadParameter, match=says):
            spec_type_drafter(bad)
    assert chosen_drafter({"spec_type": "none"}) == (None, True)
    assert chosen_drafter({"drafter_kind": "mtp", "spec_type": "draft-mtp"}) == ("mtp", False)
    with pytest.raises(click.UsageError, match="disagree"):
        chosen_drafter({"drafter": "lookup", "spec_type": "draft-mtp"})


@pytest.mark.slow
def test_the_synthetic_benchmark_model_agrees_at_its_stated_rate(tmp_path):
    """benchmarks/synthetic/synth_mtp.py --preset tiny: the head is right on a known fraction a of the vocabulary, so
    with k=3 a step emits 1 + a + a^2 + a^3 tokens on average (2.53 at a = 0.7), and greedy output is the trunk's x + c."""
    import subprocess
    import sys

    script = REPO / "benchmarks" / "synthetic" / "synth_mtp.py"
    out = tmp_path / "synth.gguf"
    run = subprocess.run([sys.executable, str(script), str(out), "--preset", "tiny", "--agree", "0.7"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    expected = plain_tokens(out, [5, 6, 7], 96)
    assert len({(b - a) % 4096 for a, b in zip(expected, expected[1:])}) == 1     # x -> x + c
    with mtp_pair(out, "mtp", 3) as pair:
        c = pair.generate([5, 6, 7], max_tokens=96)
    assert c.tokens == expected
    per_pass = c.stats.tokens_generated / c.stats.target_passes
    assert abs(per_pass - (1 + 0.7 + 0.7 ** 2 + 0.7 ** 3)) < 0.45, per_pass


@pytest.mark.parametrize("arch, reach", [("qwen35", 4), ("glm4moe", 12)])
def test_a_policy_chosen_at_run_time_stays_within_the_snapshots_the_load_kept(model_dir, arch, reach):
    # loaded with fixed k (4 snapshots on the hybrid), then chat's /policy auto or the server's PATCH: auto takes the
    # snapshots as its longest draft, as a load with auto would give it; past them every draft saves a checkpoint.
    # An attention-only target has no such bound (auto's own 12), and a length given is kept
    import dataclasses

    path = make_mtp_model(arch, model_dir, head="agree", trunk_mix=AGREE_MIX[arch])
    try:
        pair = load_pair(str(path), drafter="mtp", policy="fixed", **SETTINGS)
    except UnsupportedModelError as e:
        pytest.skip(f"speculation on this hybrid target needs bounded rollback: {e}")
    with pair:
        pair.set_drafting(dataclasses.replace(pair.config.drafting, policy="auto"))
        assert pair.policy.name == "auto" and pair.policy.draft_max == reach
        pair.set_drafting(dataclasses.replace(pair.config.drafting, policy="auto", draft_max=6))
        assert pair.policy.draft_max == 6
        pair.set_drafting(dataclasses.replace(pair.config.drafting, policy="fixed", draft_max=None))
        assert pair.policy.draft_max == 4
        assert pair.generate(PROMPT, max_tokens=8).stats.tokens_generated == 8


@pytest.mark.parametrize("arch", ["qwen35", pytest.param("glm4moe", marks=pytest.mark.slow)])
def test_tail_probes_leave_the_output_and_the_heads_cache_as_without_them(model_dir, arch):
    """The head drafts two tokens where the target verifies one (policy/auto.py _tail_due): the output is plain
    decoding's and the probes are judged where the draft token was accepted (the agreeing head); the head's cache is
    the one a catch-up would make (the random head, whose attention shows a wrong entry)."""
    path = make_mtp_model(arch, model_dir, head="agree", trunk_mix=AGREE_MIX[arch])
    expected = plain_tokens(path, PROMPT, 48)
    policy = TailEvery()
    with mtp_pair(path, k=2) as pair:
        pair.set_policy(policy)
        c = pair.generate(PROMPT, max_tokens=48)
    assert c.tokens == expected
    assert c.stats.tail_probes == len(policy.results) > 0
    judged = [r for r in policy.results if r is not None]
    assert len(judged) == c.stats.accepted > 0 and set(judged) <= {0.0, 1.0}   # judged exactly where d_1 was kept
    with mtp_pair(make_mtp_model(arch, model_dir, head="random"), k=2) as pair:
        pair.set_policy(TailEvery())
        pair.generate(PROMPT, max_tokens=24)
        assert_head_cache_is_the_one_pass_cache(pair)
