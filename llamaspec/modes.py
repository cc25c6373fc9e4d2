"""How a speculative step verifies its draft: one `Verifier` per request mode, chosen once per request (slots.py).

A verifier says what the target's pass must hand back (`wants`) and which tokens it decodes (`batch`: [last, d_1..d_k],
shorter where a grammar refuses a draft token), then judges the draft from those rows alone: it never sees a context,
so one verifier serves a slot of the pair's own context and a slot of a shared one alike. It returns (n_accepted,
next_token, target_probs): how many draft tokens stand, the token that follows them, and the target's row i as a
distribution, for a shadow probe's judgement (None when greedy). What a pass hands back, by `wants`:
- "argmax": every row's argmax token (taken on the device where the context can, else from the logits);
- "dists": every row filtered by llama.cpp's sampler chain on the device, as sampling.Dist rows;
- "logits": the logits rows, (n, n_vocab).
The modes:
- greedy: the greedy rule over the argmaxes;
- on the device: the rejection rule over the device's filtered rows;
- in numpy: the rejection rule, rows filtered only as far as it reads them;
- shaped: a grammar, penalties or log-probabilities over the target's logits (shaping.py).
Knows nothing about drafters, policies or contexts.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .sampling import Sampling, filter_logits
from .verify import accept_greedy, accept_rejection

Verdict = tuple[int, int, Callable | None]


@dataclass
class Verifier:
    """`judge(rows, history, tokens, drafted, draft_probs) -> Verdict` over the rows of a pass that decoded `tokens`
    (= `batch(last, drafted)`, asked once per step) and handed back `wants`. `own_pass`: the verifier makes its own pass (`judge` then gets None for rows;
    a tree verifier's siblings: tree.py), which only a slot of the pair's own context allows."""

    wants: str
    judge: Callable
    batch: Callable = lambda last, drafted: [last] + drafted
    own_pass: bool = False


def greedy() -> Verifier:
    def judge(argmax, history, tokens, drafted, draft_probs) -> Verdict:
        n_accepted, token = accept_greedy(drafted, argmax)
        return n_accepted, token, None

    return Verifier("argmax", judge)


def on_device(sampling: Sampling) -> Verifier:
    def judge(dists, history, tokens, drafted, draft_probs) -> Verdict:
        rows = dists.__getitem__
        n_accepted, token = accept_rejection(drafted, draft_probs, rows, sampling.rng)
        return n_accepted, token, rows

    return Verifier("dists", judge)


def in_numpy(sampling: Sampling, scratch: Callable[[int], np.ndarray]) -> Verifier:
    """`scratch(n)`: dense rows for n filtered distributions, kept across steps."""
    def judge(logits, history, tokens, drafted, draft_probs) -> Verdict:
        out, rows = scratch(len(drafted) + 1), {}

        def target_probs(i: int):
            if i not in rows:  # rows past the first rejection are never filtered
                rows[i] = filter_logits(logits[i], sampling.config, out[i])
            return rows[i]

        n_accepted, token = accept_rejection(drafted, draft_probs, target_probs, sampling.rng)
        return n_accepted, token, target_probs

    return Verifier("logits", judge)


def shaped(sampling: Sampling | None, shaper, is_eog: Callable[[int], bool]) -> Verifier:
    def batch(last, drafted):   # the batch ends before a draft token the grammar refuses
        return [last] + drafted[:shaper.admissible(drafted)]

    def judge(logits, history, tokens, drafted, draft_probs) -> Verdict:
        draft_arr = np.asarray(drafted[:len(tokens)], dtype=np.int64)   # a refused draft token stays, unaccepted
        rows = shaper.rows(logits[:len(tokens)], history, tokens)
        n_accepted, token = shaper.accept(rows, draft_arr, draft_probs, sampling)
        shaper.commit(rows, n_accepted, token, is_eog)
        return n_accepted, token, functools.partial(rows.dist, sampling.config) if sampling is not None else None

    return Verifier("logits", judge, batch)


def choose(sampling: Sampling | None, shaper, is_eog, scratch) -> Verifier:
    """The request's verifier: one path per mode."""
    if shaper is not None:
        return shaped(sampling, shaper, is_eog)
    if sampling is None:
        return greedy()
    if sampling.device:
        return on_device(sampling)
    return in_numpy(sampling, scratch)
