"""Drafting with the target's MTP head for several sequences at once (batch.py): one head context over the shared
target context with a llama.cpp sequence per slot (backend.mtp.SharedMTPContext, made by the pair's head context),
each following its own sequence as drafters/mtp.py follows one.

- Following the target: after every shared target decode (`SharedContext.on_runs`), each run's hidden rows go to its
  sequence's ring (indexed by position), and that sequence's head entries the target has just overwritten with
  other tokens are dropped. The head catches up lazily.
- Drafting (`BatchedMTP.propose_all`): a first head decode carries every drafting sequence's catch-up (the entries
  it is behind on) and its (last, h_{P-1}), whose output is d_1, plus the catch-up of sequences that lag by more than
  BEHIND_MAX without drafting (a joining prompt, plain steps), so no ring loses a row its head still needs; then one
  decode per draft depth holds (d_i, the head's own state) of every sequence still drafting. A sequence stops on its
  own (its k, its confidence stop, a token the target lacks). Rejected drafts are never caught up on.
The drafted tokens are the head's argmax (greedy) or draws from its filtered rows with the sequence's own generator;
those rows are the q the target's rejection sampling reads.

Knows nothing about llama.cpp (the head context decodes), acceptance rules or policies; the engine (slots.py) hands it
DraftJobs as it does for a draft model.
"""
from __future__ import annotations

import numpy as np

from ..sampling import Sampling, draft_filters, filter_logits, max_prob, sample
from .base import Draft, ProbsBuffer, common_prefix_len
from .mtp import BEHIND_MAX, RING_ROWS, HiddenRing


class SeqMTP:
    """One sequence's head state: a ring of the target's hidden states by position, and how far the head's entries
    are made from target states (`valid`); the same bookkeeping as MTPDrafter's for one sequence. `seq`: its head
    sequence (a backend.sequences.Sequence of the head context)."""

    def __init__(self, seq, n_vocab_target: int, ring_rows: int):
        self.seq, self.n_vocab = seq, n_vocab_target
        self.valid = 0                     # head positions < valid hold entries made from target states
        self.base = 0                      # len(history) at the last proposal
        self.sampling: Sampling | None = None
        self._filters = None   # the request's filters cut to the draft's best candidates (draft_filters)
        self.ring = HiddenRing(ring_rows, seq.shared.n_embd)
        self._probs = ProbsBuffer(n_vocab_target)
        self._scratch = np.empty(n_vocab_target, dtype=np.float32)

    def begin(self, history, sampling: Sampling | None) -> None:
        self.sampling = sampling
        self._filters = draft_filters(sampling.config) if sampling is not None else None

    def save_state(self):
        """Its head sequence's state, how far it is made from target states and the states it may still catch up
        from (a backend SavedSeq), or None when it holds nothing."""
        return self.seq.save(valid=self.valid, **self.ring.saved())

    def restore_state(self, saved) -> bool:
        """Back to `save_state`'s (None: empty); False when the backend refused (the sequence is then empty)."""
        if saved is None or not self.seq.restore(saved):
            self.seq.clear()
            self.valid = 0
            self.ring.clear()
            return saved is None
        self.valid = saved.extra["valid"]
        self.ring.load(saved.extra)
        return True

    def accepted(self, n_accepted: int) -> None:
        # the accepted drafts' entries were made from the head's own states: they are caught up on properly later
        self.seq.keep(min(self.base + 1, self.seq.n_past))

    def follow(self, tokens, first_position: int, rows: np.ndarray) -> None:
        """The target decoded `tokens` at first_position.. on this sequence, with hidden states `rows`."""
        if first_position < self.valid:    # the target went back: keep the head's entries that still match
            self.valid = first_position + common_prefix_len(self.seq.tokens[first_position:self.valid], tokens)
            self.seq.keep(self.valid)
        self.ring.remember(rows, first_position)

    def start(self, history, last: int, max_len: int) -> tuple[list[int], np.ndarray]:
        """The first run of a proposal: the entries the head lacks of `history`, then (last, h_{P-1})."""
        position = len(history)
        self.valid = min(self.valid, position)            # past the history: rejected tokens
        self.base = position
        self._probs.rows(max_len)                         # grown before the draft's rows land in it
        return self.catch_up(history, position, last)

    def behind(self, history) -> tuple[list[int], np.ndarray] | None:
        """A sequence not drafting: its catch-up where it lags by more than BEHIND_MAX, else None."""
        if len(history) - min(self.valid, len(history)) <= BEHIND_MAX:
            return None
        self.valid = min(self.valid, len(history))
        return self.catch_up(history, len(history))

    def catch_up(self, history, end: int, last: int | None = None) -> tuple[list[int], np.ndarray]:
        """The entries the head lacks for positions n_past..end-1 (history[p] with h_{p-1}) and, when `last` is
        given, (last, h_{end-1}) at end, with their states. States the ring no longer has: it starts over at end."""
        seq = self.seq
        entries, states = self.ring.pending(seq, self.valid, history, end, last)
        if states is None:                                  # lost: begin afresh at end
            seq.clear()
            seq.tokens.extend([-1] * end)                   # -1: never decoded here, matches no token
            entries = [last] if last is not None else []
            states = self.ring.states(end - 1, 1)
            if states is None:
                states = np.zeros((1, self.ring.rows.shape[1]), dtype=np.float32)
            states = states[:len(entries)]
        self.valid = seq.n_past + len(entries) if entries else seq.n_past
        return entries, states

    def choose(self, row: np.ndarray, i: int, p_min: float, dists: list) -> int | None:
        """The draft token from the head's logits row (greedy: argmax; sampling: a draw from the filtered row, kept
        in `dists`), or None where the draft stops: unsure (p_min) or a token the target lacks."""
        if self.sampling is None:
            token = int(row.argmax())
            confidence = max_prob(row, self._scratch, row[token]) if p_min > 0 else 1.0
        else:
            q = filter_logits(row, self._filters, self._probs.rows(i + 1)[i])
            token = sample(q, self.sampling.rng)
            confidence = q.max_prob() if p_min > 0 else 1.0
            dists.append(q)
        return None if confidence < p_min or not 0 <= token < self.n_vocab else token


class BatchedMTP:
    """The head context and one SeqMTP per sequence of the shared target context `target`; `head_ctx`: the pair's
    own MTPContext (whose model, the target's or a head file, it runs over `target`: backend.mtp.SharedMTPContext)."""

    def __init__(self, target, head_ctx, n_seq: int):
        self.target = target
        self.ctx = head_ctx.over_shared(target, n_seq)
        rows = max(RING_ROWS, target.n_batch + 2 * BEHIND_MAX + 2)   # what a head may lag plus one decode
        self.seqs = [SeqMTP(s, target.n_vocab, rows) for s in self.ctx.sequences]
        target.on_runs = self._follow

    def _follow(self, runs) -> None:
        hidden = self.target.hidden_rows(sum(len(r.tokens) for r in runs))
        start = 0
        for run in runs:
            m = len(run.tokens)
            self.seqs[run.seq.seq_id].follow(run.tokens, run.seq.n_past, hidden[start:start + m])
            start += m

    def propose_all(self, jobs: list, idle: list[tuple[SeqMTP, list[int]]]) -> list[Draft]:
        """Draft for every job (batched.DraftJob over a SeqMTP) together; `idle`: (SeqMTP, history) of sequences
        not drafting, caught up in the first decode where they lag by more than BEHIND_MAX. Each job's Draft."""
        runs = [(job.draft.seq, *job.draft.start(job.history, job.last, job.max_len), True) for job in jobs]
        for seq, history in idle:
            if (late := seq.behind(history)) is not None and late[0]:
                runs.append((seq.seq, *late, False))
        tokens: list[list[int]] = [[] for _ in jobs]
        dists: list[list] = [[] for _ in jobs]
        states: list[np.ndarray | None] = [None] * len(jobs)
        firsts = iter(range(len(jobs)))

        def take(j: int, rows, i: int) -> None:
            job = jobs[j]
            token = job.draft.choose(rows[0], i, job.p_min, dists[j])
            if token is not None:
                tokens[j].append(token)
                states[j] = rows[1]

        for batch in _packed(runs, self.ctx.n_batch):
            for rows in self.ctx.decode_runs(batch):
                if rows is not None:
                    take(next(firsts), rows, 0)
        live, i = [j for j, job in enumerate(jobs) if 0 < len(tokens[j]) < job.max_len], 1
        while live:
            got = self.ctx.decode_runs([(jobs[j].draft.seq, tokens[j][-1:], states[j][None], True) for j in live])
            for j, rows in zip(live, got):
                take(j, rows, i)
            live = [j for j in live if len(tokens[j]) == i + 1 < jobs[j].max_len]
            i += 1
        return [Draft(t, d[:len(t)] if job.draft.sampling is not None else None)
                for t, d, job in zip(tokens, dists, jobs)]

    def close(self) -> None:
        if self.target.on_runs == self._follow:
            self.target.on_runs = None
        self.ctx.close()


def _packed(runs: list[tuple], n_batch: int) -> list[list[tuple]]:
    """The runs in batches of at most n_batch entries, in order; a run too long for what is left of a batch is
    split (its output, if any, on its last part)."""
    batches, batch, size = [], [], 0
    for seq, entries, states, output in runs:
        a = 0
        while a < len(entries):
            if size == n_batch:
                batches.append(batch)
                batch, size = [], 0
            b = min(len(entries), a + n_batch - size)
            batch.append((seq, entries[a:b], states[a:b], output and b == len(entries)))
            size += b - a
            a = b
    if batch:
        batches.append(batch)
    return batches
