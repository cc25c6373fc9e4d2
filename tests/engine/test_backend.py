"""The llama.cpp boundary: load failures explained, a quiet load, llama.cpp's own batch size honoured."""
import pytest

from llamaspec import backend
from llamaspec.backend.native import load_error
from llamaspec.config import ModelConfig
from llamaspec.errors import GPUOutOfMemoryError, ModelLoadError


def test_out_of_memory_in_llamas_log_becomes_a_gpu_memory_error():
    log = "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 18000 MiB on device 0: cudaMalloc failed: out of memory\n"
    err = load_error(log, "m.gguf: llama.cpp could not load this model", "offload fewer layers")
    assert isinstance(err, GPUOutOfMemoryError) and "offload fewer layers" in str(err)


def test_other_load_failures_quote_llamas_last_line():
    err = load_error("line one\nerror loading model: unknown model architecture: 'foo'\n", "m.gguf", "x")
    assert type(err) is ModelLoadError and "unknown model architecture: 'foo'" in str(err)


def test_loading_prints_nothing_and_keeps_llamas_account(tiny_models, capfd):
    model = backend.Model(tiny_models["target"], ModelConfig(no_repack=True))
    ctx = backend.Context(model, ModelConfig(n_ctx=256, n_threads=1))
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert "model buffer size" in model.load_log
    ctx.close()
    model.close()


def test_batches_follow_the_batch_size_llama_cpp_chose(tiny_models):
    model = backend.Model(tiny_models["target"], ModelConfig(no_repack=True))
    ctx = backend.Context(model, ModelConfig(n_ctx=64, n_batch=512, n_threads=1))
    assert ctx.n_batch <= ctx.n_ctx
    ctx.eval(list(range(1000, 1000 + ctx.n_ctx - 1)), logits="last")  # longer than n_batch: split in chunks
    assert ctx.n_past == ctx.n_ctx - 1
    ctx.close()
    model.close()
