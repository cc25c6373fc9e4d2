"""Synthetic target + EAGLE-3 / DFlash drafts that agree at known rates, for benchmarks (no trained draft needed).

    python benchmarks/synthetic/make_hidden_pair.py --out DIR [--preset 8b] [--scenario cycle|constant] [--fill zeros|random]
    python benchmarks/synthetic/make_hidden_pair.py --out DIR --like TARGET.gguf   (drafts only, the target's shape)

The target is a qwen3-architecture model of real shape (the preset) whose attention and FFN outputs are zero, so
it costs what a real model of that shape costs per token but computes a bigram map: logits = output . norm(embed).
Its output head is built so that the map is known:
- cycle: the next token of t is G(t), one random cycle through the whole vocabulary (no token repeats within a
  context, every drafted token is a new one);
- constant: every token is followed by the same token c (all embeddings equal).
The drafts borrow the target's embeddings and head (llama.cpp's ctx_other) and compute the same map:
- eagle3.gguf: one layer attending to its own position (keys = queries = the token's embedding, a RoPE base that
  gives every distance its own phases): accepts every token (rate 1) in both scenarios;
- dflash.gguf: the injected features project to zero and the mask token's embedding is zero, so each block row
  averages the value of `last`: every row predicts G(last). cycle: the first drafted token is accepted, no later one
  (1 per block, known); constant: whole blocks (rate 1);
- eagle3-random.gguf, dflash-random.gguf: random weights of the same shapes, with their own embeddings and head
  (rate about 0: the per-step cost).
Weights other than embeddings and heads are zeros (`--fill zeros`, fast to write, same compute) or random.
The tokenizer is llama.cpp's "test" one (ids hashed from text), sized like a real vocabulary. All F16.
Writes DIR/target.gguf, the four drafts and DIR/pair.json (shapes, the map's first tokens, the prompt used).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

# (n_embd, n_layer, n_ff, n_head, n_head_kv, head_dim, n_vocab); dflash draft layers
PRESETS = {
    "tiny": (256, 4, 512, 4, 1, 64, 4096, 2),
    "1b": (2048, 28, 6144, 16, 8, 128, 151936, 3),
    "4b": (2560, 36, 9728, 32, 8, 128, 151936, 5),
    "8b": (4096, 36, 12288, 32, 8, 128, 151936, 5),
}
MASK_ID = 3
F16 = np.float16


class Writer:
    def __init__(self, path: Path, arch: str, n_vocab: int, n_embd: int, n_layer: int, n_ff: int, n_head: int,
                 n_head_kv: int, head_dim: int, rope_base: float = 1e6, eps: float = 1e-6, n_ctx: int = 32768,
                 tokenizer: list | None = None):
        self.w = GGUFWriter(str(path.with_suffix(".partial")), arch)
        self.path, w = path, self.w
        w.add_name(path.stem)
        w.add_block_count(n_layer)
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(rope_base)
        w.add_layer_norm_rms_eps(eps)
        if tokenizer is not None:   # another file's tokenizer fields (--like): (key, GGUFValueType, value)
            for key, vtype, value in tokenizer:
                if vtype == GGUFValueType.ARRAY:
                    w.add_array(key, value)
                else:
                    w.add_key_value(key, value, vtype)
            return
        w.add_string("tokenizer.ggml.model", "test")   # llama.cpp's test vocabulary: text hashed to ids
        w.add_array("tokenizer.ggml.tokens", [f"tok_{i}" for i in range(n_vocab)])
        w.add_array("tokenizer.ggml.scores", [0.0] * n_vocab)
        w.add_array("tokenizer.ggml.token_type", [1] * n_vocab)
        w.add_bool("tokenizer.ggml.add_bos_token", False)
        w.add_bool("tokenizer.ggml.add_eos_token", False)

    def tensor(self, name: str, value: np.ndarray) -> None:
        self.w.add_tensor(name, value if value.ndim == 1 and value.dtype == np.float32 else value.astype(F16))

    def close(self) -> Path:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file(progress=False)
        self.w.close()
        self.path.with_suffix(".partial").rename(self.path)
        return self.path


def rows_normed(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-12)


def make_target(out: Path, preset, scenario: str, fill: str, rng) -> tuple[Path, np.ndarray]:
    n_embd, n_layer, n_ff, n_head, n_head_kv, head_dim, n_vocab, _ = preset
    emb = rng.standard_normal((n_vocab, n_embd), dtype=np.float32)
    if scenario == "constant":
        emb[:] = emb[0]
    emb[MASK_ID] = 0.0                         # DFlash's mask token: its embedding carries nothing
    normed = rows_normed(emb).astype(np.float32)
    scale = 8.0 / n_embd                       # the chosen successor's logit is 8, any other's about 8 / sqrt(n_embd)
    if scenario == "cycle":
        order = rng.permutation([t for t in range(n_vocab) if t != MASK_ID])
        nxt = np.full(n_vocab, order[0])
        nxt[order] = np.roll(order, -1)        # G: each token of the cycle points to the one after it
        head = np.zeros((n_vocab, n_embd), np.float32)
        head[nxt[order]] = normed[order] * scale
        head[MASK_ID] = rng.standard_normal(n_embd) * scale
    else:
        nxt = np.full(n_vocab, 5)
        head = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * (scale / np.sqrt(n_embd))
        head[5] = normed[0] * scale
    w = Writer(out, "qwen3", n_vocab, n_embd, n_layer, n_ff, n_head, n_head_kv, head_dim)
    w.tensor("token_embd.weight", emb)
    w.tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.tensor("output.weight", head)
    weights = (lambda *s: (rng.standard_normal(s, dtype=np.float32) * 0.02)) if fill == "random" else \
        (lambda *s: np.zeros(s, F16))
    q, kv = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layer):
        b = f"blk.{i}"
        for name in ("attn_norm", "ffn_norm"):
            w.tensor(f"{b}.{name}.weight", np.ones(n_embd, np.float32))
        w.tensor(f"{b}.attn_q_norm.weight", np.ones(head_dim, np.float32))
        w.tensor(f"{b}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        w.tensor(f"{b}.attn_q.weight", weights(q, n_embd))
        w.tensor(f"{b}.attn_k.weight", weights(kv, n_embd))
        w.tensor(f"{b}.attn_v.weight", weights(kv, n_embd))
        w.tensor(f"{b}.attn_output.weight", np.zeros((n_embd, q), F16))     # the bigram map: no attention output
        w.tensor(f"{b}.ffn_gate.weight", weights(n_ff, n_embd))
        w.tensor(f"{b}.ffn_up.weight", weights(n_ff, n_embd))
        w.tensor(f"{b}.ffn_down.weight", np.zeros((n_embd, n_ff), F16))     # ... and no FFN output
    return w.close(), nxt


def make_eagle3(out: Path, preset, emulate: bool, rng, tokenizer=None, fill: str = "random") -> Path:
    n_embd, n_layer, n_ff, _, _, _, n_vocab, _ = preset
    head_dim = 64
    n_head = n_embd // head_dim
    w = Writer(out, "eagle3", n_vocab, n_embd, 1, n_ff, n_head, n_head, head_dim,
               rope_base=1e-4 if emulate else 1e6, eps=1e-10 if emulate else 1e-6, tokenizer=tokenizer)
    layers = [2, n_layer // 2, n_layer - 3] if n_layer >= 6 else [0, 1, max(n_layer - 2, 1)]
    w.w.add_array("eagle3.target_layers", layers)
    w.w.add_uint32("eagle3.target_hidden_size", n_embd)
    rand = lambda *s: rng.standard_normal(s, dtype=np.float32) * (1.0 / np.sqrt(s[-1]))  # noqa: E731
    idle = rand if fill == "random" or not emulate else (lambda *s: np.zeros(s, F16))  # weights the map ignores
    if not emulate:  # its own embeddings and head: nothing in common with the target
        w.tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd), dtype=np.float32))
        w.tensor("output.weight", rand(n_vocab, n_embd))
    w.tensor("fc.weight", np.zeros((n_embd, 3 * n_embd), F16) if emulate else rand(n_embd, 3 * n_embd))
    w.tensor("output_norm.weight", np.ones(n_embd, np.float32))
    eye = np.eye(n_embd, dtype=np.float32)
    half = lambda m: np.concatenate([m, np.zeros_like(m)], axis=1)  # noqa: E731  (the embedding half of the input)
    if emulate:
        w.w.add_bool("eagle3.norm_before_residual", True)
    w.tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    w.tensor("blk.0.attn_norm_2.weight", np.full(n_embd, 0.0 if emulate else 1.0, np.float32))
    for name, factor in (("attn_q", 4.0), ("attn_k", 4.0), ("attn_v", 1.0)):
        w.tensor(f"blk.0.{name}.weight", half(eye * factor) if emulate else rand(n_embd, 2 * n_embd))
    w.tensor("blk.0.attn_output.weight", eye if emulate else rand(n_embd, n_embd))
    w.tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    w.tensor("blk.0.ffn_gate.weight", idle(n_ff, n_embd))
    w.tensor("blk.0.ffn_up.weight", idle(n_ff, n_embd))
    w.tensor("blk.0.ffn_down.weight", np.zeros((n_embd, n_ff), F16) if emulate else rand(n_embd, n_ff))
    return w.close()


def make_dflash(out: Path, preset, emulate: bool, rng, block_size: int, tokenizer=None,
                fill: str = "random") -> Path:
    n_embd, n_layer, n_ff, _, _, _, n_vocab, n_draft_layers = preset
    head_dim = 64
    n_head = n_embd // head_dim
    w = Writer(out, "dflash", n_vocab, n_embd, n_draft_layers, n_ff, n_head, n_head, head_dim,
               eps=1e-10 if emulate else 1e-6, tokenizer=tokenizer)
    taps = sorted({min(n_layer - 1, 1 + i * (n_layer - 2) // 4) for i in range(5)})
    w.w.add_array("dflash.target_layers", taps)
    w.w.add_uint32("dflash.block_size", block_size)
    w.w.add_uint32("tokenizer.ggml.mask_token_id", MASK_ID)
    rand = lambda *s: rng.standard_normal(s, dtype=np.float32) * (1.0 / np.sqrt(s[-1]))  # noqa: E731
    zeros = lambda *s: np.zeros(s, F16)  # noqa: E731
    idle = rand if fill == "random" or not emulate else zeros   # weights the map ignores (the compute is the same)
    if not emulate:  # its own embeddings (a mask token that carries something) and head
        w.tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd), dtype=np.float32))
        w.tensor("output.weight", rand(n_vocab, n_embd))
    w.tensor("fc.weight", idle(n_embd, len(taps) * n_embd))
    w.tensor("enc.output_norm.weight", np.full(n_embd, 0.0 if emulate else 1.0, np.float32))
    w.tensor("output_norm.weight", np.ones(n_embd, np.float32))
    eye = np.eye(n_embd, dtype=np.float32)
    for i in range(n_draft_layers):
        b = f"blk.{i}"
        for name in ("attn_norm", "ffn_norm"):
            w.tensor(f"{b}.{name}.weight", np.ones(n_embd, np.float32))
        w.tensor(f"{b}.attn_q_norm.weight", np.ones(head_dim, np.float32))
        w.tensor(f"{b}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        # emulate: queries 0 (uniform attention), values = the normed input; every row keeps the direction of last
        w.tensor(f"{b}.attn_q.weight", zeros(n_embd, n_embd) if emulate else rand(n_embd, n_embd))
        w.tensor(f"{b}.attn_k.weight", idle(n_embd, n_embd))
        w.tensor(f"{b}.attn_v.weight", eye if emulate else rand(n_embd, n_embd))
        w.tensor(f"{b}.attn_output.weight", eye if emulate else rand(n_embd, n_embd))
        w.tensor(f"{b}.ffn_gate.weight", idle(n_ff, n_embd))
        w.tensor(f"{b}.ffn_up.weight", idle(n_ff, n_embd))
        w.tensor(f"{b}.ffn_down.weight", zeros(n_embd, n_ff) if emulate else rand(n_embd, n_ff))
    return w.close()


def shape_of(target: Path) -> tuple[tuple, list]:
    """(a preset tuple, tokenizer fields) for drafts that fit an existing target GGUF: its width, trunk depth (MTP
    blocks excluded), FFN width and vocabulary, its tokenizer copied; 5 DFlash layers."""
    r = GGUFReader(target)
    arch = r.fields["general.architecture"].contents()
    get = lambda key, default=0: r.fields[f"{arch}.{key}"].contents() if f"{arch}.{key}" in r.fields else default  # noqa: E731
    n_ff = get("feed_forward_length")
    n_ff = max(n_ff) if isinstance(n_ff, list) else n_ff
    n_layer = get("block_count") - get("nextn_predict_layers")
    tokenizer = [(key, f.types[0], f.contents()) for key, f in r.fields.items() if key.startswith("tokenizer.")]
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    return (get("embedding_length"), n_layer, n_ff, 0, 0, 0, n_vocab, 5), tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--like", type=Path, metavar="TARGET.gguf",
                    help="write only drafts (the emulating eagle3/dflash by default) of this existing target's shape "
                         "and tokenizer; they borrow its embeddings and head. Their agreement is then unknown: for "
                         "timing with synthetic acceptance (bench_engine --synthetic-len)")
    ap.add_argument("--scenario", choices=["cycle", "constant"], default="cycle")
    ap.add_argument("--fill", choices=["zeros", "random"], default="zeros",
                    help="the target's non-output weights, and those the emulating drafts' map ignores (the compute "
                         "is the same)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drafts", default="eagle3,dflash,eagle3-random,dflash-random",
                    help="which drafts to write (comma-separated)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    preset, tokenizer = PRESETS[a.preset], None
    t0 = time.time()
    if a.like:
        try:
            preset, tokenizer = shape_of(a.like)
        except (OSError, ValueError, KeyError) as e:   # missing, not a GGUF, no shape or tokenizer keys
            ap.error(f"--like {a.like}: not a readable GGUF model with a tokenizer ({e})")
        if a.drafts == ap.get_default("drafts"):
            a.drafts = "eagle3,dflash"
        made, nxt = {"target": str(a.like)}, None
    else:
        target, nxt = make_target(a.out / "target.gguf", preset, a.scenario, a.fill, rng)
        made = {"target": str(target)}
    for name in a.drafts.split(","):
        kind, _, variant = name.partition("-")
        if kind not in ("eagle3", "dflash") or variant not in ("", "random"):
            ap.error(f"--drafts: unknown draft {name!r} (eagle3, dflash, eagle3-random, dflash-random)")
        path, emulate = a.out / f"{name}.gguf", not variant
        made[name] = str(make_eagle3(path, preset, emulate, rng, tokenizer, a.fill) if kind == "eagle3" else
                         make_dflash(path, preset, emulate, rng, a.block_size, tokenizer, a.fill))
    info = {"preset": a.preset, "shape": dict(zip(("n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim",
                                                   "n_vocab", "dflash_layers"), preset)),
            "scenario": a.scenario, "fill": a.fill, "block_size": a.block_size, "files": made,
            "next_of_first_tokens": {int(t): int(nxt[t]) for t in range(8)} if nxt is not None else None,
            "seconds": round(time.time() - t0, 1)}
    (a.out / "pair.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    sys.exit(main())
