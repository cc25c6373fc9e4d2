"""benchmarks/probes/record_acceptance.py on the tiny models: what it records, and bad input as one line."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.probes.record_acceptance", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_a_draft_with_the_targets_weights_agrees_at_every_position(tiny_models, tmp_path):
    out = tmp_path / "traces.json"
    done = run(tiny_models["target"], tiny_models["draft"], "--out", out, "--tokens", "6", "--no-repack")
    assert done.returncode == 0, done.stderr
    requests = json.loads(out.read_text())["requests"]
    assert [r["set"] for r in requests] == ["mixed"] * 5 + ["code"] * 2 + ["prose"] * 2
    for r in requests:
        assert r["greedy"] and set(r["greedy"]) == {"1"}, r        # the same weights: the same argmax
        assert all(c > 0.99 for c in r["sampled"]), r               # p == q: sum min(p, q) = 1
    noisy = tmp_path / "noisy.json"
    assert run(tiny_models["target"], tiny_models["noisy"], "--out", noisy, "--tokens", "6",
               "--no-repack").returncode == 0
    chances = [c for r in json.loads(noisy.read_text())["requests"] for c in r["sampled"]]
    assert min(chances) < 0.99 and max(chances) <= 1.0


def test_a_wrong_pair_or_a_missing_file_is_one_line(tiny_models, tmp_path):
    out = tmp_path / "traces.json"
    for draft, message in ((tiny_models["other"], "cannot speculate for target"),
                           (tmp_path / "missing.gguf", "no such model file")):
        done = run(tiny_models["target"], draft, "--out", out, "--no-repack")
        assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()
    done = run(tiny_models["target"], tiny_models["draft"], "--out", tmp_path / "no" / "such.json")
    assert done.returncode == 2 and "no such folder" in done.stderr, done.stderr
