"""Hidden states across two contexts, for drafts that read the target's (EAGLE-3, DFlash).

- `LayerTaps`: the inputs of some of a target context's layers, copied out after each of its decodes.
- `HiddenDraftContext`: the context of such a draft. It borrows the target's token embeddings / output head when it
  has none (llama.cpp's `ctx_other`), takes rows of target features or (token, hidden row) pairs through the extended
  batch (`llama_batch_ext` + `llama_process`), and hands back logits rows and its own hidden rows.

The layer-input and hidden-row functions live in llama.cpp's staging header `llama-ext.h`: C++ linkage, so libllama
exports them under mangled names, and llama-cpp-python binds only some of them. They are looked up here at import,
as `llama_cpp.llama_cpp_ext` looks up its own (plain name, Itanium, MSVC); `missing_hidden_api()` names what this
build lacks. Which target archs can be tapped at all is `gguf.hidden_pair.TAP_ARCHS`: any other one aborts the
process inside llama.cpp, so `LayerTaps` refuses it before asking. Nothing here knows about drafting.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ..config import ModelConfig
from ..errors import DecodeError, UnsupportedModelError
from ..gguf.hidden_pair import HEAD_TAP_ARCHS, TAP_ARCHS, hidden_draft_info
from .context import Context
from .model import Model
from .native import CACHE_TYPE_IDS, FLASH_ATTN, NativeHandle, default_threads, llama_cpp, load_error, native_log

_FLOAT_P = ctypes.POINTER(ctypes.c_float)
_CTX = ctypes.c_void_p


def _bind(names: Sequence[str], argtypes, restype):
    lib = getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None)
    for name in names:
        func = getattr(lib, name, None) if lib is not None else None
        if func is not None:
            func.argtypes, func.restype = argtypes, restype
            return func
    return None


# void llama_set_embeddings_layer_inp(llama_context *, uint32_t lid, bool); float * llama_get_embeddings_layer_inp(
# llama_context *, uint32_t lid); void llama_set_embeddings_nextn(llama_context *, bool value, bool masked);
# float * llama_get_embeddings_nextn(llama_context *); float * llama_get_embeddings_nextn_ith(llama_context *, int32_t)
_EXT = {
    "llama_set_embeddings_layer_inp": _bind(
        ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
         "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"), [_CTX, ctypes.c_uint32, ctypes.c_bool], None),
    "llama_get_embeddings_layer_inp": _bind(
        ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
         "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"), [_CTX, ctypes.c_uint32], _FLOAT_P),
    "llama_set_embeddings_nextn": _bind(
        ("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb",
         "?llama_set_embeddings_nextn@@YAXPEAUllama_context@@_N1@Z"), [_CTX, ctypes.c_bool, ctypes.c_bool], None),
    "llama_get_embeddings_nextn": _bind(
        ("llama_get_embeddings_nextn", "_Z26llama_get_embeddings_nextnP13llama_context",
         "?llama_get_embeddings_nextn@@YAPEAMPEAUllama_context@@@Z"), [_CTX], _FLOAT_P),
    "llama_get_embeddings_nextn_ith": _bind(
        ("llama_get_embeddings_nextn_ith", "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
         "?llama_get_embeddings_nextn_ith@@YAPEAMPEAUllama_context@@H@Z"), [_CTX, ctypes.c_int32], _FLOAT_P),
}
# ...and what the bindings must have of the public API
_PUBLIC = ("llama_batch_ext_init", "llama_batch_ext_free", "llama_batch_ext_clear", "llama_batch_ext_add_token",
           "llama_batch_ext_add_embd", "llama_batch_ext_set_pos", "llama_batch_ext_set_embd_token",
           "llama_batch_ext_set_output_logits", "llama_process", "llama_embd", "llama_set_causal_attn")


def missing_hidden_api() -> list[str]:
    """The functions EAGLE-3/DFlash drafting needs that this llama-cpp-python build does not have."""
    missing = [name for name, func in _EXT.items() if func is None]
    missing += [name for name in _PUBLIC if not hasattr(llama_cpp, name)]
    if "ctx_other" not in dict(llama_cpp.llama_context_params._fields_):
        missing.append("llama_context_params.ctx_other")
    return missing


def require_hidden_api(what: str) -> None:
    missing = missing_hidden_api()
    if missing:
        raise UnsupportedModelError(
            f"{what} needs llama.cpp functions this llama-cpp-python build does not export ({', '.join(missing)}); "
            "install llama-cpp-python 0.3.36 or newer")


class LayerTaps:
    """The inputs of `layers` of a target context, after each of its decodes, as one row per batch token:
    [input of layers[0] | input of layers[1] | ...] (float32, len(layers) * n_embd wide). Layer id n_layer is the
    last layer's output, for the archs in HEAD_TAP_ARCHS."""

    def __init__(self, ctx: Context, layers: Sequence[int]):
        require_hidden_api("reading a target's hidden states")
        arch, n_layer = ctx.model.info.arch, int(llama_cpp.llama_model_n_layer(ctx.model._ptr))
        top = n_layer if arch in HEAD_TAP_ARCHS else n_layer - 1
        if arch not in TAP_ARCHS:  # llama.cpp would abort the process at the next decode
            raise UnsupportedModelError(f"{ctx.model.path}: llama.cpp cannot read the layer inputs of a {arch!r} "
                                        f"model (supported: {', '.join(sorted(TAP_ARCHS))})")
        if not layers or any(not 0 <= int(x) <= top for x in layers):
            raise UnsupportedModelError(f"{ctx.model.path}: cannot tap layers {list(layers)} (valid: 0..{top})")
        self.ctx = ctx
        self.layers = tuple(int(x) for x in layers)
        self.n_embd = int(llama_cpp.llama_model_n_embd(ctx.model._ptr))
        self.width = len(self.layers) * self.n_embd
        for layer in sorted(set(self.layers)):
            _EXT["llama_set_embeddings_layer_inp"](ctx._ptr, layer, True)

    def copy_rows(self, n: int, out: np.ndarray) -> None:
        """Copy the last decode's n rows into out[:n] ((n, width) float32)."""
        llama_cpp.llama_synchronize(self.ctx._ptr)  # the copies out of the graph are asynchronous
        get, e = _EXT["llama_get_embeddings_layer_inp"], self.n_embd
        for k, layer in enumerate(self.layers):
            ptr = get(self.ctx._ptr, layer)
            if not ptr:
                raise DecodeError(f"llama.cpp returned no input rows for target layer {layer}")
            out[:n, k * e:(k + 1) * e] = np.ctypeslib.as_array(ptr, shape=(n, e))


class HiddenDraftContext(NativeHandle):
    """The context of an EAGLE-3 or DFlash draft model, bound to its target's context (`ctx_other`), with the taps
    on the target's layers it reads (`taps`) and what its header says (`info`, a gguf.hidden_pair.HiddenDraftInfo).

    Positions are explicit: the draft's cache follows the target's positions, and llama.cpp wants each batch to
    start right after the cached ones. Logits and hidden rows are views valid until the next batch.
    """

    def __init__(self, model: Model, options: ModelConfig, target_ctx: Context):
        require_hidden_api(f"{model.path.name} ({model.info.arch} draft)")
        info = hidden_draft_info(model.info)
        if info is None:
            raise UnsupportedModelError(f"{model.path}: not an EAGLE-3 or DFlash draft (arch {model.info.arch!r})")
        self.model, self.options, self.target_ctx, self.info = model, options, target_ctx, info
        self._ptr = None
        self._chain = self._chain_kind = None   # a device sampler chain (set_device_argmax)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = target_ctx.n_ctx
        params.n_batch = params.n_ubatch = target_ctx.n_batch   # the encoder takes a whole batch as one ubatch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = options.n_threads or default_threads()
        params.flash_attn_type = FLASH_ATTN[options.flash_attn]
        params.type_k = CACHE_TYPE_IDS[options.cache_type_k]
        params.type_v = CACHE_TYPE_IDS[options.cache_type_v]
        params.no_perf = True
        params.ctx_other = target_ctx._ptr   # its token embeddings and output head, when the draft has none
        if hasattr(params, "n_outputs_max_per_seq"):
            params.n_outputs_max_per_seq = 0
        with native_log() as log:
            ptr = llama_cpp.llama_init_from_model(model._ptr, params)
        self.load_log = "".join(log)
        if not ptr:
            raise load_error(self.load_log, f"{model.path}: llama.cpp could not create the draft's context",
                             "use a smaller context (-c) or fewer GPU layers for the draft")
        self._ptr = ptr
        self.taps = LayerTaps(target_ctx, info.target_layers)
        # its hidden rows ("nextn" embeddings), one per output row: EAGLE-3's encoder output and pre-norm state
        _EXT["llama_set_embeddings_nextn"](ptr, True, True)
        if not info.causal:  # a DFlash block attends to all of itself
            llama_cpp.llama_set_causal_attn(ptr, False)
        self.memory = llama_cpp.llama_get_memory(ptr)
        self.n_ctx = int(llama_cpp.llama_n_ctx(ptr))
        self.n_batch = int(llama_cpp.llama_n_batch(ptr))
        self.n_vocab = model.n_vocab
        self.n_embd = int(llama_cpp.llama_model_n_embd(model._ptr))
        self._batch = llama_cpp.llama_batch_ext_init(ptr)
        self._pos = (llama_cpp.llama_pos * 4)()    # M-RoPE drafts read 4 positions per embedding row
        self.decode_seconds = 0.0
        self.decode_calls = 0
        self.rollback_seconds = 0.0     # its cache drops a tail with seq_rm: nothing to restore or replay
        self.replayed_tokens = 0

    # -- batches ------------------------------------------------------------------------------------------------
    def _row(self, rows: np.ndarray, i: int):
        return llama_cpp.llama_embd(ctypes.cast(rows.ctypes.data + i * rows.strides[0], _FLOAT_P), 1, rows.shape[1])

    def _add(self, token: int | None, pos: int, row, output: bool) -> None:
        b, lc = self._batch, llama_cpp
        idx = lc.llama_batch_ext_add_embd(b, 0, row) if token is None else lc.llama_batch_ext_add_token(b, 0, token)
        if idx < 0:
            raise DecodeError(f"internal: the draft's batch refused an entry (code {idx})")
        self._pos[0] = self._pos[1] = self._pos[2] = pos
        lc.llama_batch_ext_set_pos(b, idx, self._pos)
        if token is not None and row is not None and not lc.llama_batch_ext_set_embd_token(b, idx, row):
            raise DecodeError("internal: the draft refused a hidden row (width mismatch)")
        if output:
            lc.llama_batch_ext_set_output_logits(b, idx, True)

    def _process(self, kind: int, n: int) -> None:
        try:
            self._timed_decode(self._batch, n, llama_cpp.llama_synchronize, what="the draft's batch of {n} entries",
                               process=kind)
        finally:
            llama_cpp.llama_batch_ext_clear(self._batch)

    _timed_decode = Context._timed_decode   # the one timed decode (its cache needs no repair after a failure)

    def encode(self, features: np.ndarray, out: np.ndarray) -> None:
        """EAGLE-3's encoder: out[i] = fc(features[i]) for every row (no cache; the positions are placeholders
        after the cached ones, which llama.cpp checks even here)."""
        n, first = len(features), self.n_cached()
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            for i in range(m):
                self._add(None, first + i, self._row(features, start + i), True)
            self._process(llama_cpp.LLAMA_PROCESS_TYPE_ENCODE, m)
            out[start:start + m] = np.ctypeslib.as_array(_EXT["llama_get_embeddings_nextn"](self._ptr),
                                                         shape=(m, self.n_embd))

    def decode(self, tokens: Sequence[int], first_pos: int, rows: np.ndarray | None = None,
               outputs: int = 0) -> None:
        """Decode tokens[i] at first_pos + i, each paired with rows[i] when given (EAGLE-3's (token, hidden)
        entries); the last `outputs` entries have output rows. One batch: len(tokens) <= n_batch."""
        n = len(tokens)
        if n > self.n_batch:
            raise DecodeError(f"internal: draft batch of {n} entries, batch size is {self.n_batch}")
        for i, token in enumerate(tokens):
            self._add(int(token), first_pos + i, None if rows is None else self._row(rows, i), i >= n - outputs)
        self._process(llama_cpp.LLAMA_PROCESS_TYPE_DECODE, n)

    def inject(self, features: np.ndarray, first_pos: int) -> None:
        """DFlash: store the projection of features[i] in the cache at first_pos + i (no outputs)."""
        n = len(features)
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            for i in range(m):
                self._add(None, first_pos + start + i, self._row(features, start + i), False)
            self._process(llama_cpp.LLAMA_PROCESS_TYPE_DECODE, m)

    # -- outputs of the last batch -------------------------------------------------------------------------------
    def logits(self, rows: int) -> np.ndarray:
        """(rows, n_vocab) view of the last batch's output rows, in batch order."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ptr), shape=(rows, self.n_vocab))

    def hidden(self, i: int = -1) -> np.ndarray:
        """The draft's hidden row (pre-norm state) of output i of the last batch (-1: the last)."""
        ptr = _EXT["llama_get_embeddings_nextn_ith"](self._ptr, i)
        if not ptr:
            raise DecodeError("llama.cpp returned no hidden row for the draft's output")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,))

    def argmax(self, rows: int) -> list[int]:
        """Argmax token of each of the last batch's output rows: on the device with `set_device_argmax`."""
        if self._chain_kind != "argmax":
            return self.logits(rows).argmax(axis=1).tolist()
        get = llama_cpp.llama_get_sampled_token_ith
        out = [get(self._ptr, i) for i in range(-rows, 0)]
        if min(out) < 0:
            raise DecodeError("llama.cpp returned no argmax token for a draft output row")
        return out

    # the same greedy sampler chain on seq 0 as a target context's (it needs only _ptr and the chain fields)
    set_device_argmax = Context.set_device_argmax
    device_argmax = Context.device_argmax
    _attach_chain = Context._attach_chain
    _detach_chain = Context._detach_chain

    # Sampling filters for this draft run in numpy on its logits (the engine asks every context; one that says
    # no makes all of them filter by the same rule)
    prefers_device_sampling = False

    def set_device_sampler(self, cfg, seed: int = 0) -> bool:
        return False

    # -- the cache -----------------------------------------------------------------------------------------------
    def keep(self, n: int) -> None:
        """Drop every position >= n (a plain attention cache: always possible)."""
        llama_cpp.llama_memory_seq_rm(self.memory, 0, max(n, 0), -1)

    def n_cached(self) -> int:
        """Highest cached position + 1 (0 when empty)."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.memory, 0)) + 1

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def resync(self) -> None:
        """Nothing to repair: the drafter keeps its own account of the cache (the engine calls this on exit)."""

    def close(self) -> None:
        if self._ptr is not None:
            self._detach_chain()
            llama_cpp.llama_batch_ext_free(self._batch)
            llama_cpp.llama_free(self._ptr)
            self._ptr = None
