"""Synthetic qwen35 GGUFs (the Qwen3.5 / 3.6 hybrid: Gated DeltaNet layers, attention every fourth) of real size,
with a real Qwen tokenizer, built so that the draft's agreement with the target is known. For timing speculative
decoding on hybrids: the text they write is noise.

    python benchmarks/synthetic/synth_hybrid.py OUT_DIR --preset 27b [--vocab ggml-vocab-qwen35.gguf] [--qtype Q4_0]
        [--draft-layers 2] [--output-noise 0.05] [--logit-scale 10]

writes OUT_DIR/qwen35-PRESET-target.gguf and OUT_DIR/qwen35-PRESET-draft.gguf, and with --output-noise X also
OUT_DIR/qwen35-PRESET-draft-noise<X>.gguf.

How the agreement is known: every block's output projection is zero (`ssm_out` of the Gated DeltaNet layers,
`attn_output` of the attention layers, `ffn_down` of the FFNs). Each block still does all of its work, so the cost
is real: the recurrent state is updated, the attention reads its KV cache, the FFN multiplies, but none of it
reaches the residual stream. The logits are output(norm(embedding(current token))): the next token depends only on
the current one. A draft that shares the target's embedding and output matrices (same seeds) then agrees on every
token; noise on the draft's output matrix (X times the weights' scale) makes it disagree on some. output_norm is
--logit-scale, which makes the logits peaked enough that rounding does not move the argmax.

Shapes of the 27b preset, from Qwen3.5-27B's config.json (Qwen3.6-27B has the same text model): hidden 5120, 64
layers (48 Gated DeltaNet + 16 attention: full_attention_interval 4), FFN 17408, attention 24 query heads (doubled
for the output gate) and 4 KV heads of 256, rope over 64 dims with sections [11, 11, 10], linear attention 16 key
heads and 48 value heads of 128, conv kernel 4, vocabulary 248,320. The tokenizer file has 151,936 tokens; the rest
are padded as unused tokens so the embedding and output matrices have their real size. No MTP layer. About 26.9B
parameters; Q4_0 is about 15 GB. The draft has the target's width (it shares its embedding and output matrices)
and --draft-layers blocks (full_attention_interval 2: one Gated DeltaNet block, one attention block, ...).
The `tiny` preset (256 wide, 4 layers) writes a few MB in seconds, for a CPU smoke test.

Layer weights are tiled from 256 random rows per tensor and shared by all layers (the values do not change the
cost), so the 27b files are written in minutes; the embedding and output matrices are fully random.
"""
from __future__ import annotations

import argparse
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as Q
from gguf.quants import quantize


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ssm_k_heads: int      # ssm.group_count
    ssm_v_heads: int      # ssm.time_step_rank
    ssm_head_dim: int     # ssm.state_size (key and value heads have the same size in llama.cpp's qwen35)
    conv_kernel: int = 4
    n_vocab: int = 0      # 0: the tokenizer's own size
    rope_sections: tuple = (11, 11, 10, 0)
    rope_dims: int = 64


PRESETS = {
    "27b": Shape(5120, 64, 17408, 24, 4, 256, 16, 48, 128, n_vocab=248320),
    "9b": Shape(4096, 32, 12288, 16, 4, 256, 16, 32, 128, n_vocab=248320),
    "tiny": Shape(256, 4, 512, 2, 2, 128, 2, 2, 128),
}
QTYPES = ("Q4_0", "Q8_0")


def default_vocab() -> Path | None:
    """ggml-vocab-qwen35.gguf from $LLAMASPEC_VOCAB_DIR or the llama.cpp source benchmarks/build-llama-tools.sh
    unpacks (vendor/llama.cpp/models of the llama-cpp-python sdist)."""
    roots = [Path(os.environ["LLAMASPEC_VOCAB_DIR"])] if os.environ.get("LLAMASPEC_VOCAB_DIR") else []
    src = Path.home() / ".cache" / "llamaspec" / "llama-tools" / "src"
    roots += sorted(src.glob("*/vendor/llama.cpp/models")) if src.is_dir() else []
    for root in roots:
        for name in ("ggml-vocab-qwen35.gguf", "ggml-vocab-qwen2.gguf"):
            if (root / name).is_file():
                return root / name
    return None


def tokenizer_fields(vocab_path: Path, n_vocab: int) -> tuple[list, int]:
    """(key, value type, value) of the tokenizer's fields, its token list padded to n_vocab with unused tokens."""
    reader = GGUFReader(vocab_path)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    if n_vocab > len(tokens):
        pad = n_vocab - len(tokens)
        tokens += [f"<|synthetic_pad_{i}|>" for i in range(pad)]
        types += [int(gguf.TokenType.UNUSED)] * pad
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.tokens":
            out.append((key, "array", tokens))
        elif key == "tokenizer.ggml.token_type":
            out.append((key, "array", types))
        else:
            vt = field.types[0]
            kind = {gguf.GGUFValueType.ARRAY: "array", gguf.GGUFValueType.STRING: "string",
                    gguf.GGUFValueType.BOOL: "bool"}.get(vt, "uint32")
            out.append((key, kind, field.contents()))
    return out, len(tokens)


class Weights:
    """Quantized weight tensors: tiled from 256 random rows (layers), fully random (embedding and output), zero."""

    def __init__(self, qtype: Q):
        self.qtype = qtype
        self._cache: dict[tuple, np.ndarray] = {}

    def tiled(self, name: str, rows: int, cols: int, scale: float = 0.02) -> tuple[np.ndarray, Q]:
        key = ("tiled", name, rows, cols)
        if key not in self._cache:
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            block = quantize(rng.standard_normal((min(rows, 256), cols), dtype=np.float32) * scale, self.qtype)
            self._cache[key] = np.ascontiguousarray(np.tile(block, (-(-rows // block.shape[0]), 1))[:rows])
        return self._cache[key], self.qtype

    def zeros(self, rows: int, cols: int) -> tuple[np.ndarray, Q]:
        key = ("zeros", rows, cols)
        if key not in self._cache:
            self._cache[key] = quantize(np.zeros((rows, cols), np.float32), self.qtype)
        return self._cache[key], self.qtype

    def full(self, seed: int, rows: int, cols: int, noise: float = 0.0, noise_seed: int = 0) -> tuple[np.ndarray, Q]:
        """Every row random (N(0, 0.02)); `noise` adds N(0, 0.02 * noise) drawn from `noise_seed`."""
        key = ("full", seed, rows, cols, noise, noise_seed)
        if key not in self._cache:
            rng, noise_rng, slabs = np.random.default_rng(seed), np.random.default_rng(noise_seed), []
            for r0 in range(0, rows, 8192):  # in slabs, to bound the float32 memory
                x = rng.standard_normal((min(8192, rows - r0), cols), dtype=np.float32) * 0.02
                if noise:
                    x += noise_rng.standard_normal(x.shape, dtype=np.float32) * (0.02 * noise)
                slabs.append(quantize(x, self.qtype))
            self._cache[key] = np.concatenate(slabs)
        return self._cache[key], self.qtype


def f32(values) -> tuple[np.ndarray, Q]:
    return np.ascontiguousarray(values, dtype=np.float32), Q.F32


def write_model(path: Path, shape: Shape, n_layer: int, attention_every: int, tokenizer: list, n_vocab: int,
                weights: Weights, logit_scale: float, output_noise: float, name: str) -> None:
    s = shape
    key_dim, value_dim = s.ssm_head_dim * s.ssm_k_heads, s.ssm_head_dim * s.ssm_v_heads
    conv_dim = 2 * key_dim + value_dim
    w = GGUFWriter(str(path), "qwen35")
    w.add_name(name)
    arch = "qwen35"
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.context_length", 262144)
    w.add_uint32(f"{arch}.embedding_length", s.n_embd)
    w.add_uint32(f"{arch}.feed_forward_length", s.n_ff)
    w.add_uint32(f"{arch}.attention.head_count", s.n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", s.n_head_kv)
    w.add_uint32(f"{arch}.attention.key_length", s.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", s.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{arch}.rope.dimension_count", s.rope_dims)
    w.add_array(f"{arch}.rope.dimension_sections", list(s.rope_sections))
    w.add_float32(f"{arch}.rope.freq_base", 1e7)
    w.add_uint32(f"{arch}.ssm.conv_kernel", s.conv_kernel)
    w.add_uint32(f"{arch}.ssm.inner_size", value_dim)
    w.add_uint32(f"{arch}.ssm.state_size", s.ssm_head_dim)
    w.add_uint32(f"{arch}.ssm.time_step_rank", s.ssm_v_heads)
    w.add_uint32(f"{arch}.ssm.group_count", s.ssm_k_heads)
    w.add_uint32(f"{arch}.full_attention_interval", attention_every)
    for key, kind, value in tokenizer:
        {"array": w.add_array, "string": w.add_string, "bool": w.add_bool}.get(
            kind, lambda k, v: w.add_uint32(k, int(v)))(key, value)

    def put(tensor_name, tensor):
        data, qtype = tensor
        if qtype == Q.F32:
            w.add_tensor(tensor_name, data)
        else:
            w.add_tensor(tensor_name, data, raw_dtype=qtype)  # data: the quantized bytes, one row per output row

    # shared by target and drafts (fixed seeds): embedding and output decide the next token alone
    put("token_embd.weight", weights.full(11, n_vocab, s.n_embd))
    put("output_norm.weight", f32(np.full(s.n_embd, logit_scale)))
    put("output.weight", weights.full(12, n_vocab, s.n_embd, output_noise, noise_seed=13))
    ones = f32(np.ones(s.n_embd))
    for i in range(n_layer):
        blk = f"blk.{i}."
        put(blk + "attn_norm.weight", ones)
        put(blk + "post_attention_norm.weight", ones)
        if (i + 1) % attention_every:  # Gated DeltaNet block; its output projection is zero
            put(blk + "attn_qkv.weight", weights.tiled("qkv", conv_dim, s.n_embd))
            put(blk + "attn_gate.weight", weights.tiled("gate", value_dim, s.n_embd))
            conv = np.random.default_rng(3).standard_normal((conv_dim, s.conv_kernel)) * 0.1
            put(blk + "ssm_conv1d.weight", f32(conv))
            put(blk + "ssm_dt.bias", f32(np.zeros(s.ssm_v_heads)))
            put(blk + "ssm_a", f32(-np.ones(s.ssm_v_heads)))  # A = -exp(A_log) < 0: the state decays
            put(blk + "ssm_beta.weight", weights.tiled("beta", s.ssm_v_heads, s.n_embd))
            put(blk + "ssm_alpha.weight", weights.tiled("alpha", s.ssm_v_heads, s.n_embd))
            put(blk + "ssm_norm.weight", f32(np.ones(s.ssm_head_dim)))
            put(blk + "ssm_out.weight", weights.zeros(s.n_embd, value_dim))
        else:  # attention block (query doubled: llama.cpp's qwen35 gates the output with its second half)
            put(blk + "attn_q.weight", weights.tiled("q", 2 * s.n_head * s.head_dim, s.n_embd))
            put(blk + "attn_k.weight", weights.tiled("k", s.n_head_kv * s.head_dim, s.n_embd))
            put(blk + "attn_v.weight", weights.tiled("v", s.n_head_kv * s.head_dim, s.n_embd))
            put(blk + "attn_q_norm.weight", f32(np.ones(s.head_dim)))
            put(blk + "attn_k_norm.weight", f32(np.ones(s.head_dim)))
            put(blk + "attn_output.weight", weights.zeros(s.n_embd, s.n_head * s.head_dim))
        put(blk + "ffn_gate.weight", weights.tiled("ffn_gate", s.n_ff, s.n_embd))
        put(blk + "ffn_up.weight", weights.tiled("ffn_up", s.n_ff, s.n_embd))
        put(blk + "ffn_down.weight", weights.zeros(s.n_embd, s.n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--preset", default="27b", choices=sorted(PRESETS))
    ap.add_argument("--vocab", type=Path, help="a vocab-only GGUF with the Qwen tokenizer [default: "
                    "ggml-vocab-qwen35.gguf of the llama.cpp source build-llama-tools.sh unpacked]")
    ap.add_argument("--qtype", default="Q4_0", choices=QTYPES)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--output-noise", type=float, default=0.0,
                    help="also write a draft whose output matrix has this much noise (x the weights' scale)")
    ap.add_argument("--logit-scale", type=float, default=10.0)
    ap.add_argument("--n-layer", type=int, help="the target's layers instead of the preset's (a quick shape check)")
    ap.add_argument("--no-target", action="store_true", help="write only the draft(s)")
    a = ap.parse_args()
    vocab = a.vocab or default_vocab()
    if vocab is None or not vocab.is_file():
        sys.exit("error: no Qwen vocab GGUF found: pass --vocab (llama.cpp's models/ggml-vocab-qwen35.gguf)")
    if a.draft_layers < 2 or a.output_noise < 0 or (a.n_layer is not None and a.n_layer < 4):
        sys.exit("error: --draft-layers must be >= 2 (one Gated DeltaNet and one attention block), --n-layer >= 4 "
                 "and --output-noise >= 0")
    shape = PRESETS[a.preset]
    a.out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, n_vocab = tokenizer_fields(vocab, shape.n_vocab)
    weights = Weights(Q[a.qtype])
    stem = a.out_dir / f"qwen35-{a.preset}"
    common = dict(shape=shape, tokenizer=tokenizer, n_vocab=n_vocab, weights=weights, logit_scale=a.logit_scale)
    if not a.no_target:
        write_model(Path(f"{stem}-target.gguf"), n_layer=a.n_layer or shape.n_layer, attention_every=4,
                    output_noise=0.0, name=f"synthetic-qwen35-{a.preset}", **common)
    write_model(Path(f"{stem}-draft.gguf"), n_layer=a.draft_layers, attention_every=2, output_noise=0.0,
                name=f"synthetic-qwen35-{a.preset}-draft", **common)
    if a.output_noise:
        write_model(Path(f"{stem}-draft-noise{a.output_noise:g}.gguf"), n_layer=a.draft_layers, attention_every=2,
                    output_noise=a.output_noise, name=f"synthetic-qwen35-{a.preset}-draft-noise", **common)


if __name__ == "__main__":
    main()
