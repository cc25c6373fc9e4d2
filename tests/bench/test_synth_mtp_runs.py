"""benchmarks/synthetic/synth_mtp.py with a list of agreement rates (--agree 1.0,0.0 --agree-run N): the tokens
greedy decoding visits in a row take the rates in runs, so one answer keeps one acceptance rate and another request
may see another (the mixed workload of issue 37 on synthetic weights)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.synthetic import synth_mtp
from llamaspec import load_pair
from llamaspec.policy import FixedPolicy

SCRIPT = Path(synth_mtp.__file__)


def walk(vocab: synth_mtp.Vocabulary, start: int, n: int) -> list[int]:
    out, x = [], start
    for _ in range(n):
        out.append(x)
        x = int(vocab.sigma[x])
    return out


def test_the_rates_hold_along_runs_of_the_greedy_walk():
    vocab = synth_mtp.Vocabulary(4096, 64, (1.0, 0.0), seed=0, run=256)
    tokens = walk(vocab, 0, 4096)                       # the whole cycle, in the order greedy decoding visits it
    start = tokens.index(int(vocab.good[0]))
    in_d = vocab.in_d[np.roll(np.array(tokens), -start)]  # walk position 0 = g_0
    runs = in_d.reshape(-1, 256)
    assert (runs.mean(axis=1) == np.tile([0.0, 1.0], 8)).all()   # rate 1.0: none mispredicted; 0.0: all
    assert abs(vocab.agreement - 0.5) < 1e-9


def test_one_rate_draws_what_it_drew_before():
    one = synth_mtp.Vocabulary(4096, 64, 0.7, seed=3)
    listed = synth_mtp.Vocabulary(4096, 64, (0.7,), seed=3, run=16)
    assert (one.in_d == listed.in_d).all() and (one.alias == listed.alias).all()


@pytest.mark.parametrize("agree", ["0.5,x", "0,0", "1.5", "-0.1,0.5"])
def test_a_bad_rate_list_is_one_line(tmp_path, agree):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "m.gguf"), "--agree", agree],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--agree" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.slow
def test_two_prompts_landing_in_different_runs_see_different_acceptance(tmp_path):
    out = tmp_path / "tiny-runs.gguf"
    made = subprocess.run([sys.executable, str(SCRIPT), str(out), "--preset", "tiny", "--agree", "1.0,0.0",
                           "--agree-run", "512"], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    n_vocab = synth_mtp.PRESETS["tiny"]["n_vocab"]
    vocab = synth_mtp.Vocabulary(n_vocab, synth_mtp.PRESETS["tiny"]["n_embd"], (1.0, 0.0), seed=0, run=512)
    rates = {}
    with load_pair(str(out), drafter="mtp", no_repack=True, n_ctx=512, n_threads=2) as pair:
        pair.set_policy(FixedPolicy(1, 0.0))
        for first in range(0, n_vocab, 97):             # prompts of one token, until both kinds of run are seen
            x = int(vocab.sigma[first])
            upcoming = vocab.in_d[walk(vocab, x, 40)]
            if upcoming.all() or not upcoming.any():    # 40 tokens inside one run
                kind = "low" if upcoming.all() else "high"
                if kind in rates:
                    continue
                c = pair.generate([first], max_tokens=32)
                rates[kind] = c.stats.accepted / max(c.stats.drafted, 1)
            if len(rates) == 2:
                break
    assert rates["high"] > 0.9 and rates["low"] < 0.1, rates
