"""The only module that imports llama_cpp: load a model, make a context, decode a batch at explicit positions and
hand back logits rows as zero-copy numpy views, drop a sequence tail, tokenize and detokenize.

Everything above this module speaks token ids, numpy arrays and plain dataclasses. A `Context` holds exactly one
sequence (seq 0); its `n_past` is the number of tokens in its KV cache, and those tokens are `tokens`.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import ContextOverflowError, DecodeError, GPUOutOfMemoryError, ModelLoadError, UnsupportedModelError
from .gguf_meta import ModelInfo, read_model_info

try:
    import llama_cpp
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "llamaspec needs llama-cpp-python: pip install llama-cpp-python "
        "(for NVIDIA GPUs: CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install llama-cpp-python)"
    ) from exc

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
FLASH_ATTN = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}
SPLIT_MODES = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
               "row": llama_cpp.LLAMA_SPLIT_MODE_ROW}


def default_threads() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n <= 4 else n // 2


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp's log goes through llama-cpp-python's own callback, which prints errors (and, through its level map,
# warnings) to sys.stderr unless verbose. While a model or context is created, sys.stderr is a string buffer, much
# as llama_cpp.Llama(verbose=False) silences it: the terminal stays clean and a failure can be explained.
# ---------------------------------------------------------------------------------------------------------------
_LOG_STATE = {"verbose": env_flag("LLAMASPEC_VERBOSE")}
_INIT_LOCK = threading.Lock()
_INITIALISED = False


def init_backend(verbose: bool | None = None) -> None:
    global _INITIALISED
    if verbose is not None:
        _LOG_STATE["verbose"] = verbose or env_flag("LLAMASPEC_VERBOSE")
    llama_cpp._logger.set_verbose(_LOG_STATE["verbose"])
    with _INIT_LOCK:
        if not _INITIALISED:
            llama_cpp.llama_backend_init()
            _INITIALISED = True


@contextlib.contextmanager
def _native_log():
    """Collect what llama.cpp logs while the block runs (it reaches Python's sys.stderr through
    llama-cpp-python's callback); yields a list that holds the text afterwards."""
    text: list[str] = []
    if _LOG_STATE["verbose"]:
        yield text
        return
    buf, saved = io.StringIO(), sys.stderr
    sys.stderr = buf
    llama_cpp._logger.set_verbose(True)
    try:
        yield text
    finally:
        llama_cpp._logger.set_verbose(False)
        sys.stderr = saved
        text.append(buf.getvalue()[-50000:])


_OOM_PATTERN = re.compile(r"out of memory|failed to allocate|cudaMalloc failed|ErrorOutOfDeviceMemory|"
                          r"unable to allocate", re.IGNORECASE)


def _load_error(log: str, what: str, oom_hint: str) -> ModelLoadError:
    if _OOM_PATTERN.search(log):
        return GPUOutOfMemoryError(f"{what}: out of memory; {oom_hint}")
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return ModelLoadError(f"{what} ({lines[-1] if lines else 'no details from llama.cpp'})")


def supports_gpu_offload() -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


def system_info() -> str:
    return llama_cpp.llama_print_system_info().decode("utf-8", errors="replace")


def library_version() -> str:
    return getattr(llama_cpp, "__version__", "unknown")


# ---------------------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelOptions:
    n_gpu_layers: int = -1           # -1 = all (ignored by a CPU-only build)
    main_gpu: int = 0
    split_mode: str = "layer"        # none | layer | row
    tensor_split: tuple[float, ...] | None = None
    use_mmap: bool = True
    no_repack: bool = False          # True turns off llama.cpp's extra CPU buffer types (weight repacking)
    rpc_servers: str | None = None   # "host:port,host:port" for llama.cpp's RPC backend (build with -DGGML_RPC=on)


@dataclass(frozen=True)
class ContextOptions:
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int | None = None
    flash_attn: str = "auto"         # auto | on | off
    type_k: str = "f16"
    type_v: str = "f16"


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------
class Model:
    """A loaded GGUF model: weights, vocabulary and tokenizer."""

    def __init__(self, path: str | os.PathLike, options: ModelOptions = ModelOptions(), info: ModelInfo | None = None):
        init_backend()
        self.path = Path(path).expanduser()
        self.info = info or read_model_info(self.path)  # missing / not GGUF / truncated: ModelFileError
        self.options = options
        self._ptr = None

        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = options.n_gpu_layers if options.n_gpu_layers >= 0 else 0x7FFFFFFF
        params.main_gpu = options.main_gpu
        if options.split_mode not in SPLIT_MODES:
            raise ModelLoadError(f"split mode must be one of {', '.join(SPLIT_MODES)}, got {options.split_mode!r}")
        params.split_mode = SPLIT_MODES[options.split_mode]
        if options.tensor_split:
            n_max = llama_cpp.llama_max_devices()
            if len(options.tensor_split) > n_max:
                raise ModelLoadError(f"tensor split has {len(options.tensor_split)} entries; this build allows {n_max}")
            self._tensor_split = (ctypes.c_float * n_max)(*options.tensor_split)
            params.tensor_split = self._tensor_split
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if options.use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
        params.use_extra_bufts = not options.no_repack
        if options.rpc_servers:
            self._add_rpc_devices(params, options.rpc_servers)

        with _native_log() as log:
            ptr = llama_cpp.llama_model_load_from_file(str(self.path).encode("utf-8"), params)
        self.load_log = "".join(log)  # llama.cpp's own account of the load (buffer sizes, warnings)
        if not ptr:
            raise _load_error("".join(log), f"{self.path}: llama.cpp could not load this model",
                              f"offload fewer layers (-ngl / n_gpu_layers, now {options.n_gpu_layers}) "
                              "or use a smaller quantization")
        self._ptr = ptr
        self.vocab = llama_cpp.llama_model_get_vocab(ptr)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.is_recurrent = bool(llama_cpp.llama_model_is_recurrent(ptr))
        self.is_hybrid = bool(llama_cpp.llama_model_is_hybrid(ptr))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self._piece_cache: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self._eog = np.zeros(self.n_vocab, dtype=bool)
        for tok in range(self.n_vocab):
            # attribute lookups are cheap C calls; done once per model so is_eog is a table lookup afterwards
            if llama_cpp.llama_vocab_is_eog(self.vocab, tok):
                self._eog[tok] = True

    def _add_rpc_devices(self, params, servers: str) -> None:
        add = getattr(llama_cpp, "ggml_backend_rpc_add_server", None) or getattr(llama_cpp, "ggml_backend_rpc_add_device", None)
        if add is None:
            raise ModelLoadError("this llama-cpp-python build has no RPC backend; reinstall with "
                                 "CMAKE_ARGS=\"-DGGML_RPC=on\" pip install --force-reinstall --no-cache-dir llama-cpp-python")
        # Older bindings take the servers through llama_model_params.rpc_servers.
        if hasattr(params, "rpc_servers"):
            self._rpc = servers.encode()
            params.rpc_servers = self._rpc
        else:  # pragma: no cover - depends on the build
            for server in servers.split(","):
                add(server.strip().encode())

    @property
    def eog_ids(self) -> np.ndarray:
        return np.flatnonzero(self._eog)

    def is_eog(self, token: int) -> bool:
        return bool(self._eog[token]) if 0 <= token < self.n_vocab else False

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (control tokens render as nothing)."""
        piece = self._piece_cache.get(token)
        if piece is None:
            n = llama_cpp.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
            if n < 0:
                self._piece_buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, self._piece_buf, -n, 0, False)
            piece = self._piece_buf.raw[:n]
            self._piece_cache[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._ptr is not None:
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------------------
# Context
# ---------------------------------------------------------------------------------------------------------------
class Context:
    """One sequence's KV cache over a model, with explicit positions.

    `eval(tokens, logits)` appends tokens at positions n_past.. and returns the logits rows asked for as a view
    into llama.cpp's buffer, valid until the next eval. `truncate(n)` drops every position >= n.
    """

    def __init__(self, model: Model, options: ContextOptions = ContextOptions()):
        self.model = model
        self.options = options
        self._ptr = None
        for name, value in (("KV cache type K", options.type_k), ("KV cache type V", options.type_v)):
            if value not in KV_TYPES:
                raise ModelLoadError(f"{name} must be one of {', '.join(KV_TYPES)}, got {value!r}")
        if options.flash_attn not in FLASH_ATTN:
            raise ModelLoadError(f"flash attention must be one of auto, on, off; got {options.flash_attn!r}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = options.n_ctx
        params.n_batch = options.n_batch
        params.n_ubatch = min(options.n_ubatch, options.n_batch)
        params.n_seq_max = 1
        threads = options.n_threads or default_threads()
        params.n_threads = threads
        params.n_threads_batch = threads
        params.flash_attn_type = FLASH_ATTN[options.flash_attn]
        params.type_k = KV_TYPES[options.type_k]
        params.type_v = KV_TYPES[options.type_v]
        params.no_perf = True

        with _native_log() as log:
            ptr = llama_cpp.llama_init_from_model(model._ptr, params)
        self.load_log = "".join(log)
        if not ptr:
            raise _load_error("".join(log), f"{model.path}: llama.cpp could not create a context of "
                              f"{options.n_ctx} tokens", "use a smaller context (-c), a quantized KV cache "
                              "(-ctk q8_0 -ctv q8_0), or fewer GPU layers")
        self._ptr = ptr
        self._mem = llama_cpp.llama_get_memory(ptr)
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
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self.decode_seconds = 0.0   # accumulated time inside llama_decode + logits sync
        self.decode_calls = 0

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray | None:
        """Decode `tokens` at positions n_past.. ; logits: 'last', 'all' or 'none'.

        Returns a (rows, n_vocab) float32 view (rows = 1 for 'last', len(tokens) for 'all'), or None.
        """
        n = len(tokens)
        if n == 0:
            raise DecodeError("internal: eval of an empty batch")
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(
                f"context full: {self.n_past} + {n} tokens exceed the context size {self.n_ctx}")
        if logits == "all" and n > self.n_batch:
            raise DecodeError(f"internal: {n} rows of logits asked for, batch size is {self.n_batch}")
        if n == 1 and logits != "none":
            return self._eval_one(int(tokens[0]))
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise DecodeError(f"token id out of range for {self.model.path.name} (vocabulary of {self.n_vocab})")
        start = 0
        while start < n:
            chunk = tokens[start:start + self.n_batch]
            m = len(chunk)
            last_chunk = start + m == n
            self._tok[:m] = chunk
            self._pos[:m] = np.arange(self.n_past, self.n_past + m, dtype=np.int32)
            self._out[:m] = 1 if logits == "all" else 0
            if logits == "last" and last_chunk:
                self._out[m - 1] = 1
            self._batch.n_tokens = m
            t0 = time.perf_counter()
            rc = llama_cpp.llama_decode(self._ptr, self._batch)
            if rc == 0 and last_chunk and logits != "none":
                ptr = llama_cpp.llama_get_logits(self._ptr)  # synchronises with the device
            self.decode_seconds += time.perf_counter() - t0
            self.decode_calls += 1
            if rc != 0:
                self._decode_failed(rc, m)
            self.tokens.extend(chunk.tolist())
            start += m
        if logits == "none":
            return None
        return self._logits_view(ptr, n if logits == "all" else 1)

    def _eval_one(self, token: int) -> np.ndarray:
        """The drafting hot path: one token, its logits row. Plain ctypes stores, no numpy set-up."""
        if not 0 <= token < self.n_vocab:
            raise DecodeError(f"token id {token} out of range for {self.model.path.name} (vocabulary of {self.n_vocab})")
        b = self._batch
        b.token[0] = token
        b.pos[0] = len(self.tokens)
        b.logits[0] = 1
        b.n_tokens = 1
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self._ptr, b)
        if rc == 0:
            ptr = llama_cpp.llama_get_logits(self._ptr)
        self.decode_seconds += time.perf_counter() - t0
        self.decode_calls += 1
        if rc != 0:
            self._decode_failed(rc, 1)
        self.tokens.append(token)
        return self._logits_view(ptr, 1)

    def _decode_failed(self, rc: int, m: int):
        # drop whatever part of the batch llama.cpp may have stored; the cache is as before this call
        llama_cpp.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)
        if rc == 1:
            raise ContextOverflowError(f"no KV cache slot for {m} tokens at position {self.n_past} "
                                       f"(context {self.n_ctx})")
        if rc == 2:
            raise KeyboardInterrupt
        raise DecodeError(f"llama_decode failed with code {rc}")

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

    def truncate(self, n: int) -> bool:
        """Drop positions >= n. False when the memory cannot drop a tail (recurrent models)."""
        if n >= self.n_past:
            return True
        ok = bool(llama_cpp.llama_memory_seq_rm(self._mem, 0, n, -1))
        if ok:
            del self.tokens[n:]
        return ok

    def resync(self) -> None:
        """Drop anything the cache may hold past the recorded tokens (after an interrupted eval)."""
        llama_cpp.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)
        self.tokens.clear()

    def close(self) -> None:
        if self._ptr is not None:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ptr)
            self._ptr = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------------------
# Quantization (llama.cpp's quantizer, for convert/quantize.py)
# ---------------------------------------------------------------------------------------------------------------
# Target types that need no importance matrix; names as llama-quantize spells them.
QUANT_FTYPES = {
    "F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q5_K_S": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_S, "Q5_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1,
    "Q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0, "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q4_K_S": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S, "Q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q3_K_L": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_L,
    "Q3_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M, "Q3_K_S": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_S,
    "Q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
}
_QUANT_TENSOR_LINE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]")
_LOG_LINES: deque[str] = deque(maxlen=200)


@llama_cpp.llama_log_callback
def _quantize_log_callback(level, text, user_data):  # pragma: no cover - called from C
    _LOG_LINES.append(text.decode("utf-8", errors="replace") if text else "")


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, ftype: str, *, n_threads: int | None = None,
                   allow_requantize: bool = False) -> None:
    """Write `src` quantized to `ftype` (a QUANT_FTYPES name) at `dst`. Blocks until done: run it in a thread to
    show progress with quantize_progress()."""
    init_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_FTYPES[ftype]
    params.nthread = n_threads or default_threads()
    params.allow_requantize = allow_requantize
    _LOG_LINES.clear()
    # the quantizer reports progress only through the log: listen to it for the length of this call
    llama_cpp.llama_log_set(_quantize_log_callback, ctypes.c_void_p(0))
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode("utf-8"), str(dst).encode("utf-8"), ctypes.byref(params))
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    if rc != 0:
        failure = [ln.split("failed to quantize:", 1)[1].strip() for ln in list(_LOG_LINES)
                   if "failed to quantize:" in ln]
        raise ModelLoadError(f"{src}: llama.cpp could not quantize it to {ftype} "
                             f"({failure[-1] if failure else 'no details'})")


def quantize_progress() -> tuple[int, int] | None:
    """(tensors started, tensors in all) of the quantize_model call running now, from llama.cpp's log."""
    for line in reversed(list(_LOG_LINES)):
        match = _QUANT_TENSOR_LINE.search(line)
        if match:
            return int(match[1]), int(match[2])
    return None
