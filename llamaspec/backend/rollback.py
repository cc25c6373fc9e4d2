"""How a context's memory goes back to its first n tokens: the one cache operation the engine asks for after a
verification ("keep n"). Which way a model takes is decided here, per context, from what llama.cpp says of it;
nothing above the backend learns which kind of memory a model has.

The contract between a Context and its Rollback:

- `before_decode(ctx, n_tokens, n_outputs)` runs before every llama_decode of `n_tokens` tokens at the memory's
  position `ctx.n_in_memory`, `n_outputs` of them with logits rows (several rows: a verification; one: drafting or
  the last prompt token; none: a prefill). A kind that snapshots its state does it here.
- `keep(ctx, n) -> int | None` is asked only for n < ctx.n_in_memory: make the memory hold the first n recorded
  tokens. It returns the position m <= n the memory now holds: n when it dropped the tail, less when it restored a
  checkpoint taken at m. The Context then decodes tokens[m:n] again in front of its next batch (a *replay*, as
  llama.cpp's server replays accepted tokens as the next step's draft: it rides along with the next verification
  instead of costing a pass of its own). None when it cannot: nothing changed.
- `checkpoint(ctx, turn)`: the Context's users mark a position to come back to. turn=False: the start of a drafting
  run (a draft model decodes one token at a time; the next keep() will not go below this). turn=True: a turn
  boundary (the end of a prompt or of a generation) that a later prompt may extend, as llama.cpp's server keeps
  `--ctx-checkpoints`. Memories that drop any tail ignore both.
- `clear()`: the memory was emptied; every checkpoint is void.

The kinds, chosen by `choose_rollback` when a context is made:

- `TailDrop`: attention KV caches drop any tail (`llama_memory_seq_rm`).
- `BoundedRollback`: archs with recurrent-state snapshots (`n_rs_seq`; qwen35, qwen35moe, lfm2, nemotron_h, ...):
  after a decode of m tokens `seq_rm` may drop up to min(n_rs_seq, m - 1) of them, once. llama.cpp returns True
  but leaves a wrong state when asked to drop the whole last decode, or after single-token decodes, so the limit is
  tracked here and never read from seq_rm's answer. Beyond it, a checkpoint; a verification longer than the
  snapshots reach saves one first.
- `CheckpointRollback`: recurrent state without snapshots (qwen3next, mamba, mamba2, jamba, ...), found the way
  llama.cpp's `common_context_can_seq_rm` probes a context: the recurrent state is saved before each verification,
  restored on a partial acceptance, the attention KV trimmed with seq_rm, and the accepted tokens replayed.
- `NoRollback`: a state that can be neither cut nor saved: speculation is refused, plain decoding works.

Checkpoints use `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`: a hybrid saves only its recurrent part (its attention KV is
trimmed with seq_rm instead); for a pure recurrent memory partial is all of it (lfm2's also carries its sliding-
window KV). The one step checkpoint stays in device memory (`_ON_DEVICE`: a device-side copy, each save replacing
the last) where the saved state has a fixed size: llama.cpp aborts the process when an on-device restore finds a
different layout, so a state that grows with the tokens (or LLAMASPEC_HOST_CHECKPOINTS=1) keeps host copies.
Turn checkpoints are host copies. A checkpoint taken at position q is valid while tokens[:q] are unchanged, so
every keep(n) drops those after n.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..errors import DecodeError
from .native import env_flag, llama_cpp

SEQ = 0
PARTIAL_ONLY = getattr(llama_cpp, "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY", 1)
ON_DEVICE = getattr(llama_cpp, "LLAMA_STATE_SEQ_FLAGS_ON_DEVICE", 2)
DEFAULT_TURN_CHECKPOINTS = 32   # llama-server's --ctx-checkpoints default (config.ModelConfig.n_checkpoints)


class Rollback:
    """The contract (see the module docstring); this base can do nothing."""

    name = "none"
    speculative = False          # can it drop rejected draft tokens, i.e. serve speculation?

    def before_decode(self, ctx, n_tokens: int, n_outputs: int) -> None:
        pass

    def keep(self, ctx, n: int) -> int | None:
        return None

    def reach(self, ctx, n: int) -> int:
        """The position keep(ctx, n) would bring the memory back to, without changing it (0: it would start over)."""
        return 0

    def checkpoint(self, ctx, turn: bool = False) -> None:
        pass

    def turns(self) -> list:
        """Copies of the turn checkpoints (objects with `pos` and `data`), for a saved state (state_cache.py)."""
        return []

    def adopt(self, turns: list) -> None:
        """The memory was restored from a saved state whose turn checkpoints were `turns` (theirs from now on)."""
        self.clear()

    def clear(self) -> None:
        pass

    def describe(self) -> str:
        return self.name


class TailDrop(Rollback):
    """Attention-only memory: any tail can be dropped."""

    name = "kv"
    speculative = True

    def keep(self, ctx, n: int) -> int | None:
        return n if llama_cpp.llama_memory_seq_rm(ctx.memory, SEQ, n, -1) else None

    def reach(self, ctx, n: int) -> int:
        return n

    def describe(self) -> str:
        return "kv (drops any tail)"


class NoRollback(Rollback):
    """Recurrent state this llama.cpp can neither cut nor save: cleared and re-decoded when the history changes."""

    def describe(self) -> str:
        return "none (recurrent state that can be neither cut nor saved)"


@dataclass
class _Snapshot:
    pos: int                 # tokens in the memory when it was taken
    data: np.ndarray         # llama.cpp's serialised state (only a header when on_device)
    size: int
    on_device: bool


class _Snapshots(Rollback):
    """Checkpoints of a recurrent state: one step checkpoint and up to `n_turns` turn checkpoints; keep(n)
    restores the newest one at or before n."""

    speculative = True

    def __init__(self, n_turns: int = DEFAULT_TURN_CHECKPOINTS, on_device: bool = False):
        self.n_turns = n_turns
        self._step: _Snapshot | None = None
        self._turns: list[_Snapshot] = []
        self._device = on_device  # the step checkpoint stays on the device, until a save there fails
        self._spare: list[np.ndarray] = []  # host buffers of dropped checkpoints: a fresh one costs page faults

    def _save(self, ctx, on_device: bool, reuse: _Snapshot | None = None) -> _Snapshot | None:
        flags = PARTIAL_ONLY | (ON_DEVICE if on_device else 0)
        size = int(llama_cpp.llama_state_seq_get_size_ext(ctx._ptr, SEQ, flags))
        if size <= 0:
            return None
        if reuse is not None and not reuse.on_device:
            self._spare.append(reuse.data)
        fit = next((i for i, b in enumerate(self._spare) if b.size >= size), None) if not on_device else None
        buf = self._spare.pop(fit) if fit is not None else np.empty(size, dtype=np.uint8)
        written = int(llama_cpp.llama_state_seq_get_data_ext(
            ctx._ptr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, SEQ, flags))
        return _Snapshot(ctx.n_in_memory, buf, written, on_device) if written else None

    def _save_step(self, ctx) -> None:
        if self._step is not None and self._step.pos == ctx.n_in_memory:
            return  # the state here is saved already (a restore brought the memory back to it)
        snap = self._save(ctx, self._device, reuse=self._step)
        if snap is None and self._device:
            self._device = False
            snap = self._save(ctx, False)
        self._step = snap

    def checkpoint(self, ctx, turn: bool = False) -> None:
        if not turn:
            self._save_step(ctx)
            return
        if self.n_turns == 0 or any(s.pos == ctx.n_in_memory for s in self._turns):
            return
        reuse = self._turns.pop(0) if len(self._turns) >= self.n_turns else None
        snap = self._save(ctx, False, reuse)
        if snap is not None:
            self._turns.append(snap)

    def reach(self, ctx, n: int) -> int:
        return max((s.pos for s in (self._step, *self._turns) if s is not None and s.pos <= n), default=0)

    def turns(self) -> list:
        return [_Snapshot(s.pos, s.data[:s.size].copy(), s.size, False) for s in self._turns]

    def adopt(self, turns: list) -> None:
        self.clear()
        self._turns = list(turns)

    def keep(self, ctx, n: int) -> int | None:
        if n == 0:  # removing the whole sequence always works
            llama_cpp.llama_memory_seq_rm(ctx.memory, SEQ, -1, -1)
            self.clear()
            return 0
        saved = [s for s in (self._step, *self._turns) if s is not None and s.pos <= n]
        if not saved:
            return None
        best = max(saved, key=lambda s: s.pos)
        flags = PARTIAL_ONLY | (ON_DEVICE if best.on_device else 0)
        read = llama_cpp.llama_state_seq_set_data_ext(
            ctx._ptr, best.data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), best.size, SEQ, flags)
        if not read:  # the state may be half written: start the sequence over, the Context replays it all
            llama_cpp.llama_memory_seq_rm(ctx.memory, SEQ, -1, -1)
            self.clear()
            return 0
        # the restored recurrent cell ends at best.pos - 1, so this drops only the attention KV after it
        if not llama_cpp.llama_memory_seq_rm(ctx.memory, SEQ, best.pos, -1):
            raise DecodeError("llama.cpp could not trim the attention cache after restoring a checkpoint")
        self._forget_after(n)
        return best.pos

    def _forget_after(self, n: int) -> None:
        """Checkpoints taken after position n are void: the tokens before them changed."""
        dropped = [s for s in (self._step, *self._turns) if s is not None and s.pos > n]
        self._spare = (self._spare + [s.data for s in dropped if not s.on_device])[-2:]
        self._step = self._step if self._step is not None and self._step.pos <= n else None
        self._turns = [s for s in self._turns if s.pos <= n]

    def clear(self) -> None:
        self._forget_after(-1)


class CheckpointRollback(_Snapshots):
    """Recurrent state without snapshots: save it before each verification, restore it on a partial acceptance;
    the accepted tokens are replayed in front of the next batch."""

    name = "checkpoint"

    def before_decode(self, ctx, n_tokens: int, n_outputs: int) -> None:
        if n_outputs > 1:  # a verification: some of it may be rejected
            self._save_step(ctx)

    def describe(self) -> str:
        return "checkpoint (saves the recurrent state before each verification, restores it and replays)"


class BoundedRollback(_Snapshots):
    """Recurrent state with n_rs_seq snapshots: drop up to min(n_rs_seq, m - 1) tokens of the last decode of m."""

    name = "bounded"

    def __init__(self, n_rs_seq: int, n_turns: int = DEFAULT_TURN_CHECKPOINTS, on_device: bool = False):
        super().__init__(n_turns, on_device)
        self.n_rs_seq = n_rs_seq
        self._undoable = 0

    def before_decode(self, ctx, n_tokens: int, n_outputs: int) -> None:
        # A decode of m tokens (one ubatch: n_ubatch = n_batch) writes snapshot planes 0..min(m, n_rs_seq + 1) - 1,
        # plane d holding the state d tokens before its end; plane m - 1 is the state after its first token, the
        # furthest back it can go. Planes it did not write are stale: a single-token decode undoes nothing.
        self._undoable = min(self.n_rs_seq, n_tokens - 1)
        if n_outputs > self.n_rs_seq + 1:  # a draft longer than the snapshots reach: keep a way back
            self._save_step(ctx)

    def keep(self, ctx, n: int) -> int | None:
        drop = ctx.memory_len() - n
        if 0 < drop <= self._undoable and llama_cpp.llama_memory_seq_rm(ctx.memory, SEQ, n, -1):
            self._undoable = 0  # one rollback per decode
            self._forget_after(n)
            return n
        reached = super().keep(ctx, n)
        if reached is not None:
            self._undoable = 0  # restoring a state consumes any pending rollback
        return reached

    def reach(self, ctx, n: int) -> int:
        return n if 0 < ctx.memory_len() - n <= self._undoable else super().reach(ctx, n)

    def adopt(self, turns: list) -> None:
        super().adopt(turns)
        self._undoable = 0

    def describe(self) -> str:
        return (f"bounded (n_rs_seq={self.n_rs_seq}: drops up to {self.n_rs_seq} tokens of the last verification; "
                "checkpoint beyond)")


def choose_rollback(ctx, n_turns: int = DEFAULT_TURN_CHECKPOINTS) -> Rollback:
    """The rollback for `ctx`, a freshly made Context (its memory empty)."""
    model = ctx.model
    if not (model.is_recurrent or model.is_hybrid):
        return TailDrop()
    n_rs_seq = int(llama_cpp.llama_n_rs_seq(ctx._ptr)) if hasattr(llama_cpp, "llama_n_rs_seq") else 0
    # common_context_can_seq_rm's probe: decode two tokens and try to drop the second; and whether the saved
    # state keeps its size as tokens are added (only then may a checkpoint live in device memory)
    sizes = []
    try:
        for _ in range(2):
            ctx.eval([max(model.bos, 0)], logits="none")
            sizes.append(int(llama_cpp.llama_state_seq_get_size_ext(ctx._ptr, SEQ, PARTIAL_ONLY)))
    except DecodeError:
        ctx.clear()
        return NoRollback()
    on_device = sizes[0] == sizes[1] and not env_flag("LLAMASPEC_HOST_CHECKPOINTS")
    drops_tail = n_rs_seq == 0 and bool(llama_cpp.llama_memory_seq_rm(ctx.memory, SEQ, 1, -1))
    ctx.clear()
    if n_rs_seq > 0:
        return BoundedRollback(n_rs_seq, n_turns, on_device)
    if drops_tail:
        return TailDrop()
    return CheckpointRollback(n_turns, on_device) if min(sizes) > 0 else NoRollback()
