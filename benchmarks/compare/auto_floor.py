"""`auto` against plain decoding, interleaved prompt by prompt on one loaded pair: wall time and time to first token.

    python benchmarks/compare/auto_floor.py --target T.gguf --draft D.gguf [--no-repack] [--prompts code,prose]
        [--per-set 3] [--tokens 64] [--rounds 2] [--temps 0,0.8] [--out report.md] [--json report.json]

The pair is loaded once. Plain decoding is that pair with FixedPolicy(0) (nothing drafted, the draft never
prefilled); `auto` is one AutoPolicy kept for the whole run, across prompts, temperatures and rounds, as the server
and `llamaspec chat` keep theirs: its first request is measured like any other. Before every generation both caches
are cleared, so each generation processes its whole prompt and the times to first token compare. Within a round the
order alternates per prompt (plain then auto, auto then plain) so that a change of machine load falls on both.
Ratios are per prompt (auto / plain, seconds per generated token including the prompt, and time to first token);
the report gives their median with the spread, and the ratio of the totals.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from llamaspec import load_pair
from llamaspec.bench import auto_state, prepare_prompts
from llamaspec.bench.prompts import PROMPT_SETS
from llamaspec.backend import default_threads, library_version
from llamaspec.policy import FixedPolicy, make_policy
from llamaspec.sysinfo import hardware_line


def generate(pair, policy, prompt: list[int], tokens: int, temperature: float, seed: int) -> dict:
    pair.set_policy(policy)
    pair.reset()
    draft_before = pair.draft_ctx.decode_seconds
    c = pair.generate(list(prompt), max_tokens=tokens, temperature=temperature, seed=seed)
    s = c.stats
    return {"wall": s.time_total, "ttft": s.time_to_first_token, "prefill": s.time_prefill,
            "tokens": s.tokens_generated, "drafted": s.drafted, "accepted": s.accepted, "passes": s.target_passes,
            "draft_decode": pair.draft_ctx.decode_seconds - draft_before, "output": c.tokens}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("-ngl", type=int, default=-1)
    ap.add_argument("--prompts", default="code,prose", help="built-in sets, comma-separated")
    ap.add_argument("--per-set", type=int, default=3, help="prompts taken from each set")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    try:
        texts = [p for name in a.prompts.split(",") for p in PROMPT_SETS[name][:a.per_set]]
        temps = [float(t) for t in a.temps.split(",")]
    except (KeyError, ValueError) as e:
        ap.error(f"--prompts takes {', '.join(PROMPT_SETS)}; --temps numbers ({e})")

    load_before = os.getloadavg()
    pair = load_pair(a.target, a.draft, n_ctx=2048, n_threads=a.threads, no_repack=a.no_repack, n_gpu_layers=a.ngl)
    prompts = prepare_prompts(pair, texts)
    generate(pair, FixedPolicy(2), prompts[0], 8, 0.0, 0)   # page both models in (not measured)
    generate(pair, FixedPolicy(0), prompts[0], 8, 0.0, 0)
    plain, auto = FixedPolicy(0), make_policy("auto")
    records = []
    t_start = time.time()
    for rnd in range(a.rounds):
        for temperature in temps:
            for i, prompt in enumerate(prompts):
                order = [("plain", plain), ("auto", auto)]
                if (i + rnd) % 2:
                    order.reverse()
                for mode, policy in order:
                    r = generate(pair, policy, prompt, a.tokens, temperature, seed=1000 * rnd + i)
                    records.append({"round": rnd, "temperature": temperature, "prompt": i, "mode": mode, **r})
                    print(f"round {rnd} T={temperature} prompt {i} {mode}: {r['wall']:.2f} s, "
                          f"ttft {r['ttft']:.3f} s, drafted {r['drafted']}, draft decode {r['draft_decode']:.3f} s",
                          file=sys.stderr)
    elapsed = time.time() - t_start
    load_after = os.getloadavg()

    lines = ["# auto against plain decoding, interleaved prompt by prompt", "",
             f"- command: `{shlex.join(['python', *sys.argv])}`",
             f"- target: {Path(a.target).name}; draft: {Path(a.draft).name}",
             f"- hardware: {hardware_line(a.threads)}; llama-cpp-python {library_version()}; "
             f"no_repack={a.no_repack}",
             f"- load average (1, 5, 15 min) before {', '.join(f'{x:.1f}' for x in load_before)}, after "
             f"{', '.join(f'{x:.1f}' for x in load_after)} ({os.cpu_count()} logical CPUs)",
             f"- {len(prompts)} chat prompts ({a.prompts}, {a.per_set} each), {a.tokens} new tokens, {a.rounds} "
             f"rounds x temperatures {a.temps}, plain and auto alternating per prompt; {elapsed:.0f} s; "
             f"date {time.strftime('%Y-%m-%d %H:%M')}",
             f"- auto's cost model at the end: {auto_state(auto)}", "",
             "| temperature | round | plain s/reply | auto s/reply | total auto/plain | per-prompt time/token "
             "auto/plain: median [min-max] | TTFT plain s | TTFT auto s | TTFT auto/plain: median [min-max] | "
             "auto drafted | auto's draft-model decode s | greedy outputs equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    for temperature in temps:
        for rnd in [*range(a.rounds), None]:
            sel = [r for r in records if r["temperature"] == temperature and (rnd is None or r["round"] == rnd)]
            pairs = {}
            for r in sel:
                pairs.setdefault((r["round"], r["prompt"]), {})[r["mode"]] = r
            p = [v["plain"] for v in pairs.values()]
            q = [v["auto"] for v in pairs.values()]
            time_ratio = [(y["wall"] / y["tokens"]) / (x["wall"] / x["tokens"]) for x, y in zip(p, q)]
            ttft_ratio = [y["ttft"] / x["ttft"] for x, y in zip(p, q)]
            total = sum(y["wall"] for y in q) / sum(x["wall"] for x in p)
            same = (f"{sum(x['output'] == y['output'] for x, y in zip(p, q))}/{len(p)}" if temperature == 0
                    else "-")
            label = "all" if rnd is None else str(rnd + 1)
            lines.append(f"| {temperature:g} | {label} | {statistics.median(x['wall'] for x in p):.2f} | "
                         f"{statistics.median(y['wall'] for y in q):.2f} | {total:.3f} | {spread(time_ratio)} | "
                         f"{statistics.median(x['ttft'] for x in p):.3f} | "
                         f"{statistics.median(y['ttft'] for y in q):.3f} | {spread(ttft_ratio)} | "
                         f"{sum(y['drafted'] for y in q)} | {sum(y['draft_decode'] for y in q):.2f} | {same} |")
            summary.append({"temperature": temperature, "round": label, "total_ratio": total,
                            "time_ratio_median": statistics.median(time_ratio),
                            "ttft_ratio_median": statistics.median(ttft_ratio),
                            "auto_drafted": sum(y["drafted"] for y in q)})
    report = "\n".join(lines)
    print(report)
    if a.out:
        a.out.write_text(report + "\n")
    if a.json:
        for r in records:
            r.pop("output")
        a.json.write_text(json.dumps({"summary": summary, "records": records}, indent=2))


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()
