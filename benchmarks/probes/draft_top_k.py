"""What a draft capped at its k best tokens costs in acceptance, on a real pair: with the filters on the device, a
draft row with nothing to cut (temperature only, or min-p alone) comes back dense, a vocabulary of floats copied
out per drafted token; capped at top-k it comes back as k candidates. Rejection sampling stays exact with any draft
distribution the draft token is drawn from, so the cap changes acceptance only, and by this much.

    python benchmarks/probes/draft_top_k.py TARGET.gguf DRAFT.gguf [--temp 0.8] [--tokens 96] [--caps 16,32,64,256]
        [--prompts code,prose] [--no-repack]

The target samples each prompt's answer at the temperature (its own filters: temperature only, then llama.cpp's
defaults); at every position of it both models' rows are read and the chance a drafted token is accepted,
sum_x min(p(x), q(x)), is computed for the draft's own q and for q cut to its top k and renormalised. Prints the
mean per setting and cap, and the ratio to the uncut draft's.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.probes.pair_rows import open_pair
from llamaspec.backend import Context
from llamaspec.bench.prompts import load_prompts
from llamaspec.errors import LlamaspecError
from llamaspec.sampling import SamplerConfig, filtered_probs, sample_from

SETTINGS = {"temperature only": dict(), "top-k 40, top-p 0.95, min-p 0.05": dict(top_k=40, top_p=0.95, min_p=0.05)}


def chat(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def rows_along(target: Context, draft: Context, prompt: list[int], cfg: SamplerConfig, n: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Target and draft logits rows at each position of an answer the target samples (n rows each)."""
    p_rows, q_rows = [np.array(target.eval(prompt, logits="last")[0])], [np.array(draft.eval(prompt, logits="last")[0])]
    while len(p_rows) < n:
        token = sample_from(filtered_probs(p_rows[-1], cfg), rng)
        p_rows.append(np.array(target.eval([token], logits="last")[0]))
        q_rows.append(np.array(draft.eval([token], logits="last")[0]))
    return np.stack(p_rows), np.stack(q_rows)


def capped(q: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(q)
    best = np.argpartition(q, len(q) - k)[len(q) - k:]
    out[best] = q[best]
    return out / out.sum()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--caps", default="16,32,64,256")
    ap.add_argument("--prompts", default="code,prose")
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-repack", action="store_true")
    args = ap.parse_args(argv)
    try:
        caps = [int(c) for c in args.caps.split(",")]
        if args.temp <= 0 or args.tokens < 1 or min(caps) < 1:
            raise ValueError
    except ValueError:
        print("error: --temp must be > 0, --tokens >= 1 and --caps positive integers (16,32,64)", file=sys.stderr)
        return 2
    try:
        models, target, draft, n_vocab = open_pair(args.target, args.draft, args.no_repack, n_ctx=1024)
        prompts = [p for name in args.prompts.split(",") for p in load_prompts(name)[:args.per_set]]
        rng = np.random.default_rng(args.seed)
        print(f"# {models[0].path.name} / {models[1].path.name}, T={args.temp}, {len(prompts)} prompts x "
              f"{args.tokens} positions ({args.prompts}, {args.per_set} a set), seed {args.seed}")
        print(f"| target's filters | draft | mean chance a drafted token is accepted | / uncut draft |")
        print("|---|---|---|---|")
        for label, extra in SETTINGS.items():
            cfg = SamplerConfig(args.temp, **extra)
            sums = {None: [], **{k: [] for k in caps}}
            for prompt in prompts:
                target.clear()
                draft.clear()
                p_rows, q_rows = rows_along(target, draft, models[0].tokenize(chat(prompt)), cfg, args.tokens, rng)
                for p_row, q_row in zip(p_rows, q_rows):
                    p = filtered_probs(p_row[:n_vocab], cfg)
                    q = filtered_probs(q_row[:n_vocab], cfg)
                    sums[None].append(np.minimum(p, q).sum())
                    for k in caps:
                        sums[k].append(np.minimum(p, capped(q, k) if k < np.count_nonzero(q) else q).sum())
            base = float(np.mean(sums[None]))
            for k, values in sums.items():
                name = "uncut" if k is None else f"top-{k}"
                print(f"| {label} | {name} | {np.mean(values):.4f} | {np.mean(values) / base:.4f} |")
        return 0
    except LlamaspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
