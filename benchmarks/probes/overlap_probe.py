"""Can the draft and the target decode at the same time on this machine? The question behind overlapping the next
draft with the current verification (two llama.cpp contexts; ctypes releases the GIL inside llama_decode).

    python benchmarks/probes/overlap_probe.py --target T.gguf --draft D.gguf [--k 5] [-ngl -1] [--flash-attn on]

It times, with the caches holding --context tokens: the target verifying k+1 tokens (one batch, all logits), the
draft proposing k tokens one at a time, and both together in two threads. Overlap can only pay where "together"
is clearly below "verify + draft"; its best case saves min(verify, draft) per step, and only on steps where the
whole draft is accepted (the next draft was started from the assumption that it would be).
"""
from __future__ import annotations

import argparse
import threading
import time

from llamaspec.backend import Context, Model
from llamaspec.config import ModelConfig


def load(path: str, a) -> Context:
    m = Model(path, ModelConfig(n_gpu_layers=a.ngl, no_repack=a.no_repack))
    c = Context(m, ModelConfig(n_ctx=a.context + 128, n_batch=64, flash_attn=a.flash_attn))
    c.eval([500 + i % 1000 for i in range(a.context)], logits="none")
    return c


def verify(target: Context, k: int) -> None:
    base = target.n_past
    target.eval([1000 + i for i in range(k + 1)], logits="all")
    target.keep(base)


def draft(ctx: Context, k: int) -> None:
    base = ctx.n_past
    for i in range(k):
        ctx.eval([2000 + i], logits="last")
    ctx.keep(base)


def together(target: Context, ctx: Context, k: int) -> None:
    t = threading.Thread(target=draft, args=(ctx, k))
    t.start()
    verify(target, k)
    t.join()


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--k", default="3,5,8")
    ap.add_argument("-ngl", type=int, default=-1)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--flash-attn", default="auto")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    target, dctx = load(a.target, a), load(a.draft, a)
    for _ in range(3):
        together(target, dctx, 3)
    print(f"target {a.target}\ndraft {a.draft}\ncontext {a.context} tokens, median of {a.reps}")
    print("| k | verify k+1 (ms) | draft k (ms) | sum | together (ms) | saved / best case |")
    print("|---|---|---|---|---|---|")
    for k in (int(x) for x in a.k.split(",")):
        tv = median_ms(lambda: verify(target, k), a.reps)
        td = median_ms(lambda: draft(dctx, k), a.reps)
        tb = median_ms(lambda: together(target, dctx, k), a.reps)
        saved = tv + td - tb
        print(f"| {k} | {tv:.2f} | {td:.2f} | {tv + td:.2f} | {tb:.2f} | {saved:.2f} ms = "
              f"{100 * saved / min(tv, td):.0f}% of {min(tv, td):.2f} |")


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
