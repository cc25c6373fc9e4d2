"""Where the wait for a target pass ends when an MTP head follows it: bench_engine with the target's hidden-state read
(Context.hidden_rows, which llama.cpp's getter makes wait for the device) split in two, an explicit
llama_synchronize first and the getter after it, each timed. A wait in the first is the device finishing the pass:
time the Python share must not count (0d85908 moved it into the decode's timed span: since then it is about 0).

    python benchmarks/probes/follower_wait.py --target T-with-MTP.gguf --drafter mtp --modes fixed --k 2 \\
        --regimes greedy,filters --peers '' --tokens 128

Every argument goes to bench_engine; the split's totals print at exit (where any read ran). Measured on an H100
before 0d85908 (the synthetic 27B hybrid, fixed k=2): 3103 reads, llama_synchronize 137.3 us each, the getter after
it 20.2 us.
"""
from __future__ import annotations

import atexit
import runpy
import sys
import time
from pathlib import Path

import llama_cpp

from llamaspec.backend import context

COMPARE = Path(__file__).resolve().parent.parent / "compare"
totals = {"sync": 0.0, "get": 0.0, "n": 0}
_read = context.Context.hidden_rows


def hidden_rows(self, n):
    t0 = time.perf_counter()
    llama_cpp.llama_synchronize(self._ptr)
    t1 = time.perf_counter()
    rows = _read(self, n)
    totals["sync"] += t1 - t0
    totals["get"] += time.perf_counter() - t1
    totals["n"] += 1
    return rows


def report() -> None:
    n = totals["n"]
    if not n:   # bench_engine stopped before a decode (its own error said why) or no drafter followed the target
        return
    print(f"hidden-state reads: {totals['n']}; llama_synchronize {1e6 * totals['sync'] / n:.1f} us each, "
          f"the getter after it {1e6 * totals['get'] / n:.1f} us")


if __name__ == "__main__":
    context.Context.hidden_rows = hidden_rows
    atexit.register(report)
    sys.path.insert(0, str(COMPARE))
    sys.argv = [str(COMPARE / "bench_engine.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
