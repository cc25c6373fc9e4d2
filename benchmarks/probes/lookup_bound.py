"""How fast can prompt-lookup drafting be on this machine? An upper bound from measured costs.

    python benchmarks/probes/lookup_bound.py --target T.gguf [--prompts grounded,prose] [-n 160] [--no-repack]

Greedy output does not depend on the drafter, so each prompt is decoded once plainly and every drafting step is
then replayed offline: at each position the lookup drafter (llamaspec's own, PromptLookupDrafter.lookup) proposes
up to k tokens from the text so far, the agreeing prefix with the real output is kept, plus the target's token.
With the measured cost of verifying n tokens in one pass, v(n) = t(n) / t(1), the projected speed-up is
tokens / sum(v(drafted + 1)); a lookup costs nothing next to a target pass. The perfect draft (always right, k
tokens every pass) bounds every drafter: (k + 1) / v(k + 1).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from llamaspec import load_pair
from llamaspec.bench import prepare_prompts
from llamaspec.drafters import PromptLookupDrafter
from llamaspec.bench.prompts import PROMPT_SETS
from llamaspec.sysinfo import hardware_line


def verify_curve(ctx, n_max: int, reps: int) -> dict[int, float]:
    ctx.eval([500 + i for i in range(128)], logits="none")

    def median(n):
        times = []
        for _ in range(reps):
            base = ctx.n_past
            t0 = time.perf_counter()
            ctx.eval([1000 + i for i in range(n)], logits="all")
            times.append(time.perf_counter() - t0)
            ctx.keep(base)
        return sorted(times)[len(times) // 2]

    median(1)
    t1 = median(1)
    return {n: median(n) / t1 for n in range(1, n_max + 1)}


def replay(prompt: list[int], output: list[int], k: int, drafter: PromptLookupDrafter, v: dict[int, float]):
    ctx, i, cost, passes, drafted, accepted = list(prompt), 0, 0.0, 0, 0, 0
    while i < len(output):
        d = drafter.lookup(np.asarray(ctx, dtype=np.int64), k)[:k] if k else []
        a = 0
        while a < len(d) and i + a < len(output) and d[a] == output[i + a]:
            a += 1
        step = min(a + 1, len(output) - i)
        ctx.extend(output[i:i + step])
        i += step
        cost, passes, drafted, accepted = cost + v[len(d) + 1], passes + 1, drafted + len(d), accepted + a
    return len(output), cost, passes, drafted, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", default="grounded,prose")
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true")
    a = ap.parse_args()

    pair = load_pair(a.target, n_ctx=2048, n_threads=a.threads, no_repack=a.no_repack)
    print(f"target: {a.target}\nhardware: {hardware_line(a.threads)}; no_repack={a.no_repack}")
    v = verify_curve(pair.target_ctx, a.k_max + 1, a.reps)
    pair.reset()
    print("v(n) = verify(n)/verify(1): " + ", ".join(f"{n}:{x:.2f}" for n, x in v.items()))
    bound = {k: (k + 1) / v[k + 1] for k in range(1, a.k_max + 1)}
    best = max(bound, key=bound.get)
    print(f"perfect draft (every token right): best k={best}: {bound[best]:.2f}x; " +
          ", ".join(f"k={k}: {x:.2f}x" for k, x in bound.items()))
    drafter = PromptLookupDrafter()
    for name in a.prompts.split(","):
        runs = []
        for toks in prepare_prompts(pair, PROMPT_SETS[name]):
            pair.reset()
            runs.append((toks, [p.token for p in pair.stream(toks, max_tokens=a.n) if p.token is not None]))
        print(f"\n## {name}: {len(runs)} prompts, {sum(len(o) for _, o in runs)} greedy tokens, lookup n-grams "
              f"{drafter.ngram_min}..{drafter.ngram_max}\n")
        print("| k | tokens/pass | drafted/pass | acceptance | projected speed-up |")
        print("|---|---|---|---|---|")
        for k in range(1, a.k_max + 1):
            tot = np.sum([replay(p, o, k, drafter, v) for p, o in runs], axis=0)
            tokens, cost, passes, drafted, accepted = tot
            print(f"| {k} | {tokens / passes:.2f} | {drafted / passes:.2f} | {accepted / max(drafted, 1):.0%} | "
                  f"{tokens / cost:.2f}x |")


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
