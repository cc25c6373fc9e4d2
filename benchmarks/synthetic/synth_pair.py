"""A synthetic target and draft model (one tokenizer) whose greedy agreement is known, and may change in runs along
an answer: the draft-model counterpart of synth_mtp.py, so that a mixed session can show requests that want
different draft lengths on the draft-model path too. Writes OUT_DIR/target.gguf and OUT_DIR/draft.gguf:

    python benchmarks/synthetic/synth_pair.py OUT_DIR --preset 32b --agree 0.95,0.7,0.4,0.1 --agree-run 2048 \
        --vocab ggml-vocab-qwen2.gguf

    python benchmarks/synthetic/synth_pair.py OUT_DIR [--preset 32b|tiny] [--agree 0.7] [--agree-run N]
        [--scale S] [--seed 0] [--vocab VOCAB.gguf] [--draft-layers 2] [--draft-ff 2048]

Shapes (--preset 32b) follow Qwen2.5-32B in llama.cpp's llama architecture (no attention biases): width 5120, 64
blocks, 40 query heads and 8 KV heads of 128, FFN 27648; the draft has the same width (it shares the embeddings'
and output matrix's construction) with --draft-layers blocks of FFN --draft-ff. Every block matrix is Q4_K and zero,
the embeddings and output matrices Q8_0, so a token costs what a Q4 model of that shape costs (the 32B target about
18 GiB, the 2-block draft about 1.6 GiB with Qwen2's 152k vocabulary). `tiny` (width 256) is for a CPU smoke test.

What the weights compute (synth_mtp.py's Vocabulary, whose docstring has the details): the blocks write nothing
into the residual stream, so each model's next token follows from its embedding of the current token alone. The
target's embedding of x is e(x) and its next token sigma(x), a cycle through the good tokens G. The draft's
embedding is e(x) without the last 1/8 of the dimensions, which for a token x of the set D (1 - agree of G, drawn
per run of the greedy walk with a list of rates) leaves e(alias(x)): the draft predicts sigma(alias(x)) there, a
different token, and sigma(x) everywhere else. A drafted token is accepted (greedy) exactly when the token it follows
is not in D, so each draft position is accepted with probability ~ agree independently, and with --agree 0.95,0.1
--agree-run 2048 one answer keeps one rate for up to 2048 tokens and the next request, starting elsewhere on the
cycle, may see another. With a real vocabulary (--vocab) G is the tokens that decode to plain text (valid UTF-8 at
any temperature, so ik_llama.cpp's server answers too) and generation never ends early; the token list is then
padded to 152064 ids whatever the preset (Qwen2.5's padded size), so a `tiny` file and a `32b` file of the same
vocabulary and --seed walk the same runs: which agreement each request meets can be checked on a CPU first.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFValueType, GGUFWriter

try:
    from . import synth_mtp            # imported as benchmarks.synthetic.synth_pair (the tests)
except ImportError:
    import synth_mtp                   # run as a script: its folder is on sys.path

PRESETS = {
    "32b": dict(n_embd=5120, n_layer=64, n_ff=27648, n_head=40, n_head_kv=8, head_dim=128, n_vocab=152064),
    "tiny": dict(n_embd=256, n_layer=4, n_ff=512, n_head=2, n_head_kv=1, head_dim=128, n_vocab=4096),
}
ARCH = "llama"


def draft_shape(p: dict, n_layer: int, n_ff: int) -> dict:
    return {**p, "n_layer": n_layer, "n_ff": n_ff}


def tensor_plan(p: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape, kind) of every tensor; kind: zero (Q4_K zeros), one (F32 ones), embd, output."""
    n_embd, n_ff = p["n_embd"], p["n_ff"]
    q_dim, kv_dim = p["head_dim"] * p["n_head"], p["head_dim"] * p["n_head_kv"]
    plan = [("token_embd.weight", (n_embd, p["n_vocab"]), "embd"), ("output_norm.weight", (n_embd,), "one"),
            ("output.weight", (n_embd, p["n_vocab"]), "output")]
    for il in range(p["n_layer"]):
        blk = f"blk.{il}."
        plan += [(blk + "attn_norm.weight", (n_embd,), "one"), (blk + "attn_q.weight", (n_embd, q_dim), "zero"),
                 (blk + "attn_k.weight", (n_embd, kv_dim), "zero"), (blk + "attn_v.weight", (n_embd, kv_dim), "zero"),
                 (blk + "attn_output.weight", (q_dim, n_embd), "zero"), (blk + "ffn_norm.weight", (n_embd,), "one"),
                 (blk + "ffn_gate.weight", (n_embd, n_ff), "zero"), (blk + "ffn_up.weight", (n_embd, n_ff), "zero"),
                 (blk + "ffn_down.weight", (n_ff, n_embd), "zero")]
    return plan


def write_model(path: Path, p: dict, name: str, embeddings, output_rows, tokenizer) -> None:
    """One GGUF of shape p: `embeddings(rows)` and `output_rows(rows)` give float rows of the two matrices."""
    block, size = GGML_QUANT_SIZES[Q.Q4_K]
    w = GGUFWriter(str(path), ARCH)
    w.add_name(name)
    for key, value, vtype in [
        ("context_length", 32768, GGUFValueType.UINT32), ("embedding_length", p["n_embd"], GGUFValueType.UINT32),
        ("block_count", p["n_layer"], GGUFValueType.UINT32), ("feed_forward_length", p["n_ff"], GGUFValueType.UINT32),
        ("attention.head_count", p["n_head"], GGUFValueType.UINT32),
        ("attention.head_count_kv", p["n_head_kv"], GGUFValueType.UINT32),
        ("attention.layer_norm_rms_epsilon", 1e-6, GGUFValueType.FLOAT32),
        ("rope.dimension_count", p["head_dim"], GGUFValueType.UINT32),
        ("rope.freq_base", 1e6, GGUFValueType.FLOAT32),
    ]:
        w.add_key_value(f"{ARCH}.{key}", value, vtype)
    if tokenizer is not None:
        tokenizer.write(w)
    else:
        w.add_tokenizer_model("test")                   # llama.cpp's test vocabulary: no BOS/EOS, hashes any text
        w.add_token_list([f"tok_{i}" for i in range(p["n_vocab"])])
        w.add_token_scores([0.0] * p["n_vocab"])
        w.add_token_types([1] * p["n_vocab"])
    plan = tensor_plan(p)
    for tensor, shape, kind in plan:
        n = int(np.prod(shape))
        if kind == "zero":
            w.add_tensor_info(tensor, tuple(reversed(shape)), np.dtype(np.float32), n // block * size, Q.Q4_K)
        elif kind in ("embd", "output"):
            w.add_tensor_info(tensor, tuple(reversed(shape)), np.dtype(np.float32), n // 32 * 34, Q.Q8_0)
        else:
            w.add_tensor_info(tensor, tuple(reversed(shape)), np.dtype(np.float32), n * 4, Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    zeros = np.zeros(max(int(np.prod(s)) for _, s, k in plan if k == "zero") // block * size, dtype=np.uint8)
    for _, shape, kind in plan:
        n = int(np.prod(shape))
        if kind == "zero":
            data = zeros[:n // block * size]
        elif kind == "embd":
            data = synth_mtp.quantized_matrix(embeddings, p["n_vocab"], p["n_embd"], Q.Q8_0)
        elif kind == "output":
            data = synth_mtp.quantized_matrix(output_rows, p["n_vocab"], p["n_embd"], Q.Q8_0)
        else:
            data = np.ones(n, dtype=np.float32)
        w.write_tensor_data(data)
    w.close()


def shape_error(p: dict) -> str | None:
    """Why a shape cannot be written (a Q4_K row is whole blocks), or None."""
    block = GGML_QUANT_SIZES[Q.Q4_K][0]
    bad = sorted({shape[0] for _, shape, kind in tensor_plan(p) if kind == "zero" and shape[0] % block})
    return f"rows of {', '.join(map(str, bad))} are not a multiple of {block} (Q4_K blocks)" if bad else None


def draft_embeddings(vocab: synth_mtp.Vocabulary, rows: np.ndarray) -> np.ndarray:
    """The draft's embedding: the target's without the dimensions past n_a, which hold a D token's own part."""
    e = vocab.embeddings(rows)
    e[:, vocab.n_a:] = 0.0
    return e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    synth_mtp.add_agree_args(ap, "the draft")
    ap.add_argument("--scale", type=float, default=None,
                    help="output logit scale [default: p(top) ~ 0.75 at T=0.8 over the good tokens]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=Path, help="a vocab-only GGUF whose tokenizer both models take (byte-level BPE: "
                    "llama.cpp's models/ggml-vocab-qwen2.gguf) [default: llama.cpp's test vocabulary]")
    ap.add_argument("--draft-layers", type=int, default=2, help="the draft's blocks [2]")
    ap.add_argument("--draft-ff", type=int, default=None, help="the draft's FFN size [2048 at 32b, 256 at tiny]")
    a = ap.parse_args()
    rates = synth_mtp.agree_rates(ap, a)
    if a.draft_layers < 1:
        ap.error("--draft-layers must be at least 1")
    p = dict(PRESETS[a.preset])
    # with a real vocabulary every preset pads it as the 32b one does, so that a tiny file walks the same runs as a
    # 32b one of the same vocabulary and seed (the agreement each request sees can be checked on a CPU)
    tokenizer = synth_mtp.Tokenizer(a.vocab, max(p["n_vocab"], PRESETS["32b"]["n_vocab"]), None) \
        if a.vocab is not None else None
    if tokenizer is not None:
        p["n_vocab"] = tokenizer.n_vocab
    good = tokenizer.good if tokenizer is not None else np.arange(p["n_vocab"])
    scale = a.scale if a.scale is not None else synth_mtp.default_scale(p["n_embd"], len(good))
    d = draft_shape(p, a.draft_layers, a.draft_ff or (2048 if a.preset == "32b" else 256))
    for which, shape in (("the target", p), ("the draft (--draft-ff)", d)):
        if shape_error(shape):
            ap.error(f"{which}: {shape_error(shape)}")
    t0 = time.perf_counter()
    vocab = synth_mtp.Vocabulary(p["n_vocab"], p["n_embd"], rates[0] if len(rates) == 1 else rates, a.seed,
                                 tokenizer.good if tokenizer is not None else None, a.agree_run)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    output = lambda rows: vocab.output_rows(rows, scale)   # noqa: E731  (both models share it)
    write_model(a.out_dir / "target.gguf", p, f"synthetic {a.preset} target", vocab.embeddings, output, tokenizer)
    write_model(a.out_dir / "draft.gguf", d, f"synthetic {a.preset} draft", lambda rows: draft_embeddings(vocab, rows),
                output, tokenizer)

    # check on a few tokens that the target's argmax is sigma(x) and the draft's is sigma(x) exactly outside D
    probe = vocab.good[np.arange(0, len(vocab.good), max(1, len(vocab.good) // 64))[:64]]
    rows = np.unique(np.concatenate([vocab.sigma[probe], vocab.sigma[vocab.alias[probe]]]))
    out = output(rows)
    t_top = rows[(vocab.embeddings(probe) @ out.T).argmax(axis=1)]
    d_top = rows[(draft_embeddings(vocab, probe) @ out.T).argmax(axis=1)]
    target_ok = np.mean(t_top == vocab.sigma[probe])
    draft_ok = np.mean((d_top == vocab.sigma[probe]) == ~vocab.in_d[probe])
    sizes = ", ".join(f"{f.name} {f.stat().st_size / 2**30:.2f} GiB" for f in (a.out_dir / "target.gguf",
                                                                            a.out_dir / "draft.gguf"))
    checks = (f"of {len(probe)} probed tokens the target's argmax is sigma(x) for {100 * target_ok:.0f}% and the draft "
              f"agrees exactly outside D for {100 * draft_ok:.0f}%")
    print(f"wrote {a.out_dir} ({sizes}; {a.preset}, draft {d['n_layer']} blocks of FFN {d['n_ff']}) in "
          f"{time.perf_counter() - t0:.0f} s: {synth_mtp.agreement_said('draft', vocab, a, rates)}; {checks} "
          f"(scale {scale})", file=sys.stderr)


if __name__ == "__main__":
    main()
