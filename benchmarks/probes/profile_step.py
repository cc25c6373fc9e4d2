"""Profile the speculative step with cProfile: where the Python time goes besides llama.cpp's own work.

    python benchmarks/probes/profile_step.py --target T.gguf --draft D.gguf [--policy fixed --k 4] [-n 256] [--temp 0]
        [--top-k 40 --top-p 0.95 --min-p 0.05] [--repeat 3]

Prints the generation's split (time inside llama_decode and the logits/argmax sync vs everything else), where the
sampling filters ran (on the device or in numpy), and the functions with the most time of their own.
`llama_decode` and the sync show up as ctypes calls; everything else is llamaspec's Python. --repeat runs the
measured generation several times (the same seed) and prints each one's Python ms per step, then the profile of
the last.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from llamaspec import load_pair
from llamaspec.policy import make_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--policy", default="fixed")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--prompt", default="def quicksort(arr):")
    ap.add_argument("-ngl", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    pair = load_pair(a.target, a.draft, n_ctx=2048, n_gpu_layers=a.ngl, n_threads=a.threads, no_repack=a.no_repack)
    pair.set_policy(make_policy(a.policy, draft_max=a.k))
    sampler = dict(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=1)
    pair.generate(a.prompt, max_tokens=16, **sampler)  # warm-up
    for _ in range(a.repeat):
        pair.reset()
        prof = cProfile.Profile()
        prof.enable()
        c = pair.generate(a.prompt, max_tokens=a.n, **sampler)
        prof.disable()
        s = c.stats
        steps = max(s.target_passes, 1)
        where = "greedy" if not a.temp else \
            f"filters {'on the device' if getattr(pair.target_ctx, 'device_sampler', False) else 'in numpy'}"
        print(f"{s.summary()}\nwall {s.time_total:.3f} s, in llama.cpp (decode + sync) {s.time_in_decode:.3f} s, "
              f"Python {100 * s.python_overhead:.1f}% = "
              f"{1000 * (s.time_total - s.time_in_decode - s.time_prefill) / steps:.3f} ms per step over {steps} "
              f"steps ({where})")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
