"""What the draft-length policy costs per engine step (its update and next_draft_len), in CPU time of this process
so that other load on the machine does not count. Three regimes of `auto`: plain decoding where no draft can pay,
drafting on a GPU-like cost curve, and a useless draft on a GPU-like curve (plain with probes); FixedPolicy(0) as
the floor.

    python benchmarks/probes/policy_overhead.py [--steps 20000]
"""
from __future__ import annotations

import argparse
import time

from llamaspec.policy import FixedPolicy, make_policy

REGIMES = {
    # name: (draft seconds per token, verify seconds of n tokens, acceptance: accepted count for k drafted)
    "auto, no draft can pay (v(n)=n, c=0.3)": (0.3, lambda n: float(n), lambda k: k),
    "auto, drafting (v(n)=1+0.12(n-1), c=0.05, all accepted)": (0.05, lambda n: 1 + 0.12 * (n - 1), lambda k: k),
    "auto, useless draft (v(n)=1+0.12(n-1), c=0.05)": (0.05, lambda n: 1 + 0.12 * (n - 1), lambda k: 0),
}


def per_step_us(policy, t_draft, verify, accepted, steps: int, warmup: int = 200) -> tuple[float, float]:
    for _ in range(warmup):
        k = policy.next_draft_len()
        policy.update(k, accepted(k), k * t_draft, verify(k + 1))
    drafted = 0
    t0 = time.process_time()
    for _ in range(steps):
        k = policy.next_draft_len()
        policy.update(k, accepted(k), k * t_draft, verify(k + 1))
        drafted += k
    return 1e6 * (time.process_time() - t0) / steps, drafted / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20000)
    a = ap.parse_args()
    print("| policy and regime | CPU us per step | mean draft length |")
    print("|---|---|---|")
    us, _ = per_step_us(FixedPolicy(0), 0.0, lambda n: 1.0, lambda k: 0, a.steps)
    print(f"| FixedPolicy(0) (plain) | {us:.2f} | 0 |")
    for name, (t_draft, verify, accepted) in REGIMES.items():
        us, mean_k = per_step_us(make_policy("auto"), t_draft, verify, accepted, a.steps)
        print(f"| {name} | {us:.2f} | {mean_k:.2f} |")


if __name__ == "__main__":
    main()
