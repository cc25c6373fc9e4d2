"""Run a benchmark script (benchmarks/FOLDER/NAME.py) as a user would: a fresh interpreter, CPU weight repacking off."""
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """benchmarks/SCRIPT (e.g. "probes/profile_step.py") with these arguments; its exit code, stdout and stderr."""
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, LLAMASPEC_NO_REPACK="1"))
