"""The benchmarks' tests: one tiny model of the 27B hybrid's structure (with its MTP head) for every probe that runs
on one, written once a session."""
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_mtp(tmp_path_factory) -> Path:
    """synth_mtp.py --preset tiny: a qwen35-shaped hybrid at width 256 whose MTP head agrees 70% (read it, never
    write it: every test of the session shares it)."""
    from benchmarks.synthetic import synth_mtp

    model = tmp_path_factory.mktemp("tiny-mtp") / "tiny-mtp.gguf"
    made = subprocess.run([sys.executable, synth_mtp.__file__, str(model), "--preset", "tiny"], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    return model
