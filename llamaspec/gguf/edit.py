"""Copy a GGUF file into a new one with some metadata and tensors changed: the building blocks of the draft-making
tools in convert/ (keep a subset of transformer blocks, pad or trim a vocabulary).

Metadata keeps its GGUF value types (llama.cpp checks them: a uint32 block count written back as an int32 does not
load). Tensor data is never decoded: it is sliced from a memory map of the source and copied, so any quantization
type passes through. The output is written with `gguf.GGUFWriter` to a temp file in the output folder and renamed
when complete, so an interrupted run never leaves a half-written model under the final name.

The header is parsed here rather than with `gguf.GGUFReader`, which builds one numpy view per array element and
takes many seconds on a 150k-token vocabulary. This module knows nothing about llama.cpp.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from ..errors import IncompatiblePairError, InvalidParameterError, ModelFileError, UnsupportedModelError
from .reader import DEFAULT_ALIGNMENT, ModelInfo, pair_mismatch, read_model_info

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
TOKEN_TYPE_UNUSED = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: a padding entry no text maps to
_PAD_TOKEN = re.compile(rb"\[PAD\d+\]")

# Architectures whose blocks are all alike and whose loader knows nothing about a block's index, so any subset of
# blocks renumbered from 0 still loads and means the same thing. Models with leading dense blocks, MTP blocks,
# recurrent blocks or index-based layer kinds (no-RoPE every 4th layer, MoE every other layer) are left out.
PRUNABLE_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "mistral3", "phi3", "granite", "olmo", "olmo2",
                  "starcoder2", "stablelm", "internlm2", "exaone", "command-r", "minicpm", "gemma",
                  "gemma2", "gemma3", "cohere2")
# Architectures whose sliding-window layers follow the block index (llama.cpp's set_swa_pattern(n)): every n-th
# block is global. A pruned model gets an explicit per-block pattern so each kept block keeps its kind.
SWA_PATTERN_ARCHS = {"gemma2": 2, "gemma3": 6, "cohere2": 4}


@dataclass(frozen=True)
class Field:
    """One metadata entry with its GGUF type. Arrays are lists; string elements are bytes."""

    key: str
    vtype: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None   # element type of an array

    def replaced(self, value: Any) -> Field:
        return dataclasses.replace(self, value=value)


@dataclass(frozen=True)
class TensorData:
    name: str
    shape: tuple[int, ...]        # GGUF order: shape[0] is the length of a row (ne0)
    ggml_type: GGMLQuantizationType
    data: np.ndarray              # raw bytes (uint8, 1-D): a view of the source's memory map, or a new array

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[0] // block_size * type_size


@dataclass(frozen=True)
class GGUFContents:
    """A GGUF file's metadata (in file order) and tensors (in file order)."""

    path: Path
    fields: dict[str, Field]
    tensors: tuple[TensorData, ...]
    alignment: int = DEFAULT_ALIGNMENT

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return field.value if field is not None else default

    @property
    def arch(self) -> str:
        return self.get("general.architecture", "unknown")

    @property
    def n_layer(self) -> int:
        return int(self.get(f"{self.arch}.block_count", 0))

    def tensor(self, name: str) -> TensorData | None:
        return next((t for t in self.tensors if t.name == name), None)

    def with_fields(self, *fields: Field) -> GGUFContents:
        merged = dict(self.fields)
        for field in fields:
            merged[field.key] = field
        return dataclasses.replace(self, fields=merged)


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------
def read_gguf(path: str | os.PathLike) -> GGUFContents:
    """Open a GGUF file: typed metadata plus a memory-mapped view of every tensor's bytes.

    Missing, non-GGUF and truncated files raise ModelFileError (checked by gguf_meta first).
    """
    info = read_model_info(path)
    memory = np.memmap(info.path, dtype=np.uint8, mode="r")
    fields = _read_fields(memory)
    tensors = tuple(
        TensorData(t.name, t.shape, GGMLQuantizationType(t.ggml_type),
                   memory[info.data_offset + t.offset: info.data_offset + t.offset + t.n_bytes])
        for t in info.tensors)
    alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else DEFAULT_ALIGNMENT
    return GGUFContents(info.path, fields, tensors, alignment)


def _read_fields(memory: np.ndarray) -> dict[str, Field]:
    buf = memoryview(memory)
    pos = 4 + 4 + 8  # magic, version, tensor count
    (n_kv,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    fields: dict[str, Field] = {}
    for _ in range(n_kv):
        key, pos = _read_string(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        value, sub_type, pos = _read_value(buf, pos + 4, GGUFValueType(vtype))
        key = key.decode("utf-8")
        fields[key] = Field(key, GGUFValueType(vtype), value, sub_type)
    return fields


def _read_string(buf, pos: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8: pos + 8 + n]), pos + 8 + n


def _read_value(buf, pos: int, vtype: GGUFValueType) -> tuple[Any, GGUFValueType | None, int]:
    if vtype == GGUFValueType.STRING:
        raw, pos = _read_string(buf, pos)
        try:
            return raw.decode("utf-8"), None, pos
        except UnicodeDecodeError:
            return raw, None, pos
    if vtype != GGUFValueType.ARRAY:
        fmt = _SCALAR_FORMATS[vtype]
        (value,) = struct.unpack_from(fmt, buf, pos)
        return value, None, pos + struct.calcsize(fmt)
    elem_type = GGUFValueType(struct.unpack_from("<I", buf, pos)[0])
    (count,) = struct.unpack_from("<Q", buf, pos + 4)
    pos += 12
    if elem_type == GGUFValueType.STRING:
        items = []
        for _ in range(count):
            item, pos = _read_string(buf, pos)
            items.append(item)
        return items, elem_type, pos
    if elem_type == GGUFValueType.ARRAY:
        raise UnsupportedModelError("nested metadata arrays are not supported")
    dtype = np.dtype(_SCALAR_FORMATS[elem_type])
    values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).tolist()
    return values, elem_type, pos + dtype.itemsize * count


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------
def check_output_path(output: str | os.PathLike, force: bool, inputs: Sequence[str | os.PathLike] = ()) -> Path:
    """The output path, once it is known that writing there is allowed (ModelFileError otherwise)."""
    output = Path(output).expanduser()
    if output.is_dir():
        raise ModelFileError(f"{output}: is a directory; give the output file name")
    if not output.parent.is_dir():
        raise ModelFileError(f"{output.parent}: output folder does not exist")
    for source in inputs:
        if output.exists() and Path(source).expanduser().resolve() == output.resolve():
            raise ModelFileError(f"{output}: output would overwrite the input; choose another name")
    if output.exists() and not force:
        raise ModelFileError(f"{output}: already exists (pass --force to overwrite it)")
    if not os.access(output.parent, os.W_OK):
        raise ModelFileError(f"{output.parent}: output folder is not writable")
    return output


def temp_path_for(output: Path) -> Path:
    """A hidden name next to `output`: same file system, so the final rename is atomic."""
    return output.with_name(f".{output.name}.{os.getpid()}.partial")


def write_gguf(contents: GGUFContents, output: str | os.PathLike, *, progress: bool = False) -> Path:
    """Write `contents` to `output` through a temp file renamed at the end; ModelFileError on a write error."""
    output = Path(output)
    tmp = temp_path_for(output)
    writer = None
    try:
        logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)
        writer = GGUFWriter(tmp, contents.arch)
        writer.data_alignment = contents.alignment
        for field in contents.fields.values():
            if field.key != "general.architecture":
                writer.add_key_value(field.key, field.value, field.vtype, field.sub_type)
        for tensor in contents.tensors:
            writer.add_tensor(tensor.name, _byte_view(tensor), raw_dtype=tensor.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        writer = None
        os.replace(tmp, output)
    except OSError as e:
        raise ModelFileError(write_failure_message(output, e.strerror or str(e))) from None
    finally:
        if writer is not None:
            _close_quietly(writer)
        tmp.unlink(missing_ok=True)
    return output


def write_failure_message(output: Path, reason: str) -> str:
    """One line for a failed write, with the free space left (a full disk is the usual cause)."""
    try:
        free = f"{shutil.disk_usage(output.parent).free / 1e6:,.0f} MB free there"
    except OSError:
        free = "free space unknown"
    return f"{output}: writing failed ({reason}; {free}); nothing was written under this name"


def _byte_view(tensor: TensorData) -> np.ndarray:
    """The tensor's bytes shaped as GGUFWriter expects raw data: numpy order, the last axis in bytes."""
    numpy_shape = tuple(reversed(tensor.shape))
    return tensor.data.reshape(numpy_shape[:-1] + (tensor.row_bytes,))


def _close_quietly(writer: GGUFWriter) -> None:
    try:
        writer.close()
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# Keeping a subset of the transformer blocks
# ---------------------------------------------------------------------------------------------------------------
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def parse_layer_list(text: str) -> list[int]:
    """'0,1,2,5' or '0-11,20' -> block indices (InvalidParameterError on anything else)."""
    layers: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise InvalidParameterError(f"layers: {part!r} is not a block index or a range like 0-11")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise InvalidParameterError(f"layers: range {part!r} runs backwards")
        layers.extend(range(first, last + 1))
    return layers


def select_blocks(n_layer: int, *, keep_first: int | None = None, drop_last: int | None = None,
                  layers: Sequence[int] | None = None) -> list[int]:
    """The block indices to keep, from exactly one of the three ways of saying it."""
    given = [name for name, v in (("--keep-first", keep_first), ("--drop-last", drop_last), ("--layers", layers))
             if v is not None]
    if len(given) != 1:
        raise InvalidParameterError("give exactly one of --keep-first, --drop-last, --layers"
                                    + (f" (got {', '.join(given)})" if given else ""))
    if keep_first is not None:
        keep = list(range(min(keep_first, n_layer)))
    elif drop_last is not None:
        if drop_last < 0:
            raise InvalidParameterError(f"--drop-last must be >= 0, got {drop_last}")
        keep = list(range(max(n_layer - drop_last, 0)))
    else:
        keep = list(layers)
        outside = [i for i in keep if not 0 <= i < n_layer]
        if outside:
            raise InvalidParameterError(f"layers: block {outside[0]} does not exist (the model has blocks "
                                        f"0-{n_layer - 1})")
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise InvalidParameterError("layers: give each block once, in increasing order")
    if not keep:
        raise InvalidParameterError(f"nothing left to keep: the model has {n_layer} blocks")
    if len(keep) == n_layer:
        raise InvalidParameterError(f"nothing to prune: all {n_layer} blocks would be kept")
    return keep


def check_prunable(contents: GGUFContents) -> None:
    """UnsupportedModelError unless the model's blocks can be dropped and renumbered freely."""
    if contents.arch not in PRUNABLE_ARCHS:
        raise UnsupportedModelError(
            f"{contents.path}: architecture {contents.arch!r} is not supported for pruning (supported: "
            f"{', '.join(PRUNABLE_ARCHS)})")
    if f"{contents.arch}.block_count" not in contents.fields:
        raise ModelFileError(f"{contents.path}: no {contents.arch}.block_count in the metadata; not a model file")


def prune_blocks(contents: GGUFContents, keep: Sequence[int]) -> GGUFContents:
    """Keep the blocks `keep` (renumbered 0..len-1); per-block metadata arrays keep the same entries."""
    check_prunable(contents)
    arch, n_layer = contents.arch, contents.n_layer
    new_index = {old: new for new, old in enumerate(keep)}
    present = {int(m[1]) for m in (_BLOCK_TENSOR.fullmatch(t.name) for t in contents.tensors) if m}
    missing = [i for i in keep if i not in present]
    if missing:
        raise ModelFileError(f"{contents.path}: block {missing[0]} has no tensors; the file is damaged")

    tensors = []
    for tensor in contents.tensors:
        match = _BLOCK_TENSOR.fullmatch(tensor.name)
        if match is None:
            tensors.append(tensor)
        elif int(match[1]) in new_index:
            tensors.append(dataclasses.replace(tensor, name=f"blk.{new_index[int(match[1])]}.{match[2]}"))

    changed = [contents.fields[f"{arch}.block_count"].replaced(len(keep))]
    for field in contents.fields.values():
        if (field.key.startswith(f"{arch}.") and field.vtype == GGUFValueType.ARRAY
                and len(field.value) == n_layer):
            changed.append(field.replaced([field.value[i] for i in keep]))
    swa = _swa_pattern_field(contents, keep)
    if swa is not None:
        changed.append(swa)
    name = contents.get("general.name")
    if isinstance(name, str):
        changed.append(contents.fields["general.name"].replaced(f"{name} ({len(keep)} of {n_layer} blocks)"))
    return dataclasses.replace(contents.with_fields(*changed), tensors=tuple(tensors))


def _swa_pattern_field(contents: GGUFContents, keep: Sequence[int]) -> Field | None:
    """An explicit per-block sliding-window pattern when the index-based one would change a kept block's kind."""
    arch = contents.arch
    key = f"{arch}.attention.sliding_window_pattern"
    if arch not in SWA_PATTERN_ARCHS:
        return None
    field = contents.fields.get(key)
    if field is not None and field.vtype == GGUFValueType.ARRAY:
        return None  # an explicit per-block array: already pruned with the other per-block arrays
    period = int(field.value) if field is not None else SWA_PATTERN_ARCHS[arch]

    def is_swa(index: int) -> bool:  # llama_hparams::set_swa_pattern(period, dense_first=false)
        return period == 0 or index % period < period - 1

    kept_kinds = [is_swa(i) for i in keep]
    if kept_kinds == [is_swa(i) for i in range(len(keep))]:
        return None
    return Field(key, GGUFValueType.ARRAY, kept_kinds, GGUFValueType.BOOL)


# ---------------------------------------------------------------------------------------------------------------
# Aligning a draft's vocabulary with its target's
# ---------------------------------------------------------------------------------------------------------------
def vocab_mismatch_ignoring_size(target: ModelInfo, draft: ModelInfo) -> str | None:
    """pair_mismatch over the vocabulary range both files have: None when only the padding differs."""
    n = min(target.n_vocab, draft.n_vocab)
    return pair_mismatch(dataclasses.replace(target, tokens=target.tokens[:n]),
                         dataclasses.replace(draft, tokens=draft.tokens[:n]))


def align_vocab(draft: GGUFContents, target_path: str | os.PathLike) -> GGUFContents:
    """Pad or trim the draft's vocabulary (tokens, token types, scores, embedding and output rows) to the target's.

    New rows are zero blocks (all-zero bytes decode to zeros in every GGML type), so quantized tensors keep their
    type. Trimming drops only padding entries; IncompatiblePairError when real tokens differ or would be lost.
    """
    target = read_model_info(target_path, keep_all=True)
    draft_info = read_model_info(draft.path)
    reason = vocab_mismatch_ignoring_size(target, draft_info)
    if reason is not None:
        raise IncompatiblePairError(f"draft {draft.path} and target {target.path} have different tokenizers, "
                                    f"not just different padding: {reason}")
    n_draft, n_target = draft_info.n_vocab, target.n_vocab
    if n_target < n_draft:
        _check_trimmable(draft, draft_info, n_target)
    tensors = tuple(_resize_rows(t, n_target) if _is_vocab_tensor(t, n_draft) else t for t in draft.tensors)
    return dataclasses.replace(draft.with_fields(*_resized_vocab_fields(draft, target, n_target)), tensors=tensors)


def _is_vocab_tensor(tensor: TensorData, n_vocab: int) -> bool:
    """token_embd / output and the like: a matrix outside the blocks with one row per token."""
    return len(tensor.shape) == 2 and tensor.shape[1] == n_vocab and not tensor.name.startswith("blk.")


def _check_trimmable(draft: GGUFContents, draft_info: ModelInfo, n_keep: int) -> None:
    types = draft.get("tokenizer.ggml.token_type") or []
    for i in range(n_keep, draft_info.n_vocab):
        unused = i < len(types) and types[i] == TOKEN_TYPE_UNUSED
        if not unused and not _PAD_TOKEN.fullmatch(draft_info.tokens[i]):
            text = draft_info.tokens[i].decode("utf-8", errors="replace")
            raise IncompatiblePairError(
                f"draft {draft.path}: token {i} ({text!r}) is a real token beyond the target's vocabulary of "
                f"{n_keep}; only padding can be trimmed")
    for key, field in draft.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and int(field.value) >= n_keep:
            raise IncompatiblePairError(f"draft {draft.path}: {key} = {field.value} lies in the padding that "
                                        f"would be trimmed (target vocabulary {n_keep})")


def _resized_vocab_fields(draft: GGUFContents, target: ModelInfo, n_vocab: int) -> list[Field]:
    """tokens / token_type / scores cut to n_vocab or extended with the target's own entries."""
    changed = []
    for key, filler in (("tokenizer.ggml.tokens", None), ("tokenizer.ggml.token_type", TOKEN_TYPE_UNUSED),
                        ("tokenizer.ggml.scores", 0.0)):
        field = draft.fields.get(key)
        if field is None:
            continue
        values = list(field.value[:n_vocab])
        if len(values) < n_vocab:
            # the new ids get the target's own entries (target read with keep_all), else the filler
            source = target.tokens if key == "tokenizer.ggml.tokens" else target.get(key)
            extra = [_as_element(v, field.sub_type) for v in source[len(values):n_vocab]] if source is not None else []
            values += extra + [filler] * (n_vocab - len(values) - len(extra))
        changed.append(field.replaced(values))
    vocab_size = draft.fields.get(f"{draft.arch}.vocab_size")
    if vocab_size is not None:
        changed.append(vocab_size.replaced(n_vocab))
    return changed


def _as_element(value, sub_type: GGUFValueType | None):
    if sub_type == GGUFValueType.STRING:
        return value if isinstance(value, bytes) else str(value).encode("utf-8")
    if sub_type == GGUFValueType.FLOAT32 or sub_type == GGUFValueType.FLOAT64:
        return float(value)
    return int(value)


def _resize_rows(tensor: TensorData, n_rows: int) -> TensorData:
    """Cut a (n_embd, n_vocab) tensor to n_rows token rows, or append all-zero rows (zero in any GGML type)."""
    n_bytes = n_rows * tensor.row_bytes
    if n_bytes <= tensor.data.nbytes:
        data = tensor.data[:n_bytes]
    else:
        data = np.zeros(n_bytes, dtype=np.uint8)
        data[:tensor.data.nbytes] = tensor.data
    return dataclasses.replace(tensor, shape=(tensor.shape[0], n_rows), data=data)
