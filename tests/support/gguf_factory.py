"""Tiny random-weight GGUF models with a real tokenizer, written by the tests into a temp dir.

A qwen2-architecture model of 2 blocks and width 64 carries the tokenizer of a llama.cpp vocab-only file
(`ggml-vocab-qwen2.gguf` from the llama-cpp-python sdist). `logit_scale` makes the logits peaked, so the argmax is
stable under the rounding differences of batched and single-token decoding; `output_noise` perturbs only the output
matrix, which gives a draft that agrees with its target often but not always.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, GGUFWriter

from llamaspec.gguf.reader import read_model_info

VOCAB_FILES = ("ggml-vocab-qwen2.gguf", "ggml-vocab-llama-spm.gguf")
OPTIONAL_VOCAB_FILES = ("ggml-vocab-qwen35.gguf",)   # kept beside them when found; tests that need one skip


def write_out(writer: GGUFWriter) -> None:
    """Write what was added to a GGUFWriter (header, key-values, tensors) and close its file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def _vocab_cache() -> Path:
    env = os.environ.get("LLAMASPEC_VOCAB_DIR")
    user_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(env) if env else user_cache / "llamaspec" / "vocab"


def _fetch_sdist_vocab(cache: Path, names: tuple[str, ...]) -> None:
    """Extract `names` from llama.cpp's models/ in the llama-cpp-python sdist of the installed version (pip
    download: no build happens) into `cache`; nothing when offline or without pip."""
    try:
        from importlib.metadata import version

        lcpp_version = version("llama-cpp-python")
    except Exception:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               "-d", tmp, f"llama-cpp-python=={lcpp_version}"]
        if subprocess.run(cmd, capture_output=True, timeout=600).returncode != 0:
            return
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            return
        cache.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                if Path(member.name).name in names and "/vendor/llama.cpp/models/" in member.name:
                    src = tar.extractfile(member)
                    part = cache / (Path(member.name).name + ".partial")
                    with part.open("wb") as f:
                        shutil.copyfileobj(src, f)
                    part.rename(cache / Path(member.name).name)


def find_vocab_dir() -> Path | None:
    """Where llama.cpp's vocab-only GGUFs are: $LLAMASPEC_VOCAB_DIR, else the user cache, or the llama-cpp-python
    sdist fetched with pip (kept in that folder afterwards, with the optional ones). None when none of these works
    (offline, no pip)."""
    cache = _vocab_cache()
    if not all((cache / v).exists() for v in VOCAB_FILES):
        _fetch_sdist_vocab(cache, VOCAB_FILES + OPTIONAL_VOCAB_FILES)
    return cache if all((cache / v).exists() for v in VOCAB_FILES) else None


def find_vocab_file(name: str) -> Path | None:
    """One vocab-only GGUF (e.g. an OPTIONAL_VOCAB_FILES one) in the vocab cache, copied there first from the
    llama.cpp source benchmarks/build-llama-tools.sh unpacks ($LLAMASPEC_LLAMA_SRC's models/) or from the sdist
    fetched with pip; None when none has it."""
    cache = _vocab_cache()
    if not (cache / name).is_file():
        src = os.environ.get("LLAMASPEC_LLAMA_SRC")
        beside = Path(src).expanduser().parent / "models" / name if src else None
        if beside is not None and beside.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(beside, cache / (name + ".partial"))
            (cache / (name + ".partial")).rename(cache / name)
        else:
            _fetch_sdist_vocab(cache, (name,))
    return cache / name if (cache / name).is_file() else None


def _copy_tokenizer(writer: GGUFWriter, vocab_path: Path, n_vocab: int | None = None) -> int:
    info = read_model_info(vocab_path, keep_all=True)
    tokens = list(info.tokens)
    token_types = list(np.asarray(info.get("tokenizer.ggml.token_type")).astype(int))
    if n_vocab is not None and n_vocab > len(tokens):  # padded vocabulary, as Qwen's 152064
        extra = n_vocab - len(tokens)
        tokens += [f"[PAD{i}]".encode() for i in range(len(tokens), n_vocab)]  # Qwen names them by id
        token_types += [5] * extra  # 5 = UNUSED, as in Qwen's files
    for key, value in info.metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.tokens":
            writer.add_array(key, tokens)
        elif key == "tokenizer.ggml.token_type":
            writer.add_array(key, [int(t) for t in token_types])
        elif key == "tokenizer.ggml.scores":
            writer.add_array(key, [float(x) for x in np.asarray(value)] + [0.0] * (len(tokens) - len(value)))
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, (list, np.ndarray)):
            writer.add_array(key, list(value))
    return len(tokens)


def make_tiny_model(
    path: str | os.PathLike,
    vocab_path: str | os.PathLike,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 4096,
    logit_scale: float = 100.0,
    output_noise: float = 0.0,
    seed: int = 0,
    n_vocab: int | None = None,
    name: str = "tiny-qwen2",
) -> Path:
    """Write a tiny qwen2 GGUF; two files with the same seed and shape have identical weights."""
    path = Path(path)
    tmp = path.with_suffix(".partial")
    writer = GGUFWriter(str(tmp), "qwen2")
    writer.add_name(name)
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(1)
    vocab_size = _copy_tokenizer(writer, Path(vocab_path), n_vocab)

    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head

    def normal(*shape, scale=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)

    writer.add_tensor("token_embd.weight", normal(vocab_size, n_embd, scale=1.0))
    writer.add_tensor("output_norm.weight", np.full(n_embd, logit_scale, np.float32))
    output = normal(vocab_size, n_embd)
    if output_noise:
        noise_rng = np.random.default_rng(seed + 1_000_003)
        output = (output.astype(np.float32)
                  + noise_rng.standard_normal(output.shape, dtype=np.float32) * 0.02 * output_noise).astype(np.float16)
    writer.add_tensor("output.weight", output)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", normal(n_head * head_dim, n_embd, scale=0.2))
        writer.add_tensor(f"blk.{i}.attn_q.bias", np.zeros(n_head * head_dim, np.float32))
        writer.add_tensor(f"blk.{i}.attn_k.weight", normal(n_head_kv * head_dim, n_embd, scale=0.2))
        writer.add_tensor(f"blk.{i}.attn_k.bias", np.zeros(n_head_kv * head_dim, np.float32))
        writer.add_tensor(f"blk.{i}.attn_v.weight", normal(n_head_kv * head_dim, n_embd, scale=0.2))
        writer.add_tensor(f"blk.{i}.attn_v.bias", np.zeros(n_head_kv * head_dim, np.float32))
        writer.add_tensor(f"blk.{i}.attn_output.weight", normal(n_embd, n_head * head_dim, scale=0.1))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", normal(n_ff, n_embd, scale=0.1))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", normal(n_ff, n_embd, scale=0.1))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", normal(n_embd, n_ff, scale=0.1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    tmp.rename(path)
    return path
