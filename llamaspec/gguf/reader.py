"""Read what a GGUF file says about itself, without loading its weights.

Architecture, sizes, tokenizer and special tokens, the chat template and every tensor's type and size come from
the file's header alone. The pair compatibility check and the memory estimate are built on this.

The header is parsed directly (with the `gguf` package's type tables) instead of through `gguf.GGUFReader`, which
builds a numpy view per array element and takes tens of seconds on a 150k-token vocabulary. This module knows
nothing about llama.cpp.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import ModelFileError
from .info import ModelInfo, TensorInfo
from .limits import header_problem

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


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
# ggml types newer than the gguf package's table: (block elements, block bytes).
_EXTRA_TYPE_SIZES = {42: (64, 18)}  # Q2_0
# gguf.cpp's limits: GGML_MAX_DIMS dimensions, names shorter than GGML_MAX_NAME bytes, int64 element counts.
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64
INT64_MAX = 2**63 - 1
# Large arrays nobody here needs as Python objects: skipped, only their length is kept.
MAX_HEADER_ITEM = 1 << 32   # bytes or elements: a header string or array beyond 4 GiB is a corrupt length
_SKIPPED_ARRAYS = ("tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


class HeaderIncomplete(ModelFileError):
    """The buffer is a prefix of the file and the header goes on past it: read up to byte `needed` (at least)."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


class _Cursor:
    """Little-endian reads from a memory map (or a prefix of the file of `size` bytes); running off the end of the
    file means it is truncated, off the end of a prefix that more of it is needed (HeaderIncomplete). Counts are
    checked against the bytes left before anything is allocated or looped over."""

    def __init__(self, buf, path: Path, keep_all: bool = False, size: int | None = None):
        self.buf, self.pos, self.path, self.keep_all = buf, 0, path, keep_all
        self.size = len(buf) if size is None else size
        self.elem_types: dict[str, GGUFValueType] = {}  # array key -> element type

    def _past_prefix(self, end: int) -> None:
        if len(self.buf) < end <= self.size:
            raise HeaderIncomplete(f"{self.path}: the header goes on past byte {len(self.buf)}", end)

    def need(self, n: int) -> None:
        if n > MAX_HEADER_ITEM:   # a flipped bit, not a cut-off download
            raise self.corrupt(f"a length of {n:,} bytes, more than any header item holds")
        self._past_prefix(self.pos + n)
        if self.pos + n > len(self.buf):
            raise ModelFileError(
                f"{self.path}: truncated GGUF file (header ends at byte {len(self.buf)}, "
                f"more data expected at byte {self.pos + n}); download it again"
            )

    def corrupt(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: corrupt GGUF header (byte {self.pos}): {what}")

    def count(self, n: int, min_item_bytes: int, what: str) -> int:
        """An element count that the rest of the file can hold (a cut-off download looks the same as a lie)."""
        self._past_prefix(self.pos + n * min_item_bytes)
        left = len(self.buf) - self.pos
        if n > MAX_HEADER_ITEM:
            raise self.corrupt(f"{what} is {n:,}, more than any header holds")
        if n * min_item_bytes > left:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF file ({what} is {n:,}, more than the "
                                 f"{left:,} bytes after byte {self.pos} hold); download it again")
        return n

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
            n = unpack("<Q", buf, pos)[0]
            if n > MAX_HEADER_ITEM:
                self.pos = pos
                self.need(n)
            pos += 8 + n
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

    def value_type(self, key: str) -> GGUFValueType:
        raw = self.scalar("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.corrupt(f"key {key!r} has unknown value type {raw}") from None

    def value(self, vtype: GGUFValueType, key: str):
        if vtype == GGUFValueType.STRING:
            return self.string().decode("utf-8", errors="replace")
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[vtype])
        elem_type = self.elem_types[key] = self.value_type(key)
        if elem_type == GGUFValueType.ARRAY:  # gguf.cpp refuses them too, so no loadable model has one
            raise self.corrupt(f"key {key!r} is an array of arrays, which llama.cpp cannot read")
        if elem_type == GGUFValueType.STRING:
            count = self.count(self.scalar("<Q"), 8, f"the length of array {key!r}")
            if key in _SKIPPED_ARRAYS and not self.keep_all:
                self.skip_strings(count)
                return ("skipped", count)
            return self.strings(count)
        dtype = np.dtype(_NUMPY_DTYPES[elem_type]).newbyteorder("<")
        count = self.count(self.scalar("<Q"), dtype.itemsize, f"the length of array {key!r}")
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += dtype.itemsize * count
        if key in _SKIPPED_ARRAYS and not self.keep_all:
            return ("skipped", count)
        return arr.tolist() if count <= 4096 else arr


def type_sizes(ggml_type: int) -> tuple[int, int] | None:
    """(block elements, block bytes) of a ggml type; None for a type ggml does not have (any more)."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return _EXTRA_TYPE_SIZES.get(ggml_type)


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    n_elems = math.prod(shape)
    block_size, type_size = type_sizes(ggml_type)
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
    if not path.is_file():   # opening a FIFO blocks until a writer comes, and a device never ends
        raise ModelFileError(f"{path}: not a regular file (a pipe, socket or device), not a GGUF model file")
    try:
        with path.open("rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 24:
                raise ModelFileError(f"{path}: not a GGUF file ({file_size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(mm, path, file_size, keep_all)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read model file ({e.strerror or e})") from None
    except (ValueError, KeyError, UnicodeDecodeError, OverflowError, MemoryError, struct.error) as e:
        raise ModelFileError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from None


def parse_header(prefix: bytes, path: Path, file_size: int) -> ModelInfo:
    """The header from the first bytes of a file of `file_size` bytes (e.g. read over HTTP); HeaderIncomplete says
    how far to read when the header goes on past `prefix`."""
    if len(prefix) < 24 <= file_size:
        raise HeaderIncomplete(f"{path}: the header goes on past byte {len(prefix)}", 24)
    try:
        return _parse(prefix, path, file_size, keep_all=False)
    except (ValueError, KeyError, UnicodeDecodeError, OverflowError, MemoryError, struct.error) as e:
        raise ModelFileError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from None


def _parse(mm, path: Path, file_size: int, keep_all: bool) -> ModelInfo:
    """gguf.cpp's own checks (it refuses such files cleanly; this reader would crash or mislead), then the
    hyperparameter limits llama.cpp asserts on (`limits.header_problem`)."""
    if mm[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (starts with {bytes(mm[:4])!r}, expected b'GGUF')")
    cur = _Cursor(mm, path, keep_all, size=file_size)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: unsupported GGUF version {version} (big-endian or too new?)")
    # the smallest tensor entry: 1-byte name, 0 dims, type, offset; the smallest key: 1 byte, type, 1-byte value
    n_tensors = cur.count(cur.scalar("<Q"), 8 + 1 + 4 + 4 + 8, "the tensor count")
    n_kv = cur.count(cur.scalar("<Q"), 8 + 1 + 4 + 1, "the metadata key count")

    metadata: dict = {}
    value_types: dict[str, GGUFValueType] = {}
    tokens: list[bytes] = []
    for _ in range(n_kv):
        key = cur.string().decode("utf-8", errors="replace")
        if not key or key in metadata:
            raise cur.corrupt(f"key {key!r} appears twice" if key else "a metadata key is empty")
        vtype = value_types[key] = cur.value_type(key)
        value = cur.value(vtype, key)
        if key == "tokenizer.ggml.tokens" and cur.elem_types.get(key) == GGUFValueType.STRING:
            tokens = value
            metadata[key] = ("tokens", len(value))
        else:
            metadata[key] = value

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if value_types.get("general.alignment", GGUFValueType.UINT32) != GGUFValueType.UINT32:
        raise cur.corrupt(f"general.alignment is a {value_types['general.alignment'].name}, not a UINT32")
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.corrupt(f"general.alignment is {alignment}, not a power of two")

    tensors = []
    names: set[str] = set()
    expected_offset = 0  # gguf.cpp: tensor data lies in header order, each tensor padded to the alignment
    for _ in range(n_tensors):
        raw_name = cur.string()
        name = raw_name.decode("utf-8", errors="replace")
        if len(raw_name) >= GGML_MAX_NAME or name in names:
            raise cur.corrupt(f"tensor {name!r} appears twice" if name in names else
                              f"tensor name {name[:20]!r}... is {len(raw_name):,} bytes (at most {GGML_MAX_NAME - 1})")
        names.add(name)
        n_dims = cur.scalar("<I")
        if n_dims > GGML_MAX_DIMS:
            raise cur.corrupt(f"tensor {name!r} has {n_dims:,} dimensions (at most {GGML_MAX_DIMS})")
        shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
        if math.prod(shape) > INT64_MAX or any(d > INT64_MAX for d in shape):
            raise cur.corrupt(f"tensor {name!r} has an impossible shape {list(shape)}")
        ggml_type = cur.scalar("<I")
        sizes = type_sizes(ggml_type)
        if sizes is None:
            raise cur.corrupt(f"tensor {name!r} has unknown ggml type {ggml_type}")
        if shape and shape[0] % sizes[0]:
            raise cur.corrupt(f"tensor {name!r}: a row of {shape[0]} elements is not whole blocks of {sizes[0]} "
                              f"({TensorInfo(name, shape, ggml_type, 0, 0).type_name})")
        offset = cur.scalar("<Q")
        if offset != expected_offset:
            raise cur.corrupt(f"tensor {name!r} has data offset {offset:,}, but the tensors before it end at "
                              f"{expected_offset:,}")
        n_bytes = tensor_nbytes(shape, ggml_type)
        expected_offset += n_bytes + (-n_bytes) % alignment
        tensors.append(TensorInfo(name, shape, ggml_type, offset, n_bytes))

    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    data_end = max((data_offset + t.offset + t.n_bytes for t in tensors), default=cur.pos)
    if data_end > file_size:
        missing = data_end - file_size
        raise ModelFileError(
            f"{path}: truncated GGUF file ({file_size:,} bytes, tensor data needs {data_end:,}; "
            f"{missing:,} bytes missing); the download or copy did not finish"
        )
    info = ModelInfo(path, file_size, version, metadata, tuple(tensors), tuple(tokens), data_offset)
    problem = header_problem(info, value_types, cur.elem_types)
    if problem is not None:
        raise ModelFileError(f"{path}: {problem}; the file is damaged or was not made for llama.cpp")
    return info
