"""`llamaspec bench` as a user reads it: modes interleaved over repeats, the spread, a speed-up only beyond the
noise, one closing sentence, and Ctrl-C keeping what was measured. A scripted pair stands in for the models: its
clock says how long each generation took, by mode and by call."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llamaspec import bench
from llamaspec.cli import bench as bench_cli
from llamaspec.cli import main
from llamaspec.engine import Completion, snapshot_bound
from llamaspec.stats import GenerationStats

TOKENS = 20


def mode_of(policy) -> str:
    if policy.name == "fixed":
        return "plain" if policy.draft_max == 0 else f"k={policy.draft_max}"
    return policy.name


class ScriptedPair:
    """A pair whose generations take `clock(mode, call_number)` seconds for TOKENS tokens; records the order of
    the calls and raises KeyboardInterrupt on call `interrupt_at` (counting from 0), as a Ctrl-C would."""

    speculative = True

    def __init__(self, clock, interrupt_at: int | None = None):
        self.clock, self.interrupt_at = clock, interrupt_at
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.policy = None

    def set_policy(self, policy):
        self.policy = policy

    def generate(self, prompt, max_tokens, **sampling):
        mode = mode_of(self.policy)
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        seconds = self.clock(mode, len(self.calls))
        self.calls.append((mode, tuple(prompt)))
        plain = mode == "plain"
        stats = GenerationStats(tokens_generated=TOKENS, target_passes=TOKENS if plain else TOKENS // 2,
                                time_total=seconds, drafted=0 if plain else TOKENS, accepted=0 if plain else TOKENS // 2)
        return Completion("same text", [], "length", stats)


MODES = [bench.PLAIN, bench.fixed_mode(1), bench.fixed_mode(4), bench.policy_mode("auto")]
PROMPTS = [[1, 2], [3, 4]]


def speeds(tok_per_s: dict[str, float], load=lambda call: 1.0):
    """A clock: each mode's speed, slowed by `load(call)` (a factor >= 1: background load at that moment)."""
    return lambda mode, call: TOKENS / tok_per_s[mode] * load(call)


def run(pair, repeats=3, modes=MODES, **kw):
    return bench.run_bench(pair, PROMPTS, modes, max_tokens=TOKENS, warmup=False, repeats=repeats, **kw)


def test_modes_are_interleaved_prompt_by_prompt_in_every_repeat():
    pair = ScriptedPair(speeds({"plain": 10, "k=1": 11, "k=4": 14, "auto": 13}))
    report = run(pair, repeats=3)
    cycle = ["plain", "k=1", "k=4", "auto"]
    assert [mode for mode, _ in pair.calls] == cycle * len(PROMPTS) * 3
    assert [prompt for _, prompt in pair.calls[:8]] == [(1, 2)] * 4 + [(3, 4)] * 4
    plain = report.plain
    assert plain.repeats == 3 and plain.prompts == 2 and plain.tokens == 3 * 2 * TOKENS
    assert len(plain.repeat_tokens_per_second) == 3


def test_a_load_that_comes_and_goes_reads_as_noise_not_as_a_speedup():
    """Run one after another, a burst of load during plain's turn gave k=2 a '3.8x'; interleaved, the burst lands
    on every mode of its repeat and the spread it leaves is the noise a speed-up must beat."""
    per_repeat = len(PROMPTS) * len(MODES)
    burst = lambda call: 3.0 if call // per_repeat == 1 else 1.0   # noqa: E731  (the second repeat is loaded)
    pair = ScriptedPair(speeds({"plain": 10, "k=1": 10.2, "k=4": 10.1, "auto": 10.0}, burst))
    report = run(pair)
    k4 = next(r for r in report.results if r.mode == "k=4")
    assert report.plain.tokens_per_second_min == pytest.approx(10 / 3)
    assert report.plain.tokens_per_second_max == pytest.approx(10)
    assert k4.speedup == pytest.approx(1.01) and k4.verdict == "same"
    verdict = report.verdicts()[0]
    assert verdict.pays is False and verdict.best is None
    assert bench_cli.verdict_sentence(verdict) == ("speculation does not pay here: use plain decoding "
                                                   "(--spec-type none)")


def test_a_speedup_beyond_the_noise_is_a_win_and_the_sentence_names_it():
    jitter = lambda call: 1.0 + 0.01 * (call % 3)   # noqa: E731  (about 2% apart: below MIN_NOISE)
    pair = ScriptedPair(speeds({"plain": 10, "k=1": 11, "k=4": 14, "auto": 13.8}, jitter))
    report = run(pair)
    by_mode = {r.mode: r for r in report.results}
    assert by_mode["k=4"].verdict == "faster" and by_mode["k=4"].speedup == pytest.approx(1.4, rel=0.03)
    assert by_mode["k=1"].verdict == "faster"
    verdict = report.verdicts()[0]
    assert verdict.pays and verdict.best.mode == "k=4" and verdict.auto_matches_best
    assert bench_cli.verdict_sentence(verdict) == ("on this machine speculation pays: 1.39x with k=4; auto picks it "
                                                   "(1.38x)")


def test_auto_far_behind_the_best_length_says_how_to_fix_it():
    pair = ScriptedPair(speeds({"plain": 10, "k=1": 11, "k=4": 14, "auto": 11}))
    sentence = bench_cli.verdict_sentence(run(pair).verdicts()[0])
    assert sentence.endswith("with k=4; auto gets 1.10x, so choose it yourself: --policy fixed --draft-max 4")


def test_a_small_difference_is_the_same_as_plain_and_a_loss_is_slower():
    pair = ScriptedPair(speeds({"plain": 10, "k=1": 10.2, "k=4": 6, "auto": 9.9}))
    by_mode = {r.mode: r for r in run(pair).results}
    assert by_mode["k=1"].verdict == "same" and by_mode["auto"].verdict == "same"
    assert by_mode["k=4"].verdict == "slower"


def test_one_repeat_judges_nothing():
    pair = ScriptedPair(speeds({"plain": 10, "k=1": 11, "k=4": 30, "auto": 13}))
    report = run(pair, repeats=1)
    assert all(r.verdict is None for r in report.results)
    assert report.verdicts()[0].pays is None
    assert "--repeats 3" in bench_cli.verdict_sentence(report.verdicts()[0])


def test_ctrl_c_keeps_what_every_mode_finished():
    per_repeat = len(PROMPTS) * len(MODES)
    pair = ScriptedPair(speeds({"plain": 10, "k=1": 11, "k=4": 14, "auto": 13}), interrupt_at=per_repeat + 6)
    report = run(pair)   # stopped in the second repeat, at the second prompt's k=4
    assert report.interrupted
    plain, k4 = report.results[0], report.results[2]
    assert plain.repeats == 2 and len(plain.repeat_tokens_per_second) == 2
    # the second prompt of the second repeat was run by plain and k=1 only: left out of every mode
    assert plain.tokens == k4.tokens == 3 * TOKENS
    assert k4.speedup == pytest.approx(1.4)


# ---------------------------------------------------------------------------------------------------------------
# the command: table, JSON, Ctrl-C
# ---------------------------------------------------------------------------------------------------------------
class ScriptedModel:
    def __init__(self, name):
        self.info = type("Info", (), {"name": name, "arch": "fake", "weights_bytes": 1})()
        self.path = f"/models/{name}.gguf"


@pytest.fixture
def scripted(monkeypatch):
    """`llamaspec bench` on a ScriptedPair: returns a function that sets the pair up."""
    holder = {}

    def use(pair):
        pair.target, pair.draft, pair.drafter_kind = ScriptedModel("target"), ScriptedModel("draft"), "model"
        pair.close = lambda: None
        holder["pair"] = pair

    monkeypatch.setattr(bench_cli, "load_pair_from_options", lambda opts: holder["pair"])
    monkeypatch.setattr(bench, "prepare_prompts", lambda pair, prompts, chat=True: PROMPTS)
    return use


def invoke_bench(*args):
    return CliRunner().invoke(main, ["bench", "-m", "unused.gguf", "--no-warmup", "--k", "1,4", "--policies", "auto",
                                     "-n", str(TOKENS), *args])


def test_the_table_shows_the_spread_and_ends_with_the_verdict(scripted):
    scripted(ScriptedPair(speeds({"plain": 10, "k=1": 11, "k=4": 14, "auto": 13.8})))
    result = invoke_bench()
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    header = next(line for line in lines if line.startswith("mode"))
    assert "min-max" in header and "vs plain" in header
    assert any(line.startswith("k=4") and "faster" in line for line in lines)
    assert lines[-1] == "on this machine speculation pays: 1.40x with k=4; auto picks it (1.38x)"


def test_json_has_the_spread_and_the_verdict(scripted):
    scripted(ScriptedPair(speeds({"plain": 10, "k=1": 10.1, "k=4": 10.2, "auto": 10})))
    result = invoke_bench("--json", "--repeats", "2")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["repeats"] == 2 and data["interrupted"] is False
    k4 = next(r for r in data["results"] if r["mode"] == "k=4")
    assert len(k4["repeat_tokens_per_second"]) == 2 and len(k4["speedups"]) == 2
    assert {"tokens_per_second_min", "tokens_per_second_max", "spread", "verdict"} <= set(k4)
    assert data["verdicts"][0]["pays"] is False
    assert data["verdict"] == ["speculation does not pay here: use plain decoding (--spec-type none)"]


def test_ctrl_c_prints_what_was_measured_and_exits_130(scripted):
    scripted(ScriptedPair(speeds({"plain": 10, "k=1": 11, "k=4": 14, "auto": 13}), interrupt_at=12))
    result = invoke_bench()
    assert result.exit_code == 130
    assert any(line.startswith("k=4") for line in result.stdout.splitlines())
    assert "interrupted: the results above are of 2 of 3 repeat(s)" in result.stderr
    assert "Traceback" not in result.output


def test_ctrl_c_before_anything_was_measured_says_so(scripted):
    scripted(ScriptedPair(speeds({"plain": 10, "k=1": 11, "k=4": 14, "auto": 13}), interrupt_at=2))
    result = invoke_bench()
    assert result.exit_code == 130
    assert "interrupted before any prompt was measured in every mode" in result.stderr


def test_on_a_hybrid_target_the_modes_stay_within_the_snapshots_its_load_kept(tmp_path):
    # a hybrid's load keeps one recurrent-state snapshot per draft token (3 for an MTP head under auto); a mode
    # drafting past them saves a checkpoint every step, which a user's own load of that policy would not
    import subprocess
    import sys
    from types import SimpleNamespace

    from benchmarks.synthetic import synth_mtp
    from llamaspec.gguf.reader import read_model_info

    hybrid = tmp_path / "hybrid-mtp.gguf"
    made = subprocess.run([sys.executable, synth_mtp.__file__, str(hybrid), "--preset", "tiny", "--header-only"],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    pair = SimpleNamespace(speculative=True, target=SimpleNamespace(info=read_model_info(hybrid)),
                           config=SimpleNamespace(target=SimpleNamespace(n_rs_seq=3)))
    assert snapshot_bound(pair) == 3
    plain, fixed, auto = bench.default_modes(pair)
    assert (fixed.draft_max, auto.make_policy().draft_max) == (3, 3)
    assert bench.default_modes(pair, draft_max=2)[1].draft_max == 2          # a length given is the fixed one
    assert [m.make_policy().draft_max for m in bench_cli.build_modes(pair, None, "auto,confidence", None)] == [3, 3]
    assert bench_cli.build_modes(pair, None, "auto", 6)[0].make_policy().draft_max == 6
    kv = SimpleNamespace(speculative=True, target=ScriptedModel("target"),   # a memory that drops tokens itself
                         config=SimpleNamespace(target=SimpleNamespace(n_rs_seq=3)))
    assert snapshot_bound(kv) is None
    assert [m.draft_max for m in bench.default_modes(kv)] == [0, 4, None]
