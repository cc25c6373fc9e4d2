"""Per-row cost of building the filtered distribution in Python, on real logits rows: the plain rule
(`filtered_probs` + `sample_from`, the hot path before `filter_logits`) against `filter_logits` + `sample`.

    python benchmarks/probes/sampling_rows.py MODEL.gguf [--rows 40] [--temp 0.8] [--no-repack]

Rows come from the model sampling a short chat reply at the given temperature. For each setting it prints the
median over single calls (rows x 5) of: a target row (filter only; the rejection rule then reads p(x)) and a
draft row (filter and draw one token). The device path has no such cost (llama.cpp filters in the graph);
profile_step.py measures it.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from llamaspec.backend import Context, Model
from llamaspec.config import ModelConfig
from llamaspec.sampling import SamplerConfig, filter_logits, filtered_probs, sample, sample_from

SETTINGS = [dict(), dict(top_k=40), dict(top_p=0.95), dict(min_p=0.05), dict(top_k=40, top_p=0.95),
            dict(top_k=40, top_p=0.95, min_p=0.05)]


def logits_rows(path: str, n_rows: int, temperature: float, no_repack: bool, threads: int | None) -> np.ndarray:
    options = ModelConfig(no_repack=no_repack, n_ctx=512, n_threads=threads)
    model = Model(path, options)
    ctx = Context(model, options)
    prompt = model.tokenize("<|im_start|>user\nWrite a Python function that parses a CSV file and prints the mean "
                            "of a column.<|im_end|>\n<|im_start|>assistant\n")
    rng = np.random.default_rng(0)
    rows = [np.array(ctx.eval(prompt, logits="last")[0])]
    while len(rows) < n_rows:
        token = sample_from(filtered_probs(rows[-1], SamplerConfig(temperature)), rng)
        rows.append(np.array(ctx.eval([token], logits="last")[0]))
    ctx.close()
    model.close()
    return np.stack(rows)


def median_ms(fn, rows: np.ndarray, repeat: int = 5) -> float:
    """The median of single calls (robust to the process being descheduled on a shared machine)."""
    times = []
    for row in rows:
        fn(row)  # warm
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn(row)
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true")
    a = ap.parse_args()
    rows = logits_rows(a.model, a.rows, a.temp, a.no_repack, a.threads)
    scratch = np.empty(rows.shape[1], dtype=np.float32)
    rng = np.random.default_rng(1)
    print(f"{len(rows)} rows of {rows.shape[1]} logits, temperature {a.temp}; median ms per row\n")
    print("| setting | target row: plain rule | target row: filter_logits | draft row: plain rule | "
          "draft row: filter_logits |")
    print("|---|---|---|---|---|")
    for extra in SETTINGS:
        cfg = SamplerConfig(a.temp, **extra)
        old_target = median_ms(lambda r: filtered_probs(r, cfg, out=scratch), rows)
        new_target = median_ms(lambda r: filter_logits(r, cfg, scratch).prob(0), rows)
        old_draft = median_ms(lambda r: sample_from(filtered_probs(r, cfg, out=scratch), rng), rows)
        new_draft = median_ms(lambda r: sample(filter_logits(r, cfg, scratch), rng), rows)
        name = ", ".join(f"{k} {v}" for k, v in extra.items()) or "temperature only"
        print(f"| {name} | {old_target:.3f} | {new_target:.3f} | {old_draft:.3f} | {new_draft:.3f} |")


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()
