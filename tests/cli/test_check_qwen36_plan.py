"""`llamaspec check` on the shape of Qwen3.6-27B with its MTP head (benchmarks/synthetic/synth_mtp.py --preset 27b
--header-only: the header of the 15.6 GiB file and a hole for its data), planned for a 24 GB card at 32K-128K of
context with f16 and q8_0 KV caches: the numbers against llama.cpp's formulas, and the verdicts.

The shape: 64 blocks, every 4th full attention with 4 KV heads of 256, the other 48 gated delta-net (16 key heads
and 48 value heads of 128, a 4-wide convolution), one nextn block (attention).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llamaspec.cli import main
from llamaspec.gguf.memory import GiB, Settings, kv_cache_bytes, model_memory, mtp_head_memory, plan_memory
from llamaspec.gguf.reader import read_model_info
from llamaspec.gguf.recurrent import recurrent_state_bytes
from support.paths import REPO

SCRIPT = REPO / "benchmarks" / "synthetic" / "synth_mtp.py"
N_ATTENTION, N_DELTA_NET, N_HEAD_KV, HEAD_DIM = 16, 48, 4, 256
# one sequence's delta-net state: (kernel - 1) x conv channels (q, k: 16 x 128 each; v: 48 x 128) + 48 heads x 128^2
STATE_BYTES = N_DELTA_NET * ((4 - 1) * (2 * 16 * 128 + 48 * 128) + 48 * 128 * 128) * 4
VRAM = 24 * GiB


@pytest.fixture(scope="module")
def qwen36_27b(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen36-shape") / "qwen35-27b-mtp.gguf"
    run = subprocess.run([sys.executable, str(SCRIPT), str(out), "--preset", "27b", "--header-only"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return out


def llama_cpp_kv_bytes(n_ctx: int, bytes_per_element: float) -> float:
    """llama.cpp's KV cache: n_ctx x n_head_kv x head_dim x 2 (K and V) x bytes per element, per attention layer."""
    return N_ATTENTION * n_ctx * N_HEAD_KV * HEAD_DIM * 2 * bytes_per_element


@pytest.mark.parametrize("n_ctx", [32768, 65536])
@pytest.mark.parametrize("kv, bytes_per_element", [("f16", 2), ("q8_0", 34 / 32)])
def test_the_trunk_kv_cache_is_llama_cpps_formula_over_its_attention_layers(qwen36_27b, n_ctx, kv, bytes_per_element):
    info = read_model_info(qwen36_27b)
    settings = Settings(n_ctx=n_ctx, type_k=kv, type_v=kv)
    assert kv_cache_bytes(info, settings) == llama_cpp_kv_bytes(n_ctx, bytes_per_element)
    target = model_memory(info, settings)
    assert target.gpu_kv_cache == target.kv_cache       # all 64 trunk layers on the GPU, the nextn block apart
    head = mtp_head_memory(info, settings)
    assert head.kv_cache == llama_cpp_kv_bytes(n_ctx, bytes_per_element) / N_ATTENTION   # its one attention block


def test_each_slot_keeps_its_recurrent_state_and_turn_checkpoints(qwen36_27b):
    info = read_model_info(qwen36_27b)
    assert recurrent_state_bytes(info) == STATE_BYTES
    one = model_memory(info, Settings(n_ctx=65536, speculative=True, n_rs_seq=4, n_checkpoints=4))
    two = model_memory(info, Settings(n_ctx=65536, speculative=True, n_rs_seq=4, n_checkpoints=4, n_parallel=2))
    assert one.checkpoints == 4 * STATE_BYTES and two.checkpoints == 2 * 4 * STATE_BYTES     # host RAM
    assert one.gpu_recurrent == (1 + 4) * STATE_BYTES and two.gpu_recurrent == 2 * one.gpu_recurrent
    assert two.kv_cache == one.kv_cache                  # one unified cache of n_ctx cells for all slots
    plan = plan_memory(info, None, Settings(n_ctx=65536, n_checkpoints=4, n_parallel=2, cache_ram=8 * GiB), VRAM)
    assert plan.host_bytes == 2 * 4 * STATE_BYTES + 8 * GiB


def check(path, *args) -> str:
    result = CliRunner().invoke(main, ["check", str(path), "--vram", "24", *args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("n_ctx", ["32768", "65536"])
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_qwen36_27b_and_its_head_fit_a_24_gb_card_at_64k(qwen36_27b, n_ctx, kv):
    out = check(qwen36_27b, "-c", n_ctx, "-ctk", kv, "-ctv", kv)
    assert "=> fits fully offloaded" in out
    head = next(line for line in out.splitlines() if "drafting with the MTP head" in line)
    assert ": fits," in head
    assert "32 turn checkpoints of the recurrent state" in out   # llama-server's --ctx-checkpoints default


def test_at_128k_the_head_fits_with_a_q8_0_cache_only(qwen36_27b):
    f16 = check(qwen36_27b, "-c", "131072")
    assert "short" in next(line for line in f16.splitlines() if "drafting with the MTP head" in line)
    q8 = check(qwen36_27b, "-c", "131072", "-ctk", "q8_0", "-ctv", "q8_0")
    assert ": fits," in next(line for line in q8.splitlines() if "drafting with the MTP head" in line)
    line = next(line for line in f16.splitlines() if "with the MTP head:" in line and "largest" in line)
    f16_max, q8_max = (int(part.split()[-1]) for part in line.split(":", 1)[1].split(","))
    assert 65536 < f16_max < 131072 < q8_max
