"""Profile the speculative step with cProfile: where the Python time goes besides llama.cpp's own work.

    python benchmarks/probes/profile_step.py --target T.gguf (--draft D.gguf | --drafter mtp) [--policy fixed --k 4]
        [-n 256] [--temp 0] [--top-k 40 --top-p 0.95 --min-p 0.05] [--repeat 3]

Prints the generation's split (time inside llama_decode and the logits/argmax sync vs everything else), where the
sampling filters ran (on the device or in numpy), and the functions with the most time of their own.
`llama_decode` and the sync show up as ctypes calls; everything else is llamaspec's Python. --repeat runs the
measured generation several times (the same seed) without the profiler and prints each one's Python ms per step
(the profiler's own cost per call would count as Python's), then profiles one more run and prints its table.
The pair is loaded with the policy and --k as its drafting settings, so a hybrid target keeps one recurrent-state
snapshot per token of the longest draft (as a user's load with that draft length does); `--policy auto` without
--k drafts as far as a user's default load lets it.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import pstats

from llamaspec import load_pair


def _count(least: int):
    def integer(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text}")
        return value
    return integer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", help="draft GGUF (or --drafter)")
    ap.add_argument("--drafter", help="a drafter instead of a draft model: mtp (the target's head), lookup, "
                                      "lookup+mtp, eagle3, dflash (as load_pair's drafter)")
    ap.add_argument("--policy", default="fixed")
    ap.add_argument("--k", type=_count(0), default=None, help="draft length (fixed: 4 if not given)")
    ap.add_argument("-n", type=_count(1), default=256)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repeat", type=_count(0), default=1)
    ap.add_argument("--prompt", default="def quicksort(arr):")
    ap.add_argument("-ngl", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--top", type=_count(1), default=15)
    ap.add_argument("--split", action="store_true",
                    help="one more run with every llama.cpp call outside the timed decode timed by name")
    a = ap.parse_args()
    if not a.draft and not a.drafter:
        ap.error("give --draft or --drafter")
    if a.k is None and a.policy == "fixed":
        a.k = 4
    drafting = {name: value for name, value in (("drafter", a.drafter), ("draft_max", a.k)) if value is not None}
    pair = load_pair(a.target, a.draft, policy=a.policy, n_ctx=2048, n_gpu_layers=a.ngl, n_threads=a.threads,
                     no_repack=a.no_repack, **drafting)
    print(f"{pair.drafter_kind} drafter, {a.policy} policy, longest draft {pair.policy.draft_max}")
    sampler = dict(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=1)
    pair.generate(a.prompt, max_tokens=16, **sampler)  # warm-up
    where = "greedy" if not a.temp else \
        f"filters {'on the device' if getattr(pair.target_ctx, 'device_sampler', False) else 'in numpy'}"
    # The shares are measured without the profiler (its own cost per Python call would count as Python's); one
    # more run, the same, is profiled for the table.
    shares = []
    for run in range(a.repeat + 1):
        profiled = run == a.repeat
        pair.reset()
        prof = cProfile.Profile() if profiled else None
        if prof:
            prof.enable()
        c = pair.generate(a.prompt, max_tokens=a.n, **sampler)
        if prof:
            prof.disable()
        s = c.stats
        steps = max(s.target_passes, 1)
        print(f"{'profiled: ' if profiled else ''}{s.summary()}\nwall {s.time_total:.3f} s, in llama.cpp "
              f"(decode + sync) {s.time_in_decode:.3f} s, rolling caches back {s.time_rollback:.3f} s, Python "
              f"{100 * s.python_overhead:.1f}% = {s.python_ms_per_step:.3f} ms per step over {steps} steps "
              f"({where}{', with the profiler' if profiled else ''})")
        if not profiled:
            shares.append((s.python_overhead, s.python_ms_per_step))
    if shares:
        share, ms = sorted(shares)[len(shares) // 2]
        print(f"median of {len(shares)} runs without the profiler: Python {100 * share:.1f}% = {ms:.3f} ms per step")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())
    if a.split:
        split_run(pair, a, sampler)


# llama_decode and the sync after it are the decode time itself (decode_seconds); everything else llamaspec asks of
# llama.cpp during a step is host time that counts as Python's
_DECODE_CALLS = {"llama_decode", "llama_process", "llama_synchronize", "llama_get_logits", "llama_get_logits_ith"}


def split_run(pair, a, sampler) -> None:
    """Time every llama.cpp function called outside the decode (each wrapped in a timer: about a microsecond of
    its own per call, which this run's Python share includes; a call within a timed decode, such as the read that
    is its sync, is decode time and not counted) and print, per step, what each took."""
    import time

    import llama_cpp

    from llamaspec.backend.context import Context

    totals: dict[str, list] = {}
    inside = [0]   # > 0 within a timed decode: a call there (a read that is the decode's sync) is decode time

    def timed(name, fn):
        def call(*args):
            if inside[0]:
                return fn(*args)
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                entry = totals.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - t0
        return call

    from llamaspec.backend import device_sampling

    patched = [(llama_cpp, name, fn) for name, fn in vars(llama_cpp).items()
               if name.startswith("llama_") and name not in _DECODE_CALLS and isinstance(fn, ctypes._CFuncPtr)]
    # the row reads that call llama.cpp through prototypes of their own (an address, not a pointer object)
    patched += [(device_sampling, name, getattr(device_sampling, name)) for name in ("_probs_address",
                "_candidates_address") if getattr(device_sampling, name, None) is not None]
    timed_decode = Context._timed_decode

    def decode_span(self, *args, **kwargs):
        inside[0] += 1
        try:
            return timed_decode(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    patched.append((Context, "_timed_decode", timed_decode))
    pair.reset()
    for module, name, fn in patched:
        setattr(module, name, decode_span if name == "_timed_decode" else timed(name, fn))
    try:
        c = pair.generate(a.prompt, max_tokens=a.n, **sampler)
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
    s = c.stats
    steps = max(s.target_passes, 1)
    host = s.python_ms_per_step
    api = 1000 * sum(t for _, t in totals.values()) / steps
    print(f"split: {s.summary()}\nPython {host:.3f} ms per step over {steps} steps (rolling caches back "
          f"{1000 * s.time_rollback / steps:.3f} ms apart); llama.cpp calls outside the decode {api:.3f} ms (the "
          "prefill's and the rollback's included), each wrapped in a timer:")
    for name, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"  {name:44s} {n / steps:7.2f} calls  {1e6 * t / steps:8.1f} us per step  {1e6 * t / n:6.2f} us/call")


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
