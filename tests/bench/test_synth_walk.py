"""benchmarks/probes/synth_walk.py: a synthetic MTP file's (or pair's) greedy acceptance from its construction alone,
checked against what the engine drafts and accepts on the file itself (the tiny preset, Qwen's tokenizers)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.gguf_factory import find_vocab_file

from benchmarks.compare.bench_engine import CODE, PROSE
from benchmarks.probes import synth_walk
from benchmarks.synthetic import synth_mtp, synth_pair
from llamaspec import load_pair
from llamaspec.policy import FixedPolicy

TOKENS = 40


def write_and_walk(tmp_path_factory, vocab_name: str, script, output: str, pair: bool = False) -> tuple:
    """A tiny synthetic file (agreement 0.6) written by `script` as `output`, and its walk: (the path, its requests,
    what synth_walk said)."""
    vocab = find_vocab_file(vocab_name)
    if vocab is None:
        pytest.skip(f"llama.cpp's {vocab_name} unavailable (set LLAMASPEC_VOCAB_DIR or LLAMASPEC_LLAMA_SRC, or allow "
                    "pip to download the llama-cpp-python sdist)")
    path = tmp_path_factory.mktemp("walk") / output
    made = subprocess.run([sys.executable, script.__file__, str(path), "--preset", "tiny", "--agree", "0.6",
                           "--vocab", str(vocab)], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    done = subprocess.run([sys.executable, "-m", "benchmarks.probes.synth_walk", *(["--pair"] if pair else []),
                           "--vocab", str(vocab), "--preset", "tiny", "--agree", "0.6", "--tokens", str(TOKENS),
                           "--per-set", "1", "--out", str(path.parent / "walk.json")],
                          capture_output=True, text=True, timeout=300, cwd=Path(synth_walk.__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert "fixed k's tokens a pass on the 2 uniform requests: k=1 " in done.stderr
    return path, json.loads((path.parent / "walk.json").read_text())["requests"], done.stderr


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    model, requests, _ = write_and_walk(tmp_path_factory, "ggml-vocab-qwen35.gguf", synth_mtp, "tiny-mtp.gguf")
    return model, requests


@pytest.fixture(scope="module")
def walked_pair(tmp_path_factory):
    folder, requests, said = write_and_walk(tmp_path_factory, "ggml-vocab-qwen2.gguf", synth_pair, "pair", pair=True)
    assert "draft agreement 0.599" in said   # the tiny vocabulary's share of 0.6 (seed 0)
    return folder, requests


def check_fixed_lengths(requests: list, **load) -> None:
    """Fixed k=1 and k=3 on the uniform requests draft and accept what the walk says, token for token."""
    by_prompt = {r["prompt"]: r["greedy"] for r in requests}
    assert {r["set"] for r in requests} == {"code", "prose", "warm", "mixed"}
    assert [len(by_prompt[p]) for p in (CODE[0], PROSE[0])] == [TOKENS + 1, TOKENS + 1]
    with load_pair(no_repack=True, n_ctx=512, n_threads=2, **load) as pair:
        for k in (1, 3):
            pair.set_policy(FixedPolicy(k, 0.0))
            for prompt in (CODE[0], PROSE[0]):
                _, drafted, accepted = synth_walk.fixed_steps(by_prompt[prompt], k, TOKENS)   # what the walk says
                pair.reset()
                stats = pair.generate(prompt, max_tokens=TOKENS).stats
                assert (stats.drafted, stats.accepted) == (drafted, accepted), (k, prompt)
                assert 0 < accepted < drafted


@pytest.mark.slow
def test_the_walk_predicts_every_fixed_length_s_drafted_and_accepted_tokens_exactly(walked):
    model, requests = walked
    check_fixed_lengths(requests, target=str(model), drafter="mtp")
    assert synth_walk.fixed_steps([1.0] * 9, 2, 8) == (3, 5, 5)   # 3, 3 and the last 2 tokens: a shorter last draft
    assert synth_walk.tokens_a_pass([[1.0] * 9], 2, 8) == pytest.approx(8 / 3)


@pytest.mark.slow
def test_the_walk_of_a_pair_predicts_its_draft_model_s_tokens_exactly(walked_pair):
    folder, requests = walked_pair
    check_fixed_lengths(requests, target=str(folder / "target.gguf"), draft=str(folder / "draft.gguf"))


def test_bad_input_gets_one_line_and_a_non_zero_exit(tmp_path):
    root = Path(synth_walk.__file__).parents[2]
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not a model\n")
    for args, says in ((["--vocab", str(tmp_path / "none.gguf")], "no file"),
                       (["--vocab", str(not_gguf)], "not a readable GGUF file"),
                       (["--vocab", str(not_gguf), "--tokens", "0"], "--tokens must be at least 1"),
                       (["--vocab", str(not_gguf), "--per-set", "9"], "--per-set must be 1 to 4"),
                       (["--vocab", str(not_gguf), "--agree", "2"], "--agree"),
                       (["--vocab", str(not_gguf), "--pair", "--preset", "27b"], "--preset: synth_pair.py has")):
        done = subprocess.run([sys.executable, "-m", "benchmarks.probes.synth_walk", *args], capture_output=True,
                              text=True, timeout=120, cwd=root)
        assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len([line for line in done.stderr.splitlines() if "error" in line]) == 1
