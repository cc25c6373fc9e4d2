"""Two versions of llamaspec on the same files, alternated: did a change cost speed?

    python benchmarks/compare/before_after.py --before OLD_TREE --after NEW_TREE --rounds 2 -- \
        --target T.gguf --drafter mtp --k 2 --modes plain,fixed --regimes greedy,filters --peers ''

Each round runs the engine benchmark (bench_engine.py, the arguments after `--`) once from each source tree, in
alternating order (before, after; then after, before), each in a fresh process with that tree first on PYTHONPATH,
so drift of the machine falls on both. Prints, for every (regime, mode), the median tok/s of each version over the
rounds, every round's figure, and after / before. The trees are checkouts of this repository (git worktree).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(tree: Path, bench_args: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(tree / "benchmarks" / "compare" / "bench_engine.py"), *bench_args,
               "--json", str(out)]
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.exit(f"error: {tree}: bench_engine failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        return [r for r in json.loads(out.read_text()) if r["engine"] == "llamaspec"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_engine.py's arguments")
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    for tree in (a.before, a.after):
        if not (tree / "benchmarks" / "compare" / "bench_engine.py").is_file():
            sys.exit(f"error: {tree} is not a checkout of this repository")
    tps: dict[tuple[str, str], dict[str, list[float]]] = {}
    for i in range(a.rounds):
        order = [("before", a.before), ("after", a.after)]
        for name, tree in order if i % 2 == 0 else order[::-1]:
            for row in run_once(tree, bench_args):
                tps.setdefault((row["regime"], row["mode"]), {"before": [], "after": []})[name].append(row["tok_s"])
            print(f"round {i + 1}: {name} done", file=sys.stderr, flush=True)
    lines = [f"command: `{' '.join([sys.argv[0], *sys.argv[1:]])}`", "",
             "| regime | mode | before tok/s (median; each round) | after tok/s (median; each round) | after / before |",
             "|---|---|---|---|---|"]
    for (regime, mode), v in tps.items():
        b, f = statistics.median(v["before"]), statistics.median(v["after"])
        each = lambda xs: ", ".join(f"{x:.2f}" for x in xs)   # noqa: E731
        lines.append(f"| {regime} | {mode} | {b:.2f} ({each(v['before'])}) | {f:.2f} ({each(v['after'])}) | "
                     f"{f / b:.3f}x |")
    report = "\n".join(lines)
    print(report)
    if a.out:
        a.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
