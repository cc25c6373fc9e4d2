"""Shared fixtures: the three tiers of models.

- no model: pure unit tests use fakes;
- tiny models: written by `gguf_factory` into a session temp dir, with a real llama.cpp tokenizer;
- real models: the folder in $LLAMASPEC_TEST_MODELS (made by fetch-test-models); tests skip when absent.

llama.cpp's CPU weight repacking is turned off for every test (LLAMASPEC_NO_REPACK=1): on some CPUs that
advertise AMX it makes batched decoding die with SIGILL.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ["LLAMASPEC_NO_REPACK"] = "1"

from support.gguf_factory import find_vocab_dir, make_tiny_model  # noqa: E402

REAL_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
REAL_DRAFT = "qwen2.5-coder-0.5b-instruct.gguf"
REAL_SMOLLM = "smollm2-135m-instruct-q4_1.gguf"
REAL_GEMMA = "gemma-3-270m-q4_k_m.gguf"


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
def real_models() -> Path:
    folder = os.environ.get("LLAMASPEC_TEST_MODELS")
    if not folder:
        pytest.skip("real test models not configured: run fetch-test-models DEST and set LLAMASPEC_TEST_MODELS=DEST")
    path = Path(folder)
    missing = [n for n in (REAL_TARGET, REAL_DRAFT, REAL_SMOLLM, REAL_GEMMA) if not (path / n).exists()]
    if missing:
        pytest.skip(f"real test models missing in {path}: {', '.join(missing)}")
    return path
