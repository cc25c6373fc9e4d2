"""The exact greedy acceptance of a synthetic MTP file (benchmarks/synthetic/synth_mtp.py) on bench_engine's
requests, from the file's construction alone: no model is loaded. The trunk's next token is sigma(x) of the current
token, and a drafted token is accepted exactly when the token it follows is outside the set D the head mispredicts,
so an answer's acceptance is the walk x, sigma(x), sigma(sigma(x)), ... from the prompt's last token (a token outside
the cycle, as a prompt's last may be, counts as the good token whose embedding it has). The output is
the policy simulator's recorded-trace format (tests/support/policy_sim.py: `Trace`, `recorded_session`), a set each:
bench_engine's uniform requests (code, prose), the warm-up request of its +warm modes (warm) and its mixed session
(mixed, each request its share of --tokens):

    python benchmarks/probes/synth_walk.py --vocab ggml-vocab-qwen35.gguf [--preset 27b] [--agree 0.7]
        [--agree-run 1024] [--seed 0] [--tokens 128] [--per-set 2] [--out FILE.json]
    python benchmarks/probes/synth_walk.py --pair --vocab ggml-vocab-qwen2.gguf --preset 32b ...

--pair: a synthetic pair's (benchmarks/synthetic/synth_pair.py: its draft is wrong on the same kind of set D).

Give it the arguments the file was written with. It prints the tokens a pass each fixed k=1..4 makes on the
uniform requests (bench_engine --prompts code,prose --per-set N), which a run's fixed rows can be checked against.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.compare.bench_engine import CODE, MIXED, PROSE, WARM_PROMPT
from benchmarks.synthetic import synth_mtp, synth_pair


def walk(vocab: synth_mtp.Vocabulary, last: int, n: int) -> list[float]:
    """1.0 where a token drafted after the i-th token of the answer (the prompt's last is the 0th) is accepted."""
    out, x = [], last
    for _ in range(n + 1):   # a token outside G (a prompt's last, say) is its good token's embedding: source(x)
        out.append(0.0 if vocab.in_d[vocab.source[x]] else 1.0)
        x = int(vocab.sigma[x])
    return out


def fixed_steps(flags: list[float], k: int, n: int) -> tuple[int, int, int]:
    """(target passes, drafted tokens, accepted tokens) of fixed k over an answer of n tokens (a draft shortened at
    the answer's end, as the engine does)."""
    passes = drafted = accepted = done = 0
    while done < n:
        kk, run = min(k, n - done - 1), 0
        while run < kk and flags[done + run] == 1.0:
            run += 1
        passes, drafted, accepted, done = passes + 1, drafted + kk, accepted + run, done + run + 1
    return passes, drafted, accepted


def tokens_a_pass(traces: list[list[float]], k: int, n: int) -> float:
    """Fixed k's tokens a target pass over the answers."""
    return n * len(traces) / sum(fixed_steps(flags, k, n)[0] for flags in traces)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=Path, required=True, help="the vocab-only GGUF the file took its tokenizer from")
    ap.add_argument("--pair", action="store_true", help="the file is synth_pair.py's (its presets: 32b, tiny)")
    ap.add_argument("--preset", choices=sorted({*synth_mtp.PRESETS, *synth_pair.PRESETS}), default=None,
                    help="[27b; with --pair 32b]")
    synth_mtp.add_agree_args(ap, "the MTP head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not a.vocab.is_file():
        ap.error(f"--vocab: no file {a.vocab}")
    if a.tokens < 1:
        ap.error("--tokens must be at least 1")
    if not 1 <= a.per_set <= min(len(CODE), len(PROSE)):
        ap.error(f"--per-set must be 1 to {min(len(CODE), len(PROSE))} (bench_engine's prompts a set)")
    import llama_cpp

    rates = synth_mtp.agree_rates(ap, a)
    presets = synth_pair.PRESETS if a.pair else synth_mtp.PRESETS
    a.preset = a.preset or ("32b" if a.pair else "27b")
    if a.preset not in presets:
        ap.error(f"--preset: {'synth_pair' if a.pair else 'synth_mtp'}.py has {', '.join(sorted(presets))}")
    n_vocab = presets[a.preset]["n_vocab"]
    if a.pair:   # a pair pads a real vocabulary as its 32b preset does, whatever the preset (synth_pair.main)
        n_vocab = max(n_vocab, synth_pair.PRESETS["32b"]["n_vocab"])
    tokenizer = synth_mtp.Tokenizer(a.vocab, n_vocab, None)
    vocab = synth_mtp.Vocabulary(tokenizer.n_vocab, presets[a.preset]["n_embd"],
                                 rates[0] if len(rates) == 1 else rates, a.seed, tokenizer.good, run=a.agree_run)
    model = llama_cpp.Llama(str(a.vocab), vocab_only=True, verbose=False)
    requests = []
    sets = [("code", [(p, a.tokens) for p in CODE[:a.per_set]]), ("prose", [(p, a.tokens) for p in PROSE[:a.per_set]]),
            ("warm", [(WARM_PROMPT, a.tokens)]),
            ("mixed", [(p, max(int(round(share * a.tokens)), 1)) for _, p, share in MIXED])]
    for name, prompts in sets:
        for prompt, n in prompts:
            last = model.tokenize(prompt.encode(), add_bos=False, special=True)[-1]
            requests.append({"set": name, "prompt": prompt, "greedy": walk(vocab, last, n)})
    uniform = [r["greedy"] for r in requests if r["set"] in ("code", "prose")]
    print(f"{'draft' if a.pair else 'head'} agreement {vocab.agreement:.3f}; fixed k's tokens a pass on the "
          f"{len(uniform)} uniform requests: "
          + ", ".join(f"k={k} {tokens_a_pass(uniform, k, a.tokens):.2f}" for k in (1, 2, 3, 4, 5, 8)), file=sys.stderr)
    text = json.dumps({"file": vars(a) | {"vocab": a.vocab.name, "out": None}, "requests": requests})
    if a.out:
        a.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
