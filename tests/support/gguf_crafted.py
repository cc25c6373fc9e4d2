"""Crafted GGUF files for the hardening tests, written as bytes: nothing here is committed as a binary.

- `Image`: a GGUF file as editable parts (version, metadata in file order, tensor entries, the data region) and
  `to_bytes()`, a serializer that also writes what no honest writer would (alignment 0, nested arrays, counts that
  do not match the entries, offsets past the end). `parse()` reads a valid file into an Image. Tensor data is laid out
  in order on writing, cut or zero-padded to each tensor's shape, so changing a shape or type keeps the file
  consistent unless a test says otherwise (`Tensor.offset`, counts given to `to_bytes`).
- `tiny_llama()`: a complete, loadable llama-architecture model of one block, width 32, with llama.cpp's built-in
  "test" tokenizer (32 tokens): about 40 KB, made in milliseconds.
- `CORPUS`: named malformed files, each one way a crafted header has crashed or could crash a reader or
  llama.cpp's loader; `corpus_file(name)` gives its bytes.

This module is independent of llamaspec's own reader, so a bug there cannot hide itself here.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import struct
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_KNOWN_TYPES = {int(t): t for t in GGMLQuantizationType}

# GGUF value types (gguf.GGUFValueType; spelled out so the serializer can write invalid ones too)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
            BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
GGML_F32 = 0
GGML_NVFP4 = 40
MAX_TENSOR_BYTES = 1 << 36  # a shape claiming more is not backed by data (a sparse file can hold less)


@dataclass
class KV:
    key: str | bytes
    vtype: int
    value: object   # scalar; str/bytes for STRING; (elem_type, [items]) for ARRAY (items nest the same way)


@dataclass
class Tensor:
    name: str | bytes
    shape: list[int]   # GGUF order: shape[0] is the row length
    ggml_type: int
    data: bytes = b""  # cut or zero-padded to what shape and type need when written
    offset: int | None = None  # None: where the layout puts it; a number: what the header claims instead

    def nbytes(self) -> int | None:
        sizes = GGML_QUANT_SIZES.get(_KNOWN_TYPES[self.ggml_type]) if self.ggml_type in _KNOWN_TYPES else None
        if sizes is None:
            return None
        return math.prod(self.shape) // sizes[0] * sizes[1]


@dataclass
class Image:
    version: int = 3
    kvs: list[KV] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    alignment: int = 32  # padding used when writing; the general.alignment key, if any, is in kvs

    def copy(self) -> "Image":
        """A copy whose entries can be edited or replaced; values (token lists, tensor bytes) are shared, so edits
        replace them rather than change them in place."""
        tensors = [dataclasses.replace(t, shape=list(t.shape)) for t in self.tensors]
        return dataclasses.replace(self, kvs=[copy.copy(kv) for kv in self.kvs], tensors=tensors)

    def find(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def set(self, key: str, vtype: int, value) -> "Image":
        kv = self.find(key)
        if kv is None:
            self.kvs.append(KV(key, vtype, value))
        else:
            kv.vtype, kv.value = vtype, value
        return self

    def remove(self, key: str) -> "Image":
        self.kvs = [kv for kv in self.kvs if kv.key != key]
        return self

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def _pad(self, n: int) -> int:
        return (-n) % self.alignment if self.alignment > 0 else 0

    def layout(self) -> tuple[list[tuple[int, bytes]], int]:
        """(offset, bytes) of each tensor in the data region, and the region's size: tensors in order, each
        padded to the alignment, as gguf.GGUFWriter lays them out. Missing bytes are zeros."""
        pieces, end = [], 0
        for t in self.tensors:
            end += self._pad(end)
            n = t.nbytes()
            size = n if n is not None and n <= MAX_TENSOR_BYTES else len(t.data)  # a larger claim stays a lie
            pieces.append((end, t.data[:size]))
            end += size
        return pieces, end + self._pad(end)

    def header_bytes(self, n_kv: int | None = None, n_tensors: int | None = None,
                     offsets: list[int] | None = None) -> bytes:
        offsets = offsets if offsets is not None else [offset for offset, _ in self.layout()[0]]
        out = bytearray(b"GGUF")
        out += struct.pack("<IQQ", self.version, len(self.tensors) if n_tensors is None else n_tensors,
                           len(self.kvs) if n_kv is None else n_kv)
        for kv in self.kvs:
            out += _string(kv.key) + struct.pack("<I", kv.vtype) + _value(kv.vtype, kv.value)
        for t, offset in zip(self.tensors, offsets):
            out += _string(t.name) + struct.pack("<I", len(t.shape))
            out += b"".join(struct.pack("<Q", d) for d in t.shape)
            out += struct.pack("<IQ", t.ggml_type, offset if t.offset is None else t.offset)
        return bytes(out)

    def _parts(self, n_kv, n_tensors):
        pieces, size = self.layout()
        header = self.header_bytes(n_kv, n_tensors, [offset for offset, _ in pieces])
        return header, len(header) + self._pad(len(header)), pieces, size

    def to_bytes(self, n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
        header, start, pieces, size = self._parts(n_kv, n_tensors)
        out = bytearray(start + size)
        out[:len(header)] = header
        for offset, data in pieces:
            out[start + offset:start + offset + len(data)] = data
        return bytes(out)

    def write(self, path, n_kv: int | None = None, n_tensors: int | None = None):
        """to_bytes() into a file, with the zeros of tensors without data left as holes (a sparse file)."""
        header, start, pieces, size = self._parts(n_kv, n_tensors)
        with open(path, "wb") as f:
            f.write(header)
            for offset, data in pieces:
                if data:
                    f.seek(start + offset)
                    f.write(data)
            f.truncate(start + size)
        return path


def _string(s: str | bytes) -> bytes:
    raw = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


class Raw(bytes):
    """A value's encoded payload, written as is."""


def _value(vtype: int, value) -> bytes:
    if isinstance(value, Raw):
        return value
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        elem_type, items = value
        out = bytearray(struct.pack("<IQ", elem_type, len(items)))
        for item in items:
            out += _value(elem_type, item)
        return bytes(out)
    return struct.pack(_FORMATS.get(vtype, "<I"), value)  # an unknown type gets 4 bytes of payload


# ---------------------------------------------------------------------------------------------------------------
# Reading a valid file
# ---------------------------------------------------------------------------------------------------------------
def parse(buf, with_data: bool = True) -> Image:
    """A valid GGUF file's bytes (or a memory map of it) as an Image; without data, tensors are written as zeros."""
    pos = 4
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, pos)
    pos += 20

    def string(pos):
        (n,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8:pos + 8 + n]), pos + 8 + n

    def value(vtype, pos):
        if vtype == STRING:
            raw, pos = string(pos)
            return raw, pos
        if vtype == ARRAY:
            elem_type, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            items = []
            if elem_type in _FORMATS:  # numbers in one read
                fmt = _FORMATS[elem_type]
                size = struct.calcsize(fmt)
                items = [v for (v,) in struct.iter_unpack(fmt, buf[pos:pos + size * count])]
                return (elem_type, items), pos + size * count
            for _ in range(count):
                item, pos = value(elem_type, pos)
                items.append(item)
            return (elem_type, items), pos
        fmt = _FORMATS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)

    image = Image(version=version)
    offsets = []
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        val, pos = value(vtype, pos + 4)
        if vtype == STRING:
            val = val.decode("utf-8", "surrogateescape")
        image.kvs.append(KV(key.decode("utf-8"), vtype, val))
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        shape = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        image.tensors.append(Tensor(name.decode("utf-8"), shape, ggml_type))
        offsets.append(offset)
    align_kv = image.find("general.alignment")
    image.alignment = int(align_kv.value) if align_kv is not None else 32
    start = pos + (-pos) % image.alignment
    for t, offset in zip(image.tensors, offsets):
        t.data = bytes(buf[start + offset:start + offset + t.nbytes()]) if with_data else b""
    return image


# ---------------------------------------------------------------------------------------------------------------
# A tiny complete model
# ---------------------------------------------------------------------------------------------------------------
def tiny_llama(n_layer: int = 1, n_embd: int = 32, n_head: int = 2, n_head_kv: int = 1, n_ff: int = 64,
               n_vocab: int = 32, seed: int = 0) -> Image:
    """A loadable llama model with F32 weights and the "test" tokenizer (tokens tok_0 .. tok_{n_vocab-1})."""
    head_dim = n_embd // n_head
    image = Image()
    for key, vtype, value in [
        ("general.architecture", STRING, "llama"), ("general.name", STRING, "crafted-tiny-llama"),
        ("llama.context_length", UINT32, 256), ("llama.embedding_length", UINT32, n_embd),
        ("llama.block_count", UINT32, n_layer), ("llama.feed_forward_length", UINT32, n_ff),
        ("llama.attention.head_count", UINT32, n_head), ("llama.attention.head_count_kv", UINT32, n_head_kv),
        ("llama.attention.layer_norm_rms_epsilon", FLOAT32, 1e-5), ("llama.rope.dimension_count", UINT32, head_dim),
        ("llama.rope.freq_base", FLOAT32, 10000.0),
        ("tokenizer.ggml.model", STRING, "test"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, [f"tok_{i}" for i in range(n_vocab)])),
        ("tokenizer.ggml.token_type", ARRAY, (INT32, [1] * n_vocab)),
    ]:
        image.kvs.append(KV(key, vtype, value))
    shapes = {"token_embd.weight": [n_embd, n_vocab], "output_norm.weight": [n_embd]}
    for i in range(n_layer):
        shapes.update({
            f"blk.{i}.attn_norm.weight": [n_embd], f"blk.{i}.attn_q.weight": [n_embd, head_dim * n_head],
            f"blk.{i}.attn_k.weight": [n_embd, head_dim * n_head_kv],
            f"blk.{i}.attn_v.weight": [n_embd, head_dim * n_head_kv],
            f"blk.{i}.attn_output.weight": [head_dim * n_head, n_embd], f"blk.{i}.ffn_norm.weight": [n_embd],
            f"blk.{i}.ffn_gate.weight": [n_embd, n_ff], f"blk.{i}.ffn_down.weight": [n_ff, n_embd],
            f"blk.{i}.ffn_up.weight": [n_embd, n_ff]})
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        values = (np.ones(shape[0], np.float32) if name.endswith("norm.weight")
                  else rng.standard_normal(math.prod(shape), dtype=np.float32) * 0.5)
        image.tensors.append(Tensor(name, shape, GGML_F32, values.tobytes()))
    return image


# ---------------------------------------------------------------------------------------------------------------
# The corpus: one malformed file per way of breaking a header
# ---------------------------------------------------------------------------------------------------------------
def _with(**changes):
    """A corpus entry that sets metadata keys on tiny_llama(): key=(vtype, value); '__' stands for '.'."""
    def make() -> bytes:
        image = tiny_llama()
        for key, (vtype, value) in changes.items():
            image.set(key.replace("__", "."), vtype, value)
        return image.to_bytes()
    return make


def _edit(func):
    def make() -> bytes:
        image = tiny_llama()
        return func(image) or image.to_bytes()
    return make


def _nested(depth: int) -> Raw:
    """An array holding an array holding ... (depth levels) holding [1]."""
    return Raw(struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQi", INT32, 1, 1))


def _set_tensor(name, **changes):
    def edit(image):
        t = image.tensor(name)
        for k, v in changes.items():
            setattr(t, k, v)
    return _edit(edit)


def _nvfp4_scaled_and_biased(image):
    """An NVFP4 ffn_down with both a per-tensor scale and a bias (llama-graph.cpp's build_ffn asserts on it)."""
    image.tensor("blk.0.ffn_down.weight").ggml_type = GGML_NVFP4
    image.tensors += [Tensor("blk.0.ffn_down.scale", [1], GGML_F32, np.ones(1, np.float32).tobytes()),
                      Tensor("blk.0.ffn_down.bias", [32], GGML_F32, np.zeros(32, np.float32).tobytes())]


CORPUS = {
    # counts and sizes the file cannot hold
    "n_tensors_huge": _edit(lambda im: im.to_bytes(n_tensors=2**62)),
    "n_kv_huge": _edit(lambda im: im.to_bytes(n_kv=2**40)),
    "n_kv_past_entries": _edit(lambda im: im.to_bytes(n_kv=len(im.kvs) + 1)),
    "string_length_huge": _edit(lambda im: im.to_bytes().replace(
        _string("crafted-tiny-llama"), struct.pack("<Q", 2**63) + b"crafted-tiny-llama", 1)),
    "array_length_huge": _edit(lambda im: im.to_bytes().replace(
        struct.pack("<IQ", STRING, 32) + _string("tok_0"), struct.pack("<IQ", STRING, 2**61) + _string("tok_0"), 1)),
    "number_array_length_huge": _edit(lambda im: im.to_bytes().replace(
        struct.pack("<IQ", INT32, 32), struct.pack("<IQ", INT32, 2**62 - 1), 1)),
    "unknown_value_type": _with(general__name=(99, 0)),
    "unknown_array_element_type": _with(general__name=(ARRAY, (99, []))),
    "nested_arrays_deep": _with(general__nested=(ARRAY, _nested(100_000))),
    "duplicate_key": _edit(lambda im: im.kvs.append(KV("general.name", STRING, "again"))),
    "key_not_utf8": _edit(lambda im: im.kvs.append(KV(b"general.\xff", UINT32, 1))),
    "empty_key": _edit(lambda im: im.kvs.append(KV(b"", UINT32, 1))),
    "version_1": _edit(lambda im: setattr(im, "version", 1)),
    "alignment_zero": _with(general__alignment=(UINT32, 0)),
    "alignment_not_power_of_two": _with(general__alignment=(UINT32, 24)),
    "alignment_wrong_type": _with(general__alignment=(STRING, "32")),
    # tensor entries
    "tensor_offset_past_end": _set_tensor("output_norm.weight", offset=2**40),
    "tensor_data_past_end": _edit(lambda im: im.to_bytes()[:-100]),
    "tensor_offset_unaligned": _set_tensor("output_norm.weight", offset=4),
    "tensor_offsets_overlap": _set_tensor("output_norm.weight", offset=0),
    "tensor_dims_5": _set_tensor("output_norm.weight", shape=[32, 1, 1, 1, 1]),
    "tensor_dim_zero": _set_tensor("blk.0.ffn_up.weight", shape=[32, 0]),
    "tensor_elements_overflow": _set_tensor("token_embd.weight", shape=[2**32, 2**32]),
    "tensor_type_unknown": _set_tensor("output_norm.weight", ggml_type=99),
    "tensor_type_removed": _set_tensor("output_norm.weight", ggml_type=4),  # Q4_2, gone from ggml
    "tensor_row_not_whole_blocks": _set_tensor("output_norm.weight", ggml_type=12),  # Q4_K: 256-element blocks
    "tensor_duplicate_name": _edit(lambda im: im.tensors.append(copy.copy(im.tensors[1]))),
    "tensor_name_too_long": _edit(lambda im: setattr(im.tensors[1], "name", "n" * 64)),
    "tensor_shape_vs_embedding_length": _set_tensor("token_embd.weight", shape=[16, 64]),
    # hyperparameters llama.cpp asserts on
    "block_count_999": _with(llama__block_count=(UINT32, 999)),
    "block_count_zero": _with(llama__block_count=(UINT32, 0)),
    "block_count_wrong_type": _with(llama__block_count=(STRING, "1")),
    "head_count_zero": _with(llama__attention__head_count=(UINT32, 0)),
    "head_count_kv_zero": _with(llama__attention__head_count_kv=(UINT32, 0)),
    "head_count_kv_not_divisor": _with(llama__attention__head_count_kv=(UINT32, 3)),
    "head_count_array_wrong_length": _with(llama__attention__head_count=(ARRAY, (UINT32, [2, 2, 2]))),
    "head_count_array_wrong_type": _with(llama__attention__head_count=(ARRAY, (FLOAT32, [2.0]))),
    "embedding_length_zero": _with(llama__embedding_length=(UINT32, 0)),
    "embedding_length_not_head_multiple": _with(llama__embedding_length=(UINT32, 33)),
    "context_length_zero": _with(llama__context_length=(UINT32, 0)),
    "feed_forward_length_array_long": _with(llama__feed_forward_length=(ARRAY, (UINT32, [64] * 600))),
    "expert_count_huge": _with(llama__expert_count=(UINT32, 5000), llama__expert_used_count=(UINT32, 2)),
    "expert_used_without_experts": _with(llama__expert_used_count=(UINT32, 2)),
    "expert_used_over_count": _with(llama__expert_count=(UINT32, 4), llama__expert_used_count=(UINT32, 8)),
    "nextn_layers_over_block_count": _with(llama__nextn_predict_layers=(UINT32, 5)),
    "nextn_layers_not_a_number": _with(llama__nextn_predict_layers=(STRING, "x")),
    "rope_scaling_type_unknown": _with(llama__rope__scaling__type=(STRING, "cubic")),
    "rope_dimension_odd_large": _with(llama__rope__dimension_count=(UINT32, 17)),
    "key_length_differs_from_value_length": _with(llama__attention__key_length=(UINT32, 8)),
    "value_length_wrong": _with(llama__attention__value_length=(UINT32, 8)),
    "norm_not_f32": _set_tensor("output_norm.weight", ggml_type=1),  # F16: ggml's CPU add/mul abort on it
    "nvfp4_ffn_down_with_scale_and_bias": _edit(_nvfp4_scaled_and_biased),
    "matrix_f64": _set_tensor("blk.0.ffn_down.weight", ggml_type=28),
    "rms_epsilon_negative": _with(llama__attention__layer_norm_rms_epsilon=(FLOAT32, -1.0)),
    "rms_epsilon_nan": _with(llama__attention__layer_norm_rms_epsilon=(FLOAT32, float("nan"))),
    "rope_dimension_zero": _with(llama__rope__dimension_count=(UINT32, 0)),
    "rope_sections_past_head": _with(llama__rope__dimension_sections=(ARRAY, (INT32, [16, 8, 8, 0]))),
    "expert_gating_unknown": _with(llama__expert_gating_func=(UINT32, 9)),
    "kv_heads_over_query_heads": _with(llama__attention__head_count_kv=(UINT32, 4)),
    "query_heads_do_not_fit_projection": _with(llama__attention__head_count=(UINT32, 4),
                                               llama__attention__key_length=(UINT32, 16),
                                               llama__attention__value_length=(UINT32, 16)),
    # tokenizer
    "tokenizer_none": _with(tokenizer__ggml__model=(STRING, "none")),
    "tokens_duplicate": _edit(lambda im: im.find("tokenizer.ggml.tokens").value[1].__setitem__(2, "tok_0")),
    "tokens_not_strings": _with(tokenizer__ggml__tokens=(ARRAY, (INT32, list(range(32))))),
    "tokens_empty": _with(tokenizer__ggml__tokens=(ARRAY, (STRING, []))),
    "token_type_short": _with(tokenizer__ggml__token_type=(ARRAY, (INT32, [1]))),
    "bos_id_out_of_range": _with(tokenizer__ggml__bos_token_id=(UINT32, 10**6)),
    "bos_id_negative": _with(tokenizer__ggml__bos_token_id=(INT32, -5)),
    "tokenizer_model_unknown": _with(tokenizer__ggml__model=(STRING, "nonesuch")),
    "architecture_unknown": _with(general__architecture=(STRING, "nonesuch")),
    "architecture_not_string": _with(general__architecture=(UINT32, 7)),
    "chat_template_not_string": _with(tokenizer__chat_template=(UINT32, 7)),
    "name_not_utf8": _with(general__name=(STRING, b"\xff\xfe")),
}


def corpus_file(name: str) -> bytes:
    return CORPUS[name]()


# Mutants of the fuzzer's seeds that got past the header checks and then aborted llama.cpp, as (seed architecture,
# field, value): a metadata key set to (value type, value), or a tensor given {attribute: value}. The seed is
# test-llama-archs' model of that architecture (the fuzz tests' `seeds`); `replay` makes the mutant again.
MUTANT_SEEDS = (
    ("lfm2", "lfm2.attention.value_length_swa", (UINT32, 0)),   # GGML_ASSERT(n_embd_v_gqa == n_embd_k_gqa)
    ("llama", "blk.0.ffn_down.weight", {"ggml_type": GGML_NVFP4}),   # beside ffn_down.scale and ffn_down.bias
)


def replay(seed: Image, field: str, value) -> Image:
    """A copy of `seed` with one entry of MUTANT_SEEDS applied."""
    image = seed.copy()
    if isinstance(value, dict):
        for attribute, new in value.items():
            setattr(image.tensor(field), attribute, new)
    else:
        image.set(field, *value)
    return image


# ---------------------------------------------------------------------------------------------------------------
# Mutations of a valid file, driven by a random.Random (hypothesis' st.randoms() in the fuzz tests)
# ---------------------------------------------------------------------------------------------------------------
_INT_RANGES = {UINT8: (0, 2**8 - 1), INT8: (-2**7, 2**7 - 1), UINT16: (0, 2**16 - 1), INT16: (-2**15, 2**15 - 1),
               UINT32: (0, 2**32 - 1), INT32: (-2**31, 2**31 - 1), UINT64: (0, 2**64 - 1),
               INT64: (-2**63, 2**63 - 1)}
_EDGE_INTS = (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512, 513, 1023, 1024, 1025,
              4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -1, -2**31)
_EDGE_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, 3.4e38, float("nan"), float("inf"), float("-inf"))
_EDGE_STRINGS = ("", "x", "none", "linear", "yarn", "longrope", "gpt2", "llama", "test", "no_vocab", "default",
                 "qwen2", "llama3", "\udcff", "\x00", "a" * 70)
# Keys llama.cpp reads for most architectures (prefixed with the architecture), for adding where absent.
_ARCH_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "expert_count",
              "expert_used_count", "expert_group_count", "expert_group_used_count", "expert_feed_forward_length",
              "nextn_predict_layers", "leading_dense_block_count", "vocab_size", "attention.head_count",
              "attention.head_count_kv", "attention.key_length", "attention.value_length",
              "attention.sliding_window", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
              "rope.dimension_sections", "rope.scaling.type", "rope.scaling.factor", "ssm.conv_kernel",
              "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
              "attention.recurrent_layers", "full_attention_interval")
_TOKENIZER_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.ggml.model", "tokenizer.ggml.pre")


def _edge_int(rnd, current: int | None = None, vtype: int = UINT32) -> int:
    choices = list(_EDGE_INTS)
    if current is not None:
        choices += [current - 1, current + 1, current * 2, current // 2, current * 16]
    lo, hi = _INT_RANGES.get(vtype, (0, 2**32 - 1))
    return min(max(rnd.choice(choices), lo), hi)


def _edge_value(rnd, vtype: int):
    if vtype in _INT_RANGES:
        return _edge_int(rnd, vtype=vtype)
    if vtype in (FLOAT32, FLOAT64):
        return rnd.choice(_EDGE_FLOATS)
    if vtype == BOOL:
        return rnd.random() < 0.5
    if vtype == STRING:
        return rnd.choice(_EDGE_STRINGS)
    elem = rnd.choice((UINT32, INT32, FLOAT32, STRING, BOOL))
    return (elem, [_edge_value(rnd, elem) for _ in range(rnd.choice((0, 1, 2, 3, 8, 513)))])


@dataclass
class Mutant:
    """A mutated image, how to write it (counts that lie, bytes overwritten in the header) and what was done."""

    image: Image
    n_kv: int | None = None
    n_tensors: int | None = None
    noise: list[tuple[int, int]] = field(default_factory=list)  # (position in the header, new byte)
    done: list[str] = field(default_factory=list)

    def write(self, path):
        self.image.write(path, self.n_kv, self.n_tensors)
        if self.noise:
            header_len = len(self.image.header_bytes(self.n_kv, self.n_tensors))
            with open(path, "r+b") as f:
                for pos, byte in self.noise:
                    f.seek(pos % header_len)
                    f.write(bytes([byte]))
        return path


def _mutate_kv(m: Mutant, rnd) -> None:
    kv = m.image.kvs[rnd.randrange(len(m.image.kvs))]  # an index: hypothesis records each draw's repr
    if kv.key == "tokenizer.ggml.tokens":
        return _mutate_tokens(m, rnd)
    how = rnd.choice(("value", "value", "value", "type", "remove", "duplicate"))
    if how == "remove":
        m.image.kvs.remove(kv)
    elif how == "duplicate":
        m.image.kvs.insert(rnd.randrange(len(m.image.kvs) + 1), copy.copy(kv))
    elif how == "type":
        kv.vtype = rnd.choice((UINT8, INT8, UINT32, INT32, UINT64, INT64, FLOAT32, FLOAT64, BOOL, STRING, ARRAY))
        kv.value = _edge_value(rnd, kv.vtype)
    elif kv.vtype == ARRAY:
        elem, items = kv.value
        items = list(items)
        if items and rnd.random() < 0.6:
            i = rnd.randrange(len(items))
            items[i] = (_edge_int(rnd, items[i], elem) if elem in _INT_RANGES and isinstance(items[i], int)
                        else _edge_value(rnd, elem))
        elif rnd.random() < 0.5:
            items = items[:rnd.randrange(len(items) + 1)]
        else:
            items += items[-1:] * rnd.choice((1, 2, 511))
        kv.value = (elem, items)
    elif kv.vtype in _INT_RANGES:
        kv.value = _edge_int(rnd, kv.value, kv.vtype)
    else:
        kv.value = _edge_value(rnd, kv.vtype)
    m.done.append(f"{how} of {kv.key}")


def _add_kv(m: Mutant, rnd) -> None:
    arch_kv = m.image.find("general.architecture")
    arch = arch_kv.value if arch_kv is not None and isinstance(arch_kv.value, str) else "llama"
    key = rnd.choice([f"{arch}.{k}" for k in _ARCH_KEYS] + list(_TOKENIZER_KEYS) + ["general.alignment"])
    vtype = rnd.choice((UINT32, UINT32, UINT32, INT32, FLOAT32, STRING, BOOL, ARRAY))
    m.image.set(key, vtype, _edge_value(rnd, vtype))
    m.done.append(f"set {key}")


def _mutate_tokens(m: Mutant, rnd) -> None:
    kv = m.image.find("tokenizer.ggml.tokens")
    if kv is None or kv.vtype != ARRAY:
        return
    elem, tokens = kv.value
    tokens = list(tokens)
    how = rnd.choice(("duplicate", "empty", "cut", "clear", "long"))
    if how == "duplicate" and len(tokens) > 1:
        tokens[rnd.randrange(1, len(tokens))] = tokens[0]
    elif how == "empty" and tokens:
        tokens[rnd.randrange(len(tokens))] = b""
    elif how == "cut":
        tokens = tokens[:rnd.randrange(len(tokens) + 1)]
    elif how == "clear":
        tokens = []
    elif tokens:
        tokens[rnd.randrange(len(tokens))] = b"\xff" * rnd.choice((1, 300, 70_000))
    kv.value = (elem, tokens)
    m.done.append(f"tokens: {how}")


def _mutate_tensor(m: Mutant, rnd) -> None:
    if not m.image.tensors:
        return
    t = m.image.tensors[rnd.randrange(len(m.image.tensors))]
    how = rnd.choice(("shape", "shape", "dims", "type", "remove", "rename", "offset"))
    if how == "shape" and t.shape:
        i = rnd.randrange(len(t.shape))
        t.shape[i] = max(_edge_int(rnd, t.shape[i], UINT64), 0)
    elif how == "dims":
        cut = t.shape[:rnd.randrange(len(t.shape) + 1)]
        t.shape = cut if rnd.random() < 0.5 else t.shape + [1] * rnd.choice((1, 3))
    elif how == "type":
        t.ggml_type = rnd.choice(list(_KNOWN_TYPES) + [4, 5, 31, 42, 43, 1000])
    elif how == "remove":
        m.image.tensors.remove(t)
    elif how == "rename":
        other = m.image.tensors[rnd.randrange(len(m.image.tensors))]
        t.name = rnd.choice((other.name, "blk.999.attn_q.weight", "blk.-1.ffn_up.weight", "", "x" * 63))
    else:
        t.offset = _edge_int(rnd, vtype=UINT64)
    m.done.append(f"{how} of tensor {t.name}")


def _mutate_counts(m: Mutant, rnd) -> None:
    if rnd.random() < 0.5:
        m.n_kv = max(len(m.image.kvs) + rnd.choice((-2, -1, 1, 2, 2**20, 2**40)), 0)
    else:
        m.n_tensors = max(len(m.image.tensors) + rnd.choice((-2, -1, 1, 2, 2**20, 2**40)), 0)
    m.done.append("counts")


def _mutate_bytes(m: Mutant, rnd) -> None:
    for _ in range(rnd.choice((1, 1, 2, 4, 16))):
        m.noise.append((rnd.randrange(2**31), rnd.randrange(256)))
    m.done.append("header bytes")


_MUTATIONS = ((_mutate_kv, 6), (_add_kv, 3), (_mutate_tokens, 1), (_mutate_tensor, 3), (_mutate_counts, 1),
              (_mutate_bytes, 2))


def mutate(image: Image, rnd, structured_only: bool = False) -> Mutant:
    """One to three random edits of a copy of `image` (structured ones only: no lying counts, no byte noise)."""
    m = Mutant(image.copy())
    ops = [op for op, weight in _MUTATIONS for _ in range(weight)
           if not (structured_only and op in (_mutate_counts, _mutate_bytes))]
    for _ in range(rnd.choice((1, 1, 1, 2, 3))):
        rnd.choice(ops)(m, rnd)
    return m
