"""A target context whose memory holds branches: tree verification's one backend need (llamaspec/tree.py).

Seq 0 is the committed sequence, exactly as in Context. A tree pass decodes the chain [last, d_1..d_k] in seq 0 and
each sibling s_j (an alternative to d_i) in its own seq j at d_i's position; the chain tokens before d_i carry seq j
too, so the shared prefix is decoded once (llama.cpp's seq ids per batch token over one unified KV cache; the
history is shared with seq j by llama_memory_seq_cp before the pass). Afterwards either a sibling's cell joins
seq 0 in place of d_i's (`take_branch`) or the branches are dropped (`drop_branches`); seqs 1.. are empty again.
Attention memories only: a recurrent state would need one copy per branch (tree.py refuses those targets).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..errors import ContextOverflowError, DecodeError
from .context import Context
from .native import llama_cpp


class TreeContext(Context):
    """A Context with `n_seq` sequences over one unified KV cache (seq 0: the committed one)."""

    def __init__(self, model, options, n_seq: int):
        self.n_seq = n_seq
        super().__init__(model, options)
        self._tree = llama_cpp.llama_batch_init(self.n_batch, 0, n_seq)
        self._branch_base = -1   # position of `last` in the pending tree pass, -1: none pending

    def _configure(self, params) -> None:
        params.n_seq_max = self.n_seq
        params.kv_unified = True   # a cell shared by several seqs is stored once

    def eval_tree(self, chain: Sequence[int], siblings: Sequence[tuple[int, int]]) -> np.ndarray:
        """Decode chain = [last, d_1..d_k] at n_past.. in seq 0 and sibling j = (i, token), an alternative to d_i
        (1 <= i <= k), in seq j + 1. Returns the logits rows (k + 1 + len(siblings), n_vocab): the chain's, then
        the siblings' in order, valid until the next decode."""
        m, n_sib = len(chain), len(siblings)
        if n_sib >= self.n_seq:
            raise DecodeError(f"internal: {n_sib} siblings for {self.n_seq} sequences")
        if self.n_pending or self.on_decode is not None:
            raise DecodeError("internal: a tree pass over a memory with a pending replay or a decode follower")
        if self.n_past + m > self.n_ctx or m + n_sib > self.n_batch:
            raise ContextOverflowError(f"context full: a tree of {m + n_sib} tokens at position {self.n_past}")
        if self._chain is not None:
            self._detach_chain()   # every row's logits come back
        base, b = self.n_past, self._tree
        for j in range(n_sib):   # each branch sees the history
            llama_cpp.llama_memory_seq_cp(self.memory, 0, j + 1, -1, -1)
        for t, token in enumerate(chain):
            b.token[t], b.pos[t], b.logits[t] = int(token), base + t, 1
            seqs = [0] + [j + 1 for j, (i, _) in enumerate(siblings) if i > t]
            b.n_seq_id[t] = len(seqs)
            for s, seq in enumerate(seqs):
                b.seq_id[t][s] = seq
        for j, (i, token) in enumerate(siblings):
            r = m + j
            b.token[r], b.pos[r], b.logits[r], b.n_seq_id[r] = int(token), base + i, 1, 1
            b.seq_id[r][0] = j + 1
        b.n_tokens = m + n_sib
        ptr = self._timed_decode(b, m + n_sib, llama_cpp.llama_get_logits, undo=self._undo_tree)
        self.tokens.extend(int(t) for t in chain)
        self._merged_from = -1
        self._branch_base = base
        return self._logits_view(ptr, m + n_sib)

    def _undo_tree(self) -> None:
        """After a failed tree pass: the branches go, and seq 0 holds its recorded tokens again."""
        self.drop_branches()
        self.resync()

    def take_branch(self, j: int, i: int, token: int) -> None:
        """Sibling j (an alternative to d_i, `token`) stands: seq 0 keeps [last, d_1..d_(i-1)] and takes the
        sibling's cell; every branch is dropped."""
        pos = self._branch_base + i
        llama_cpp.llama_memory_seq_rm(self.memory, 0, pos, -1)
        llama_cpp.llama_memory_seq_cp(self.memory, j + 1, 0, pos, pos + 1)
        del self.tokens[pos:]
        self.tokens.append(int(token))
        self.drop_branches()

    def drop_branches(self) -> None:
        t0 = time.perf_counter()
        for seq in range(1, self.n_seq):
            llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self._branch_base = -1
        self.rollback_seconds += time.perf_counter() - t0

    def clear(self) -> None:
        super().clear()
        self._branch_base = -1

    def close(self) -> None:
        if self._ptr is not None:
            llama_cpp.llama_batch_free(self._tree)
        super().close()
