"""What a change of draft length costs beyond the passes themselves.

On a GPU llama.cpp replays a captured CUDA graph while the batch shape of a context stays the same; a pass of
another shape runs without it and the next passes of the old shape run uncaptured and re-capture before the replay
resumes. A policy that drafts now and then (a probe) or changes k pays that on top of the draft and the longer
verification. This runs the engine with scripted draft lengths and reports each step's wall time by how many
steps ago the draft length changed, against steps of an unchanged length in the same run.

    python benchmarks/probes/switch_cost.py --target T.gguf [--draft D.gguf] [--every 16] [--tokens 128] [--no-cuda-graphs]

Patterns (one policy object each, the same prompts): plain; a k-token probe every `--every` steps for k in --probe-k;
a fixed k and the same k alternating with k+1 (always drafting).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compare"))   # bench_engine's prompts and hardware line


class Scripted:
    """A draft length per step from a function of the step number; records each step's wall time."""

    name, draft_p_min = "scripted", 0.0

    def __init__(self, lengths, draft_max: int):
        self.lengths, self.draft_max, self.step = lengths, draft_max, 0
        self.steps: list[tuple[int, float, float]] = []   # (drafted, wall seconds since the last step, verify)
        self._last = None

    def next_draft_len(self) -> int:
        return self.lengths(self.step)

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.steps.append((drafted, now - self._last, verify_seconds))
        self._last = now
        self.step += 1

    def new_request(self) -> None:
        self._last = None   # the first step of a request includes the prompt


def summarize(policy: Scripted) -> dict:
    """Plain steps by distance (in steps) from the last drafted one, drafted steps by whether k changed."""
    by_distance: dict[int, list[float]] = {}
    drafted_same, drafted_changed = [], []
    since, last_k = 1 << 20, None
    for drafted, wall, _ in policy.steps:
        if drafted:
            (drafted_same if drafted == last_k else drafted_changed).append(wall)
            since = 0
        else:
            since += 1
            by_distance.setdefault(min(since, 6), []).append(wall)
        last_k = drafted
    med = lambda xs: 1000 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"plain_by_distance": {d: (med(v), len(v)) for d, v in sorted(by_distance.items())},
            "drafted_same_k": (med(drafted_same), len(drafted_same)),
            "drafted_k_changed": (med(drafted_changed), len(drafted_changed))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", help="the draft model [default: the target's own MTP head]")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--probe-k", default="1,3")
    ap.add_argument("--k", type=int, default=3, help="the always-drafting patterns' length")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="set GGML_CUDA_DISABLE_GRAPHS for this process")
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.no_cuda_graphs:
        os.environ["GGML_CUDA_DISABLE_GRAPHS"] = "1"   # read once, at the first graph compute
    from bench_engine import CODE, hardware  # noqa: E402  (after the environment is set)

    from llamaspec import load_pair

    probe_ks = [int(k) for k in a.probe_k.split(",")]
    pair = load_pair(a.target, a.draft, n_ctx=2048, flash_attn="on", no_repack=a.no_repack, policy="fixed",
                     draft_max=a.k + 1, drafter="model" if a.draft else "mtp", n_rs_seq=a.k + 1)
    pair.generate("warm up", max_tokens=16)
    every = a.every
    patterns = [("plain", lambda s: 0, 0)]
    patterns += [(f"probe k={k} every {every}", lambda s, k=k: k if s % every == every - 1 else 0, k)
                 for k in probe_ks]
    patterns += [(f"fixed k={a.k}", lambda s: a.k, a.k),
                 (f"k={a.k}/{a.k + 1} alternating", lambda s: a.k + s % 2, a.k + 1)]
    prompts = CODE[:a.prompts]
    lines = ["# cost of changing the draft length", "",
             f"- command: `{' '.join([sys.executable, *sys.argv])}`",
             f"- target: {Path(a.target).name}; draft: {Path(a.draft).name if a.draft else 'its MTP head'}; "
             f"hardware: {hardware()}",
             f"- CUDA graphs: {'disabled (GGML_CUDA_DISABLE_GRAPHS=1)' if a.no_cuda_graphs else 'as llama.cpp does'}",
             f"- {len(prompts)} prompts x {a.tokens} greedy tokens per pattern; wall time per step (median), ms", "",
             "| pattern | tok/s | vs plain | plain step, steps after a draft: 1 / 2 / 3 / 4 / 5 / 6+ | "
             "drafted step, same k / k changed |", "|---|---|---|---|---|"]
    plain_tps = None
    for label, lengths, k_max in patterns:
        policy = Scripted(lengths, k_max)
        pair.set_policy(policy)
        tokens = seconds = 0.0
        for prompt in prompts:
            pair.reset()
            policy.new_request()
            c = pair.generate(prompt, max_tokens=a.tokens, temperature=0.0)
            tokens += c.stats.tokens_generated
            seconds += c.stats.decode_time
        tps = tokens / seconds
        plain_tps = plain_tps or tps
        s = summarize(policy)
        dist = " / ".join(f"{s['plain_by_distance'][d][0]:.2f}" if d in s["plain_by_distance"] else "-"
                          for d in range(1, 7))
        same, changed = s["drafted_same_k"], s["drafted_k_changed"]
        lines.append(f"| {label} | {tps:.2f} | {tps / plain_tps:.3f}x | {dist} | "
                     f"{same[0]:.2f} ({same[1]}) / {changed[0]:.2f} ({changed[1]}) |")
        print(f"done: {label}", file=sys.stderr)
    report = "\n".join(lines)
    print(report)
    if a.out:
        a.out.write_text(report + "\n")


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()
