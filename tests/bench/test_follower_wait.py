"""benchmarks/probes/follower_wait.py: the wait a follower's read of a target pass pays, split from the read."""
import os
import re
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "follower_wait.py"


def test_it_counts_every_hidden_state_read_of_an_mtp_run_and_splits_its_wait(tiny_mtp):
    model = tiny_mtp
    done = subprocess.run([sys.executable, str(PROBE), "--target", str(model), "--drafter", "mtp", "--modes", "fixed",
                           "--k", "2", "--regimes", "greedy", "--peers", "", "--tokens", "8", "--per-set", "1",
                           "--no-repack", "--threads", "2"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, LLAMASPEC_NO_REPACK="1"))
    assert done.returncode == 0, done.stderr
    found = re.search(r"hidden-state reads: (\d+); llama_synchronize ([\d.]+) us each, the getter after it ([\d.]+) us",
                      done.stdout)
    assert found and int(found.group(1)) > 0, done.stdout[-2000:]
    assert "llamaspec fixed k=2" in done.stdout   # bench_engine's own report ran through it


def test_a_missing_model_is_one_line_and_a_nonzero_exit(tmp_path):
    done = subprocess.run([sys.executable, str(PROBE), "--target", str(tmp_path / "missing.gguf"), "--drafter", "mtp",
                           "--peers", ""], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.gguf'}: no such model file"]
    assert "hidden-state reads" not in done.stdout
