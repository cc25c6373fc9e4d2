"""Where plain decoding loses time against llama-bench's tg128: the same one-token loop, one setting changed at a time.

    python benchmarks/probes/plain_gap.py --target T.gguf [--draft D.gguf | --drafter mtp] [--tokens 128] [--reps 3]

Rows (tok/s, median of --reps runs of --tokens tokens from an empty cache, one model load):
- bare: llama.cpp's C API from Python, llama-bench's loop (decode one token, synchronise; no sampling);
- bare, n_rs_seq=K (each of --rs): the same with recurrent-state snapshots for rollback (hybrids: what a speculating target gets);
- Context: llamaspec's context (its logits row as a numpy view, argmax on the host);
- Context, device argmax: llama.cpp's backend sampler takes the argmax (the greedy path);
- Context, device argmax, n_rs_seq=K;
- Pair target only / Pair with the drafter, fixed k=0: the whole engine, as `bench_engine.py`'s plain mode runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

from llamaspec import load_pair   # before numpy: see the note in benchmarks/results (numpy first crashed a CUDA load)

import numpy as np  # noqa: E402,I001
from llamaspec.backend.context import Context
from llamaspec.backend.model import Model  # noqa: F401  (the type the loops take)
from llamaspec.backend.native import default_threads, llama_cpp
from llamaspec.config import ModelConfig
from llamaspec.errors import LlamaspecError
from llamaspec.policy import make_policy


def bare(model: Model, n_ctx: int, n_rs_seq: int, tokens: int, reps: int, n_batch: int = 512,
         outputs_all: bool = False) -> float:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, n_batch, 1
    if outputs_all and hasattr(params, "n_outputs_max_per_seq"):
        params.n_outputs_max_per_seq = 0   # as Context sets it (device argmax of every verified row)
    params.no_perf = True
    params.n_threads = params.n_threads_batch = default_threads()   # llama-bench's -t default, as Context uses
    if hasattr(params, "n_rs_seq"):
        params.n_rs_seq = n_rs_seq
    ctx = llama_cpp.llama_init_from_model(model._ptr, params)
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    batch.n_tokens, batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 1, 0, 1
    mem = llama_cpp.llama_get_memory(ctx)
    rng = np.random.default_rng(0)
    rates = []
    try:
        for rep in range(reps + 1):   # the first is a warm-up
            llama_cpp.llama_memory_clear(mem, True)
            ids = rng.integers(0, model.n_vocab, tokens)
            t0 = time.perf_counter()
            for i in range(tokens):
                batch.token[0], batch.pos[0] = int(ids[i]), i
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                llama_cpp.llama_synchronize(ctx)
            if rep:
                rates.append(tokens / (time.perf_counter() - t0))
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return statistics.median(rates)


def context_loop(model: Model, n_ctx: int, n_rs_seq: int, device_argmax: bool, tokens: int, reps: int) -> float:
    ctx = Context(model, ModelConfig(n_ctx=n_ctx, n_rs_seq=n_rs_seq))
    ctx.set_device_argmax(device_argmax)
    rates = []
    try:
        for rep in range(reps + 1):
            ctx.clear()
            token = 0
            t0 = time.perf_counter()
            for _ in range(tokens):
                token = ctx.eval_argmax([token])[0]
            if rep:
                rates.append(tokens / (time.perf_counter() - t0))
    finally:
        ctx.close()
    return statistics.median(rates)


def pair_loop(pair, tokens: int, reps: int) -> float:
    pair.set_policy(make_policy("fixed", draft_max=0))
    rates = []
    for rep in range(reps + 1):
        pair.reset()
        c = pair.generate([1, 2, 3, 4], max_tokens=tokens, temperature=0.0)
        if rep:
            rates.append(c.stats.tokens_per_second)
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--drafter", help="mtp: the target's own head")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--rs", default="3,4,12", help="n_rs_seq values for the snapshot rows (comma-separated; the "
                    "Context row takes the first)")
    a = ap.parse_args()
    try:
        rs = [int(v) for v in a.rs.split(",")]
    except ValueError:
        ap.error(f"--rs: comma-separated integers, got {a.rs!r}")
    try:
        rows = measure(a, rs)
    except LlamaspecError as e:   # a missing or damaged file, a drafter the model cannot serve: one line
        ap.error(str(e))
    base = rows[0][1]
    print(f"target {a.target}; {a.tokens} tokens x {a.reps} (median), context {a.n_ctx}")
    print("| loop | tok/s | vs bare |\n|---|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:.2f} | {rate / base:.3f}x |")


def measure(a, rs: list[int]) -> list[tuple[str, float]]:
    rows = []
    with load_pair(a.target, None, n_ctx=a.n_ctx) as pair:   # the product's load path (devices, checks)
        model = pair.target
        hybrid = model.is_hybrid or model.is_recurrent
        rows.append(("bare (llama-bench's loop)", bare(model, a.n_ctx, 0, a.tokens, a.reps)))
        if hybrid:
            for n in rs:
                rows.append((f"bare, n_rs_seq={n}", bare(model, a.n_ctx, n, a.tokens, a.reps)))
        nb = pair.target_ctx.options.n_batch
        rows.append((f"bare, n_batch=n_ubatch={nb} (Context's)", bare(model, a.n_ctx, 0, a.tokens, a.reps, nb)))
        rows.append(("bare, n_outputs_max_per_seq=0 (Context's)",
                     bare(model, a.n_ctx, 0, a.tokens, a.reps, outputs_all=True)))
        rows.append(("Context, host argmax", context_loop(model, a.n_ctx, 0, False, a.tokens, a.reps)))
        rows.append(("Context, device argmax", context_loop(model, a.n_ctx, 0, True, a.tokens, a.reps)))
        if hybrid:
            rows.append((f"Context, device argmax, n_rs_seq={rs[0]}",
                         context_loop(model, a.n_ctx, rs[0], True, a.tokens, a.reps)))
        rows.append(("Pair, target only", pair_loop(pair, a.tokens, a.reps)))
    if a.draft or a.drafter:
        with load_pair(a.target, a.draft, drafter=a.drafter or "model", n_ctx=a.n_ctx) as pair:
            rows.append((f"Pair with {a.drafter or 'draft model'} (n_rs_seq {pair.target_ctx.options.n_rs_seq}), "
                         "fixed k=0", pair_loop(pair, a.tokens, a.reps)))
    return rows


if __name__ == "__main__":
    main()
