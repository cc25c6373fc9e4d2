"""Several sequences in one llama.cpp context: N sequence ids over one unified KV cache, each with its own token
record and `keep(n)`, and one llama_decode for a batch made of several sequences' token runs.

A `Run` is one sequence's tokens for the next decode (appended at that sequence's own positions) and which of their
rows come back: every row ("all": a verification), the last ("last": the last prompt token, a draft token) or none
(a prefill chunk). `SharedContext.decode(runs)` packs the runs into one batch, decodes it once and returns each run's
rows as a zero-copy view into llama.cpp's logits buffer (valid until the next decode), or None.

The KV cache is unified (`kv_unified`): the sequences share its cells, so a long one may use what short ones leave,
and llama.cpp puts a batch of mixed sequences in one ubatch. Each sequence is held to `n_ctx_seq` = n_ctx / n_seq
tokens, so no decode can run out of cells. Nothing here knows what a run means (a verification, a draft, a sibling
branch of a tree): sequence ids are handed out by whoever owns the context.

Recurrent and hybrid memories (qwen35, ...): llama.cpp gives each sequence its own recurrent state cell, and with
`n_rs_seq` snapshots (rollback.py, BoundedRollback) `Sequence.keep` may drop up to min(n_rs_seq, m - 1) tokens of
the sequence's run in the context's last decode (m tokens), once; llama.cpp keeps that snapshot index per sequence,
and its equal split of a multi-sequence batch keeps each sequence's last n_rs_seq + 1 tokens in one ubatch, so the
bound holds per run whatever the other runs' lengths. Beyond it, a sequence goes back only to a turn checkpoint:
`checkpoint_turn()` saves its recurrent part (host copies, `n_checkpoints` a sequence, the oldest dropped first) at
the end of a prompt, and a later prompt that leaves what followed (a chat template that re-renders the last answer)
restarts there (`reusable` names that position, `keep` restores it) instead of from nothing. A caller that verifies
drafts keeps them within `n_rs_seq`. llama.cpp hands logits rows back in the batch's order even when it reorders ubatches.
The single-sequence methods inherited from Context (eval, keep, ...) act on sequence 0's record and are not used on
a shared context; `on_runs(runs)` takes the place of `on_decode` (an MTP head reads each run's hidden rows there).
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..errors import ContextOverflowError, DecodeError
from ..sampling import SamplerConfig
from .context import Context
from .device_sampling import LazyRows, attach, chain_key, greedy_chain, read_dist, sampling_chain, sorted_rows
from .model import Model
from .native import env_flag, llama_cpp
from .rollback import PARTIAL_ONLY, NoRollback, Rollback, TailDrop
from .state_cache import SavedSeq, read_seq, write_seq


def batchable(ctx: Context, drafts: bool) -> str | None:
    """None when `ctx`'s model can hold several sequences in a SharedContext (verifying drafts, if `drafts`);
    otherwise why not. A recurrent or hybrid model verifies drafts only where llama.cpp keeps recurrent-state
    snapshots for it (n_rs_seq: `ctx`, a one-sequence context made with them, shows whether it honoured them)."""
    model = ctx.model
    if drafts and (model.is_recurrent or model.is_hybrid) and getattr(ctx.rollback, "n_rs_seq", 0) < 1:
        return (f"{model.path.name} keeps a recurrent state without rollback snapshots (n_rs_seq), which llamaspec "
                "cannot roll back per sequence in a shared context")
    return None


@dataclass
class _Turn:
    pos: int            # tokens the sequence held when it was saved
    data: np.ndarray    # llama.cpp's serialised recurrent state (PARTIAL_ONLY)
    size: int


class Sequence:
    """One sequence id of a SharedContext: the tokens its memory holds (positions 0..n_past-1)."""

    def __init__(self, shared: "SharedContext", seq_id: int):
        self.shared, self.seq_id = shared, seq_id
        self.tokens: list[int] = []
        self.undoable = 0   # recurrent state: tokens of its run in the last decode that keep() can drop
        self.turns: list[_Turn] = []   # recurrent state: turn checkpoints, oldest first
        self.restored_tokens = 0       # how far turn checkpoints took it back in all (what they saved re-decoding)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def n_ctx(self) -> int:
        return self.shared.n_ctx_seq

    def reusable(self, tokens: list[int]) -> int:
        """How many of `tokens`' first tokens this sequence can keep: their common prefix with its record; on a
        recurrent state only if it holds all of the record or drops no more than `undoable` of it, else the newest
        turn checkpoint within the common prefix (0 without one)."""
        common = next((i for i, (a, b) in enumerate(zip(self.tokens, tokens)) if a != b), min(self.n_past, len(tokens)))
        if not self.shared.recurrent or self.n_past - common <= self.undoable:
            return common
        return max((t.pos for t in self.turns if t.pos <= common), default=0)

    def checkpoint_turn(self) -> None:
        """Save the recurrent state here (the end of a prompt) for a later prompt to come back to."""
        if not self.shared.recurrent or self.shared.n_turns < 1 or any(t.pos == self.n_past for t in self.turns):
            return
        t0 = time.perf_counter()
        ptr, flags = self.shared._ptr, PARTIAL_ONLY
        size = int(llama_cpp.llama_state_seq_get_size_ext(ptr, self.seq_id, flags))
        if size > 0:
            old = self.turns.pop(0) if len(self.turns) >= self.shared.n_turns else None
            data = old.data if old is not None and old.data.size >= size else np.empty(size, dtype=np.uint8)
            written = int(llama_cpp.llama_state_seq_get_data_ext(
                ptr, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, self.seq_id, flags))
            if written:
                self.turns.append(_Turn(self.n_past, data, written))
        self.shared.rollback_seconds += time.perf_counter() - t0

    def _restore(self, n: int) -> bool:
        """Back to the turn checkpoint taken at n: its recurrent state, the attention cache trimmed after it."""
        turn = next((t for t in self.turns if t.pos == n), None)
        if turn is None:
            return False
        t0 = time.perf_counter()
        read = llama_cpp.llama_state_seq_set_data_ext(self.shared._ptr, turn.data.ctypes.data_as(
            ctypes.POINTER(ctypes.c_uint8)), turn.size, self.seq_id, PARTIAL_ONLY)
        ok = bool(read) and bool(llama_cpp.llama_memory_seq_rm(self.shared.memory, self.seq_id, n, -1))
        self.shared.rollback_seconds += time.perf_counter() - t0
        if not ok:   # the state may be half written: the sequence starts over
            self.clear()
            return False
        self.restored_tokens += self.n_past - n
        del self.tokens[n:]
        self.undoable = 0
        self.turns = [t for t in self.turns if t.pos <= n]
        return True

    def keep(self, n: int) -> bool:
        """Keep the first n tokens, drop the rest (llama_memory_seq_rm on this sequence only). On a recurrent
        state: False (nothing changed) beyond what the last decode's snapshots undo (`undoable`), except n = 0."""
        if n >= self.n_past:
            return True
        if n == 0:
            self.clear()
            return True
        if self.shared.recurrent and self.n_past - n > self.undoable:
            return self._restore(n)
        t0 = time.perf_counter()
        ok = bool(llama_cpp.llama_memory_seq_rm(self.shared.memory, self.seq_id, n, -1))
        self.shared.rollback_seconds += time.perf_counter() - t0
        self.undoable = 0   # one rollback per decode
        if ok:
            del self.tokens[n:]
            self.turns = [t for t in self.turns if t.pos <= n]
        return ok

    def save(self, **extra) -> SavedSeq | None:
        """This sequence's whole state (KV cells and recurrent state), its tokens and copies of its turn checkpoints,
        with `extra` records, for a host-memory cache (state_cache.py); None when llama.cpp has nothing to write."""
        data = read_seq(self.shared._ptr, self.seq_id)
        return None if data is None else SavedSeq(
            data, list(self.tokens), [_Turn(t.pos, t.data[:t.size].copy(), t.size) for t in self.turns], extra)

    def restore(self, saved: SavedSeq) -> bool:
        """Make this sequence what `saved` was (its turn checkpoints become this sequence's); False when llama.cpp
        refused it (the sequence is then empty)."""
        if not write_seq(self.shared._ptr, self.seq_id, saved.data):
            self.clear()
            return False
        self.tokens[:] = saved.tokens
        self.undoable = 0
        self.turns = list(saved.turns)
        return True

    def clear(self) -> None:
        llama_cpp.llama_memory_seq_rm(self.shared.memory, self.seq_id, -1, -1)
        self.tokens.clear()
        self.undoable = 0
        self.turns = []


class _SeqChain:
    """A sampling chain attached to one sequence (SharedContext.set_seq_sampler) and the shape of its rows."""

    __slots__ = ("chain", "sorted_rows", "shape")

    def __init__(self, chain, sorted_rows: bool):
        self.chain, self.sorted_rows, self.shape = chain, sorted_rows, None


@dataclass
class Run:
    """One sequence's tokens in a shared decode; outputs: 'all', 'last' or 'none'."""

    seq: Sequence
    tokens: list[int]
    outputs: str = "all"

    @property
    def n_rows(self) -> int:
        return len(self.tokens) if self.outputs == "all" else int(self.outputs == "last")


class SharedContext(Context):
    """One llama.cpp context holding `n_seq` sequences (`sequences[i]` has seq id i) over a unified KV cache; a
    recurrent state per sequence with `n_rs_seq` snapshots (options.n_rs_seq, as llama.cpp honoured it: 0 for an
    attention model or an arch without snapshots)."""

    Run = Run   # callers that do not import the backend build their runs with shared.Run(...)

    def __init__(self, model: Model, options: ModelConfig, n_seq: int):
        if n_seq < 1:
            raise DecodeError(f"internal: a shared context of {n_seq} sequences")
        self.n_seq = n_seq
        self.recurrent = model.is_recurrent or model.is_hybrid
        self.n_turns = options.n_checkpoints   # turn checkpoints a sequence keeps (Sequence.checkpoint_turn)
        super().__init__(model, options)
        self.n_rs_seq = int(llama_cpp.llama_n_rs_seq(self._ptr)) \
            if self.recurrent and hasattr(llama_cpp, "llama_n_rs_seq") else 0
        self.n_ctx_seq = self.n_ctx // n_seq
        self.sequences = [Sequence(self, i) for i in range(n_seq)]
        self._seq_of_row = np.full(self.n_batch, -1, dtype=np.int64)   # the seq id each batch slot was given last
        self.on_runs = None   # callback(runs) after each llama_decode, before the runs' tokens are recorded (an
        #                       MTP head follows the target's hidden rows through it: drafters/batched_mtp.py)
        self._argmax_chains: dict[int, object] = {}   # seq id -> the greedy chain attached to it (set_seq_argmax)
        self._sample_chains: dict[int, _SeqChain] = {}   # seq id -> its sampling chain (set_seq_sampler)

    def _configure(self, params) -> None:
        params.n_seq_max = self.n_seq
        params.kv_unified = True
        if hasattr(params, "n_rs_seq") and not self.recurrent:
            params.n_rs_seq = 0

    def _choose_rollback(self) -> Rollback:
        # each Sequence drops its own tail (keep); the one-sequence rollback is not used here
        return NoRollback() if self.recurrent else TailDrop()

    def set_seq_argmax(self, seq_id: int, on: bool) -> bool:
        """Attach (or detach) a greedy sampler to one sequence, so that llama.cpp takes its output rows' argmax in the
        graph: `decode` then hands that sequence's rows back as their argmax tokens, and a decode whose every output
        row has such a sampler copies no logits out (llama.cpp's needs_raw_logits). Returns whether it is attached
        (a build that cannot run it keeps the logits). Attaching makes llama.cpp reserve its graphs again at the
        next decode: a sequence keeps its sampler from request to request while they are greedy."""
        chain = self._argmax_chains.get(seq_id)
        if on == (chain is not None):
            return on
        if on and seq_id in self._sample_chains:
            self.set_seq_sampler(seq_id, None)
        if not on:
            llama_cpp.llama_set_sampler(self._ptr, seq_id, None)
            llama_cpp.llama_sampler_free(self._argmax_chains.pop(seq_id))
            return False
        chain = greedy_chain()
        if chain is None or not attach(self._ptr, seq_id, chain):
            return False
        self._argmax_chains[seq_id] = chain
        return True

    def seq_argmax(self, seq_id: int) -> bool:
        return seq_id in self._argmax_chains

    def set_seq_sampler(self, seq_id: int, cfg: SamplerConfig | None, seed: int | None = None) -> bool:
        """Attach a sampling chain for `cfg` (its filters and a draw seeded from `seed`) to one sequence, so that
        llama.cpp filters that sequence's output rows and draws from them in the graph: `decode` then hands its rows
        back as sampling.Dist rows (each read when first asked for) and copies no logits for them. None detaches.
        Returns whether it is attached (a build or device that cannot run every sampler of it keeps the logits).
        A caller attaches it where the sequence has output rows in every decode from then on and detaches it when
        they end: with a chain attached to a sequence that has no rows in a decode, the vendored llama.cpp handed
        other sequences' sampled rows back stale (candidates that were not ids, ids past the vocabulary)."""
        old = self._sample_chains.pop(seq_id, None)
        if old is not None:
            llama_cpp.llama_set_sampler(self._ptr, seq_id, None)
            llama_cpp.llama_sampler_free(old.chain)
        if cfg is None or cfg.greedy or not hasattr(llama_cpp, "llama_get_sampled_probs_ith"):
            return False
        self.set_seq_argmax(seq_id, False)
        key = chain_key(cfg, self.n_vocab)
        chain = sampling_chain(key, seed)
        if not attach(self._ptr, seq_id, chain):
            return False
        self._sample_chains[seq_id] = _SeqChain(chain, sorted_rows(key))
        return True

    def seq_sampler(self, seq_id: int) -> bool:
        return seq_id in self._sample_chains

    @property
    def samples_on_device(self) -> bool:
        """Whether sampled sequences should get sampling chains (set_seq_sampler): only where asked for
        (LLAMASPEC_BATCH_DEVICE_SAMPLING=1; not yet measured on a GPU), on a context that prefers device sampling (a
        GPU, or LLAMASPEC_DEVICE_SAMPLING=1)."""
        return env_flag("LLAMASPEC_BATCH_DEVICE_SAMPLING") and self.prefers_device_sampling

    def decode(self, runs: list[Run]) -> list:
        """Decode every run in one llama_decode; each run's rows (a (rows, n_vocab) float32 view; for a sequence with
        a greedy sampler attached, `set_seq_argmax`, their argmax tokens; with a sampling chain, `set_seq_sampler`,
        their filtered distributions and draws, each read when first asked for) or None.

        A recurrent state's snapshots live in its cell, and llama.cpp gathers the sequences of a ubatch into
        neighbouring cells without moving the snapshots of those it displaces: a run can be undone only if no later
        ubatch of the decode holds several sequences. So here the runs without rows (prefill chunks) go first (one
        such run in the same llama_decode, several in one of their own before), and the runs with rows undo only
        when they all have the same length (llama.cpp's equal split then puts them in one ubatch, after which at
        most the chunk's remainder runs, alone); callers verifying drafts pad their runs to one length."""
        if self.recurrent:
            quiet = [r for r in runs if r.outputs == "none"]
            if len(quiet) > 1 and len(quiet) < len(runs):
                self.decode(quiet)
                rows = iter(self.decode([r for r in runs if r.outputs != "none"]))
                return [None if r.outputs == "none" else next(rows) for r in runs]
            if quiet and runs[0] is not quiet[0]:
                order = quiet + [r for r in runs if r.outputs != "none"]
                rows = dict(zip(map(id, order), self.decode(order)))
                return [rows[id(r)] for r in runs]
        n = sum(len(r.tokens) for r in runs)
        if n == 0 or n > self.n_batch:
            raise DecodeError(f"internal: a shared batch of {n} tokens (batch size {self.n_batch})")
        b, start, n_out, spans, raw = self._batch, 0, 0, [], False
        chains, samplers = self._argmax_chains, self._sample_chains
        for run in runs:
            m, seq = len(run.tokens), run.seq
            if seq.n_past + m > self.n_ctx_seq:
                raise ContextOverflowError(f"sequence {seq.seq_id} full: {seq.n_past} + {m} tokens exceed its "
                                           f"{self.n_ctx_seq} (context {self.n_ctx} over {self.n_seq} sequences)")
            tokens = np.asarray(run.tokens, dtype=np.int32)
            if tokens.min() < 0 or tokens.max() >= self.n_vocab:
                raise DecodeError(f"token id out of range for {self.model.path.name} (vocabulary of {self.n_vocab})")
            end = start + m
            self._tok[start:end] = tokens
            self._pos[start:end] = np.arange(seq.n_past, seq.n_past + m, dtype=np.int32)
            self._out[start:end] = run.outputs == "all"
            if run.outputs == "last":
                self._out[end - 1] = 1
            for i in np.flatnonzero(self._seq_of_row[start:end] != seq.seq_id):   # ctypes stores where it changed
                b.seq_id[start + i][0] = seq.seq_id
            self._seq_of_row[start:end] = seq.seq_id
            rows = run.n_rows
            spans.append((n_out, rows, end - rows))   # (first output row, rows, the batch index of the first)
            raw = raw or (rows > 0 and seq.seq_id not in chains and seq.seq_id not in samplers)
            n_out += rows
            start = end
        b.n_tokens = n
        # reading the logits, or where every row is sampled on the device waiting for it, ends the timed span
        # (or where a follower reads the batch's rows at once: backend/context.py's _decode_chunks)
        sync = llama_cpp.llama_get_logits if raw else \
            llama_cpp.llama_synchronize if n_out or self.on_runs is not None else None
        ptr = self._timed_decode(b, n, sync, undo=lambda: self._undo_runs(runs), what="a shared batch of {n} tokens")
        if self.on_runs is not None:
            self.on_runs(runs)
        if self.recurrent:   # llama.cpp's split keeps each run's last n_rs_seq + 1 tokens in one ubatch
            for seq in self.sequences:
                seq.undoable = 0
            lengths = {len(r.tokens) for r in runs if r.outputs != "none"}
            for run in runs:
                if len(runs) == 1 or run.outputs != "none" and len(lengths) == 1:
                    run.seq.undoable = min(self.n_rs_seq, len(run.tokens) - 1)
        for run in runs:
            run.seq.tokens.extend(run.tokens)
        view = self._logits_view(ptr, n_out) if raw else None
        out = []
        for run, (a, rows, first) in zip(runs, spans):
            seq_id = run.seq.seq_id
            if not rows:
                out.append(None)
            elif seq_id in chains:
                out.append(self._argmaxes(first, rows))
            elif seq_id in samplers:
                out.append(self._dists(samplers[seq_id], first, rows))
            else:
                out.append(view[a:a + rows])
        return out

    def _argmaxes(self, first: int, n: int) -> list[int]:
        """The device's argmax tokens of batch entries first .. first + n - 1 (a sequence with a greedy sampler)."""
        get, ctx = llama_cpp.llama_get_sampled_token_ith, self._ptr
        out = [get(ctx, first + i) for i in range(n)]
        if min(out) < 0:
            raise DecodeError("llama.cpp returned no argmax token for an output row")
        return out

    def _dists(self, sc: _SeqChain, first: int, n: int) -> LazyRows:
        """The filtered rows of batch entries first .. first + n - 1 (a sequence with a sampling chain), each read
        when first asked for. Each of the chain's draws is committed now (one accept a row): with several outputs
        of a sequence, llama.cpp's dist sampler would otherwise replay its draws in the next decode."""
        for _ in range(n):
            llama_cpp.llama_sampler_accept(sc.chain, 0)

        def read(i: int):
            dist, sc.shape = read_dist(self, i, None, sc.shape, sc.sorted_rows)
            return dist

        return LazyRows(read, first, n)

    def _undo_runs(self, runs: list[Run]) -> None:
        """After a failed decode: whatever part llama.cpp stored goes, every sequence is as before (a recurrent state
        cannot go back without a snapshot: those sequences start over)."""
        for run in runs:
            if not self.recurrent:
                llama_cpp.llama_memory_seq_rm(self.memory, run.seq.seq_id, run.seq.n_past, -1)
            else:
                run.seq.clear()

    def close(self) -> None:
        if self._ptr is not None:
            for seq_id in list(self._argmax_chains):
                self.set_seq_argmax(seq_id, False)
            for seq_id in list(self._sample_chains):
                self.set_seq_sampler(seq_id, None)
        super().close()


def shared_like(ctx: Context, n_seq: int, n_ctx: int | None = None, n_rs_seq: int = 0) -> SharedContext:
    """A SharedContext over `ctx`'s model with its settings, holding n_seq sequences in n_ctx tokens (default: n_seq
    times ctx's, so each sequence has the room a lone one has); n_rs_seq: recurrent-state snapshots per sequence
    (the longest draft it will verify; 0 for no drafts)."""
    options = ctx.options.replace(n_ctx=n_ctx or ctx.n_ctx * n_seq, n_rs_seq=n_rs_seq)
    return SharedContext(ctx.model, options, n_seq)

