"""benchmarks/probes/sampled_step_host.py: a sampled step's host time over stand-in dense rows, no model needed."""
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "sampled_step_host.py"


def run(*args):
    return subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=120)


def test_a_short_run_reports_acceptance_and_host_time_per_step():
    done = run("--vocab", "4096", "--k", "3", "-n", "48", "--repeat", "1")
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[0]
    assert line.startswith("vocabulary 4096, k=3, T=0.8: 48 tokens") and "ms per step" in line, line


@pytest.mark.parametrize("args, message", [(("--k", "0"), "--k must be at least 1"),
                                           (("--temp", "0"), "--temp must be > 0"),
                                           (("--vocab", "3"), "--vocab must be at least 16"),
                                           (("--disagree", "1.5"), "--disagree must be in [0, 1]")])
def test_bad_settings_are_one_line_and_exit_2(args, message):
    done = run(*args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
