"""Copy a GGUF file into a new one with some metadata and tensors changed: the building blocks of the draft-making
tools in convert/ (prune.py keeps a subset of transformer blocks, align.py pads or trims a vocabulary).

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
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from ..errors import ModelFileError, UnsupportedModelError
from .reader import DEFAULT_ALIGNMENT, read_model_info

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}

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
