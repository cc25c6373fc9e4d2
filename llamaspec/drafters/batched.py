"""Drafting for several sequences at once with one draft model: each sequence has its own sequence id in a shared
draft context (backend/sequences.py) and `SeqDraft` keeps it in step with that sequence's history, as ModelDrafter
does for one. `propose_all` drafts for every sequence together: the first decode carries each sequence's catch-up
and its `last` (and a prefill chunk of a sequence that is joining), then one decode per draft position holds one
token of every sequence still drafting. A sequence stops on its own (its k, its confidence stop, a token the target
lacks) and drops out of the later decodes.

Knows nothing about acceptance rules, policies or the target's cache; it talks to the shared context through
`decode(runs)` and the sequences' `keep` / `clear` / `tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sampling import Sampling, draft_filters, filter_logits, max_prob, sample
from .base import Draft, ProbsBuffer, common_prefix_len


class SeqDraft:
    """One sequence's draft-model state: its cache holds history[offset:] (see ModelDrafter: after a long pause the
    draft restarts on the last `window` tokens instead of catching up on all of them)."""

    def __init__(self, seq, n_vocab_target: int, window: int = 64, max_catchup: int = 128):
        self.seq = seq
        self.n_vocab = seq.shared.n_vocab
        self.n_vocab_target = n_vocab_target
        self.window, self.max_catchup = window, max_catchup
        self.offset = 0
        self._known_equal = 0
        self._base = 0
        self.sampling: Sampling | None = None
        self._filters = None   # the request's filters cut to the draft's best candidates (draft_filters)
        self.pending: list[int] = []   # prompt tokens still to decode, a chunk per step (prefill_chunk)
        self._probs = ProbsBuffer(max(n_vocab_target, self.n_vocab))
        self._scratch = np.empty(self.n_vocab, dtype=np.float32)

    def begin(self, history: list[int], sampling: Sampling | None) -> None:
        """A new request on this sequence: reuse the common prefix, decode the rest of `history` in chunks."""
        self.sampling, self._known_equal, self.offset = sampling, 0, 0
        self._filters = draft_filters(sampling.config) if sampling is not None else None
        self.pending = self._align(history, extra=1, limit=None)

    def save_state(self):
        """Its sequence's state and offset (a backend SavedSeq), or None when it holds nothing."""
        return self.seq.save(offset=self.offset)

    def restore_state(self, saved) -> bool:
        """Back to `save_state`'s (None: empty); False when the backend refused (the sequence is then empty)."""
        self._known_equal, self.pending = 0, []
        if saved is None or not self.seq.restore(saved):
            self.seq.clear()
            self.offset = 0
            return saved is None
        self.offset = saved.extra["offset"]
        return True

    def prefill_chunk(self, n: int) -> list[int]:
        chunk, self.pending = self.pending[:n], self.pending[n:]
        return chunk

    def _align(self, history: list[int], extra: int, limit: int | None) -> list[int]:
        rel = history[self.offset:] if self.offset else history
        common = common_prefix_len(self.seq.tokens, rel, self._known_equal)
        missing = len(rel) - common
        behind = limit is not None and missing > limit
        too_long = len(rel) + extra > self.seq.n_ctx
        if behind or too_long or not self.seq.keep(common):
            self.seq.clear()
            self.offset = max(0, len(history) - self.window) if (behind or too_long) else 0
            rel, common = history[self.offset:], 0
        self._known_equal = common
        return rel[common:]

    def start(self, history: list[int], last: int, max_len: int) -> list[int]:
        """The first run of a proposal: what the cache lacks of history, then `last`."""
        self.pending = []
        missing = self._align(history, max_len + 1, self.max_catchup)
        self._base = len(history) - self.offset
        self._probs.rows(max_len)   # grown before the draft's rows land in it
        return missing + [last]

    def accepted(self, n_accepted: int) -> None:
        self.seq.keep(min(self._base + 1 + n_accepted, self.seq.n_past))
        self._known_equal = self.seq.n_past

    def choose(self, row: np.ndarray, i: int, p_min: float, dists: list) -> int | None:
        """The draft token from a logits row (greedy: argmax; sampling: a draw from the filtered row, kept in
        `dists`), or None where the draft stops: unsure (p_min) or a token the target lacks."""
        if self.sampling is None:
            token = int(row.argmax())
            confidence = max_prob(row, self._scratch, row[token]) if p_min > 0 else 1.0
        else:
            q = filter_logits(row, self._filters, self._probs.rows(i + 1)[i][:self.n_vocab])
            token = sample(q, self.sampling.rng)
            confidence = q.max_prob() if p_min > 0 else 1.0
            dists.append(q)
        return None if confidence < p_min or token >= self.n_vocab_target else token


@dataclass
class DraftJob:
    draft: SeqDraft
    history: list[int]
    last: int
    max_len: int
    p_min: float


def propose_all(shared, jobs: list[DraftJob], prefills: list[tuple[SeqDraft, int]] = ()) -> list[Draft]:
    """Draft for every job together (one decode per draft position); `prefills`: (sequence, n) pairs whose next n
    pending prompt tokens ride along with the first decode. Returns each job's Draft."""
    Run = shared.Run
    runs = [Run(job.draft.seq, job.draft.start(job.history, job.last, job.max_len), "last") for job in jobs]
    runs += [Run(draft.seq, chunk, "none") for draft, n in prefills if (chunk := draft.prefill_chunk(n))]
    tokens: list[list[int]] = [[] for _ in jobs]
    dists: list[list] = [[] for _ in jobs]
    live = list(range(len(jobs)))
    rows = _decode_packed(shared, runs)
    i = 0
    while live:
        still = []
        for j, row in zip(live, rows):
            job = jobs[j]
            token = job.draft.choose(row[-1], i, job.p_min, dists[j])
            if token is None:
                continue
            tokens[j].append(token)
            if len(tokens[j]) < job.max_len:
                still.append(j)
        live, i = still, i + 1
        if live:
            rows = shared.decode([Run(jobs[j].draft.seq, [tokens[j][-1]], "last") for j in live])
    return [Draft(t, d[:len(t)] if job.draft.sampling is not None else None) for t, d, job in zip(tokens, dists, jobs)]


def _decode_packed(shared, runs) -> list:
    """The rows of runs that want them, decoded in as few batches as fit (a catch-up may fill one); the rows of an
    earlier batch are copied before the next decode overwrites them."""
    out, batch, size = [], [], 0
    for run in runs:
        if batch and size + len(run.tokens) > shared.n_batch:
            out += [None if r is None else np.array(r) for r in shared.decode(batch)]
            batch, size = [], 0
        batch.append(run)
        size += len(run.tokens)
    if batch:
        out += shared.decode(batch)
    return [r for r, run in zip(out, runs) if run.outputs != "none"]
