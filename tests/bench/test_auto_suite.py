"""benchmarks/compare/auto_suite.py: the `auto` benchmark in units that resume, the model files written once and
removed after their last unit, and the summary's ratios read off bench_engine's JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.gguf_factory import find_vocab_file

from benchmarks.compare import auto_suite
from benchmarks.compare.bench_engine import PEER_LABELS

SCRIPT = Path(auto_suite.__file__)


def suite(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def vocab_dir(tmp_path: Path) -> Path:
    """A folder with the two vocabulary files the suite asks for (empty stand-ins: a dry run reads none)."""
    d = tmp_path / "vocab"
    d.mkdir()
    for name in ("qwen35", "qwen2"):
        (d / f"ggml-vocab-{name}.gguf").write_bytes(b"")
    return d


def test_every_model_file_is_written_once_before_its_units_and_removed_after_the_last(tmp_path):
    run = suite(str(tmp_path / "out"), "--vocab-dir", str(vocab_dir(tmp_path)), "--dry-run")
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith(("$", "#"))]
    writes = [i for i, line in enumerate(lines) if "benchmarks/synthetic/" in line]
    assert len(writes) == 5, lines                          # mtp, mtpmix, pair, pair04, pairmix: once each
    removals = [i for i, line in enumerate(lines) if line.startswith("# ") and "removed" in line]
    assert len(removals) == 5
    for w, r in zip(writes, removals):
        assert w < r
        between = lines[w + 1:r]
        assert between and all(line.startswith("$") for line in between)   # its units only, then it goes
    engine = [line for line in lines if "bench_engine.py" in line]
    parallel = [line for line in lines if "bench_parallel.py" in line]
    assert len(engine) == 5 * 3 and len(parallel) == 5                 # 5 bench_engine units x 3 regimes
    assert sum("LLAMASPEC_BATCH_DEVICE_SAMPLING=1" in line for line in parallel) == 2   # the sampled regimes
    assert all("--json" in line and "--out" in line for line in engine)
    assert all("--k 1,2,3,5,8" in line for line in engine if "--draft " in line and "pair04" not in line)
    assert sum("pair04/draft.gguf --k 1 " in line for line in engine) == 3     # the useless draft: k=1 only
    assert all("--drafter mtp --k 1,2,3" in line for line in engine if "--draft " not in line)


def test_a_finished_unit_is_skipped_and_one_cut_short_runs_again(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "uniform-mtp-greedy.md").write_text("# report\n\n| a |\n")
    (out / "uniform-mtp-greedy.json").write_text("[]")
    (out / "mixed-mtp-greedy.md").write_text("# report\n\n| a |\n")    # final, but its JSON cut short
    (out / "mixed-mtp-greedy.json").write_text("[{\"regime\": ")
    (out / "uniform-mtp-filters.md").write_text("# report\n\n**Partial: the run has not finished (...)**\n")
    run = suite(str(out), "--vocab-dir", str(vocab_dir(tmp_path)), "--regimes", "greedy,filters", "--only",
                "uniform-mtp,mixed-mtp-greedy", "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "# uniform-mtp-greedy: done" in run.stdout
    ran = [line for line in run.stdout.splitlines() if line.startswith("$") and "bench_engine.py" in line]
    assert len(ran) == 2 and "--regimes filters" in ran[0] and "mixed-mtp-greedy.md" in ran[1]
    assert "| mixed-mtp-greedy | unreadable" in run.stdout    # the summary says so, no traceback
    listed = suite(str(out), "--regimes", "greedy,filters", "--only", "uniform-mtp", "--list").stdout
    assert "uniform-mtp-greedy" in listed and "done" in listed.splitlines()[0]
    assert "to run" in listed.splitlines()[1]


@pytest.mark.parametrize("args, message", [
    (["--regimes", "hot"], "--regimes: choose from"),
    (["--only", "nothing"], "--only: no unit named nothing"),
    (["--tokens", "0"], "--tokens must be at least 1"),
    (["--tools", "/nonexistent"], "--tools: no llama-server in /nonexistent"),
    ([], "--vocab-dir: give llama.cpp's models/ folder"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, message):
    run = suite(str(tmp_path / "out"), *args)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr


def row(engine: str, mode: str, tok_s: float, **extra) -> dict:
    return {"regime": "greedy", "engine": engine, "mode": mode, "tok_s": tok_s, **extra}


def test_the_summary_puts_auto_against_the_best_fixed_k_and_each_peers_best(tmp_path):
    ik, tuner, own = PEER_LABELS["ik"], PEER_LABELS["ik-autotune"], PEER_LABELS["ik-autotune-own"]
    runs = lambda *x: {"request_tok_s": list(x), "request_tokens": [100, 100]}   # noqa: E731
    (tmp_path / "mixed-mtp-greedy.json").write_text(json.dumps([
        row("llamaspec", "plain", 80.0, **runs(80.0, 80.0)),
        row("llamaspec", "fixed k=1", 100.0, **runs(150.0, 60.0)),
        row("llamaspec", "fixed k=2", 90.0, **runs(200.0, 50.0)),
        row("llamaspec", "auto", 110.0), row("llamaspec", "auto+warm", 120.0),
        row("llama-server", "k=1", 95.0), row("llama-server", "k=2", 99.0),
        row(ik, "k=1", 104.0), row(ik, "k=2", 0.0, skipped="failed"),
        row(tuner, "k=3", 88.0), row(own, "k=3", 100.0),
    ]))
    (tmp_path / "uniform-mtp-greedy.json").write_text(json.dumps([
        row("llamaspec", "plain", 80.0), row("llamaspec", "fixed k=2", 125.0), row("llamaspec", "auto", 100.0)]))
    (tmp_path / "useless-pair-greedy.json").write_text(json.dumps([
        row("llamaspec", "plain", 80.0), row("llamaspec", "fixed k=1", 72.0), row("llamaspec", "auto", 78.0),
        row("llama-server", "k=1", 61.0)]))
    lines = auto_suite.summary_rows(tmp_path)
    useless = next(line for line in lines if line.startswith("| useless-pair-greedy"))
    cells = [c.strip() for c in useless.strip("|").split("|")]
    assert cells[2] == "80.00 (plain)" and cells[5] == f"{78 / 80:.3f}, -"   # where no draft pays, plain is k=0
    assert cells[7] == "61.00 (k=1)" and cells[8] == "-"     # the peers drafted there: no ratio to a slower peer
    mixed = next(line for line in lines if line.startswith("| mixed-mtp-greedy"))
    cells = [c.strip() for c in mixed.strip("|").split("|")]
    assert cells[2] == "100.00 (fixed k=1)"
    assert cells[5] == "1.100, 1.200"
    # each request at its best: 200 tok/s (k=2) and 80 (plain): 200 tokens in 0.5 + 1.25 s
    assert cells[6] == f"{200 / 1.75 / 100:.3f}"
    assert cells[7] == "99.00 (k=2)" and cells[8] == f"{110 / 99:.3f}"
    assert cells[9] == "104.00 (k=1)"                       # the failed k=2 is no best; no tuner row counts here
    assert cells[10] == "100.00" and cells[11] == "1.100"    # the faster of the two tuners
    uniform = next(line for line in lines if line.startswith("| uniform-mtp-greedy"))
    cells = [c.strip() for c in uniform.strip("|").split("|")]
    assert cells[4] == "-" and cells[5] == "0.800, -" and cells[6] == "-"    # no warm row; no ceiling when uniform
    assert cells[7] == "not run" and cells[11] == "-"


@pytest.mark.slow
def test_a_tiny_unit_runs_end_to_end_and_leaves_no_model_behind(tmp_path):
    """The tiny preset on this CPU: one bench_engine unit writes its file, its report and JSON, removes the file and
    prints its line of the summary."""
    qwen35, qwen2 = find_vocab_file("ggml-vocab-qwen35.gguf"), find_vocab_file("ggml-vocab-qwen2.gguf")
    if qwen35 is None or qwen2 is None or qwen35.parent != qwen2.parent:
        pytest.skip("the Qwen3.5 and Qwen2 vocabulary files are not in the vocab cache")
    out = tmp_path / "out"
    run = suite(str(out), "--vocab-dir", str(qwen35.parent), "--preset", "tiny", "--tokens", "8", "--only",
                "uniform-mtp-greedy", "--extra", "--no-repack --threads 2", timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (out / "uniform-mtp-greedy.md").is_file() and (out / "uniform-mtp-greedy.json").is_file()
    assert not (out / "models" / "mtp.gguf").exists()
    assert any(line.startswith("| uniform-mtp-greedy |") for line in run.stdout.splitlines())
    again = suite(str(out), "--vocab-dir", str(qwen35.parent), "--preset", "tiny", "--only", "uniform-mtp-greedy")
    assert again.returncode == 0 and "# uniform-mtp-greedy: done" in again.stdout
    assert not (out / "models" / "mtp.gguf").exists()     # nothing to run: nothing written


def test_a_model_file_is_written_under_a_temporary_name_and_one_cut_short_is_written_again(tmp_path, monkeypatch):
    files = auto_suite.model_files("tiny", tmp_path)
    written = []

    def fake_run(cmd, env=None, dry=False):   # the synthetic script: writes its output path
        out = Path(cmd[2])
        written.append(out.name)
        if cmd[1].endswith("synth_pair.py"):
            out.mkdir()
            (out / "target.gguf").write_bytes(b"t")
            (out / "draft.gguf").write_bytes(b"d")
        else:
            out.write_bytes(b"whole")

    monkeypatch.setattr(auto_suite, "run", fake_run)
    models = tmp_path / "models"
    models.mkdir()
    (models / "mtp.gguf.partial").write_bytes(b"cut short")          # a run killed while writing
    made: set = set()
    auto_suite.ensure_model(models, files["mtp.gguf"], False, made)
    assert (models / "mtp.gguf").read_bytes() == b"whole" and not (models / "mtp.gguf.partial").exists()
    auto_suite.ensure_model(models, files["pair"], False, made)
    assert (models / "pair" / "draft.gguf").is_file() and not (models / "pair.partial").exists()
    auto_suite.ensure_model(models, files["mtp.gguf"], False, set())   # there already: not written again
    assert written == ["mtp.gguf.partial", "pair.partial"]
