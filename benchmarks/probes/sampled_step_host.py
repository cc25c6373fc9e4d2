"""The host (Python) time of a sampled speculative step with the filters on the device, without a model: stand-in
contexts hand back dense, normalised rows over a realistic vocabulary (temperature only: every id has mass; a
context asked for top-k, as a drafter's are, its k best candidates), each with a draw from it, in a buffer that every decode overwrites (as llama.cpp's is). What they do in place of the
device (writing the row, drawing) counts as decode time; the rest of the step is llamaspec's own.

    python benchmarks/probes/sampled_step_host.py [--vocab 152064] [--k 5] [-n 400] [--disagree 0.3] [--repeat 3]
        [--profile]

Prints the acceptance, the steps and the host milliseconds per step (best of --repeat), and with --profile the
functions with the most time of their own.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np

from llamaspec.drafters import make_drafter
from llamaspec.engine import Pair
from llamaspec.errors import LlamaspecError
from llamaspec.policy import make_policy
from llamaspec.sampling import Dist


class RowsModel:
    """A model whose next-token distribution is a peak (mass `peak_mass`, on a token set by the last two tokens)
    over one of a few fixed dense noise rows."""

    is_recurrent = is_hybrid = False

    def __init__(self, n_vocab: int, disagree: float = 0.0, salt: int = 0, peak_mass: float = 0.8, seed: int = 0):
        self.n_vocab, self.eog, self.disagree, self.salt, self.peak_mass = n_vocab, -1, disagree, salt, peak_mass
        self.path = type("P", (), {"name": "rows.gguf"})()
        rng = np.random.default_rng(seed)
        self.noise, self.cdfs = [], []
        for _ in range(4):
            w = np.exp(rng.standard_normal(n_vocab) * 0.6)
            w *= (1.0 - peak_mass) / w.sum()
            self.noise.append(w.astype(np.float32))
            self.cdfs.append(np.cumsum(w / w.sum()))

    def peak(self, tokens) -> int:
        a, b = (tokens[-2] if len(tokens) > 1 else 0), tokens[-1]
        peak = (a * 7 + b * 13 + 5) % (self.n_vocab - 2) + 2
        if self.disagree and (hash((a, b, self.salt)) % 1000) / 1000 < self.disagree:
            peak = (peak + 1 + self.salt) % (self.n_vocab - 2) + 2
        return peak

    def is_eog(self, token: int) -> bool:
        return False

    def token_bytes(self, token: int) -> bytes:
        return b"x"

    def tokenize(self, text, add_special=True, parse_special=True):
        return [2 + (ord(c) % (self.n_vocab - 2)) for c in text]

    def detokenize(self, tokens):
        return "x" * len(tokens)

    def close(self):
        pass


class RowsContext:
    """A context that "samples on the device": eval_dists writes each asked row into its own buffer (overwritten by
    the next decode) and draws from it; all of that is counted as decode time."""

    prefers_device_sampling = True
    device_argmax = False

    def __init__(self, model: RowsModel, n_ctx: int, n_batch: int = 64):
        self.model, self.n_ctx, self.n_batch, self.n_vocab = model, n_ctx, n_batch, model.n_vocab
        self.tokens: list[int] = []
        self.decode_seconds = self.rollback_seconds = 0.0
        self.replayed_tokens = 0
        self.buffer = np.zeros((n_batch, model.n_vocab), dtype=np.float32)
        self.draws = np.random.default_rng(1)
        self.cfg = None

    n_past = property(lambda self: len(self.tokens))
    n_in_memory = n_past

    def checkpoint(self, turn=False):
        pass

    def eval(self, tokens, logits="last"):
        assert logits == "none", "this stand-in hands back device rows only"
        self.tokens.extend(int(t) for t in tokens)

    def eval_dists(self, tokens, rows="last"):
        t0 = time.perf_counter()
        m = self.model
        out = []
        n = len(tokens)
        for i, t in enumerate(tokens):
            self.tokens.append(int(t))
            if rows == "all" or i == n - 1:
                j = len(out)
                peak, which = m.peak(self.tokens), len(self.tokens) % len(m.noise)
                row = self.buffer[j]
                row[:] = m.noise[which]
                row[peak] += np.float32(m.peak_mass)
                top_k = self.cfg.top_k if self.cfg is not None and 0 < self.cfg.top_k < m.n_vocab else 0
                if top_k:   # as llama.cpp's device top-k: the k best candidates, renormalised, and a draw among them
                    ids = np.argpartition(row, m.n_vocab - top_k)[m.n_vocab - top_k:].astype(np.int32)
                    weights = row[ids] / row[ids].sum(dtype=np.float32)
                    draw = int(ids[np.searchsorted(np.cumsum(weights), self.draws.random())
                                   .clip(max=top_k - 1)])
                    out.append(Dist(ids, weights, 1.0, draw=draw))
                    continue
                u = self.draws.random()
                draw = peak if u < m.peak_mass else int(np.searchsorted(m.cdfs[which], self.draws.random()))
                out.append(Dist(None, row, 1.0, draw=min(draw, m.n_vocab - 1)))
        self.decode_seconds += time.perf_counter() - t0
        return out

    def set_device_argmax(self, on):
        return False

    def set_device_sampler(self, cfg, seed=0):
        self.cfg = cfg   # a drafter's filters cut to its best candidates (sampling.draft_filters) are honoured
        return cfg is not None

    def keep(self, n):
        del self.tokens[n:]
        return True

    def reach(self, n):
        return min(n, self.n_past)

    def resync(self):
        pass

    def clear(self):
        self.tokens.clear()

    def close(self):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=152_064)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("-n", type=int, default=400)
    ap.add_argument("--disagree", type=float, default=0.3)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    for bad, what in ((a.vocab < 16, "--vocab must be at least 16"), (a.k < 1, "--k must be at least 1"),
                      (a.n < 1, "-n must be at least 1"),
                      (not 0.0 <= a.disagree <= 1.0, "--disagree must be in [0, 1]"),
                      (not a.temp > 0.0, "--temp must be > 0 (a sampled step)"),
                      (a.repeat < 1, "--repeat must be >= 1")):
        if bad:
            ap.error(what)
    try:
        run(a)
    except LlamaspecError as e:
        raise SystemExit(f"sampled_step_host: {e}") from None


def run(a: argparse.Namespace) -> None:
    target = RowsModel(a.vocab, seed=0)
    draft = RowsModel(a.vocab, disagree=a.disagree, salt=3, seed=1)
    n_ctx = a.n + 64
    pair = Pair(target, RowsContext(target, n_ctx), make_drafter("model", target, RowsContext(draft, n_ctx)),
                make_policy("fixed", draft_max=a.k))
    best, prof = float("inf"), None
    for r in range(a.repeat + 1):   # the first run warms up
        pair.reset()
        prof = cProfile.Profile() if a.profile and r == a.repeat else None
        if prof:
            prof.enable()
        c = pair.generate([5, 6, 7], max_tokens=a.n, temperature=a.temp, seed=1)
        if prof:
            prof.disable()
        s = c.stats
        steps = max(s.target_passes, 1)
        host = (s.time_total - s.time_in_decode - s.time_prefill) / steps
        if r:
            best = min(best, host)
    print(f"vocabulary {a.vocab}, k={a.k}, T={a.temp}: {s.tokens_generated} tokens, {steps} steps, "
          f"acceptance {s.acceptance_rate:.0%}; host {best * 1e3:.3f} ms per step (best of {a.repeat})")
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue())


if __name__ == "__main__":
    main()
