"""Time the load's warm-up (Pair.warm_up) in two layouts on one loaded pair, alternately, and print what each took
and the prices it gave every pass size (relative to a one-token pass), so that a layout's cost and how much its
prices move from one warm-up to the next are read on one machine in one run.

    python benchmarks/probes/warm_up_layouts.py --target T.gguf (--draft D.gguf | --drafter mtp) [--repeat 3]
        [--layouts 1x5,3x2] [--draft-max N]

A layout SxW times every draft length W warm passes in a row (after its two cold ones), the whole range S times
over (llamaspec/policy/calibration.py: `_SWEEPS`, `_WARM_A_SWEEP`; the load's own is 3x2, before it 1x5). The
longest draft is the one `auto` reaches on this load (a hybrid target: its recurrent-state snapshots) unless
--draft-max says otherwise. The last layout named is left in place.
"""
from __future__ import annotations

import argparse
import statistics
import time

from llamaspec import load_pair
from llamaspec.gguf.reader import read_model_info
from llamaspec.kinds import drafter_kind
from llamaspec.config import LoadConfig
from llamaspec.errors import LlamaspecError
from llamaspec.loading import snapshot_reach
from llamaspec.policy import calibration, make_policy


def layout(text: str) -> tuple[int, int]:
    try:
        sweeps, warm = (int(x) for x in text.lower().split("x"))
        if sweeps < 1 or warm < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is SWEEPSxWARM with both >= 1, e.g. 3x2; got {text!r}") from None
    return sweeps, warm


def set_layout(sweeps: int, warm: int) -> None:
    calibration._SWEEPS, calibration._WARM_A_SWEEP = sweeps, warm
    calibration._WARM_SAMPLES = sweeps * warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--drafter", default="model", help="model (with --draft) or mtp")
    ap.add_argument("--repeat", type=int, default=3, help="warm-ups of each layout, alternating")
    ap.add_argument("--layouts", default="1x5,3x2", help="comma-separated SWEEPSxWARM")
    ap.add_argument("--draft-max", type=int, help="the longest draft timed [auto's reach on this load]")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--no-repack", action="store_true")
    a = ap.parse_args()
    try:
        layouts = [layout(x) for x in a.layouts.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    if a.draft_max is not None and a.draft_max < 1:
        ap.error(f"--draft-max must be at least 1, got {a.draft_max}")
    if (a.draft is None) == (a.drafter == "model"):
        ap.error("give --draft with --drafter model, and no --draft with --drafter mtp")

    try:
        reach = snapshot_reach(LoadConfig(drafter=a.drafter, policy="auto"), read_model_info(a.target),
                               drafter_kind(a.drafter)).drafting.draft_max
        longest = a.draft_max or make_policy("auto", draft_max=reach).draft_max
        t0 = time.perf_counter()
        pair = load_pair(a.target, a.draft, drafter=a.drafter, n_ctx=a.n_ctx, n_rs_seq=longest,
                         no_repack=a.no_repack or None)
    except LlamaspecError as e:
        raise SystemExit(f"warm_up_layouts.py: {e}") from None
    print(f"load_pair (its own warm-up included) {time.perf_counter() - t0:.2f} s; longest draft timed {longest}")
    seconds: dict = {x: [] for x in layouts}
    prices: dict = {x: [] for x in layouts}
    try:
        for _ in range(a.repeat):
            for x in layouts:
                set_layout(*x)
                t = time.perf_counter()
                pair.warm_up(longest)
                seconds[x].append(time.perf_counter() - t)
                verify = pair.costs.verify
                prices[x].append(dict(verify))
    finally:
        pair.close()
    for (sweeps, warm), runs in prices.items():
        print(f"\nlayout {sweeps}x{warm} ({sweeps} sweeps, {warm} warm passes a length each): warm_up({longest}) "
              f"{', '.join(f'{s:.2f}' for s in seconds[(sweeps, warm)])} s")
        print("  1-token pass, ms: " + " ".join(f"{1000 * r[1]:.2f}" for r in runs))
        for n in sorted(runs[0]):
            rel = [r[n] / r[1] for r in runs if n in r]
            spread = (max(rel) - min(rel)) / statistics.median(rel)
            print(f"  {n:2d}-token pass / 1-token: " + " ".join(f"{v:.3f}" for v in rel)
                  + f"   spread {100 * spread:.1f}%")


if __name__ == "__main__":
    main()
