"""Measure the costs the speed-up formula needs, on this machine: the target's time to verify n tokens (one pass,
logits for every row) for n = 1..N, relative to one token, and the draft's time per token relative to the target's.

    python benchmarks/probes/cost_curve.py --target T.gguf --draft D.gguf [-ngl -1] [--no-repack] [--json out.json]

Then, with per-token acceptance a, the expected speed-up of draft length k is
(1 - a^(k+1)) / ((1 - a) (k c + v(k+1))), c = draft/target time per token, v(n) = verify(n) / verify(1).
"""
from __future__ import annotations

import argparse
import json
import time

from llamaspec.backend import Context, Model
from llamaspec.config import ModelConfig


def median_time(ctx: Context, n: int, reps: int, logits: str) -> float:
    times = []
    for _ in range(reps):
        base = ctx.n_past
        t0 = time.perf_counter()
        ctx.eval([1000 + i for i in range(n)], logits=logits)
        times.append(time.perf_counter() - t0)
        ctx.keep(base)
    return sorted(times)[len(times) // 2]


def speedup(a: float, k: int, c: float, v: dict[int, float]) -> float:
    tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    return tokens / (k * c + v[k + 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("-ngl", type=int, default=-1)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--flash-attn", default="auto")
    ap.add_argument("--max-n", type=int, default=17)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache when measuring")
    ap.add_argument("--acceptance", default="0.5,0.7,0.8,0.9", help="acceptance rates for the projection table")
    ap.add_argument("--json")
    a = ap.parse_args()

    def load(path):
        m = Model(path, ModelConfig(n_gpu_layers=a.ngl, no_repack=a.no_repack))
        c = Context(m, ModelConfig(n_ctx=a.context + 64, n_batch=64, flash_attn=a.flash_attn))
        c.eval([500 + i % 1000 for i in range(a.context)], logits="none")
        return c

    target, draft = load(a.target), load(a.draft)
    median_time(target, 1, 3, "all")
    median_time(draft, 1, 3, "last")
    t1 = median_time(target, 1, a.reps, "all")
    verify = {n: median_time(target, n, a.reps, "all") / t1 for n in range(1, a.max_n + 1)}
    c = median_time(draft, 1, a.reps * 3, "last") / t1
    print(f"target one token: {1000 * t1:.2f} ms; draft/target cost c = {c:.3f}")
    print("v(n) = verify(n)/verify(1): " + ", ".join(f"{n}:{v:.2f}" for n, v in verify.items()))
    print("projected speed-up (fixed k), by acceptance:")
    for acc in (float(x) for x in a.acceptance.split(",")):
        best = max(range(1, a.max_n), key=lambda k: speedup(acc, k, c, verify))
        row = ", ".join(f"k={k}: {speedup(acc, k, c, verify):.2f}x" for k in (1, 2, 3, 5, 8) if k < a.max_n)
        print(f"  a={acc:.2f}: {row}; best k={best}: {speedup(acc, best, c, verify):.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"target_ms": 1000 * t1, "c": c, "v": verify}, f, indent=1)


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
