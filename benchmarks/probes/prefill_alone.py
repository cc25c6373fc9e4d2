"""A long prompt alone: its prefill on the pair's own context (one slot) and in a two-slot shared engine, and, with
a draft model, how much of the prompt the draft holds when drafting begins.

    python benchmarks/probes/prefill_alone.py --model T.gguf [--draft D.gguf] [--tokens 4000] [--repeats 2]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from llamaspec import load_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    package = Path(__file__).resolve().parents[2] / "llamaspec"
    source = "".join(p.read_text() for p in sorted(package.glob("*.py")))
    with load_pair(args.model, args.draft, n_ctx=8192, n_batch=512, no_repack=True, n_threads=args.threads,
                   cache_ram=0, policy="fixed", draft_max=3) as pair:
        tokens = pair.tokenize(source)[:args.tokens]
        engines = {"one slot": pair.engine(1), "--parallel 2": pair.engine(2, 16384)}
        for repeat in range(args.repeats):
            for name, engine in engines.items():
                prompt = [(tokens[0] + repeat + 1) % 1000] + tokens[1:]   # nothing reused from the last run
                slot = engine.submit(prompt, max_tokens=1 if args.draft is None else 16)
                for _ in engine.pieces(slot):
                    pass
                stats = slot.stats
                line = (f"{name}, run {repeat + 1}: {len(prompt)} tokens, prefill {stats.time_prefill:.2f} s "
                        f"({(len(prompt) - 1) / stats.time_prefill:.0f} tok/s)")
                if args.draft is not None:
                    held = slot.draft.seq.n_past if slot.draft is not None else pair.draft_ctx.n_past
                    line += f"; the draft holds {held} tokens, {stats.accepted} of {stats.drafted} drafts accepted"
                print(line, flush=True)


if __name__ == "__main__":
    main()
