"""The host cost of a rejected sampled step on a 248,320-token vocabulary (Qwen3.5/3.6's), as the MTP head drafts at
T=0.8 with the filters on the device: full-vocabulary rows, the target's each with the device's own draw.

    python benchmarks/probes/rejection_step.py [--steps 200] [--k 3]

Each step judges k draft tokens from a draft that peaks elsewhere than the target (the first is rejected) and
samples the token after the rejection: with the row's draw (kept with chance max(0, p - q) / p at the drawn token,
else the residual in full; verify.sample_residual) and without it (the residual built and sampled in full every
time, as before). The k draft rows are copied first, as the head's draws are (drafters/mtp.py). Prints
milliseconds per step, best of 3.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from llamaspec.sampling import Dist
from llamaspec.verify import accept_rejection

V = 248_320


def row(peak: int, seed: int) -> np.ndarray:
    z = np.random.default_rng(seed).standard_normal(V).astype(np.float32) * 0.6
    z[peak] += 9.0
    p = np.exp(z - z.max())
    return (p / p.sum(dtype=np.float64)).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--k", type=int, default=3)
    a = ap.parse_args()
    target = [row(10 + i, i) for i in range(a.k + 1)]
    draft = [row(5000 + i, 100 + i) for i in range(a.k)]
    drafted = np.arange(5000, 5000 + a.k)
    rng = np.random.default_rng(0)
    for with_draw in (False, True):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(a.steps):
                q = [Dist(None, d.copy(), 1.0) for d in draft]
                p = [Dist(None, t, 1.0, draw=10 + i if with_draw else -1) for i, t in enumerate(target)]
                accept_rejection(drafted, q, p.__getitem__, rng)
            best = min(best, (time.perf_counter() - t0) / a.steps)
        print(f"{'with the draw' if with_draw else 'without it  '}: {best * 1e3:.3f} ms a rejected step "
              f"(k={a.k}, the {a.k} draft rows copied)")


if __name__ == "__main__":
    main()
