"""`check` and `run` give one verdict on a file: `check` asks llama.cpp's loader (without the weights) what `run`
meets when it loads. A header with an absurd length is called corrupt, not truncated; a model whose weights are
NaN is refused at load in one line instead of printing nothing and exiting 0."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.gguf_crafted import ARRAY, INT32, STRING, corpus_file, tiny_llama
from support.paths import REPO

from llamaspec.errors import ModelFileError
from llamaspec.gguf.reader import read_model_info


def cli(*args) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "LLAMASPEC_NO_REPACK": "1", "GGML_NO_BACKTRACE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "llamaspec", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def write(tmp_path: Path, name: str, image) -> Path:
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(image.to_bytes())
    return path


def unknown_pre_tokenizer():
    image = tiny_llama()
    image.set("tokenizer.ggml.model", STRING, "gpt2")
    image.set("tokenizer.ggml.pre", STRING, "nonesuch")
    image.set("tokenizer.ggml.merges", ARRAY, (STRING, ["t o"]))
    return image


def short_token_type():
    image = tiny_llama()
    image.set("tokenizer.ggml.token_type", ARRAY, (INT32, [1]))
    return image


@pytest.mark.parametrize("make", [unknown_pre_tokenizer, short_token_type], ids=["pre-tokenizer", "token-type"])
def test_check_refuses_what_run_refuses(make, tmp_path):
    path = write(tmp_path, make.__name__, make())
    run_line = one_error_line(cli("run", "-m", path, "-n", "1", "hi"))
    check = cli("check", path, "--vram", "24")
    check_line = one_error_line(check)
    reason = run_line.split("(", 1)[-1]
    assert reason in check_line, (run_line, check_line)   # llama.cpp's own words, in both
    assert "fits" not in check.stdout


def test_a_valid_file_passes_both(tmp_path):
    path = write(tmp_path, "valid", tiny_llama())
    assert cli("check", path, "--vram", "24").returncode == 0
    assert cli("run", "-m", path, "-n", "2", "--temp", "0", "hi").returncode == 0


@pytest.mark.parametrize("name", ["n_tensors_huge", "n_kv_huge", "string_length_huge"])
def test_an_absurd_length_is_corrupt_not_truncated(name, tmp_path):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(corpus_file(name))
    with pytest.raises(ModelFileError) as error:
        read_model_info(path)
    assert "corrupt GGUF header" in str(error.value) and "truncated" not in str(error.value)


def test_nan_weights_are_refused_in_one_line(tmp_path):
    image = tiny_llama()
    norm = image.tensor("output_norm.weight")
    norm.data = np.full(len(norm.data) // 4, np.nan, np.float32).tobytes()
    path = write(tmp_path, "nan", image)
    line = one_error_line(cli("run", "-m", path, "-n", "4", "hi"))
    assert "non-finite logits" in line and str(path) in line
