"""Profile the speculative step with cProfile: where the Python time goes besides llama.cpp's own work.

    python benchmarks/profile_step.py --target T.gguf --draft D.gguf [--policy fixed --k 4] [-n 256] [--temp 0]

Prints the generation's split (time inside llama_decode and the logits/argmax sync vs everything else) and the
functions with the most time of their own. `llama_decode` and the sync show up as ctypes calls; everything else
is llamaspec's Python.
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
    ap.add_argument("--prompt", default="def quicksort(arr):")
    ap.add_argument("-ngl", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    pair = load_pair(a.target, a.draft, n_ctx=2048, n_gpu_layers=a.ngl, n_threads=a.threads, no_repack=a.no_repack)
    pair.set_policy(make_policy(a.policy, k=a.k))
    pair.generate(a.prompt, max_tokens=16, temperature=a.temp, seed=1)  # warm-up
    pair.reset()
    prof = cProfile.Profile()
    prof.enable()
    c = pair.generate(a.prompt, max_tokens=a.n, temperature=a.temp, seed=1)
    prof.disable()
    s = c.stats
    steps = max(s.target_passes, 1)
    print(f"{s.summary()}\nwall {s.time_total:.3f} s, in llama.cpp (decode + sync) {s.time_in_decode:.3f} s, "
          f"Python {100 * s.python_overhead:.1f}% = {1000 * (s.time_total - s.time_in_decode - s.time_prefill) / steps:.3f} "
          f"ms per step over {steps} steps")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
