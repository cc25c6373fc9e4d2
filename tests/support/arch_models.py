"""Tiny random-weight models of real llama.cpp architectures (hybrid, recurrent, MoE), for tests.

They are written by llama.cpp's own `test-llama-archs -a ARCH -o DIR -s SEED -d STDEV`, which
benchmarks/build-llama-tools.sh builds into ~/.cache/llamaspec/llama-tools/bin (or $LLAMASPEC_LLAMA_TOOLS). Each
file is a few MB (width 256, 2-3 blocks, F32) and takes milliseconds to write; the same arch, seed and stdev
give the same bytes.

Every model carries the same dummy tokenizer ("test": 128 tokens tok_0..tok_127, no BOS/EOS, text is hashed in
5-byte chunks, tokens detokenize as their hex id), whatever the arch and seed. So any two of them are a compatible
target/draft pair: the same seed with another stdev gives a draft that agrees often (the weights are the same
normal draws, scaled), another seed one that almost never agrees. With the default stdev 0.1 the logits are nearly
flat and the recurrent state barely matters; pass stdev=0.5 when a test needs context-sensitive logits.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

# How the vendored llama.cpp undoes rejected draft tokens, for the archs tried:
# "rollback": honours n_rs_seq, so llama_memory_seq_rm can drop the last tokens of the latest decode;
# "checkpoint": recurrent state, n_rs_seq clamped to 0: save/restore the sequence state instead;
# "attention": plain KV cache, seq_rm always works.
ARCH_MEMORY = {
    "qwen35": "rollback", "qwen35moe": "rollback", "lfm2": "rollback", "nemotron_h": "rollback",
    "qwen3next": "checkpoint", "mamba2": "checkpoint",
    "qwen3": "attention", "llama": "attention",
}

SKIP_REASON = ("llama.cpp's test-llama-archs not found: run benchmarks/build-llama-tools.sh "
               "(or set LLAMASPEC_LLAMA_TOOLS to the folder it prints)")


def find_test_llama_archs() -> Path | None:
    """The test-llama-archs binary from $LLAMASPEC_LLAMA_TOOLS or ~/.cache/llamaspec/llama-tools/bin, or None."""
    env = os.environ.get("LLAMASPEC_LLAMA_TOOLS")
    folders = [Path(env).expanduser()] if env else []
    folders.append(Path.home() / ".cache" / "llamaspec" / "llama-tools" / "bin")
    for folder in folders:
        path = folder / "test-llama-archs"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def require_test_llama_archs() -> Path:
    """find_test_llama_archs(), or pytest.skip with the reason and the fix (for tests and fixtures)."""
    path = find_test_llama_archs()
    if path is None:
        pytest.skip(SKIP_REASON)
    return path


def make_arch_model(arch: str, out_dir: str | os.PathLike, seed: int = 1, stdev: float = 0.1,
                    moe: bool = False) -> Path:
    """Path of the GGUF that test-llama-archs writes for `arch` (an exact llama.cpp arch name, e.g. "qwen35").

    Cached in out_dir per arch, seed, stdev and variant. moe picks the MoE variant where an arch has both (llama);
    archs that only exist as MoE (qwen35moe, qwen3next) get it anyway. Skips the test when the binary is absent.
    """
    if not re.fullmatch(r"[a-z0-9_\-]+", arch):
        raise ValueError(f"not an arch name: {arch!r}")
    out = Path(out_dir) / f"{arch}{'-moe' if moe else ''}-s{seed}-d{stdev:g}.gguf"
    if out.exists():
        return out
    binary = require_test_llama_archs()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        run = subprocess.run([str(binary), "-a", arch, "-o", tmp, "-s", str(seed), "-d", str(stdev)],
                             capture_output=True, text=True, timeout=120)
        written = [Path(tmp) / f"{arch}-{v}.gguf" for v in (("moe", "dense") if moe else ("dense", "moe"))]
        found = next((p for p in written if p.exists()), None)
        if run.returncode != 0 or found is None:
            raise RuntimeError(f"test-llama-archs wrote no model for {arch!r} (exit {run.returncode}; unknown or "
                               f"unsupported arch?): {(run.stderr or run.stdout).strip()[-500:]}")
        shutil.move(str(found), out)  # same folder: an atomic rename, so parallel workers see whole files
    return out
