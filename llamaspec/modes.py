"""How a speculative step verifies its draft: one path per request mode, chosen once per request (Pair._verifier).

Each runs one target pass over [last, d_1..d_k] and returns (n_accepted, next_token, target_probs): how many draft
tokens stand, the token that follows them, and the target's row i as a distribution, for a shadow probe's
judgement (None when greedy). The paths:
- greedy: the argmax of every row (taken on the device where it can be), the greedy rule;
- on the device: llama.cpp's sampler chains filter every row and return only the kept candidates;
- in numpy: the logits come back and rows are filtered only as far as the rejection rule reads them;
- shaped: a grammar, penalties or log-probabilities over the target's logits (shaping.py).
Knows nothing about drafters or policies.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from .sampling import Sampling, filter_logits
from .verify import accept_greedy, accept_rejection

Verdict = tuple[int, int, Callable | None]


class Rows:
    """What these paths ask of a context, answered from rows a decode already returned (a slot's run of one shared
    decode, batch.py): `rows` is set before each verification."""

    rows: np.ndarray

    def eval(self, tokens, logits: str = "all") -> np.ndarray:
        return self.rows[:len(tokens)]

    def eval_argmax(self, tokens, rows: str = "all") -> list[int]:
        return self.rows[:len(tokens)].argmax(axis=1).tolist()


def greedy(ctx, history: list[int], last: int, drafted: list[int], draft_probs) -> Verdict:
    argmax = ctx.eval_argmax([last] + drafted, rows="all")
    n_accepted, token = accept_greedy(np.asarray(drafted, dtype=np.int64), np.asarray(argmax))
    return n_accepted, token, None


def on_device(ctx, sampling: Sampling, history: list[int], last: int, drafted: list[int], draft_probs) -> Verdict:
    rows = ctx.eval_dists([last] + drafted, rows="all").__getitem__
    n_accepted, token = accept_rejection(np.asarray(drafted, dtype=np.int64), draft_probs, rows, sampling.rng)
    return n_accepted, token, rows


def in_numpy(ctx, sampling: Sampling, scratch: Callable[[int], np.ndarray], history: list[int], last: int,
             drafted: list[int], draft_probs) -> Verdict:
    """`scratch(n)`: dense rows for n filtered distributions, kept across steps."""
    logits = ctx.eval([last] + drafted, logits="all")
    out, rows = scratch(len(drafted) + 1), {}

    def target_probs(i: int):
        if i not in rows:  # rows past the first rejection are never filtered
            rows[i] = filter_logits(logits[i], sampling.config, out[i])
        return rows[i]

    n_accepted, token = accept_rejection(np.asarray(drafted, dtype=np.int64), draft_probs, target_probs, sampling.rng)
    return n_accepted, token, target_probs


def shaped(ctx, sampling: Sampling | None, shaper, is_eog: Callable[[int], bool], history: list[int], last: int,
           drafted: list[int], draft_probs) -> Verdict:
    batch = [last] + drafted[:shaper.admissible(drafted)]   # the batch ends before a draft token the grammar refuses
    logits = ctx.eval(batch, logits="all")
    draft_arr = np.asarray(drafted[:len(batch)], dtype=np.int64)   # a refused draft token stays, unaccepted
    rows = shaper.rows(logits, history, batch)
    n_accepted, token = shaper.accept(rows, draft_arr, draft_probs, sampling)
    shaper.commit(rows, n_accepted, token, is_eog)
    return n_accepted, token, functools.partial(rows.dist, sampling.config) if sampling is not None else None
