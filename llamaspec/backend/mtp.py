"""The context of a target's multi-token-prediction head (MTP, "nextn"): llama.cpp runs the head's block alone
(LLAMA_CONTEXT_TYPE_MTP) over the target model's weights, with a plain KV cache of its own.

Each entry of its batches is a token *and* a hidden state: at position p the head reads the embedding of x_p and
h_{p-1} (the target's final hidden state at p-1 when it follows the target, its own output when it drafts ahead)
and predicts x_{p+1}. The legacy llama_batch carries both (token ids and `embd` rows; llama.cpp's batch conversion
keeps the two for such batches), so a batch's hidden states go in as one numpy copy rather than one llama_batch_ext
call per entry. The head's own output state is read per arch (MTP_OUTPUT_ROWS_ARCHS): most MTP graphs keep a row
per batch entry (read unmasked: llama.cpp's masked read would return the first entry's row), a few only the output
rows (read masked).

`SharedMTPContext` is the same head over a SharedContext (backend/sequences.py): a head sequence per target
sequence, several sequences' entries in one decode (`decode_runs`).

This module knows what an MTP context needs from llama.cpp, not when to decode what (drafters/mtp.py and
drafters/batched_mtp.py do).
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ..errors import ContextOverflowError, DecodeError, ModelLoadError, UnsupportedModelError
from ..sampling import Dist
from .context import Context
from .native import llama_cpp, nextn_functions
from .rollback import TailDrop
from .sequences import Sequence as SharedSequence


# archs whose llama.cpp builds an MTP graph (LLM_GRAPH_TYPE_DECODER_MTP, src/models/*.cpp); for any other arch an
# MTP context would run the trunk's graph over the head's cache, and llama.cpp aborts
MTP_GRAPH_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next", "glm4moe", "glm-dsa", "deepseek2", "deepseek32",
                             "deepseek4", "bailingmoe3", "cohere2moe", "nemotron_h_moe", "hy_v3", "mimo2", "step35"})
# archs whose MTP graph keeps its output state for the output rows only: their rows must be read masked (unmasked,
# llama.cpp reads a row per batch entry past the tensor's end and aborts); the others keep every entry's row, and
# masked reading would hand back the first entry's
MTP_OUTPUT_ROWS_ARCHS = frozenset({"qwen3next", "deepseek4", "mimo2", "step35"})


def mtp_unsupported(model) -> str | None:
    """Why `model` (a loaded backend Model) cannot draft with its MTP head, or None when it can."""
    ext, why = nextn_functions()
    if ext is None:
        return why
    arch = model.info.arch
    if model.n_layer_nextn <= 0:
        return f"{model.path}: no multi-token-prediction (MTP) head in this file (nextn_predict_layers is 0)"
    if arch not in MTP_GRAPH_ARCHS:
        return f"{model.path}: llama.cpp has no MTP graph for the {arch} architecture"
    if model.n_layer_nextn > 1:   # chained heads (one per draft position, llama_set_nextn_layer_offset)
        return f"{model.path}: {model.n_layer_nextn} chained MTP heads; llamaspec drafts with a single head only"
    if not model.mtp_loaded:
        return f"{model.path}: loaded without its MTP head (load_mtp)"
    n_embd_inp = getattr(llama_cpp, "llama_model_n_embd_inp", None)
    if n_embd_inp is not None and int(n_embd_inp(model._ptr)) != model.n_embd_out:
        return (f"{model.path}: its MTP head takes {int(n_embd_inp(model._ptr))}-wide inputs but the hidden state is "
                f"{model.n_embd_out} wide; llama.cpp's MTP batches cannot carry that")
    return None


class MTPContext(Context):
    """The MTP head of `target_ctx`'s model, at the target's context size, following the target's positions.

    `decode(tokens, first_hidden, rest_hidden, output)` appends (token, hidden state) entries at n_past..;
    `last_logits()` / `last_argmax()` / `last_hidden()` read the result for its last entry. `keep(n)` always works
    (a plain KV cache); `restart_at(p)` empties the cache and goes on at position p (llama.cpp accepts any first
    position in an empty cache), for when the hidden states of the positions before p are gone.
    """

    def __init__(self, target_ctx: Context, head=None):
        model = target_ctx.model if head is None else head   # head: a separate head file's Model (a sidecar)
        why = mtp_unsupported(model)
        if why is None and model.n_embd_out != target_ctx.model.n_embd_out:
            why = (f"{model.path}: its MTP head reads {model.n_embd_out}-wide hidden states, the target "
                   f"{target_ctx.model.path} makes {target_ctx.model.n_embd_out}-wide ones: not this target's head")
        if why is not None:
            raise UnsupportedModelError(why)
        self.target = target_ctx
        self.head = head               # a file of its own: closed with the context
        self._target_ptr = target_ctx._ptr
        options = target_ctx.options.replace(n_ctx=target_ctx.n_ctx, n_batch=target_ctx.n_batch, n_rs_seq=0)
        try:
            super().__init__(model, options)
        except ModelLoadError as exc:
            raise type(exc)(f"{exc} (the MTP head's context)") from None
        self.n_embd = model.n_embd_out

        # one batch of (token, hidden state) entries, its arrays owned here (the struct points into them)
        n = self.n_batch
        self._pair_tok = np.zeros(n, dtype=np.int32)
        self._pair_pos = np.zeros(n, dtype=np.int32)
        self._pair_embd = np.zeros((n, self.n_embd), dtype=np.float32)
        self._pair_nseq = np.ones(n, dtype=np.int32)
        self._pair_out = np.zeros(n, dtype=np.int8)
        self._seq_zero = (ctypes.c_int32 * 1)(0)
        seq_ptr = ctypes.cast(self._seq_zero, ctypes.POINTER(ctypes.c_int32))
        self._pair_seq = (ctypes.POINTER(ctypes.c_int32) * n)(*([seq_ptr] * n))
        self._pair_batch = llama_cpp.llama_batch(
            n_tokens=0, token=self._pair_tok.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token)),
            embd=self._pair_embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos=self._pair_pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos)),
            n_seq_id=self._pair_nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), seq_id=self._pair_seq,
            logits=self._pair_out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))
        self._logits_ptr = None
        self._last_n = 0                # entries of the last decode
        self._state_views: dict[int, np.ndarray] = {}
        masked = model.info.arch in MTP_OUTPUT_ROWS_ARCHS
        nextn_functions()[0].llama_set_embeddings_nextn(self._ptr, True, masked)   # its own state, to chain drafts
        target_ctx.enable_hidden_rows()  # the target's rows, to follow it

    def close(self) -> None:
        super().close()
        if self.head is not None:      # a sidecar head: its model goes with its context
            self.head.close()
            self.head = None

    def release(self) -> None:
        """Free the llama.cpp context (a head file's model stays) before its target's context is remade; then
        remake_over_target() makes it again, empty, over the target's new one."""
        head, self.head = self.head, None
        self.close()
        self.head = head

    def remake_over_target(self) -> None:
        MTPContext.__init__(self, self.target, self.head)

    def over_shared(self, target, n_seq: int) -> "SharedMTPContext":
        """This head (its model: the target's or a head file's, which stays this context's) over `target`, a
        SharedContext of the same model: a head sequence for each of its n_seq sequences."""
        return SharedMTPContext(target, n_seq, self.head)

    def _configure(self, params) -> None:
        params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        params.ctx_other = self._target_ptr
        if hasattr(params, "n_rs_seq"):
            params.n_rs_seq = 0

    def _choose_rollback(self):
        return TailDrop()               # the head's memory is a plain KV cache, whatever the trunk's is

    # -- decoding ----------------------------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], first_hidden: np.ndarray, rest_hidden: np.ndarray | None = None,
               output: str | None = None) -> None:
        """Decode entries (tokens[i], hidden_i) at positions n_past.., hidden_0 = first_hidden and hidden_i =
        rest_hidden[i-1]. output: None, "logits", "argmax" (device-side; set_device_argmax first) or "dist" (the
        filtered distribution and a draw, device-side; set_device_sampler first) of the last entry."""
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise DecodeError(f"internal: an MTP batch of {n} entries (batch size {self.n_batch})")
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(f"context full: {self.n_past} + {n} tokens exceed the context size {self.n_ctx}")
        if output == "logits" and self._chain is not None:
            self._detach_chain()
        start = self.n_past
        if n == 1:
            self._pair_tok[0] = tokens[0]
            self._pair_pos[0] = start
        else:
            self._pair_tok[:n] = tokens
            self._pair_pos[:n] = np.arange(start, start + n, dtype=np.int32)
            self._pair_embd[1:n] = rest_hidden
            self._pair_out[:n] = 0
        self._pair_embd[0] = first_hidden
        self._pair_out[n - 1] = 1 if output else 0
        self._pair_batch.n_tokens = n
        self._last_n = n
        if not output:
            self._timed_decode(self._pair_batch, n)
        elif self._chain is None:
            self._logits_ptr = self._timed_decode(self._pair_batch, n, llama_cpp.llama_get_logits)   # waits
        else:
            self._timed_decode(self._pair_batch, n, llama_cpp.llama_synchronize)
        if n == 1:
            self.tokens.append(int(tokens[0]))
        else:
            self.tokens.extend(int(t) for t in tokens)

    def last_logits(self) -> np.ndarray:
        """The logits row of the last decode's output entry (a view, valid until the next decode)."""
        return self._logits_view(self._logits_ptr, 1)[0]

    def last_argmax(self) -> int:
        token = int(llama_cpp.llama_get_sampled_token_ith(self._ptr, -1))
        if token < 0:
            raise DecodeError("llama.cpp returned no argmax token for the MTP head's output")
        return token

    def last_dist(self) -> Dist:
        """The device-filtered distribution of the last decode's output entry with the device's draw (a view,
        valid until the next decode); the draw is committed, so the next one is fresh."""
        if self._chain_kind != "sample":
            raise DecodeError("internal: last_dist without a device sampler (set_device_sampler)")
        dist = self._sampled_dist(-1)
        llama_cpp.llama_sampler_accept(self._chain, 0)
        return dist

    def last_hidden(self) -> np.ndarray:
        """The head's output hidden state for the last decode's last entry (what it reads in place of the target's
        hidden state when it drafts the next token); a view, valid until the next decode."""
        ptr = nextn_functions()[0].llama_get_embeddings_nextn_ith(self._ptr, self._last_n - 1)
        if not ptr:
            raise DecodeError("llama.cpp returned no output state for the MTP head's last entry")
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        view = self._state_views.get(address)
        if view is None:
            if len(self._state_views) > 64:
                self._state_views.clear()
            view = self._state_views[address] = np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
        return view

    def restart_at(self, position: int) -> None:
        """Empty the cache and continue at `position`; the positions before it are unknown to the head."""
        self.clear()
        self.tokens.extend([-1] * position)   # -1: never decoded here, matches no token

    def resync(self) -> None:
        """Drop anything past the recorded entries (a plain KV cache: nothing is ever replayed)."""
        llama_cpp.llama_memory_seq_rm(self.memory, 0, self.n_past, -1)

    def eval(self, tokens, logits="last"):
        raise DecodeError("internal: an MTP context decodes (token, hidden state) entries: use decode()")

    eval_argmax = eval


class SharedMTPContext(MTPContext):
    """The MTP head of a SharedContext's model over that context: `n_seq` sequences (`sequences[i]` has seq id i,
    the target's sequence i's head), each held to the target's n_ctx_seq. `decode_runs` decodes several sequences'
    (token, hidden state) entries in one llama_decode."""

    def __init__(self, target, n_seq: int, head=None):
        self.n_seq, self.recurrent = n_seq, False   # the head's memory is a plain KV cache
        super().__init__(target, head)
        self.head = None   # a head file's model stays its pair's: closing this context leaves it open
        self.n_ctx_seq = target.n_ctx_seq
        self.sequences = [SharedSequence(self, i) for i in range(n_seq)]
        self._seq_ids = (ctypes.c_int32 * n_seq)(*range(n_seq))
        base = ctypes.addressof(self._seq_ids)
        self._seq_ptrs = [ctypes.cast(base + i * ctypes.sizeof(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32))
                          for i in range(n_seq)]
        self._seq_of_row = np.zeros(self.n_batch, dtype=np.int64)   # MTPContext pointed every row at seq 0

    def _configure(self, params) -> None:
        super()._configure(params)
        params.n_seq_max = self.n_seq
        params.kv_unified = True

    def decode_runs(self, runs: list[tuple]) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Decode runs of (sequence, tokens, hidden states (one row per token), output) in one llama_decode; for each
        run with output its last entry's (logits row view, copy of the head's output state), else None."""
        n = sum(len(r[1]) for r in runs)
        if not 0 < n <= self.n_batch:
            raise DecodeError(f"internal: an MTP batch of {n} entries (batch size {self.n_batch})")
        start, outputs = 0, []
        for seq, tokens, states, output in runs:
            m = len(tokens)
            if seq.n_past + m > self.n_ctx_seq:
                raise ContextOverflowError(f"the MTP head's sequence {seq.seq_id} is full: {seq.n_past} + {m} "
                                           f"entries exceed its {self.n_ctx_seq}")
            end = start + m
            self._pair_tok[start:end] = tokens
            self._pair_pos[start:end] = np.arange(seq.n_past, seq.n_past + m, dtype=np.int32)
            self._pair_embd[start:end] = states
            self._pair_out[start:end] = 0
            if output:
                self._pair_out[end - 1] = 1
                outputs.append(end - 1)
            for i in np.flatnonzero(self._seq_of_row[start:end] != seq.seq_id):   # ctypes stores where it changed
                self._pair_seq[start + i] = self._seq_ptrs[seq.seq_id]
            self._seq_of_row[start:end] = seq.seq_id
            start = end
        self._pair_batch.n_tokens = n
        ptr = self._timed_decode(self._pair_batch, n, llama_cpp.llama_get_logits if outputs else None,   # waits
                                 undo=lambda: self._undo_runs(runs), what="the MTP head's batch of {n} entries")
        for seq, tokens, *_ in runs:
            seq.tokens.extend(int(t) for t in tokens)
        logits = self._logits_view(ptr, len(outputs)) if outputs else None
        ith = nextn_functions()[0].llama_get_embeddings_nextn_ith
        rows, j = [], 0
        for *_, output in runs:
            if not output:
                rows.append(None)
                continue
            state = ith(self._ptr, outputs[j])
            if not state:
                raise DecodeError("llama.cpp returned no output state for the MTP head's entry")
            rows.append((logits[j], np.ctypeslib.as_array(state, shape=(self.n_embd,)).copy()))
            j += 1
        return rows

    def _undo_runs(self, runs: list[tuple]) -> None:
        """After a failed decode: whatever part llama.cpp stored goes, every sequence is as before."""
        for seq, *_ in runs:
            llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, seq.n_past, -1)
