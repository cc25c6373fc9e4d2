"""Record a real pair's acceptance along its target's answers, for the policy simulator to replay
(tests/support/policy_sim.py: `Trace`, `recorded_session`).

    python benchmarks/probes/record_acceptance.py TARGET.gguf DRAFT.gguf --out FILE.json [--temp 0.8]
        [--tokens 128] [--no-repack]

The requests are bench_engine's: its mixed session (code completion, prose, a copy-heavy edit, a short answer, a
long answer; --tokens scaled by each one's share) and its uniform sets (code, prose; two prompts each, --tokens).
For each request:
- greedy: the target's answer, and at each of its positions 1 where the draft's argmax (given the target's text
  before it) is the target's token, else 0. A draft model that agrees at positions i..i+j-1 proposes exactly
  those tokens in one draft from i, so a policy replays exactly on it, at any draft length.
- sampled (temperature only): an answer the target samples, and at each position sum_x min(p(x), q(x)), the chance
  that a token drafted there is accepted (given the text before it); a replay draws each position by its chance.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.compare.bench_engine import CODE, MIXED, PROSE
from benchmarks.probes.pair_rows import open_pair
from llamaspec.backend import Context
from llamaspec.errors import LlamaspecError
from llamaspec.sampling import SamplerConfig, filtered_probs, sample_from


def along(target: Context, draft: Context, eog, prompt: list[int], n: int, pick) -> list:
    """Both models over the prompt, then n positions of the target's answer: pick(p_logits, q_logits) gives the
    token to go on with and the value recorded at this position."""
    target.clear()
    draft.clear()
    p, q = target.eval(prompt, logits="last")[0], draft.eval(prompt, logits="last")[0]
    values = []
    for _ in range(n):
        token, value = pick(p, q)
        values.append(value)
        if eog(token):
            break
        p, q = target.eval([token], logits="last")[0], draft.eval([token], logits="last")[0]
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-repack", action="store_true")
    args = ap.parse_args(argv)
    if args.temp <= 0 or args.tokens < 1:
        print("error: --temp must be > 0 and --tokens >= 1", file=sys.stderr)
        return 2
    if not args.out.parent.is_dir():
        print(f"error: --out {args.out}: no such folder {args.out.parent}", file=sys.stderr)
        return 2
    try:
        models, target, draft, n_vocab = open_pair(args.target, args.draft, args.no_repack, n_ctx=2048)
        cfg, rng = SamplerConfig(args.temp), np.random.default_rng(args.seed)

        def greedy(p, q):
            token = int(np.argmax(p[:n_vocab]))
            return token, int(int(np.argmax(q[:n_vocab])) == token)

        def sampled(p, q):
            pp, qq = filtered_probs(p[:n_vocab], cfg), filtered_probs(q[:n_vocab], cfg)
            return sample_from(pp, rng), round(float(np.minimum(pp, qq).sum()), 3)

        requests = [("mixed", kind, prompt, max(int(round(share * args.tokens)), 1))
                    for kind, prompt, share in MIXED]
        requests += [(name, name, prompt, args.tokens) for name, prompts in (("code", CODE), ("prose", PROSE))
                     for prompt in prompts[:2]]
        head = {"target": models[0].path.name, "draft": models[1].path.name, "temperature": args.temp,
                "seed": args.seed}
        lines = []
        for set_name, kind, prompt, n in requests:
            tokens = models[0].tokenize(prompt)
            agree = along(target, draft, models[0].is_eog, tokens, n, greedy)
            chances = along(target, draft, models[0].is_eog, tokens, n, sampled)
            lines.append(json.dumps({"set": set_name, "kind": kind, "tokens": n, "greedy": "".join(map(str, agree)),
                                     "sampled": chances}))
            print(f"{set_name} / {kind}: greedy agreement {np.mean(agree):.2f} over {len(agree)}, sampled "
                  f"acceptance chance {np.mean(chances):.2f} over {len(chances)}", flush=True)
        body = json.dumps(head)[:-1] + ',\n "requests": [\n  ' + ",\n  ".join(lines) + "\n ]}\n"
        args.out.write_text(body)   # a request a line
        return 0
    except LlamaspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
