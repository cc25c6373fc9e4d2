"""bench_engine.py --rounds: llamaspec's modes run in interleaved rounds, summed, each round's tok/s reported."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compare.bench_engine import Row, merge_rounds

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "compare" / "bench_engine.py"


def row(tps_each: list[float], tokens_each: list[int], drafted: int) -> Row:
    r = Row("fixed k=2", 0.0, drafted=drafted, passes=10, overhead=[0.02], step_overhead_ms=[0.3], rollback_ms=[0.01])
    r.runs, r.run_tokens = list(tps_each), list(tokens_each)
    r.tokens = sum(tokens_each)
    r.seconds = sum(n / t for n, t in zip(tokens_each, tps_each))
    return r


def test_rounds_sum_into_one_row_with_each_requests_tokens_over_its_time():
    one, two = row([100.0, 50.0], [100, 100], 40), row([200.0, 50.0], [100, 100], 60)
    merged = merge_rounds([one, two])
    assert merged.tokens == 400 and merged.seconds == pytest.approx(1.0 + 2.0 + 0.5 + 2.0)
    assert merged.drafted == 100 and merged.passes == 20
    assert merged.runs == pytest.approx([200 / 1.5, 50.0])       # the first request: 200 tokens in 1.5 s
    assert merged.round_tps == pytest.approx([one.tps, two.tps])
    assert merged.overhead == [0.02, 0.02] and merged.step_overhead_ms == [0.3, 0.3]
    assert merge_rounds([one]) is one and one.round_tps == []    # one round: the row as it ran


def test_a_run_in_two_rounds_reports_each_and_auto_s_trace_once_a_round(tmp_path, tiny_mtp):
    model = tiny_mtp
    out, js = tmp_path / "r.md", tmp_path / "r.json"
    env = dict(os.environ, LLAMASPEC_NO_REPACK="1")
    done = subprocess.run([sys.executable, str(BENCH), "--target", str(model), "--drafter", "mtp", "--k", "1",
                           "--modes", "plain,fixed,auto", "--regimes", "greedy", "--peers", "", "--tokens", "8",
                           "--prompts", "code", "--per-set", "1", "--rounds", "2", "--no-repack", "--threads", "2",
                           "--out", str(out), "--json", str(js)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(js.read_text())
    assert [r["mode"] for r in rows] == ["plain", "fixed k=1", "auto"]
    assert all(len(r["round_tok_s"]) == 2 and r["request_tokens"] == [8] for r in rows), rows
    auto = rows[2]
    assert len(auto["auto_events"]) == 2 and "auto_events" not in rows[1]   # auto's calls, one list a round
    from support.policy_sim import replay_events
    for events in auto["auto_events"]:
        assert events[0][0] == "policy" and events[1][0] == "attach" and events[2] == ["request"]
        replayed = replay_events(events)
        assert replayed and all(s["chosen"] >= s["drafted"] for s in replayed)   # the run's own choices, or cut
        assert sum(s["chosen"] == s["drafted"] for s in replayed) >= len(replayed) - 1
    report = out.read_text()
    assert "in 2 interleaved rounds" in report and "llamaspec's rounds (tok/s each round, interleaved): plain " in report
    assert "- auto's cost model at the end: " in report and "- auto's cost model at the end (round 2): " in report
    hardware_line = report.split("- hardware: ", 1)[1].splitlines()[0]
    assert "; Python: `auto`'s own hooks " in hardware_line
    bad = subprocess.run([sys.executable, str(BENCH), "--target", str(model), "--drafter", "mtp", "--rounds", "0"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--rounds" in bad.stderr and "Traceback" not in bad.stderr


def test_each_round_draws_its_own_seeds_and_every_mode_of_a_round_the_same():
    """Sampled rounds are independent draws (a policy's first steps meet other acceptances each round), while the
    modes of one round are compared on the same draws; round 1 keeps the seeds a one-round run always had."""
    from types import SimpleNamespace

    from benchmarks.compare.bench_engine import ROUND_SEEDS, run_llamaspec
    from benchmarks.compare.peers import Regime
    from llamaspec.stats import GenerationStats

    class RecordingPair:
        target_ctx = SimpleNamespace(device_sampler=None)
        costs = None

        def __init__(self):
            self.seeds = []   # (the policy's name, the request's seed)

        def set_policy(self, policy):
            self.policy = policy

        def reset(self):
            pass

        def generate(self, prompt, max_tokens, seed, **sampling):
            self.seeds.append((self.policy.name, seed))
            return SimpleNamespace(stats=GenerationStats(tokens_generated=max_tokens, target_passes=max_tokens))

    pair = RecordingPair()
    a = SimpleNamespace(rounds=3, reach={}, tokens=4, synth=None, costs=None)
    run_llamaspec(pair, a, [Regime("temp", 0.8)], [2], ["fixed", "auto+warm"], ["p1", "p2"], 4)
    fixed = [seed for name, seed in pair.seeds if name == "fixed"]
    auto = [seed for name, seed in pair.seeds if name == "auto"]
    rounds = [[r * ROUND_SEEDS, r * ROUND_SEEDS + 1] for r in range(3)]
    assert fixed == [s for r in rounds for s in r]
    assert auto == [s for r in rounds for s in (12345 + r[0], *r)]    # its warm-up request, then the prompts


def test_the_host_s_python_speed_is_auto_s_own_hooks_on_one_fixed_trace():
    """The report's hardware line says how fast the host runs a step's Python (two H100 hosts spent 0.22 and 0.49 ms
    a step on the same code): `auto`'s hooks over one fixed trace, its own lengths and probes, the same on every
    host, so that only the time differs."""
    from benchmarks.compare.bench_engine import python_speed

    us, drafted = python_speed(steps=600, repeats=2)
    again, drafted_again = python_speed(steps=600, repeats=1)
    assert drafted == drafted_again and 1.0 < drafted < 3.0   # the same trace: drafting at 70%, plain steps between
    assert 0.0 < us < 5000.0 and 0.0 < again < 5000.0
