"""Crafted and mutated GGUF headers: the header reader refuses what llama.cpp would abort on, with one
ModelFileError and never another exception; what it accepts loads through llamaspec without aborting the process;
and every command reports a bad file in one line.

The files come from gguf_crafted.py (a named corpus and a mutator, written as bytes; nothing binary is committed).
Loads run in a worker process (load_worker.py), so an abort fails a test instead of killing pytest. The fuzz tests
are bounded (about a minute in all); LLAMASPEC_FUZZ_SCALE=10 runs ten times as many examples, and
LLAMASPEC_FUZZ_RANDOM=1 draws new ones for the loading test too.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from support.arch_models import find_test_llama_archs, make_arch_model
from conftest import REAL_DRAFT, REAL_GEMMA, REAL_SMOLLM, REAL_TARGET
from support.gguf_crafted import CORPUS, MUTANT_SEEDS, parse, mutate, replay, tiny_llama
from support.load_worker import LoadWorker
from support.paths import REPO
from llamaspec.backend.native import load_error
from llamaspec.errors import ModelFileError
from llamaspec.gguf.reader import read_model_info

FUZZ_SCALE = float(os.environ.get("LLAMASPEC_FUZZ_SCALE", "1"))
# Seeds for the fuzzer besides tiny_llama(): small models of the architectures people run, when
# test-llama-archs is built (plain attention, hybrid, recurrent, MoE, latent attention, sliding window).
SEED_ARCHS = ("llama", "qwen2", "qwen3", "qwen35", "qwen3moe", "gemma3", "mamba2", "lfm2", "granitehybrid",
              "deepseek2", "phi3", "olmo2")
FUZZ_SETTINGS = dict(deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                     suppress_health_check=list(HealthCheck))
# llama.cpp has asserts the header checks do not mirror (a few exotic architectures' shape rules): loads are
# fuzzed with a fixed sequence of examples unless LLAMASPEC_FUZZ_RANDOM=1 asks for new ones.
LOAD_FUZZ_SETTINGS = dict(FUZZ_SETTINGS, derandomize=os.environ.get("LLAMASPEC_FUZZ_RANDOM") != "1")


def examples(n: int) -> int:
    return max(1, int(n * FUZZ_SCALE))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("crafted")
    files = {name: folder / f"{name}.gguf" for name in CORPUS}
    for name, path in files.items():
        path.write_bytes(CORPUS[name]())
    return files


@pytest.fixture(scope="module")
def worker():
    w = LoadWorker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, object]:
    """name -> gguf_crafted.Image of a valid model."""
    images = {"tiny-llama": tiny_llama()}
    if find_test_llama_archs() is not None:
        folder = tmp_path_factory.mktemp("arch-seeds")
        for arch in SEED_ARCHS:
            images[arch] = parse(make_arch_model(arch, folder, moe=arch.endswith("moe")).read_bytes())
    return images


# ---------------------------------------------------------------------------------------------------------------
# the crafted corpus
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_a_crafted_header_is_read_or_refused_in_one_line(name, corpus):
    try:
        read_model_info(corpus[name])
    except ModelFileError as e:
        message = str(e)
        assert message.startswith(str(corpus[name])) and "\n" not in message


# Corpus entries that crashed the reader, aborted llama.cpp or passed `check` as fitting, and the words of the
# refusal each must get now.
REFUSED = {
    "block_count_999": "block_count is 999; llama.cpp handles 1 to 512 blocks",
    "block_count_zero": "block_count is 0",
    "alignment_zero": "general.alignment is 0, not a power of two",
    "alignment_not_power_of_two": "general.alignment is 24",
    "nested_arrays_deep": "array of arrays",
    "n_tensors_huge": "the tensor count is",
    "n_kv_huge": "the metadata key count is",
    "array_length_huge": "the length of array 'tokenizer.ggml.tokens'",
    "tensor_offset_past_end": "has data offset 1,099,511,627,776",
    "tensor_data_past_end": "truncated",
    "tensor_type_unknown": "unknown ggml type 99",
    "expert_count_huge": "expert_count is 5,000",
    "expert_used_without_experts": "expert_used_count is 2, more than the 0 experts",
    "expert_used_over_count": "more than the 4 experts",
    "nextn_layers_over_block_count": "nextn_predict_layers is 5",
    "nextn_layers_not_a_number": "nextn_predict_layers is 'x', not a size",
    "rope_scaling_type_unknown": "rope.scaling.type is 'cubic'",
    "tokens_duplicate": "tokens 0 and 2 have the same text 'tok_0'",
    "tokens_empty": "tokenizer.ggml.tokens is empty",
    "head_count_array_wrong_length": "head_count has 3 entries for 1 blocks",
    "tensor_shape_vs_embedding_length": "token_embd.weight has shape [16, 64]",
    "block_count_wrong_type": "block_count is '1', not a size",
    "chat_template_not_string": "tokenizer.chat_template is a UINT32, not a string",
    "duplicate_key": "key 'general.name' appears twice",
    # checks found by fuzzing loads (each aborted, hung or crashed llama.cpp)
    "head_count_zero": "head_count is missing or 0",
    "key_length_differs_from_value_length": "rope.dimension_count is 16; it must be even, above 0 and at most",
    "value_length_wrong": "needs equal key and value head sizes",
    "rope_dimension_odd_large": "rope.dimension_count is 17; it must be even",
    "rope_dimension_zero": "rope.dimension_count is 0",
    "rope_sections_past_head": "add up to more than the head size 16",
    "head_count_kv_not_divisor": "3 key/value heads for 2 query heads",
    "kv_heads_over_query_heads": "4 key/value heads for 2 query heads",
    "query_heads_do_not_fit_projection": "attn_q.weight has shape [32, 32], which does not fit 4 heads",
    "norm_not_f32": "tensor 'output_norm.weight' [32] is F16; norms, biases and other vectors must be F32",
    "matrix_f64": "is F64, which is no weight type",
    "rms_epsilon_negative": "layer_norm_rms_epsilon is -1.0",
    "rms_epsilon_nan": "layer_norm_rms_epsilon is nan",
    "expert_gating_unknown": "expert_gating_func is 9",
    "tokenizer_none": "has no vocabulary",
    "nvfp4_ffn_down_with_scale_and_bias": "blk.0.ffn_down.weight is NVFP4 with both blk.0.ffn_down.scale and "
                                          "blk.0.ffn_down.bias",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_headers_llama_cpp_would_abort_on_are_refused_before_it_sees_them(name, corpus):
    with pytest.raises(ModelFileError) as refused:
        read_model_info(corpus[name])
    assert REFUSED[name] in str(refused.value)


def test_no_crafted_file_aborts_the_process(corpus, worker):
    statuses = {name: worker.load(path) for name, path in corpus.items()}
    crashed = {name: s for name, s in statuses.items() if not s.startswith(("ok", "error "))}
    assert not crashed
    assert worker.load(corpus["block_count_999"]).startswith("error ModelFileError")


def test_llamas_own_reason_is_the_load_error(corpus, worker):
    assert "unknown tokenizer: 'nonesuch'" in worker.load(corpus["tokenizer_model_unknown"])
    err = load_error("x\nllama_model_load: error loading model: invalid n_rot: 17\nfailed to load model\n", "m", "")
    assert str(err) == "m (invalid n_rot: 17)"


# ---------------------------------------------------------------------------------------------------------------
# no false alarms: valid models pass
# ---------------------------------------------------------------------------------------------------------------
def test_valid_models_of_every_seed_architecture_pass_and_load(seeds, tmp_path, worker):
    for name, image in seeds.items():
        path = image.write(tmp_path / f"{name}.gguf")
        read_model_info(path)
        assert worker.load(path) == "ok", name


@pytest.mark.slow
def test_every_architecture_llama_cpp_can_write_passes_the_checks(tmp_path):
    binary = find_test_llama_archs()
    if binary is None:
        pytest.skip("llama.cpp's test-llama-archs not built")
    subprocess.run([str(binary), "-o", str(tmp_path)], check=True, capture_output=True, timeout=600)
    refused = {}
    for path in sorted(tmp_path.glob("*.gguf")):
        try:
            read_model_info(path)
        except ModelFileError as e:
            refused[path.name] = str(e)
    assert len(list(tmp_path.glob("*.gguf"))) > 100 and not refused


def test_real_models_pass_the_checks(real_models):
    for name in (REAL_TARGET, REAL_DRAFT, REAL_SMOLLM, REAL_GEMMA):
        info = read_model_info(real_models / name)
        assert info.n_layer > 0


def test_architecture_tables_match_the_llama_cpp_source():
    from support.llama_asserts import find_llama_src, graph_asserts
    from llamaspec.gguf import graph_archs

    src = find_llama_src()
    if src is None:
        pytest.skip("llama.cpp source not found (benchmarks/build-llama-tools.sh unpacks it)")
    k_eq_v, head_is_rot, query_is_n_embd = graph_asserts(src)
    assert graph_archs.HEAD_K_EQ_V_ARCHS == k_eq_v
    assert graph_archs.HEAD_IS_ROT_ARCHS == head_is_rot
    assert graph_archs.QUERY_IS_N_EMBD_ARCHS == query_is_n_embd


# ---------------------------------------------------------------------------------------------------------------
# fuzzing: mutated headers of valid models
# ---------------------------------------------------------------------------------------------------------------
@settings(max_examples=examples(600), **FUZZ_SETTINGS)
@given(data=st.data(), rnd=st.randoms(use_true_random=False))
def test_mutated_headers_are_read_or_refused_never_crash(seeds, tmp_path_factory, data, rnd):
    name = data.draw(st.sampled_from(sorted(seeds)))
    m = mutate(seeds[name], rnd)
    path = m.write(tmp_path_factory.getbasetemp() / "mutant.gguf")
    try:
        read_model_info(path)
    except ModelFileError:
        pass
    except Exception as e:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(e).__name__} from a mutated {name} ({m.done}): {e}")


@settings(max_examples=examples(300), **LOAD_FUZZ_SETTINGS)
@given(data=st.data(), rnd=st.randoms(use_true_random=False))
@pytest.mark.slow
def test_mutated_models_the_reader_accepts_load_without_aborting(seeds, worker, tmp_path_factory, data, rnd):
    name = data.draw(st.sampled_from(sorted(seeds)))
    m = mutate(seeds[name], rnd, structured_only=True)
    path = m.write(tmp_path_factory.getbasetemp() / "mutant-load.gguf")
    try:
        read_model_info(path)
    except ModelFileError:
        return
    status = worker.load(path)
    if not status.startswith(("ok", "error ")):
        kept = tmp_path_factory.mktemp("aborted") / f"{name}.gguf"
        kept.write_bytes(path.read_bytes())
        pytest.fail(f"a mutated {name} ({m.done}) got past the header checks and then {status}; kept as {kept}")


@pytest.mark.realmodel
@settings(max_examples=examples(20), **FUZZ_SETTINGS)
@given(data=st.data(), rnd=st.randoms(use_true_random=False))
def test_mutated_real_model_headers_are_read_or_refused_never_crash(real_headers, tmp_path_factory, data, rnd):
    name = data.draw(st.sampled_from(sorted(real_headers)))
    m = mutate(real_headers[name], rnd)
    path = m.write(tmp_path_factory.getbasetemp() / "mutant-real.gguf")  # sparse: the header and holes
    try:
        read_model_info(path)
    except ModelFileError:
        pass
    except Exception as e:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(e).__name__} from a mutated {name} ({m.done}): {e}")


@pytest.mark.parametrize("arch, field, value", MUTANT_SEEDS, ids=[f"{a}-{f}" for a, f, _ in MUTANT_SEEDS])
def test_mutants_that_once_aborted_llama_cpp_are_refused_by_run_and_check(seeds, worker, tmp_path, arch, field, value):
    if arch not in seeds:
        pytest.skip(f"no {arch} seed: llama.cpp's test-llama-archs not built")
    seed_path = seeds[arch].write(tmp_path / f"{arch}.gguf")
    read_model_info(seed_path)   # the seed itself is fine
    path = replay(seeds[arch], field, value).write(tmp_path / f"{arch}-mutant.gguf")
    with pytest.raises(ModelFileError):
        read_model_info(path)
    assert worker.load(path).startswith("error ModelFileError")
    assert_one_error_line(cli("run", "-m", path, "-n", "1", "hi"), str(path))
    assert_one_error_line(cli("check", path), str(path))


@pytest.fixture(scope="module")
def real_headers(real_models) -> dict[str, object]:
    images = {}
    for name in (REAL_SMOLLM, REAL_GEMMA):
        with open(real_models / name, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            images[name] = parse(mm, with_data=False)
    return images


# ---------------------------------------------------------------------------------------------------------------
# every command: one line
# ---------------------------------------------------------------------------------------------------------------
def cli(*args, input_bytes: bytes | None = None, script: Path | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """A command in its own process (an abort there cannot take pytest down)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), LLAMASPEC_NO_REPACK="1", GGML_NO_BACKTRACE="1")
    command = [sys.executable, str(script)] if script else [sys.executable, "-m", "llamaspec"]
    return subprocess.run(command + [str(a) for a in args], input=input_bytes, capture_output=True, env=env,
                          timeout=timeout)


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    stderr = result.stderr.decode("utf-8", "replace")
    lines = stderr.strip().splitlines()
    assert result.returncode == 1, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


@pytest.mark.parametrize("name", ["block_count_999", "alignment_zero", "nested_arrays_deep",
                                  "nvfp4_ffn_down_with_scale_and_bias"])
def test_run_and_check_refuse_a_crafted_model_in_one_line(name, corpus):
    assert_one_error_line(cli("run", "-m", corpus[name], "-n", "1", "hi"), str(corpus[name]))
    result = cli("check", corpus[name], "--vram", "24")
    assert_one_error_line(result, str(corpus[name]))
    assert b"fits" not in result.stdout


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_model_that_is_not_a_regular_file_is_refused_before_it_is_opened(kind, tmp_path):
    """Opening a FIFO blocks until a writer comes (and ignored SIGINT and SIGTERM there); /dev/zero never ends."""
    if kind == "fifo":
        path = tmp_path / "model.gguf"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    for args in (["run", "-m", path, "-n", "1", "hi"], ["check", path]):   # in a process: it may block
        assert_one_error_line(cli(*args, timeout=60), str(path), "not a regular file")
    with pytest.raises(ModelFileError, match="not a regular file"):
        read_model_info(path)


def test_doctor_reports_a_crafted_model_as_one_problem(corpus):
    result = cli("doctor", "-m", corpus["alignment_zero"], "-m", corpus["nested_arrays_deep"])
    out = result.stdout.decode()
    assert result.returncode == 1 and b"Traceback" not in result.stderr, result.stderr
    assert out.count("model: ") == 2 and "not a power of two" in out and "array of arrays" in out


@pytest.mark.parametrize("script, extra", [("prune_draft.py", ["--keep-first", "1"]), ("align_vocab.py", []),
                                           ("quantize.py", ["-t", "Q8_0"])])
@pytest.mark.parametrize("name", ["nested_arrays_deep", "alignment_zero", "block_count_999"])
def test_convert_scripts_refuse_a_crafted_model_in_one_line(script, extra, name, corpus, tmp_path):
    args = [corpus[name], tmp_path / "out.gguf", *extra]
    if script == "align_vocab.py":
        args = [corpus[name], corpus[name], tmp_path / "out.gguf"]
    assert_one_error_line(cli(*args, "--quiet", script=REPO / "convert" / script), str(corpus[name]))
    assert not list(tmp_path.iterdir())
