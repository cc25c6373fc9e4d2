"""Shared fixtures: the three tiers of models, the fast tier, and a home folder that is not the user's.

- no model: pure unit tests use fakes;
- tiny models: written by `gguf_factory` into a session temp dir, with a real llama.cpp tokenizer;
- real models: the folder in $LLAMASPEC_TEST_MODELS (`python -m tests.support.fetch_models DEST` makes it); tests
  skip when absent.

Tiers: a plain `pytest` run is the fast tier: tests marked `slow` or `realmodel` are deselected (a test that uses
the real models is marked `realmodel` here). `--full` runs every test; `-m EXPR` chooses by markers instead.

Nothing is written under the user's home: HOME, the XDG folders (where platformdirs puts llamaspec's config, data
and chats), HF_HOME and llamaspec's own folder variables point into temp folders, one for the session (the
servers and commands that fixtures start inherit it) and a fresh one for each test. What the tests read from the
real home (the real test models, llama.cpp's tools and source, the vocab cache) is located first, here, and passed
on through the variables the tests read.

A SIGTERM (`timeout`) ends the run, also during a llama.cpp call (support/sigterm.py).

llama.cpp's CPU weight repacking is turned off for every test (LLAMASPEC_NO_REPACK=1): on some CPUs that
advertise AMX it makes batched decoding die with SIGILL.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ["LLAMASPEC_NO_REPACK"] = "1"

from support.gguf_factory import find_vocab_dir, make_tiny_model  # noqa: E402
from support.home import HOME_VARS, UNSET_VARS, locate_shared_resources, point_home_at  # noqa: E402
from support.sigterm import (pytest_configure, pytest_runtest_call, pytest_runtest_setup,  # noqa: E402,F401
                             pytest_runtest_teardown, pytest_unconfigure)

REAL_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
REAL_DRAFT = "qwen2.5-coder-0.5b-instruct.gguf"
REAL_SMOLLM = "smollm2-135m-instruct-q4_1.gguf"
REAL_GEMMA = "gemma-3-270m-q4_k_m.gguf"


# -- the user's folders --------------------------------------------------------------------------------------------
locate_shared_resources()


@pytest.fixture(scope="session", autouse=True)
def session_home(tmp_path_factory) -> Path:
    """A temp home for the session's fixtures and the processes they start."""
    home = tmp_path_factory.mktemp("home")
    saved = {var: os.environ.get(var) for var in (*HOME_VARS, *UNSET_VARS)}
    point_home_at(home, os.environ.__setitem__, lambda var: os.environ.pop(var, None))
    yield home
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.fixture(autouse=True)
def temp_home(session_home, monkeypatch) -> Path:
    """A fresh temp home for each test (beside the test's own tmp_path, which it leaves empty)."""
    home = Path(tempfile.mkdtemp(prefix="home-", dir=session_home.parent))
    point_home_at(home, monkeypatch.setenv, lambda var: monkeypatch.delenv(var, raising=False))
    return home


# -- tiers ---------------------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run every tier: the slow and real-model tests too (the default run deselects them)")


@pytest.hookimpl(tryfirst=True)   # before -m reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "real_models" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.realmodel)
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    named = [_node_id(config, arg) for arg in config.args if "::" in arg]   # tests asked for by name always run
    kept, deselected = [], []
    for item in items:
        slow = item.get_closest_marker("slow") or item.get_closest_marker("realmodel")
        asked = any(item.nodeid == name or item.nodeid.startswith((name + "[", name + "::")) for name in named)
        (deselected if slow and not asked else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def _node_id(config, arg: str) -> str:
    path, rest = arg.split("::", 1)
    try:
        path = Path(path).resolve().relative_to(config.rootpath).as_posix()
    except ValueError:
        pass
    return f"{path}::{rest}"


def pytest_report_header(config):
    if not config.getoption("--full") and not config.getoption("markexpr"):
        return "fast tier: slow and real-model tests deselected (--full runs them)"
    return None


# -- models ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    found = find_vocab_dir()
    if found is None:
        pytest.skip("llama.cpp vocab files unavailable (set LLAMASPEC_VOCAB_DIR, or allow pip to download the "
                    "llama-cpp-python sdist once)")
    return found


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, vocab_dir) -> dict[str, Path]:
    """target; draft (same weights: agrees 100%); noisy draft (agrees often); other (a different tokenizer)."""
    d = tmp_path_factory.mktemp("tiny-models")
    qwen = vocab_dir / "ggml-vocab-qwen2.gguf"
    return {
        "target": make_tiny_model(d / "tiny-target.gguf", qwen, seed=1),
        "draft": make_tiny_model(d / "tiny-draft.gguf", qwen, seed=1, name="tiny-draft"),
        "noisy": make_tiny_model(d / "tiny-noisy.gguf", qwen, seed=1, output_noise=0.6, name="tiny-noisy"),
        "other": make_tiny_model(d / "tiny-spm.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf", seed=2,
                                 name="tiny-spm"),
    }


@pytest.fixture(scope="session")
def tiny_mtp(tmp_path_factory) -> Path:
    """benchmarks/synthetic/synth_mtp.py --preset tiny: a qwen35-shaped hybrid at width 256 whose MTP head agrees 70%,
    for the benchmarks' probes (read it, never write it: the session's tests share it)."""
    import subprocess

    from benchmarks.synthetic import synth_mtp

    model = tmp_path_factory.mktemp("tiny-mtp") / "tiny-mtp.gguf"
    made = subprocess.run([sys.executable, synth_mtp.__file__, str(model), "--preset", "tiny"], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    return model


@pytest.fixture(scope="session")
def real_models() -> Path:
    folder = os.environ.get("LLAMASPEC_TEST_MODELS")
    if not folder:
        pytest.skip("real test models not configured: run `python -m tests.support.fetch_models DEST` and set "
                    "LLAMASPEC_TEST_MODELS=DEST")
    path = Path(folder)
    missing = [n for n in (REAL_TARGET, REAL_DRAFT, REAL_SMOLLM, REAL_GEMMA) if not (path / n).exists()]
    if missing:
        pytest.skip(f"real test models missing in {path}: {', '.join(missing)}")
    return path
