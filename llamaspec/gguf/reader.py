"""Read what a GGUF file says about itself, without loading its weights.

Architecture, sizes, tokenizer and special tokens, the chat template and every tensor's type and size come from
the file's header alone. The pair compatibility check and the memory estimate are built on this.

The header is parsed directly (with the `gguf` package's type tables) instead of through `gguf.GGUFReader`, which
builds a numpy view per array element and takes tens of seconds on a 150k-token vocabulary. This module knows
nothing about llama.cpp.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import IncompatiblePairError, ModelFileError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# llama.cpp's common_speculative_are_compatible: token text is compared from this id up.
VOCAB_CHECK_START_ID = 5
VOCAB_MAX_SIZE_DIFFERENCE = 128

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}
# Large arrays nobody here needs as Python objects: skipped, only their length is kept.
_SKIPPED_ARRAYS = ("tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"


@dataclass(frozen=True)
class ModelInfo:
    """The header of one GGUF file."""

    path: Path
    file_size: int
    version: int
    metadata: dict  # key -> scalar, string, or (for arrays) a list / numpy array / ("skipped", length)
    tensors: tuple[TensorInfo, ...]
    tokens: tuple[bytes, ...] = field(repr=False)
    data_offset: int = 0

    # -- convenience views over the metadata ---------------------------------------------------------------------
    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def arch_get(self, suffix: str, default=None):
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    @property
    def arch(self) -> str:
        return self.metadata.get("general.architecture", "unknown")

    @property
    def name(self) -> str:
        return self.metadata.get("general.name") or self.path.name

    @property
    def n_layer(self) -> int:
        return int(self.arch_get("block_count", 0))

    @property
    def n_layer_nextn(self) -> int:
        """Multi-token-prediction (nextn) blocks at the end of the file's blocks (counted in n_layer)."""
        return int(self.arch_get("nextn_predict_layers", 0) or 0)

    @property
    def n_ctx_train(self) -> int:
        return int(self.arch_get("context_length", 0))

    @property
    def n_embd(self) -> int:
        return int(self.arch_get("embedding_length", 0))

    @property
    def n_head(self) -> int:
        return _first_int(self.arch_get("attention.head_count", 0))

    @property
    def n_head_kv(self) -> int:
        return _first_int(self.arch_get("attention.head_count_kv", self.n_head)) or self.n_head

    @property
    def head_dim_k(self) -> int:
        return int(self.arch_get("attention.key_length", 0)) or (self.n_embd // max(self.n_head, 1))

    @property
    def head_dim_v(self) -> int:
        return int(self.arch_get("attention.value_length", 0)) or (self.n_embd // max(self.n_head, 1))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def vocab_model(self) -> str | None:
        return self.metadata.get("tokenizer.ggml.model")

    @property
    def vocab_pre(self) -> str | None:
        return self.metadata.get("tokenizer.ggml.pre")

    @property
    def bos_id(self) -> int | None:
        return self.metadata.get("tokenizer.ggml.bos_token_id")

    @property
    def eos_id(self) -> int | None:
        return self.metadata.get("tokenizer.ggml.eos_token_id")

    @property
    def add_bos(self) -> bool | None:
        return self.metadata.get("tokenizer.ggml.add_bos_token")

    @property
    def add_eos(self) -> bool | None:
        return self.metadata.get("tokenizer.ggml.add_eos_token")

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    @property
    def weights_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def is_recurrent(self) -> bool:
        # Mamba / RWKV style models carry an ssm or wkv block; llama.cpp decides precisely at load time.
        return any(k.startswith(f"{self.arch}.ssm.") or k.startswith(f"{self.arch}.wkv.") for k in self.metadata)


def _first_int(value) -> int:
    """Per-layer arrays (e.g. head_count_kv on some models) collapse to their first element."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return int(value[0]) if len(value) else 0
    return int(value)


class _Cursor:
    """Little-endian reads from a memory map; running off the end means the file is truncated."""

    def __init__(self, buf, path: Path, keep_all: bool = False):
        self.buf, self.pos, self.path, self.keep_all = buf, 0, path, keep_all

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelFileError(
                f"{self.path}: truncated GGUF file (header ends at byte {len(self.buf)}, "
                f"more data expected at byte {self.pos + n}); download it again"
            )

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> bytes:
        n = self.scalar("<Q")
        self.need(n)
        value = self.buf[self.pos:self.pos + n]
        self.pos += n
        return value

    def skip_strings(self, count: int) -> None:
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8)
            pos += 8 + unpack("<Q", buf, pos)[0]
        self.pos = pos
        self.need(0)

    def strings(self, count: int) -> list[bytes]:
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8)
            n = unpack("<Q", buf, pos)[0]
            pos += 8
            append(buf[pos:pos + n])
            pos += n
        self.pos = pos
        self.need(0)
        return out

    def value(self, vtype: int, key: str):
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string().decode("utf-8", errors="replace")
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[vtype])
        elem_type = GGUFValueType(self.scalar("<I"))
        count = self.scalar("<Q")
        if elem_type == GGUFValueType.STRING:
            if key in _SKIPPED_ARRAYS and not self.keep_all:
                self.skip_strings(count)
                return ("skipped", count)
            return self.strings(count)
        if elem_type == GGUFValueType.ARRAY:
            return [self.value(GGUFValueType.ARRAY, key) for _ in range(count)]
        dtype = np.dtype(_NUMPY_DTYPES[elem_type]).newbyteorder("<")
        n_bytes = dtype.itemsize * count
        self.need(n_bytes)
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += n_bytes
        if key in _SKIPPED_ARRAYS and not self.keep_all:
            return ("skipped", count)
        return arr.tolist() if count <= 4096 else arr


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    n_elems = int(np.prod(shape, dtype=np.int64)) if shape else 1
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return n_elems // block_size * type_size


def read_model_info(path: str | os.PathLike, keep_all: bool = False) -> ModelInfo:
    """Parse a GGUF header; raise ModelFileError for a missing, non-GGUF or truncated file.

    keep_all also keeps the large tokenizer arrays (merges, scores, token types) that are skipped by default.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFileError(f"{path}: no such model file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF model file")
    try:
        with path.open("rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 24:
                raise ModelFileError(f"{path}: not a GGUF file ({file_size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(mm, path, file_size, keep_all)
    except PermissionError as e:
        raise ModelFileError(f"{path}: cannot read model file ({e.strerror})") from None
    except (ValueError, KeyError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise ModelFileError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from None


def _parse(mm, path: Path, file_size: int, keep_all: bool) -> ModelInfo:
    if mm[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (starts with {bytes(mm[:4])!r}, expected b'GGUF')")
    cur = _Cursor(mm, path, keep_all)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: unsupported GGUF version {version} (big-endian or too new?)")
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise ModelFileError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")

    metadata: dict = {}
    tokens: list[bytes] = []
    for _ in range(n_kv):
        key = cur.string().decode("utf-8", errors="replace")
        value = cur.value(cur.scalar("<I"), key)
        if key == "tokenizer.ggml.tokens":
            tokens = value
            metadata[key] = ("tokens", len(value))
        else:
            metadata[key] = value

    tensors = []
    for _ in range(n_tensors):
        name = cur.string().decode("utf-8", errors="replace")
        n_dims = cur.scalar("<I")
        shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
        ggml_type = cur.scalar("<I")
        offset = cur.scalar("<Q")
        tensors.append(TensorInfo(name, shape, ggml_type, offset, tensor_nbytes(shape, ggml_type)))

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    data_end = max((data_offset + t.offset + t.n_bytes for t in tensors), default=cur.pos)
    if data_end > file_size:
        missing = data_end - file_size
        raise ModelFileError(
            f"{path}: truncated GGUF file ({file_size:,} bytes, tensor data needs {data_end:,}; "
            f"{missing:,} bytes missing); the download or copy did not finish"
        )
    return ModelInfo(path, file_size, version, metadata, tuple(tensors), tuple(tokens), data_offset)


# ---------------------------------------------------------------------------------------------------------------
# Pair compatibility (llama.cpp's rule, plus the pre-tokenizer)
# ---------------------------------------------------------------------------------------------------------------

def pair_mismatch(target: ModelInfo, draft: ModelInfo) -> str | None:
    """The first reason the draft cannot speculate for the target, or None when they are compatible."""
    for label, key in (("vocabulary type", "tokenizer.ggml.model"), ("pre-tokenizer", "tokenizer.ggml.pre"),
                       ("add-BOS flag", "tokenizer.ggml.add_bos_token"),
                       ("add-EOS flag", "tokenizer.ggml.add_eos_token")):
        t, d = target.get(key), draft.get(key)
        if t != d:
            return f"{label} ({key}) differs: target {t!r}, draft {d!r}"
    if target.add_bos and target.bos_id != draft.bos_id:
        return f"BOS token id differs: target {target.bos_id}, draft {draft.bos_id}"
    if target.eos_id != draft.eos_id:
        return f"EOS token id differs: target {target.eos_id}, draft {draft.eos_id}"
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        return (f"vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}: "
                f"target {target.n_vocab}, draft {draft.n_vocab}")
    n = min(target.n_vocab, draft.n_vocab)
    if target.tokens[VOCAB_CHECK_START_ID:n] != draft.tokens[VOCAB_CHECK_START_ID:n]:
        for i in range(VOCAB_CHECK_START_ID, n):
            if target.tokens[i] != draft.tokens[i]:
                t = target.tokens[i].decode("utf-8", errors="replace")
                d = draft.tokens[i].decode("utf-8", errors="replace")
                return f"token {i} differs: target {t!r}, draft {d!r}"
    return None


def check_pair(target: ModelInfo, draft: ModelInfo) -> None:
    """Raise IncompatiblePairError naming both files and the first mismatch."""
    reason = pair_mismatch(target, draft)
    if reason is not None:
        raise IncompatiblePairError(
            f"draft {draft.path} cannot speculate for target {target.path}: {reason}. "
            "Target and draft must share one tokenizer (e.g. the same model family)."
        )
