"""The engine's own Python cost per step: one request over contexts that answer instantly (no model, no llama.cpp).

    PYTHONPATH=TREE python benchmarks/probes/step_overhead.py [--steps 3000] [--repeat 7] [--modes plain,draft-k4]

Each mode generates `--steps` tokens' worth of steps from one request on the pair's own contexts and prints the
best of `--repeat` runs in microseconds per step (a step is one target pass: its draft, verification, rollback,
policy update, stats and text). The contexts return rows from a fixed table (a row depends only on the last token),
so what is measured is llamaspec's bookkeeping plus the few numpy calls the mode makes on 64-token rows:
- plain: no drafter, greedy (FixedPolicy(0));
- plain-t0.8: no drafter, T=0.8 filtered in numpy;
- draft-k4: a draft model, FixedPolicy(4), greedy (the draft disagrees with the target on ~30% of tokens);
- draft-k4-t0.8: the same at T=0.8, rejection sampling in numpy.

Only names common to every version of the package are used (Pair, make_drafter, FixedPolicy's positional length,
GenerationStats.target_passes), so any source tree runs it: put the tree first on PYTHONPATH.

Wall-clock on a shared machine is noisy; instruction counts are not. Under valgrind, count a short and a long run
and divide the difference by the difference in steps (what startup and imports cost cancels out):

    PYTHONPATH=TREE valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/probes/step_overhead.py --modes plain --steps 200 --repeat 1
    (again with --steps 1200; instructions per step = (I_1200 - I_200) / (passes_1200 - passes_200))

`--instructions` does exactly that (valgrind on PATH) and prints instructions per step for each mode.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

N_VOCAB = 64
EOG = 1
MODES = ("plain", "plain-t0.8", "draft-k4", "draft-k4-t0.8")


class InstantModel:
    """Rows from a table: row t is the next-token logits after token t, peaked at a token that is never EOG."""

    is_recurrent = is_hybrid = False

    def __init__(self, disagree: float = 0.0, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.n_vocab, self.eog = N_VOCAB, EOG
        self.path = type("P", (), {"name": "instant.gguf"})()
        peak = (np.arange(N_VOCAB) * 13 + 5) % (N_VOCAB - 2) + 2
        if disagree:   # the draft puts its peak elsewhere after a fixed share of tokens
            moved = (np.arange(N_VOCAB) * 37 % 100) < disagree * 100
            peak = np.where(moved, (peak + 1) % (N_VOCAB - 2) + 2, peak)
        self.table = rng.standard_normal((N_VOCAB, N_VOCAB)).astype(np.float32)
        self.table[np.arange(N_VOCAB), peak] += 6.0
        self.table[:, EOG] = -30.0   # no request ends early, sampled or not
        self.argmax = self.table.argmax(axis=1).tolist()
        self._bytes = [f"<{t}>".encode() for t in range(N_VOCAB)]

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token]

    def tokenize(self, text, add_special=True, parse_special=True):
        return [2 + (ord(c) % (N_VOCAB - 2)) for c in text]

    def detokenize(self, tokens):
        return "".join(f"<{t}>" for t in tokens)

    def close(self):
        pass


class InstantContext:
    """The backend context's interface (as the fake backend of the tests has it), answering from the model's table."""

    prefers_device_sampling = False
    decode_seconds = rollback_seconds = 0.0
    replayed_tokens = 0

    def __init__(self, model: InstantModel, n_ctx: int, n_batch: int = 64):
        self.model, self.n_ctx, self.n_batch, self.n_vocab = model, n_ctx, n_batch, model.n_vocab
        self.tokens: list[int] = []
        self.device_argmax = False

    @property
    def n_past(self):
        return len(self.tokens)

    n_in_memory = n_past

    def eval(self, tokens, logits="last"):
        self.tokens.extend(tokens)
        if logits == "none":
            return None
        return self.model.table[tokens if logits == "all" else tokens[-1:]]

    def eval_argmax(self, tokens, rows="last"):
        self.tokens.extend(tokens)
        argmax = self.model.argmax
        return [argmax[t] for t in tokens] if rows == "all" else [argmax[tokens[-1]]]

    def set_device_argmax(self, on):
        self.device_argmax = bool(on)
        return self.device_argmax

    def set_device_sampler(self, cfg, seed=0):
        return False

    def keep(self, n):
        del self.tokens[n:]
        return True

    def reach(self, n):
        return min(n, self.n_past)

    def checkpoint(self, turn=False):
        pass

    def save_state(self, **extra):
        return None

    def restore_state(self, saved):
        return False

    def resync(self):
        pass

    def clear(self):
        self.tokens.clear()

    def close(self):
        pass


def make_pair(mode: str, n_ctx: int):
    from llamaspec.drafters import make_drafter
    from llamaspec.engine import Pair
    from llamaspec.policy import FixedPolicy

    target = InstantModel()
    if mode.startswith("plain"):
        return Pair(target, InstantContext(target, n_ctx), None, FixedPolicy(0))
    draft = InstantModel(disagree=0.3)
    drafter = make_drafter("model", target, InstantContext(draft, n_ctx))
    return Pair(target, InstantContext(target, n_ctx), drafter, FixedPolicy(4))


def run(mode: str, steps: int, repeat: int) -> tuple[float, int, int]:
    """Best microseconds per step over `repeat` runs, the steps and the tokens of one run."""
    temperature = 0.8 if mode.endswith("t0.8") else 0.0
    prompt = "def quicksort(arr):"
    pair = make_pair(mode, len(prompt) + 4 * steps + 16)
    pair.generate(prompt, max_tokens=32, temperature=temperature, seed=1)   # warm: lazy imports, buffers
    best = float("inf")
    for _ in range(repeat):
        pair.reset()
        t0 = time.perf_counter()
        c = pair.generate(prompt, max_tokens=steps, temperature=temperature, seed=1)
        seconds = time.perf_counter() - t0
        best = min(best, seconds / c.stats.target_passes)
    return best * 1e6, c.stats.target_passes, c.stats.tokens_generated


def instructions(mode: str, steps: int) -> tuple[int, int]:
    """(instructions, steps) of one run of `mode` under callgrind, warm-up and startup included; string hashes
    fixed (PYTHONHASHSEED), so that the same tree counts the same."""
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                          __file__, "--modes", mode, "--steps", str(steps), "--repeat", "1"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}, check=True)
    collected = int(re.search(r"Collected : (\d+)", out.stderr).group(1))
    passes = int(re.search(r"steps=(\d+)", out.stdout).group(1))
    return collected, passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000, help="max_tokens of the measured request")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions per step under valgrind (a run of 200 tokens and one of 1200)")
    a = ap.parse_args()
    import llamaspec

    if not a.instructions:
        print(f"# llamaspec from {os.path.dirname(llamaspec.__file__)}", flush=True)
    for mode in a.modes.split(","):
        if a.instructions:
            (i_short, n_short), (i_long, n_long) = instructions(mode, 200), instructions(mode, 1200)
            print(f"{mode:14s} {(i_long - i_short) / (n_long - n_short):10.0f} instructions/step", flush=True)
        else:
            us, passes, tokens = run(mode, a.steps, a.repeat)
            print(f"{mode:14s} {us:7.2f} us/step  (steps={passes} tokens={tokens})", flush=True)


if __name__ == "__main__":
    main()
