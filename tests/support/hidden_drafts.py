"""Tiny EAGLE-3 and DFlash drafts for a given target GGUF, written by the tests, and targets they can agree with.

The tensor lists are those of llama.cpp's `src/models/eagle3.cpp` and `src/models/dflash.cpp` (load_arch_tensors);
shapes below are numpy's (the reverse of ggml's ne). A draft copies the target's tokenizer, so the pair check's
vocabulary rule holds; by default it has neither `token_embd` nor `output` and borrows the target's through
llama.cpp's ctx_other, as the published drafts do. Random weights are stdev * N(0, 1) from one seed, F32.

Random drafts almost never agree with a random target. For tests of the accepting paths:
- `make_bigram_target` scales a test-llama-archs model's attention and FFN outputs by `alpha`: at alpha 0 the next
  token depends on the current one only (logits = output . norm(embedding)), small alpha adds some context;
- `emulate=True` builds a draft that computes exactly that bigram map with the target's own embeddings and head:
  EAGLE-3 by attending (almost) only to its own position, whose token is the one to continue; DFlash by a uniform
  attention in which only `last` carries a value (the mask token's embedding is zero), so every block row predicts
  the token after `last` (row 1 is right, later rows only where the map has a fixed point).
`noise` multiplies the draft's output norm by (1 + noise * N(0, 1)): an emulating draft that agrees less.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGUFWriter

from .gguf_factory import _copy_tokenizer
from llamaspec.gguf.edit import read_gguf, write_gguf
from llamaspec.gguf.reader import read_model_info


def _f32(contents, name: str) -> np.ndarray:
    t = contents.tensor(name)
    return np.frombuffer(t.data.tobytes(), np.float32).reshape(tuple(reversed(t.shape)))


def bigram_map(target_path) -> np.ndarray:
    """next[t] = the argmax token after t of a bigram target (alpha 0), from its weights."""
    c = read_gguf(target_path)
    e, w, out = _f32(c, "token_embd.weight"), _f32(c, "output_norm.weight"), _f32(c, "output.weight")
    h = e / np.sqrt((e.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    return (h @ out.T).argmax(axis=1)


def make_bigram_target(path, base_path, alpha: float = 0.0) -> tuple[Path, int]:
    """The base model with every block's attention and FFN output scaled by alpha, and the embedding of one token
    the bigram map never produces zeroed (a DFlash mask token). Returns (path, mask token id)."""
    c = read_gguf(base_path)
    nxt = bigram_map(base_path)
    mask = int(next(t for t in range(len(nxt) - 1, -1, -1) if t not in set(nxt.tolist())))
    tensors = []
    for t in c.tensors:
        if t.name == "token_embd.weight" or t.name.endswith((".attn_output.weight", ".ffn_down.weight")):
            values = _f32(c, t.name).copy()
            if t.name == "token_embd.weight":
                values[mask] = 0.0
            else:
                values *= alpha
            t = type(t)(t.name, t.shape, t.ggml_type, values.reshape(-1).view(np.uint8))
        tensors.append(t)
    # gguf's writer refuses empty arrays (test-llama-archs writes a few: merges, classifier labels)
    fields = {k: f for k, f in c.fields.items() if not (isinstance(f.value, (list, tuple)) and not f.value)}
    write_gguf(type(c)(c.path, fields, tuple(tensors), c.alignment), path)
    return Path(path), mask


def _writer(path: Path, arch: str, target, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
            head_dim: int, n_ff: int, rope_base: float = 10000.0, eps: float = 1e-5) -> tuple[GGUFWriter, int]:
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(n_layer)
    writer.add_context_length(target.n_ctx_train or 4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(eps)
    n_vocab = _copy_tokenizer(writer, target.path)
    return writer, n_vocab


def _finish(writer: GGUFWriter, tmp: Path, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    tmp.rename(path)
    return path


def _output_norm(target_path, noise: float, rng) -> np.ndarray:
    w = _f32(read_gguf(target_path), "output_norm.weight").copy()
    return (w * (1.0 + noise * rng.standard_normal(w.shape))).astype(np.float32) if noise else w


def make_eagle3_draft(path: str | os.PathLike, target_path: str | os.PathLike, *, seed: int = 0,
                      stdev: float = 0.5, target_layers: Sequence[int] = (0, 1, 1), n_head: int = 4,
                      n_head_kv: int = 1, head_dim: int = 64, n_ff: int = 384, own_embd: bool = False,
                      own_output: bool = False, d2t: Sequence[int] | None = None,
                      target_hidden_size: int | None = None, emulate: bool = False, noise: float = 0.0) -> Path:
    """An EAGLE-3 draft (one decoder layer over [embedding, fused features]) for the target at target_path.

    `d2t` (draft row -> target token id) gives a reduced draft vocabulary and needs `own_output`. `emulate`: the
    bigram map of a `make_bigram_target` target (see the module docstring).
    """
    path, target = Path(path), read_model_info(target_path, keep_all=True)
    n_embd = target.n_embd
    if emulate:   # one head per 64 dims, keys = queries = 4 * the normed embedding: attention stays on itself
        n_head = n_head_kv = n_embd // head_dim
    tmp = path.with_suffix(".partial")
    # emulate: a small RoPE base gives every relative position its own phases (no key looks like one's own)
    writer, n_vocab = _writer(tmp, "eagle3", target, 1, n_embd, n_head, n_head_kv, head_dim, n_ff,
                              rope_base=1e-4 if emulate else 10000.0, eps=1e-10 if emulate else 1e-5)
    writer.add_array("eagle3.target_layers", [int(x) for x in target_layers])
    writer.add_uint32("eagle3.target_hidden_size", target_hidden_size or target.n_embd)
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * (stdev * scale)).astype(np.float32)

    def select(rows, factor):   # [factor * I | 0]: the embedding half of concat(norm(embedding), norm(g))
        return np.concatenate([np.eye(rows, n_embd, dtype=np.float32) * factor,
                               np.zeros((rows, n_embd), np.float32)], axis=1)

    n_inp = len(target_layers) * target.n_embd
    writer.add_tensor("fc.weight", normal(n_embd, n_inp, scale=1 / np.sqrt(len(target_layers))))
    writer.add_tensor("output_norm.weight", _output_norm(target_path, noise, rng) if emulate
                      else np.ones(n_embd, np.float32))
    n_draft_vocab = len(d2t) if d2t is not None else n_vocab
    if own_output:
        writer.add_tensor("output.weight", normal(n_draft_vocab, n_embd))
    if d2t is not None:
        writer.add_tensor("d2t", np.asarray(d2t, dtype=np.int64))
    if own_embd:
        writer.add_tensor("token_embd.weight", normal(n_vocab, n_embd))
    blk, q, kv = "blk.0", n_head * head_dim, n_head_kv * head_dim
    if emulate:
        writer.add_bool("eagle3.norm_before_residual", True)   # the residual is norm(g) * attn_norm_2 = 0
    writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(n_embd, np.float32))
    writer.add_tensor(f"{blk}.attn_norm_2.weight", np.full(n_embd, 0.0 if emulate else 1.0, np.float32))
    writer.add_tensor(f"{blk}.attn_q.weight", select(q, 4.0) if emulate else normal(q, 2 * n_embd, scale=0.25))
    writer.add_tensor(f"{blk}.attn_k.weight", select(kv, 4.0) if emulate else normal(kv, 2 * n_embd, scale=0.25))
    writer.add_tensor(f"{blk}.attn_v.weight", select(kv, 1.0) if emulate else normal(kv, 2 * n_embd, scale=0.25))
    writer.add_tensor(f"{blk}.attn_output.weight", np.eye(n_embd, q, dtype=np.float32) if emulate
                      else normal(n_embd, q, scale=0.25))
    writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(n_embd, np.float32))
    writer.add_tensor(f"{blk}.ffn_gate.weight", normal(n_ff, n_embd, scale=0.25))
    writer.add_tensor(f"{blk}.ffn_up.weight", normal(n_ff, n_embd, scale=0.25))
    writer.add_tensor(f"{blk}.ffn_down.weight", normal(n_embd, n_ff, scale=0.0 if emulate else 0.25))
    return _finish(writer, tmp, path)


def make_dflash_draft(path: str | os.PathLike, target_path: str | os.PathLike, *, seed: int = 0,
                      stdev: float = 0.5, target_layers: Sequence[int] = (1, 1), block_size: int = 8,
                      mask_token_id: int | None = 3, n_layer: int = 1, n_head: int = 4, n_head_kv: int = 1,
                      head_dim: int = 64, n_ff: int = 384, own_embd: bool = False, own_output: bool = False,
                      n_embd: int | None = None, emulate: bool = False, noise: float = 0.0) -> Path:
    """A DFlash draft (n_layer blocks whose KV cache holds the target's fused features) for the target.
    `emulate`: every block row predicts the bigram successor of `last` (needs the target's mask token embedding
    to be zero, as make_bigram_target makes it)."""
    path, target = Path(path), read_model_info(target_path, keep_all=True)
    n_embd = n_embd or target.n_embd   # llama.cpp sizes the features by the draft's width: it must be the target's
    if emulate:
        n_head = n_head_kv = n_embd // head_dim
        n_layer = 1
    tmp = path.with_suffix(".partial")
    writer, n_vocab = _writer(tmp, "dflash", target, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff,
                              eps=1e-10 if emulate else 1e-5)
    writer.add_array("dflash.target_layers", [int(x) for x in target_layers])
    writer.add_uint32("dflash.block_size", block_size)
    if mask_token_id is not None:
        writer.add_uint32("tokenizer.ggml.mask_token_id", mask_token_id)
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * (stdev * scale)).astype(np.float32)

    if own_embd:
        writer.add_tensor("token_embd.weight", normal(n_vocab, n_embd))
    if own_output:
        writer.add_tensor("output.weight", normal(n_vocab, n_embd))
    writer.add_tensor("fc.weight", normal(n_embd, len(target_layers) * n_embd, scale=1 / np.sqrt(len(target_layers))))
    # emulate: injected features project to zero, so the cached context carries no keys and no values
    writer.add_tensor("enc.output_norm.weight", np.full(n_embd, 0.0 if emulate else 1.0, np.float32))
    writer.add_tensor("output_norm.weight", _output_norm(target_path, noise, rng) if emulate
                      else np.ones(n_embd, np.float32))
    q, kv = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layer):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(n_embd, np.float32))
        writer.add_tensor(f"{blk}.attn_q.weight", normal(q, n_embd, scale=0.25))
        writer.add_tensor(f"{blk}.attn_k.weight", normal(kv, n_embd, scale=0.25))
        writer.add_tensor(f"{blk}.attn_v.weight", np.eye(kv, n_embd, dtype=np.float32) if emulate
                          else normal(kv, n_embd, scale=0.25))
        writer.add_tensor(f"{blk}.attn_output.weight", np.eye(n_embd, q, dtype=np.float32) if emulate
                          else normal(n_embd, q, scale=0.25))
        writer.add_tensor(f"{blk}.attn_q_norm.weight", np.ones(head_dim, np.float32))
        writer.add_tensor(f"{blk}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(n_embd, np.float32))
        writer.add_tensor(f"{blk}.ffn_gate.weight", normal(n_ff, n_embd, scale=0.25))
        writer.add_tensor(f"{blk}.ffn_up.weight", normal(n_ff, n_embd, scale=0.25))
        writer.add_tensor(f"{blk}.ffn_down.weight", normal(n_embd, n_ff, scale=0.0 if emulate else 0.25))
    return _finish(writer, tmp, path)
