"""One sequence's cache over a model: decode a batch at explicit positions, hand back logits rows as zero-copy numpy
views, device-side argmaxes or device-side filtered distributions, and keep the first n tokens (the one rollback
operation)."""
from __future__ import annotations

import contextlib
import ctypes
import time
from typing import Sequence

import numpy as np

from .. import interrupt
from ..config import ModelConfig
from ..errors import Cancelled, ContextOverflowError, DecodeError
from .device_sampling import DeviceSampling, last_sampled_token
from .model import Model
from .native import (CACHE_TYPE_IDS, FLASH_ATTN, NativeHandle, decode_stops, default_threads, llama_cpp, load_error,
                     native_log, nextn_functions)
from .rollback import NoRollback, Rollback, choose_rollback
from .state_cache import SavedSeq, read_seq, write_seq

STOPPABLE = 64   # decodes of this many tokens or more can be stopped midway (Context._stoppable)
_NO_ABORT = llama_cpp.ggml_abort_callback()   # a NULL callback: llama.cpp no longer asks


class Context(DeviceSampling, NativeHandle):
    """One sequence's KV cache over a model, with explicit positions.

    `eval(tokens, logits)` appends tokens at positions n_past.. and returns the logits rows asked for as a view
    into llama.cpp's buffer, valid until the next eval. `keep(n)` drops every position >= n, the way the model's
    memory allows (`rollback`, chosen when the context is made; see rollback.py for the contract). A memory that
    went back by restoring a checkpoint holds fewer tokens than recorded: the last `n_pending` recorded tokens are
    decoded again in front of the next eval's tokens (the caller sees only the rows it asked for).
    `checkpoint(turn)` marks a position the memory may be asked to come back to.

    `on_decode(tokens, first_position)`, when set, runs after every llama_decode of this context (each chunk of a
    long eval, every verification, every replay, every single token), while that decode's rows are still readable: an MTP
    head follows the target through it (`hidden_rows`), an EAGLE-3 / DFlash draft reads its layer inputs.
    """

    def __init__(self, model: Model, options: ModelConfig = ModelConfig()):
        self.model = model
        self.options = options
        self._ptr = None
        self._chain = None           # a sampler chain attached to seq 0: greedy (set_device_argmax) or filtering
        self._chain_kind = None      # (set_device_sampler): "argmax" or "sample"
        self._sorted_rows = False    # "sample" chain with top-p and no top-k: each row's candidates come sorted
        self._chain_key = None       # ("sample" chain) its filters
        self._row_shape = None       # ("sample" chain) (probabilities, candidates) per row, read at its first row
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = options.n_ctx
        params.n_batch = options.n_batch
        n_ubatch = min(options.n_ubatch or options.n_batch, options.n_batch)   # llama.cpp's -ub, at most -b
        params.n_ubatch = n_ubatch
        params.n_seq_max = 1
        threads = options.n_threads or default_threads()
        params.n_threads = threads
        params.n_threads_batch = threads
        params.flash_attn_type = FLASH_ATTN[options.flash_attn]
        params.type_k = CACHE_TYPE_IDS[options.cache_type_k]
        params.type_v = CACHE_TYPE_IDS[options.cache_type_v]
        params.no_perf = True
        if hasattr(params, "n_outputs_max_per_seq"):
            params.n_outputs_max_per_seq = 0  # = n_batch: device argmax of every verified row (set_device_argmax)
        if hasattr(params, "n_rs_seq"):
            # recurrent-state snapshots for rollback; llama.cpp aborts on the first decode unless
            # n_ubatch >= n_rs_seq + 2 (llama.cpp lowers n_ubatch to n_ctx)
            params.n_rs_seq = min(options.n_rs_seq, max(min(n_ubatch, options.n_ctx) - 2, 0))
        self._configure(params)

        with native_log() as log:
            ptr = llama_cpp.llama_init_from_model(model._ptr, params)
        self.load_log = "".join(log)
        if not ptr:
            raise load_error("".join(log), f"{model.path}: llama.cpp could not create a context of "
                              f"{options.n_ctx} tokens", "use a smaller context (-c), a quantized KV cache "
                              "(-ctk q8_0 -ctv q8_0), or fewer GPU layers")
        self._ptr = ptr
        self.memory = llama_cpp.llama_get_memory(ptr)
        self.n_ctx = int(llama_cpp.llama_n_ctx(ptr))
        self.n_batch = int(llama_cpp.llama_n_batch(ptr))  # llama.cpp lowers n_batch to n_ctx
        self.n_vocab = model.n_vocab

        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(ctypes.cast(b.logits, ctypes.POINTER(ctypes.c_int8)), shape=(self.n_batch,))
        self._nseq[:] = 1
        for i in range(self.n_batch):
            b.seq_id[i][0] = 0

        self.tokens: list[int] = []
        self.n_pending = 0          # the last n_pending recorded tokens are not in the memory: replayed next eval
        self._merged_from = -1      # where the last decode started when it carried a replay in front (else -1)
        self._prefix = 0            # replayed tokens in front of the last decode's own (output rows start after)
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self.decode_seconds = 0.0   # accumulated time inside llama_decode + logits sync
        self.decode_calls = 0
        self.on_decode = None       # callback(tokens, first_position) after each decode (see the class docstring)
        self._hidden = None         # (base address, view) of the last hidden-state rows (hidden_rows)
        self.rollback_seconds = 0.0  # time saving/restoring state and trimming the cache (keep, checkpoints)
        self.replayed_tokens = 0     # tokens decoded again after a checkpoint restore

        self.rollback: Rollback = NoRollback()  # while choose_rollback probes the memory
        self._before_decode, self._checkpoints = None, False
        self.rollback = self._choose_rollback()
        hooks = type(self.rollback)
        self._before_decode = None if hooks.before_decode is Rollback.before_decode else self.rollback.before_decode
        self._checkpoints = hooks.checkpoint is not Rollback.checkpoint

    def _configure(self, params) -> None:
        """Change llama_context_params before the context is made (a subclass's hook)."""

    def _choose_rollback(self) -> Rollback:
        """How this context's memory goes back (a subclass's hook; runs once, on the empty memory)."""
        return choose_rollback(self, self.options.n_checkpoints)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def enable_hidden_rows(self) -> None:
        """Make llama.cpp keep the final hidden state of every token of each decode (the input of an MTP head)."""
        ext, why = nextn_functions()
        if ext is None:
            raise DecodeError(why)
        ext.llama_set_embeddings_nextn(self._ptr, True, False)   # unmasked: one row per batch token

    def hidden_rows(self, n: int) -> np.ndarray:
        """(n, n_embd) zero-copy view of the hidden states of the last decode's first n tokens (enable_hidden_rows
        first); valid until the next decode."""
        ptr = nextn_functions()[0].llama_get_embeddings_nextn(self._ptr)   # waits for the device (on_decode: done)
        if not ptr:
            raise DecodeError("llama.cpp returned no hidden states for the last decode")
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        if self._hidden is None or self._hidden[0] != address:
            self._hidden = (address, np.ctypeslib.as_array(ptr, shape=(self.n_batch, self.model.n_embd_out)))
        return self._hidden[1][:n]

    @property
    def n_in_memory(self) -> int:
        """Recorded tokens the memory holds (n_past less those waiting to be replayed)."""
        return len(self.tokens) - self.n_pending

    def memory_len(self) -> int:
        """What llama.cpp's memory holds for the sequence: 1 + its highest position."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.memory, 0)) + 1

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray | None:
        """Decode `tokens` at positions n_past.. ; logits: 'last', 'all' or 'none'.

        Returns a (rows, n_vocab) float32 view (rows = 1 for 'last', len(tokens) for 'all'), or None.
        """
        if logits != "none" and self._chain is not None:
            self._detach_chain()  # logits wanted: llama.cpp must copy them out again
        if len(tokens) == 1 and logits != "none" and not self.n_pending:
            return self._eval_one(int(tokens[0]))
        ptr = self._decode(tokens, logits)
        if logits == "none":
            return None
        return self._logits_view(ptr, len(tokens) if logits == "all" else 1)

    def eval_argmax(self, tokens: Sequence[int], rows: str = "last") -> list[int]:
        """Decode `tokens` and return the argmax token of the last row ('last') or of every row ('all'): greedy
        decoding's only need. With `set_device_argmax(True)` llama.cpp takes the argmax on the device and no
        logits are copied; otherwise numpy takes it from the logits."""
        one = len(tokens) == 1 and not self.n_pending
        if self._chain_kind != "argmax":
            if self._chain is not None:
                self._detach_chain()
            if one:
                return [int(self._eval_one(int(tokens[0]))[0].argmax())]
            return self._logits_view(self._decode(tokens, rows), len(tokens) if rows == "all" else 1) \
                .argmax(axis=1).tolist()
        if one:  # the drafting hot path: reading the token waits for the device, so it is the decode's sync
            out = [self._decode_one(int(tokens[0]), sync=last_sampled_token)]
        else:
            self._decode(tokens, rows)
            get = llama_cpp.llama_get_sampled_token_ith
            out = [get(self._ptr, self._prefix + i) for i in range(len(tokens))] if rows == "all" and len(tokens) > 1 \
                else [get(self._ptr, -1)]
        if min(out) < 0:
            raise DecodeError("llama.cpp returned no argmax token for an output row")
        return out

    def _decode(self, tokens: Sequence[int], logits: str):
        """Decode in chunks of n_batch; outputs: every row ('all'), the last row ('last') or none. Returns
        llama.cpp's logits pointer after the last chunk when outputs were asked for (synchronised)."""
        n = len(tokens)
        if n == 0:
            raise DecodeError("internal: eval of an empty batch")
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(
                f"context full: {self.n_past} + {n} tokens exceed the context size {self.n_ctx}")
        if logits == "all" and n > self.n_batch:
            raise DecodeError(f"internal: {n} rows of logits asked for, batch size is {self.n_batch}")
        if n <= 64 and not isinstance(tokens, np.ndarray):   # a draft's or a verification's few: no numpy
            low, high = min(tokens), max(tokens)
            tokens = np.asarray(tokens, dtype=np.int32)
        else:
            tokens = np.asarray(tokens, dtype=np.int32)
            low, high = tokens.min(), tokens.max()
        if low < 0 or high >= self.n_vocab:
            raise DecodeError(f"token id out of range for {self.model.path.name} (vocabulary of {self.n_vocab})")
        prefix = 0
        if self.n_pending:  # replay what a checkpoint restore left out, in front of the new tokens
            replay = self._take_replay()
            if logits == "all" and len(replay) + n > self.n_batch:
                self._decode(replay, "none")  # on its own: every output row must land in one chunk
            else:
                tokens, prefix = np.concatenate([np.asarray(replay, dtype=np.int32), tokens]), len(replay)
                n = len(tokens)
        self._merged_from, self._prefix = (self.n_past if prefix else -1), prefix
        if n < STOPPABLE:
            return self._decode_chunks(tokens, logits, prefix)
        with self._stoppable():
            return self._decode_chunks(tokens, logits, prefix)

    @contextlib.contextmanager
    def _stoppable(self):
        """A decode of n >= STOPPABLE tokens (a prefill, a catch-up) stops soon after a stop is requested
        (interrupt.py): llama.cpp's CPU backend asks between graph nodes, and the chunk loop between chunks.
        Shorter decodes (drafting, verification) never pay for a Python call per graph node."""
        with interrupt.signals_stop():
            llama_cpp.llama_set_abort_callback(self._ptr, decode_stops, None)
            try:
                yield
            finally:
                llama_cpp.llama_set_abort_callback(self._ptr, _NO_ABORT, None)

    def _decode_chunks(self, tokens: np.ndarray, logits: str, prefix: int):
        n = len(tokens)
        ptr = None
        start = 0
        while start < n:
            if start and interrupt.requested():
                raise Cancelled(f"stopped after {start} of {n} tokens")
            chunk = tokens[start:start + self.n_batch]
            m = len(chunk)
            last_chunk = start + m == n
            self._tok[:m] = chunk
            self._pos[:m] = np.arange(self.n_past, self.n_past + m, dtype=np.int32)
            self._out[:m] = 0
            first_out = max(prefix - start, 0) if logits == "all" else m - 1 if logits == "last" and last_chunk else m
            self._out[first_out:m] = 1
            if self._before_decode is not None:
                t_hook = time.perf_counter()
                self._before_decode(self, m, m - first_out)
                self.rollback_seconds += time.perf_counter() - t_hook
            self._batch.n_tokens = m
            sync = None if not last_chunk or logits == "none" else \
                llama_cpp.llama_get_logits if self._chain is None else llama_cpp.llama_synchronize
            if sync is None and self.on_decode is not None:
                # a follower reads this decode's rows at once, which waits for the device: the wait is the decode's
                # (untimed, on an H100 137 us a pass of the 27B's verification counted as Python's)
                sync = llama_cpp.llama_synchronize
            ptr = self._timed_decode(self._batch, m, sync)
            self.tokens.extend(chunk.tolist())
            if self.on_decode is not None:
                self.on_decode(chunk, self.n_past - m)
            start += m
        return ptr

    def _eval_one(self, token: int) -> np.ndarray:
        """The drafting hot path: one token, its logits row."""
        return self._logits_view(self._decode_one(token, sync=llama_cpp.llama_get_logits), 1)

    def _decode_one(self, token: int, sync):
        """Decode one token with its output row: plain ctypes stores, no numpy set-up. `sync(ctx)` runs right
        after llama_decode and is timed with it (fetching the logits or the device argmax waits for the device);
        returns what it returned."""
        if not 0 <= token < self.n_vocab:
            raise DecodeError(f"token id {token} out of range for {self.model.path.name} (vocabulary of {self.n_vocab})")
        b = self._batch
        b.token[0] = token
        b.pos[0] = len(self.tokens)
        b.logits[0] = 1
        b.n_tokens = 1
        self._merged_from = -1
        if self._before_decode is not None:
            self._before_decode(self, 1, 1)
        result = self._timed_decode(b, 1, sync)
        self.tokens.append(token)
        if self.on_decode is not None:
            self.on_decode((token,), self.n_past - 1)
        return result

    def _timed_decode(self, batch, n: int, sync=None, undo=None, what: str | None = None,
                      process: int | None = None):
        """Every decode of a batch goes through here: llama_decode(batch) of n entries (llama_process of that kind
        for an extended batch), then, when it succeeded, `sync(ctx)` (reading the logits or the device's tokens waits
        for the device), the two timed together in decode_seconds and counted in decode_calls. Returns what sync
        returned (None without one).

        On failure `undo()` puts the memory back as it was before the batch (default: resync, for this context's one
        sequence) and an error says what failed: a batch that `what` names ("a shared batch of {n} tokens", with n
        filled in) is a DecodeError naming it; one sequence's batch is a ContextOverflowError when no KV cache slot
        was left, Cancelled when the abort callback stopped it (interrupt.py), else a DecodeError."""
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self._ptr, batch) if process is None else \
            llama_cpp.llama_process(self._ptr, process, batch)
        result = sync(self._ptr) if rc == 0 and sync is not None else None
        self.decode_seconds += time.perf_counter() - t0
        self.decode_calls += 1
        if rc != 0:
            (undo or self.resync)()   # whatever part of the batch llama.cpp stored goes: the cache is as before
            if what is not None:
                call = "llama_decode" if process is None else "llama_process"
                raise DecodeError(f"{call} failed with code {rc} on {what.format(n=n)}")
            if rc == 1:
                raise ContextOverflowError(f"no KV cache slot for {n} tokens at position {self.n_past} "
                                           f"(context {self.n_ctx})")
            if rc == 2:   # the abort callback said stop (interrupt.py)
                raise Cancelled(f"stopped while decoding {n} tokens")
            raise DecodeError(f"llama_decode failed with code {rc}")
        return result

    def _logits_view(self, ptr, rows: int) -> np.ndarray:
        """A numpy view of llama.cpp's logits buffer, made once per (address, rows): building one costs more
        than the rest of a one-token eval's Python work."""
        key = (ctypes.cast(ptr, ctypes.c_void_p).value, rows)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            view = self._views[key] = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return view

    def keep(self, n: int) -> bool:
        """Keep the first n tokens and drop the rest. False when the memory cannot (then nothing changed).

        After a checkpoint restore the memory holds fewer than n: the rest is replayed with the next eval, or at
        once when the restore undid a decode that already carried a replay (so replays never pile up)."""
        if n >= self.n_past:
            return True
        if self.n_past - n <= self.n_pending:  # only tokens not yet decoded go
            self.n_pending -= self.n_past - n
            del self.tokens[n:]
            return True
        t0 = time.perf_counter()
        try:
            reached = self.rollback.keep(self, n)
            if reached is None:
                return False
            del self.tokens[n:]
            self.n_pending = n - reached
            if self.n_pending and reached == self._merged_from:
                self._decode(self._take_replay(), "none")
            return True
        finally:
            self.rollback_seconds += time.perf_counter() - t0

    def reach(self, n: int) -> int:
        """How many of the first n recorded tokens the memory would hold after keep(n), without changing anything
        (the rest of them would be replayed; 0: it would start over)."""
        if n >= self.n_in_memory:
            return self.n_in_memory
        return self.rollback.reach(self, n)

    def save_state(self, **extra) -> SavedSeq | None:
        """The memory's whole state (KV cells and recurrent state) with the tokens it holds, copies of its turn
        checkpoints and `extra` records, for a host-memory cache (state_cache.py); None when llama.cpp has nothing
        to write."""
        data = read_seq(self._ptr, 0)
        return None if data is None else SavedSeq(data, self.tokens[:self.n_in_memory], self.rollback.turns(), extra)

    def restore_state(self, saved: SavedSeq) -> bool:
        """Make the memory what `saved` was (its turn checkpoints become this memory's); False when llama.cpp
        refused it (the memory is then empty)."""
        if not write_seq(self._ptr, 0, saved.data):
            self.clear()
            return False
        self.tokens[:] = saved.tokens
        self.n_pending, self._merged_from = 0, -1
        self.rollback.adopt(saved.turns)
        return True

    def checkpoint(self, turn: bool = False) -> None:
        """Mark the current position as one to come back to: the start of a drafting run (turn=False: the next
        keep() will not go below it) or a turn boundary a later prompt may extend. Memories that can drop any
        tail ignore it; recurrent ones save their state here (rollback.py)."""
        if self._checkpoints:
            t0 = time.perf_counter()
            self.rollback.checkpoint(self, turn)
            self.rollback_seconds += time.perf_counter() - t0

    def _take_replay(self) -> list[int]:
        replay = self.tokens[len(self.tokens) - self.n_pending:]
        del self.tokens[len(self.tokens) - self.n_pending:]
        self.n_pending = 0
        self.replayed_tokens += len(replay)
        return replay

    def resync(self) -> None:
        """Make the memory hold exactly the recorded tokens again, after an interrupted eval or keep."""
        held, recorded = self.memory_len(), self.n_in_memory
        if held == recorded:
            return
        if held < recorded:  # a restore ran without its bookkeeping: drop any attention tail, replay the rest
            llama_cpp.llama_memory_seq_rm(self.memory, 0, held, -1)
            self.n_pending += recorded - held
            return
        reached = self.rollback.keep(self, recorded)  # a decode ran without being recorded
        if reached is None:
            self.clear()  # no way back: start over (the caller's next prompt is decoded in full)
        else:
            self.n_pending = self.n_past - reached

    def logits_finite(self) -> bool:
        """Whether one token decoded into the empty memory gives finite logits (damaged weights give NaN for every
        token); the memory is empty again afterwards and the decode is not counted."""
        calls, seconds = self.decode_calls, self.decode_seconds
        try:
            row = self.eval([max(self.model.bos, 0)], "last")[0]
            return bool(np.isfinite(row).all())
        finally:
            self.clear()
            self.decode_calls, self.decode_seconds = calls, seconds

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)
        self.tokens.clear()
        self.n_pending = 0
        self.rollback.clear()

    def remake(self, n_ctx: int) -> None:
        """Free this context's llama.cpp memory and make it again, empty, with room for n_ctx tokens; whoever
        holds this object keeps a working context. A plain Context only (a subclass's own set-up is not redone)."""
        if type(self) is not Context:
            raise DecodeError(f"internal: cannot remake a {type(self).__name__}")
        self.close()   # first: the old memory is gone before the new one is allocated
        Context.__init__(self, self.model, self.options.replace(n_ctx=n_ctx))

    def close(self) -> None:
        if self._ptr is not None:
            self._detach_chain()
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ptr)
            self._ptr = None

