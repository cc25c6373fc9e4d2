"""The draft-making scripts in convert/: prune_draft, align_vocab, quantize.

Every script runs as a subprocess, the way users run it; its output must load in llama.cpp and decode, and every
bad input must give one line on stderr and a non-zero exit, leaving nothing behind.
"""
from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize
from support.gguf_factory import make_tiny_model
from support.paths import REPO

import llamaspec
from llamaspec.gguf.edit import Field, GGUFContents, TensorData, read_gguf, write_gguf
from llamaspec.gguf.prune import prune_blocks
from llamaspec.gguf.compat import check_pair, pair_mismatch
from llamaspec.gguf.reader import read_model_info

from conftest import REAL_DRAFT, REAL_GEMMA, REAL_TARGET

CONVERT = REPO / "convert"
QWEN_VOCAB = 151936


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def run_script(name: str, *args, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit_file_size():  # a small RLIMIT_FSIZE makes writes fail as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run([sys.executable, str(CONVERT / name), *map(str, args), "--quiet"], capture_output=True,
                          text=True, timeout=300, preexec_fn=limit_file_size if file_size_limit else None)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]


def generate(target: Path, draft: Path | None = None, max_tokens: int = 4, prompt: str = "hello") -> list[int]:
    pair = llamaspec.load_pair(str(target), str(draft) if draft else None, n_ctx=256, no_repack=True,
                               policy="fixed", draft_max=4)
    try:
        completion = pair.generate(prompt, max_tokens=max_tokens)
        assert len(completion.tokens) == max_tokens
        return completion.tokens
    finally:
        pair.close()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


def rewrite(source: Path, output: Path, *fields: Field, tensors=None) -> Path:
    """A copy of a GGUF with some metadata (or tensors) replaced: variants the factory does not make."""
    contents = read_gguf(source).with_fields(*fields)
    if tensors is not None:
        contents = GGUFContents(contents.path, contents.fields, tuple(tensors), contents.alignment)
    return write_gguf(contents, output)


def zeroed(tensor: TensorData) -> TensorData:
    return TensorData(tensor.name, tensor.shape, tensor.ggml_type, np.zeros_like(np.asarray(tensor.data)))


@pytest.fixture(scope="module")
def models(tiny_models, vocab_dir, tmp_path_factory) -> dict[str, Path]:
    """Variants of the tiny models: 4 blocks with per-block metadata arrays, some blocks that add nothing,
    padded vocabularies, and a width that K-quants accept."""
    d = tmp_path_factory.mktemp("convert-models")
    qwen = vocab_dir / "ggml-vocab-qwen2.gguf"
    deep = make_tiny_model(d / "deep-plain.gguf", qwen, n_layer=4, seed=3, name="tiny-deep")
    per_block = [Field("qwen2.attention.head_count_kv", GGUFValueType.ARRAY, [2, 2, 2, 2], GGUFValueType.UINT32),
                 Field("qwen2.test.per_block", GGUFValueType.ARRAY, [10, 11, 12, 13], GGUFValueType.INT32),
                 Field("qwen2.test.not_per_block", GGUFValueType.ARRAY, [1, 2, 3], GGUFValueType.INT32)]
    out = {"deep": rewrite(deep, d / "deep.gguf", *per_block)}
    # Blocks whose output projections are zero leave the residual stream unchanged: dropping them changes nothing.
    for label, idle in (("idle_last", 3), ("idle_middle", 1)):
        tensors = [zeroed(t) if t.name in (f"blk.{idle}.attn_output.weight", f"blk.{idle}.ffn_down.weight") else t
                   for t in read_gguf(deep).tensors]
        out[label] = rewrite(deep, d / f"{label}.gguf", tensors=tensors)
    out["padded128"] = make_tiny_model(d / "padded128.gguf", qwen, seed=1, n_vocab=QWEN_VOCAB + 128, name="pad128")
    out["padded256"] = make_tiny_model(d / "padded256.gguf", qwen, seed=1, n_vocab=QWEN_VOCAB + 256, name="pad256")
    out["spm_padded"] = make_tiny_model(d / "spm-padded.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf", seed=2,
                                        n_vocab=32000 + 64, name="spm-padded")
    out["wide"] = make_tiny_model(d / "wide.gguf", qwen, seed=4, n_embd=256, n_ff=512, name="tiny-wide")
    out["not_gguf"] = d / "notes.gguf"
    out["not_gguf"].write_text("this is not a model\n" * 10)
    writer = GGUFWriter(str(d / "mamba.gguf"), "mamba")
    writer.add_block_count(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out["mamba"] = d / "mamba.gguf"
    return {**tiny_models, **out}


# ---------------------------------------------------------------------------------------------------------------
# prune_draft.py
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_prune_keep_first_loads_and_decodes(models, tmp_path):
    out = tmp_path / "first1.gguf"
    assert_ok(run_script("prune_draft.py", models["target"], out, "--keep-first", "1"))
    info = read_model_info(out)
    assert info.n_layer == 1
    assert {t.name.split(".")[1] for t in info.tensors if t.name.startswith("blk.")} == {"0"}
    generate(out)


@pytest.mark.slow
def test_prune_renumbers_blocks_and_per_block_arrays(models, tmp_path):
    out = tmp_path / "layers03.gguf"
    assert_ok(run_script("prune_draft.py", models["deep"], out, "--layers", "0,3"))
    pruned, source = read_gguf(out), read_gguf(models["deep"])
    assert pruned.fields["qwen2.block_count"].value == 2
    assert pruned.fields["qwen2.block_count"].vtype == source.fields["qwen2.block_count"].vtype
    assert pruned.get("qwen2.test.per_block") == [10, 13]
    assert pruned.get("qwen2.attention.head_count_kv") == [2, 2]
    assert pruned.get("qwen2.test.not_per_block") == [1, 2, 3]
    assert sorted({t.name.split(".")[1] for t in pruned.tensors if t.name.startswith("blk.")}) == ["0", "1"]
    assert bytes(pruned.tensor("blk.1.attn_q.weight").data) == bytes(source.tensor("blk.3.attn_q.weight").data)
    assert bytes(pruned.tensor("token_embd.weight").data) == bytes(source.tensor("token_embd.weight").data)
    generate(out)


@pytest.mark.slow
def test_prune_drop_last_equals_keep_first(models, tmp_path):
    assert_ok(run_script("prune_draft.py", models["deep"], tmp_path / "a.gguf", "--drop-last", "1"))
    assert_ok(run_script("prune_draft.py", models["deep"], tmp_path / "b.gguf", "--keep-first", "3"))
    a, b = read_gguf(tmp_path / "a.gguf"), read_gguf(tmp_path / "b.gguf")
    assert a.n_layer == b.n_layer == 3
    assert [(t.name, bytes(t.data)) for t in a.tensors] == [(t.name, bytes(t.data)) for t in b.tensors]


@pytest.mark.parametrize("variant, how", [("idle_last", ["--drop-last", "1"]), ("idle_middle", ["--layers", "0,2,3"])])
@pytest.mark.slow
def test_dropping_a_block_that_adds_nothing_keeps_the_output(models, tmp_path, variant, how):
    out = tmp_path / "pruned.gguf"
    assert_ok(run_script("prune_draft.py", models[variant], out, *how))
    assert read_model_info(out).n_layer == 3
    prompt = "The quick brown fox jumps over the lazy dog"
    assert generate(out, max_tokens=8, prompt=prompt) == generate(models[variant], max_tokens=8, prompt=prompt)


@pytest.mark.slow
def test_pruned_draft_of_a_real_block_changes_the_output(models, tmp_path):
    # the control for the test above: the same prune of the unmodified model is not a no-op
    out = tmp_path / "pruned.gguf"
    assert_ok(run_script("prune_draft.py", models["deep"], out, "--drop-last", "1"))
    prompt = "The quick brown fox jumps over the lazy dog"
    assert generate(out, max_tokens=8, prompt=prompt) != generate(models["deep"], max_tokens=8, prompt=prompt)


def _fake_gemma3(n_layer: int, **fields) -> GGUFContents:
    tensors = tuple(TensorData(f"blk.{i}.attn_norm.weight", (4,), GGMLQuantizationType.F32,
                               np.zeros(16, np.uint8)) for i in range(n_layer))
    meta = {"general.architecture": Field("general.architecture", GGUFValueType.STRING, "gemma3"),
            "gemma3.block_count": Field("gemma3.block_count", GGUFValueType.UINT32, n_layer)}
    for key, field in fields.items():
        meta[field.key] = field
    return GGUFContents(Path("fake.gguf"), meta, tensors)


def test_prune_keeps_each_blocks_sliding_window_kind():
    # gemma3: every 6th block (5, 11, ...) is global. Dropping block 5 moves block 11 to index 10.
    pruned = prune_blocks(_fake_gemma3(18), [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11])
    assert pruned.get("gemma3.attention.sliding_window_pattern") == [True] * 10 + [False]
    assert pruned.fields["gemma3.attention.sliding_window_pattern"].sub_type == GGUFValueType.BOOL
    # a prefix keeps the index-based pattern: no explicit array needed
    assert "gemma3.attention.sliding_window_pattern" not in prune_blocks(_fake_gemma3(18), list(range(12))).fields


@pytest.mark.parametrize("args, fragment", [
    (["{missing}", "{out}", "--keep-first", "1"], "no such model file"),
    (["{not_gguf}", "{out}", "--keep-first", "1"], "not a GGUF file"),
    (["{mamba}", "{out}", "--keep-first", "1"], "architecture 'mamba' is not supported"),
    (["{target}", "{out}", "--keep-first", "0"], "nothing left to keep"),
    (["{target}", "{out}", "--drop-last", "2"], "nothing left to keep"),
    (["{target}", "{out}", "--keep-first", "2"], "nothing to prune"),
    (["{target}", "{out}", "--layers", "0,5"], "block 5 does not exist"),
    (["{target}", "{out}", "--layers", "1,0"], "increasing order"),
    (["{target}", "{out}", "--layers", "zero"], "not a block index"),
    (["{target}", "{out}", "--keep-first", "1", "--drop-last", "1"], "exactly one of"),
    (["{target}", "{out}"], "exactly one of"),
    (["{target}", "{existing}", "--keep-first", "1"], "already exists (pass --force"),
    (["{target}", "{no_folder}", "--keep-first", "1"], "output folder does not exist"),
    (["{target}", "{target}", "--keep-first", "1", "--force"], "overwrite the input"),
])
def test_prune_bad_input_gives_one_line(models, tmp_path, args, fragment):
    existing = tmp_path / "existing.gguf"
    existing.write_bytes(b"keep me")
    paths = {**{k: str(v) for k, v in models.items()}, "missing": tmp_path / "nope.gguf", "out": tmp_path / "o.gguf",
             "existing": existing, "no_folder": tmp_path / "no" / "o.gguf"}
    result = run_script("prune_draft.py", *[a.format(**paths) for a in args])
    assert_one_line_error(result, fragment)
    assert existing.read_bytes() == b"keep me"
    assert not (tmp_path / "o.gguf").exists() and leftovers(tmp_path) == []


def test_prune_force_overwrites(models, tmp_path):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")
    assert_ok(run_script("prune_draft.py", models["target"], out, "--keep-first", "1", "--force"))
    assert read_model_info(out).n_layer == 1


def test_prune_write_failure_leaves_nothing(models, tmp_path):
    result = run_script("prune_draft.py", models["target"], tmp_path / "o.gguf", "--keep-first", "1",
                        file_size_limit=4_000_000)
    assert_one_line_error(result, "writing failed")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# align_vocab.py
# ---------------------------------------------------------------------------------------------------------------
def test_zero_bytes_decode_to_zeros_in_every_type():
    # why padded rows can be written as zero bytes in the tensor's own quantization type
    checked = 0
    for qtype, (block_size, type_size) in GGML_QUANT_SIZES.items():
        try:
            values = dequantize(np.zeros(4 * type_size, np.uint8), qtype)
        except NotImplementedError:
            continue
        assert values.size == 4 * block_size and not np.any(values), qtype.name
        checked += 1
    assert checked >= 20


@pytest.mark.slow
def test_align_pads_draft_to_pass_the_pair_check(models, tmp_path):
    target, out = models["padded256"], tmp_path / "aligned.gguf"
    assert "vocabulary sizes differ" in pair_mismatch(read_model_info(target), read_model_info(models["draft"]))
    assert_ok(run_script("align_vocab.py", models["draft"], target, out))
    aligned, source = read_gguf(out), read_gguf(models["draft"])
    check_pair(read_model_info(target), read_model_info(out))
    assert read_model_info(out).tokens == read_model_info(target).tokens
    assert aligned.get("tokenizer.ggml.token_type")[QWEN_VOCAB:] == [5] * 256
    for name in ("token_embd.weight", "output.weight"):
        rows, original = aligned.tensor(name), source.tensor(name)
        assert rows.shape == (64, QWEN_VOCAB + 256)
        assert bytes(rows.data[:original.data.nbytes]) == bytes(original.data)
        assert not np.any(rows.data[original.data.nbytes:])
    assert generate(target, out) == generate(target)


def test_align_pads_scores_of_a_sentencepiece_vocabulary(models, tmp_path):
    out = tmp_path / "aligned.gguf"
    assert_ok(run_script("align_vocab.py", models["other"], models["spm_padded"], out))
    aligned, target = read_gguf(out), read_gguf(models["spm_padded"])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert aligned.get(key) == target.get(key), key
        assert aligned.fields[key].sub_type == read_gguf(models["other"]).fields[key].sub_type
    check_pair(read_model_info(models["spm_padded"]), read_model_info(out))
    generate(models["spm_padded"], out)


@pytest.mark.slow
def test_align_trims_padding(models, tmp_path):
    out = tmp_path / "trimmed.gguf"
    assert_ok(run_script("align_vocab.py", models["padded128"], models["target"], out))
    info = read_model_info(out)
    assert info.n_vocab == QWEN_VOCAB and pair_mismatch(read_model_info(models["target"]), info) is None
    source = read_gguf(models["padded128"]).tensor("output.weight")
    trimmed = read_gguf(out).tensor("output.weight")
    assert trimmed.shape == (64, QWEN_VOCAB) and bytes(trimmed.data) == bytes(source.data[:trimmed.data.nbytes])
    generate(models["target"], out)


@pytest.mark.slow
def test_trim_then_pad_gives_the_weights_back_and_drafts_well(models, tmp_path):
    padded = models["padded128"]
    assert_ok(run_script("align_vocab.py", padded, models["target"], tmp_path / "trimmed.gguf"))
    assert_ok(run_script("align_vocab.py", tmp_path / "trimmed.gguf", padded, tmp_path / "repadded.gguf"))
    original, repadded = read_gguf(padded), read_gguf(tmp_path / "repadded.gguf")
    for name in ("token_embd.weight", "output.weight"):
        a, b = original.tensor(name), repadded.tensor(name)
        n_real = QWEN_VOCAB * a.row_bytes
        assert b.shape == a.shape and bytes(b.data[:n_real]) == bytes(a.data[:n_real])
    pair = llamaspec.load_pair(str(padded), str(tmp_path / "repadded.gguf"), n_ctx=256, no_repack=True,
                               policy="fixed", draft_max=4)
    stats = pair.generate("Once upon a time", max_tokens=24).stats
    pair.close()
    assert stats.drafted > 0 and stats.acceptance_rate > 0.8


@pytest.mark.slow
def test_align_quantized_embeddings_keep_their_type(models, tmp_path):
    quantized = tmp_path / "draft-q4_0.gguf"
    assert_ok(run_script("quantize.py", models["draft"], quantized, "--type", "Q4_0"))
    out = tmp_path / "aligned.gguf"
    assert_ok(run_script("align_vocab.py", quantized, models["padded256"], out))
    before, after = read_gguf(quantized), read_gguf(out)
    for name in ("token_embd.weight", "output.weight"):
        old, new = before.tensor(name), after.tensor(name)
        assert new.ggml_type == old.ggml_type and new.ggml_type != GGMLQuantizationType.F16
        rows = dequantize(np.asarray(new.data).reshape(new.n_rows, new.row_bytes), new.ggml_type)
        original = dequantize(np.asarray(old.data).reshape(old.n_rows, old.row_bytes), old.ggml_type)
        np.testing.assert_array_equal(rows[:QWEN_VOCAB], original)
        assert not np.any(rows[QWEN_VOCAB:])
    check_pair(read_model_info(models["padded256"]), read_model_info(out))
    generate(models["padded256"], out)


def test_align_same_size_does_nothing(models, tmp_path):
    result = run_script("align_vocab.py", models["draft"], models["target"], tmp_path / "o.gguf")
    assert_ok(result)
    assert "nothing to do" in result.stdout and not (tmp_path / "o.gguf").exists()


def _with_token(source: Path, output: Path, index: int, text: bytes, token_type: int | None = None) -> Path:
    contents = read_gguf(source)
    tokens = list(contents.get("tokenizer.ggml.tokens"))
    tokens[index] = text
    fields = [contents.fields["tokenizer.ggml.tokens"].replaced(tokens)]
    if token_type is not None:
        types = list(contents.get("tokenizer.ggml.token_type"))
        types[index] = token_type
        fields.append(contents.fields["tokenizer.ggml.token_type"].replaced(types))
    return rewrite(source, output, *fields)


def test_align_refuses_different_real_tokens(models, tmp_path):
    changed = _with_token(models["draft"], tmp_path / "changed.gguf", 1000, b"NotTheSameToken")
    result = run_script("align_vocab.py", changed, models["padded256"], tmp_path / "o.gguf")
    assert_one_line_error(result, "token 1000 differs")
    assert not (tmp_path / "o.gguf").exists() and leftovers(tmp_path) == []


def test_align_refuses_other_tokenizer(models, tmp_path):
    result = run_script("align_vocab.py", models["other"], models["target"], tmp_path / "o.gguf")
    assert_one_line_error(result, "different tokenizers")


def test_align_refuses_to_trim_real_tokens(models, tmp_path):
    real_tail = _with_token(models["padded128"], tmp_path / "real-tail.gguf", QWEN_VOCAB + 5, b"<|new_tool|>",
                            token_type=3)
    result = run_script("align_vocab.py", real_tail, models["target"], tmp_path / "o.gguf")
    assert_one_line_error(result, f"token {QWEN_VOCAB + 5} ('<|new_tool|>') is a real token")


@pytest.mark.parametrize("args, fragment", [
    (["{missing}", "{target}", "{out}"], "no such model file"),
    (["{draft}", "{not_gguf}", "{out}"], "not a GGUF file"),
    (["{draft}", "{padded256}", "{existing}"], "already exists (pass --force"),
])
def test_align_bad_input_gives_one_line(models, tmp_path, args, fragment):
    existing = tmp_path / "existing.gguf"
    existing.write_bytes(b"keep me")
    paths = {**{k: str(v) for k, v in models.items()}, "missing": tmp_path / "nope.gguf", "out": tmp_path / "o.gguf",
             "existing": existing}
    assert_one_line_error(run_script("align_vocab.py", *[a.format(**paths) for a in args]), fragment)
    assert existing.read_bytes() == b"keep me" and not (tmp_path / "o.gguf").exists()


def test_align_write_failure_leaves_nothing(models, tmp_path):
    result = run_script("align_vocab.py", models["draft"], models["padded256"], tmp_path / "o.gguf",
                        file_size_limit=4_000_000)
    assert_one_line_error(result, "writing failed")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# quantize.py
# ---------------------------------------------------------------------------------------------------------------
def test_quantize_q8_0_has_q8_0_matrices(models, tmp_path):
    out = tmp_path / "q8.gguf"
    result = run_script("quantize.py", models["draft"], out, "--type", "q8_0")
    assert_ok(result)
    info = read_model_info(out)
    assert {t.type_name for t in info.tensors if len(t.shape) == 2} == {"Q8_0"}
    assert {t.type_name for t in info.tensors if len(t.shape) == 1} == {"F32"}
    assert info.get("general.file_type") == 7 and info.file_size < read_model_info(models["draft"]).file_size
    assert generate(models["target"], out)


@pytest.mark.slow
def test_quantize_q4_k_m_mixes_q4_k_and_q6_k(models, tmp_path):
    out = tmp_path / "q4km.gguf"
    assert_ok(run_script("quantize.py", models["wide"], out, "--type", "Q4_K_M"))
    info = read_model_info(out)
    types = {t.name: t.type_name for t in info.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert info.get("general.file_type") == 15
    generate(out)


@pytest.mark.parametrize("args, fragment", [
    (["{missing}", "{out}", "--type", "Q8_0"], "no such model file"),
    (["{not_gguf}", "{out}", "--type", "Q8_0"], "not a GGUF file"),
    (["{draft}", "{out}", "--type", "Q9_9"], "--type Q9_9 is not supported"),
    (["{draft}", "{existing}", "--type", "Q8_0"], "already exists (pass --force"),
    (["{mamba}", "{out}", "--type", "Q8_0"], "could not quantize"),
])
def test_quantize_bad_input_gives_one_line(models, tmp_path, args, fragment):
    existing = tmp_path / "existing.gguf"
    existing.write_bytes(b"keep me")
    paths = {**{k: str(v) for k, v in models.items()}, "missing": tmp_path / "nope.gguf", "out": tmp_path / "o.gguf",
             "existing": existing}
    assert_one_line_error(run_script("quantize.py", *[a.format(**paths) for a in args]), fragment)
    assert existing.read_bytes() == b"keep me"
    assert not (tmp_path / "o.gguf").exists() and leftovers(tmp_path) == []


@pytest.mark.slow
def test_quantize_refuses_a_quantized_input_unless_asked(models, tmp_path):
    q8 = tmp_path / "q8.gguf"
    assert_ok(run_script("quantize.py", models["draft"], q8, "--type", "Q8_0"))
    assert_one_line_error(run_script("quantize.py", q8, tmp_path / "q4.gguf", "--type", "Q4_0"), "already quantized")
    assert_ok(run_script("quantize.py", q8, tmp_path / "q4.gguf", "--type", "Q4_0", "--allow-requantize"))
    assert {t.type_name for t in read_model_info(tmp_path / "q4.gguf").tensors
            if t.name.startswith("blk.") and len(t.shape) == 2} == {"Q4_0"}


def test_quantize_write_failure_leaves_nothing(models, tmp_path):
    result = run_script("quantize.py", models["draft"], tmp_path / "o.gguf", "--type", "Q8_0",
                        file_size_limit=4_000_000)
    assert_one_line_error(result, "writing failed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", ["prune_draft.py", "align_vocab.py", "quantize.py"])
def test_scripts_have_help(script):
    result = subprocess.run([sys.executable, str(CONVERT / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "Usage:" in result.stdout and "--force" in result.stdout


# ---------------------------------------------------------------------------------------------------------------
# real models
# ---------------------------------------------------------------------------------------------------------------
def test_real_pruned_draft_speculates_for_its_target(real_models, tmp_path):
    out = tmp_path / "draft-20.gguf"
    assert_ok(run_script("prune_draft.py", real_models / REAL_DRAFT, out, "--drop-last", "4"))
    info = read_model_info(out)
    assert info.n_layer == 20 and info.file_size < (real_models / REAL_DRAFT).stat().st_size
    check_pair(read_model_info(real_models / REAL_TARGET), info)
    # speculating for the unpruned draft keeps the test short; the 1.5B target is measured by the prune report
    pair = llamaspec.load_pair(str(real_models / REAL_DRAFT), str(out), n_ctx=256, no_repack=True,
                               policy="fixed", draft_max=4)
    stats = pair.generate("def add(a, b):", max_tokens=8).stats
    pair.close()
    assert stats.tokens_generated == 8 and stats.drafted > 0 and stats.accepted > 0


def test_real_gemma3_prune_with_sliding_window_pattern_loads(real_models, tmp_path):
    out = tmp_path / "gemma-11.gguf"
    assert_ok(run_script("prune_draft.py", real_models / REAL_GEMMA, out, "--layers", "0-4,6-11"))
    pattern = read_model_info(out).get("gemma3.attention.sliding_window_pattern")
    assert pattern == [True] * 10 + [False]
    generate(out)


def test_real_quantized_draft_pads_to_a_padded_target(real_models, tmp_path):
    # a tiny target carrying Qwen's real tokenizer padded to 152064 entries, as the 7B-72B Qwen models have
    target = make_tiny_model(tmp_path / "target-152064.gguf", real_models / REAL_DRAFT, seed=1,
                             n_vocab=QWEN_VOCAB + 128)
    out = tmp_path / "draft-152064.gguf"
    assert_ok(run_script("align_vocab.py", real_models / REAL_DRAFT, target, out))
    info = read_model_info(out)
    assert info.n_vocab == QWEN_VOCAB + 128
    assert {t.name: t.type_name for t in info.tensors if t.name in ("token_embd.weight", "output.weight")} == \
        {t.name: t.type_name for t in read_model_info(real_models / REAL_DRAFT).tensors
         if t.name in ("token_embd.weight", "output.weight")}
    check_pair(read_model_info(target), info)
    generate(target, out)
