"""Engine benchmark: plain decoding, every draft policy, and llama.cpp's own llama-speculative-simple, on the same
prompts and files in one run. Prints a markdown report (also written to --out) with ratios against plain decoding.

    python benchmarks/bench_engine.py --target T.gguf --draft D.gguf [--tools DIR] [--no-repack] [--tokens 128]
    python benchmarks/bench_engine.py --target T-with-MTP.gguf --drafter mtp [--tools DIR] ...

--tools is the folder holding llama-speculative-simple (benchmarks/build-llama-tools.sh prints it). Greedy and
T=0.8 are both measured (--temps). --top-k/--top-p/--min-p apply to both engines: llama.cpp gets them explicitly,
with temperature first in its chain as in llamaspec (its own defaults, top-k 40, top-p 0.95, min-p 0.05 with
temperature last, would otherwise apply to it alone). Each mode runs every prompt once after one warm-up
generation. The report says where llamaspec's filters ran (on the device or in numpy). With --drafter mtp the
target's own multi-token-prediction head drafts (no --draft), and llama.cpp runs `--spec-type draft-mtp` on the
same file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from llamaspec import load_pair
from llamaspec.backend import default_threads, library_version, supports_gpu_offload
from llamaspec.bench import auto_state
from llamaspec.policy import AutoPolicy, make_policy

CODE = [
    "def quicksort(arr):",
    "# Python: parse a CSV file and print the mean of the 'price' column\nimport csv\n",
    "function debounce(fn, wait) {",
    "class LRUCache:\n    def __init__(self, capacity):",
]
PROSE = [
    "The history of the printing press begins",
    "Here are five tips for writing clear documentation:\n1.",
    "The main differences between TCP and UDP are",
    "Photosynthesis is the process by which",
]


@dataclass
class Row:
    mode: str
    temperature: float
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    overhead: list = field(default_factory=list)   # Python overhead fraction per request
    step_overhead_ms: list = field(default_factory=list)
    draft_seconds: float = 0.0     # time drafting (the cost ratio c = draft time per token / plain's time per pass)
    verify_seconds: float = 0.0    # time verifying (v(k+1) = verify time per pass / plain's)
    rollback_ms: list = field(default_factory=list)  # keep() and checkpoints per target pass (recurrent memories)
    shadow_probes: int = 0         # auto's probes that drafted one token without verifying it

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def hardware() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "GPU offload available" if supports_gpu_offload() else "CPU-only build"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            gpu = out.stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs; {gpu}; llama-cpp-python {library_version()}"


def run_mode(pair, mode: str, prompts, n_tokens: int, temperature: float, filters: dict, seed: int = 0) -> Row:
    row = Row(mode, temperature)
    for i, prompt in enumerate(prompts):
        pair.reset()
        c = pair.generate(prompt, max_tokens=n_tokens, temperature=temperature, seed=seed + i, **filters)
        s = c.stats
        row.tokens += s.tokens_generated
        row.seconds += s.decode_time
        row.drafted += s.drafted
        row.accepted += s.accepted
        row.passes += s.target_passes
        row.draft_seconds += s.time_draft
        row.verify_seconds += s.time_verify
        row.overhead.append(s.python_overhead)
        row.shadow_probes += getattr(s, "shadow_probes", 0)
        if s.target_passes:
            row.step_overhead_ms.append(1000 * (s.decode_time - s.time_in_decode) / s.target_passes)
            row.rollback_ms.append(1000 * s.time_rollback / s.target_passes)
    return row


def record_steps(policy) -> list[str]:
    """The draft length of every step a policy learns from, one character each (10-35 as a-z)."""
    steps: list[str] = []
    update, shadow, new_request = policy.update, policy.shadow, policy.new_request

    def on_update(drafted, *rest):
        steps.append("0123456789abcdefghijklmnopqrstuvwxyz"[min(drafted, 35)])
        update(drafted, *rest)

    def on_shadow(accepted, seconds):
        steps.append("s" if accepted >= 0.5 else "x")
        shadow(accepted, seconds)

    def on_new_request():
        steps.append("|")
        new_request()

    policy.update, policy.shadow, policy.new_request = on_update, on_shadow, on_new_request
    return steps


def run_llama_spec(tools: Path, target: str, draft: str | None, prompt: str, n_tokens: int, k: int,
                   temperature: float, filters: dict, threads: int, no_repack: bool, extra: list[str],
                   spec_type: str = "draft-simple") -> dict:
    """One llama-speculative-simple run: a draft model (spec_type draft-simple, draft-eagle3 or draft-dflash), or
    the target's MTP head (draft=None)."""
    exe = tools / "llama-speculative-simple"
    drafting = (["-md", draft, "--spec-type", spec_type, "-td", str(threads), "-ngld", "99"] if draft
                else ["--spec-type", "draft-mtp"])
    cmd = [str(exe), "-m", target, *drafting, "-p", prompt, "-n", str(n_tokens),
           "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
           "-t", str(threads), "-c", "2048",
           "--temp", str(temperature), "--top-k", str(filters["top_k"]), "--top-p", str(filters["top_p"]),
           "--min-p", str(filters["min_p"]), "--samplers", "temperature;top_k;top_p;min_p",
           "--seed", "1", "-ngl", "99", *extra]
    if no_repack:
        cmd.append("--no-repack")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tools}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    # llama.cpp's log is written by a thread it never flushes at exit (common/log.cpp): on a busy CPU the last lines,
    # the statistics, can be lost. Run again when they are.
    for _ in range(5):
        out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=1800)
        log = out.stdout + out.stderr
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        if m or out.returncode != 0:
            break
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"llama-speculative-simple failed ({out.returncode}): {shlex.join(cmd)}\n{log[-2000:]}")
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)),
            "drafted": int(drafted.group(1)) if drafted else 0, "accepted": int(accepted.group(1)) if accepted else 0,
            "cmd": shlex.join(cmd)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", help="draft GGUF (not with --drafter mtp)")
    ap.add_argument("--drafter", default="model", choices=["model", "mtp", "lookup+mtp"],
                    help="mtp: the target's own MTP head drafts, llama.cpp runs --spec-type draft-mtp")
    ap.add_argument("--tools", type=Path, help="folder with llama-speculative-simple")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("-ngl", type=int, default=-1)
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--k", default="5", help="draft lengths (comma-separated) of the fixed policy and llama.cpp's runs")
    ap.add_argument("--modes", default="plain,fixed,confidence,threshold,auto",
                    help="policies to run; NAME:p=X sets that policy's confidence stop p_min (e.g. auto:p=0)")
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off (both engines)")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off (both engines)")
    ap.add_argument("--min-p", type=float, default=0.0, help="0 = off (both engines)")
    ap.add_argument("--prompts", default="code,prose")
    ap.add_argument("--per-set", type=int, default=4, help="prompts taken from each set")
    ap.add_argument("--llama-extra", default="", help="extra flags for llama-speculative-simple (e.g. -fa on)")
    ap.add_argument("--spec-type", default=None,
                    help="llama-speculative-simple's --spec-type [default: from the draft: draft-eagle3 for an "
                         "EAGLE-3 draft, draft-dflash for a DFlash one, else draft-simple]")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if (a.draft is None) == (a.drafter == "model"):
        ap.error("give --draft with --drafter model (the default), and no --draft with the MTP drafters")

    prompts = [p for name in a.prompts.split(",") for p in {"code": CODE, "prose": PROSE}[name][:a.per_set]]
    if a.spec_type is None and a.draft is not None:  # the same drafter llamaspec picks for this file
        from llamaspec.gguf.reader import read_model_info

        arch = read_model_info(a.draft).arch
        a.spec_type = {"eagle3": "draft-eagle3", "dflash": "draft-dflash"}.get(arch, "draft-simple")
    temps = [float(t) for t in a.temps.split(",")]
    filters = {"top_k": a.top_k, "top_p": a.top_p, "min_p": a.min_p}
    modes = a.modes.split(",")
    lines = ["# llamaspec engine benchmark", "",
             f"- command: `{shlex.join([sys.executable, *sys.argv])}`",
             f"- target: {Path(a.target).name}; draft: {Path(a.draft).name if a.draft else 'none'}; "
             f"drafter: {a.drafter} (llama.cpp: --spec-type {a.spec_type if a.draft else 'draft-mtp'})",
             f"- hardware: {hardware()}; threads {a.threads}; no_repack={a.no_repack}",
             f"- {len(prompts)} prompts ({a.prompts}), {a.tokens} new tokens each, one warm-up; "
             f"date {time.strftime('%Y-%m-%d %H:%M')}",
             f"- sampling filters at T > 0 (both engines): top_k {a.top_k}, top_p {a.top_p}, min_p {a.min_p}", ""]
    ks = [int(k) for k in a.k.split(",")]
    # a hybrid target keeps one recurrent-state snapshot per token of the longest draft any mode will ask for
    names = [m.partition(":")[0] for m in modes]
    longest = max(ks + [make_policy(name).k_max for name in names if name not in ("plain", "fixed")])
    pair = load_pair(a.target, a.draft, n_ctx=2048, n_threads=a.threads, no_repack=a.no_repack,
                     n_gpu_layers=a.ngl, policy="fixed", draft_max=ks[0], flash_attn=a.flash_attn,
                     drafter=a.drafter, n_rs_seq=max(longest, 1))
    if hasattr(pair, "warm_up") and pair.target_ctx.output_on_gpu:
        pair.warm_up(longest)   # every draft length any mode will ask for, where load_pair warms up for its policy
    pair.generate("warm up", max_tokens=16)
    results = []
    for temperature in temps:
        rows, states = [], []
        runs = [(mode, k) for mode in modes for k in (ks if mode == "fixed" else [None])]
        for mode, k in runs:
            name, _, p_min = mode.partition(":p=")  # "auto:p=0": a policy with its confidence stop p_min set
            try:
                p_min = float(p_min) if p_min else None
            except ValueError:
                ap.error(f"--modes: {mode!r}: p= needs a number")
            policy = make_policy("fixed", k=0) if name == "plain" else make_policy(name, k=k, p_min=p_min)
            pair.set_policy(policy)
            label = f"fixed k={k}" if name == "fixed" else mode
            steps = record_steps(policy) if isinstance(policy, AutoPolicy) else None
            rows.append(run_mode(pair, label, prompts, a.tokens, temperature, filters))
            if steps is not None:   # what it measured explains what it chose
                states.append(f"- {label}'s cost model at the end: {auto_state(policy)}; "
                              f"{rows[-1].shadow_probes} shadow probes; draft length by step (s/x: a shadow probe "
                              f"accepted/rejected, | a new request): `{''.join(steps)}`")
            print(f"done: T={temperature} {label}: {rows[-1].tps:.2f} tok/s", file=sys.stderr)
        for k in ks if a.tools else []:
            runs = [run_llama_spec(a.tools, a.target, a.draft, p, a.tokens, k, temperature, filters, a.threads,
                                   a.no_repack, a.llama_extra.split(), a.spec_type) for p in prompts]
            llama = Row(f"llama-speculative-simple k={k}", temperature, passes=0,
                        tokens=sum(r["tokens"] for r in runs), seconds=sum(r["seconds"] for r in runs),
                        drafted=sum(r["drafted"] for r in runs), accepted=sum(r["accepted"] for r in runs))
            rows.append(llama)
            print(f"done: T={temperature} llama.cpp k={k}: {llama.tps:.2f} tok/s", file=sys.stderr)
            if k == ks[0]:
                lines.append(f"- llama.cpp command (first prompt): `{runs[0]['cmd']}`")
        plain = next(r for r in rows if r.mode == "plain")
        where = "" if not temperature else \
            f" (llamaspec's filters ran {'on the device' if pair.target_ctx.device_sampler else 'in numpy'})"
        lines += [f"## temperature {temperature}{where}", "",
                  "| mode | tok/s | vs plain | drafted | acceptance | tokens/pass | Python overhead | per step | "
                  "rollback per step | draft per token | verify per pass |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            tpp = f"{r.tokens / r.passes:.2f}" if r.passes else "-"
            ovh = f"{100 * sum(r.overhead) / len(r.overhead):.1f}%" if r.overhead else "-"
            step = f"{sum(r.step_overhead_ms) / len(r.step_overhead_ms):.2f} ms" if r.step_overhead_ms else "-"
            rollback = f"{sum(r.rollback_ms) / len(r.rollback_ms):.3f} ms" if r.rollback_ms else "-"
            per_draft = f"{1000 * r.draft_seconds / r.drafted:.2f} ms" if r.drafted else "-"
            per_pass = f"{1000 * r.verify_seconds / r.passes:.2f} ms" if r.passes else "-"
            lines.append(f"| {r.mode} | {r.tps:.2f} | {r.tps / plain.tps:.2f}x | {r.drafted} | "
                         f"{100 * r.acceptance:.1f}% | {tpp} | {ovh} | {step} | {rollback} | {per_draft} | {per_pass} |")
            results.append({"temperature": temperature, "mode": r.mode, "tok_s": r.tps, "vs_plain": r.tps / plain.tps,
                            "drafted": r.drafted, "accepted": r.accepted, "acceptance": r.acceptance,
                            "rollback_ms_per_step": sum(r.rollback_ms) / len(r.rollback_ms) if r.rollback_ms else None,
                            "draft_ms_per_token": 1000 * r.draft_seconds / r.drafted if r.drafted else None,
                            "verify_ms_per_pass": 1000 * r.verify_seconds / r.passes if r.passes else None})
        lines += ["", *states, ""] if states else [""]
    report = "\n".join(lines)
    print(report)
    if a.out:
        a.out.write_text(report + "\n")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
