"""benchmarks/synthetic/synth_pair.py: a synthetic target and draft whose greedy agreement is known, in runs along
the answer with a list of rates (the draft-model path's mixed workload of issue 37 on synthetic weights)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.gguf_factory import find_vocab_file

from benchmarks.compare.bench_engine import MIXED
from benchmarks.synthetic import synth_mtp, synth_pair
from llamaspec import load_pair
from llamaspec.policy import FixedPolicy

SCRIPT = Path(synth_pair.__file__)
TINY = synth_pair.PRESETS["tiny"]


def make(out: Path, *args: str) -> Path:
    run = subprocess.run([sys.executable, str(SCRIPT), str(out), "--preset", "tiny", *args],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return out


def test_the_draft_agrees_at_its_rate_and_greedy_output_is_the_targets(tmp_path):
    """With k=3 and agreement a, a pass emits 1 + a + a^2 + a^3 tokens on average (2.53 at a = 0.7); the tokens are
    the target's alone."""
    out = make(tmp_path / "pair", "--agree", "0.7")
    with load_pair(str(out / "target.gguf"), no_repack=True, n_ctx=512, n_threads=2) as plain:
        expected = plain.generate([5, 6, 7], max_tokens=160).tokens
    vocab = synth_mtp.Vocabulary(TINY["n_vocab"], TINY["n_embd"], 0.7, seed=0)
    assert expected[1:] == [int(vocab.sigma[x]) for x in expected[:-1]]     # the target walks the cycle
    with load_pair(str(out / "target.gguf"), str(out / "draft.gguf"), no_repack=True, n_ctx=512,
                   n_threads=2) as pair:
        pair.set_policy(FixedPolicy(3, 0.0))
        c = pair.generate([5, 6, 7], max_tokens=160)
    assert c.tokens == expected
    per_pass = c.stats.tokens_generated / c.stats.target_passes
    assert abs(per_pass - (1 + 0.7 + 0.7 ** 2 + 0.7 ** 3)) < 0.45, per_pass


def test_two_prompts_landing_in_different_runs_see_different_acceptance(tmp_path):
    out = make(tmp_path / "runs", "--agree", "1.0,0.0", "--agree-run", "512")
    vocab = synth_mtp.Vocabulary(TINY["n_vocab"], TINY["n_embd"], (1.0, 0.0), seed=0, run=512)
    rates = {}
    with load_pair(str(out / "target.gguf"), str(out / "draft.gguf"), no_repack=True, n_ctx=512,
                   n_threads=2) as pair:
        pair.set_policy(FixedPolicy(1, 0.0))
        for first in range(0, TINY["n_vocab"], 97):     # prompts of one token, until both kinds of run are seen
            walk, x = [], int(vocab.sigma[first])
            for _ in range(40):
                walk.append(x)
                x = int(vocab.sigma[x])
            upcoming = vocab.in_d[walk]
            if upcoming.all() or not upcoming.any():    # 40 tokens inside one run
                kind = "low" if upcoming.all() else "high"
                if kind in rates:
                    continue
                pair.reset()
                c = pair.generate([first], max_tokens=32)
                rates[kind] = c.stats.accepted / max(c.stats.drafted, 1)
            if len(rates) == 2:
                break
    assert rates["high"] > 0.9 and rates["low"] < 0.1, rates


@pytest.mark.parametrize("args, flag", [(["--agree", "0.5,x"], "--agree"), (["--agree", "0,0"], "--agree"),
                                        (["--draft-layers", "0"], "--draft-layers"),
                                        (["--draft-ff", "100"], "--draft-ff")])
def test_bad_arguments_are_one_line(tmp_path, args, flag):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "p"), "--preset", "tiny", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and flag in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.slow
def test_the_mixed_requests_meet_the_rates_the_construction_gives_them(tmp_path):
    """Over Qwen2's vocabulary with --seed 4 (the GPU runs' file: a tiny and a 32b file of one vocabulary and seed walk
    the same runs), bench_engine's five mixed requests meet runs of about 95, 11, 68, 91 and 34% agreement: what the
    construction gives each (the walk from its prompt's last token) is what k=1 accepts on it."""
    vocab_file = find_vocab_file("ggml-vocab-qwen2.gguf")
    if vocab_file is None:
        pytest.skip("llama.cpp's ggml-vocab-qwen2.gguf unavailable (set LLAMASPEC_VOCAB_DIR or LLAMASPEC_LLAMA_SRC)")
    out = make(tmp_path / "pair", "--agree", "0.95,0.7,0.4,0.1", "--agree-run", "2048", "--vocab", str(vocab_file),
               "--seed", "4")
    tokenizer = synth_mtp.Tokenizer(vocab_file, synth_pair.PRESETS["32b"]["n_vocab"], None)
    vocab = synth_mtp.Vocabulary(tokenizer.n_vocab, TINY["n_embd"], (0.95, 0.7, 0.4, 0.1), 4, tokenizer.good, 2048)
    expected, measured = [], []
    with load_pair(str(out / "target.gguf"), str(out / "draft.gguf"), no_repack=True, n_ctx=1024,
                   n_threads=2) as pair:
        pair.set_policy(FixedPolicy(1, 0.0))
        for _, prompt, share in MIXED:
            n = int(round(share * 128))
            walk, x = [], int(vocab.sigma[pair.tokenize(prompt)[-1]])
            for _ in range(n):
                walk.append(x)
                x = int(vocab.sigma[x])
            expected.append(1.0 - float(vocab.in_d[walk].mean()))
            pair.reset()
            c = pair.generate(prompt, max_tokens=n)
            measured.append(c.stats.accepted / c.stats.drafted)
    assert [round(r, 1) for r in expected] == [0.9, 0.1, 0.7, 0.9, 0.3], expected
    assert all(abs(m - e) < 0.12 for m, e in zip(measured, expected)), (measured, expected)
