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
if hasattr(llama_cpp, "LLAMA_SPLIT_MODE_TENSOR"):  # tensor parallelism across GPUs, in newer llama.cpp
    SPLIT_MODES["tensor"] = llama_cpp.LLAMA_SPLIT_MODE_TENSOR


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
# Devices: llama.cpp's backend registry (ggml), reached through ctypes on the libggml that llama-cpp-python loaded.
# It lists the GPUs, registers llama.cpp RPC servers as devices, and places a model on named devices.
# ---------------------------------------------------------------------------------------------------------------
_DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")
_RPC_HELLO = 14                 # RPC_CMD_HELLO, fixed across llama.cpp's RPC protocol versions
_RPC_CAPS_SIZE = 24             # rpc_msg_hello_req: uint8_t conn_caps[24] (protocol 7)
_RPC_LOCK = threading.Lock()
_RPC_ADDED: set[str] = set()


@dataclass(frozen=True)
class Device:
    name: str            # llama.cpp's device name: "CUDA0", "RPC0", "CPU"
    description: str     # "NVIDIA GeForce RTX 3090", "127.0.0.1:50052"
    kind: str            # cpu | gpu | igpu | accel | meta
    backend: str         # the registry it came from: "CUDA", "RPC", "CPU", ...
    free: int            # bytes
    total: int


class _Ggml:
    """ctypes bindings for the handful of ggml backend-registry functions llamaspec needs."""

    def __init__(self):
        lib = self._loaded_ggml()
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t

        def fn(name, restype, *argtypes):
            f = getattr(lib, name)
            f.restype, f.argtypes = restype, list(argtypes)
            return f

        self.dev_count = fn("ggml_backend_dev_count", sz)
        self.dev_get = fn("ggml_backend_dev_get", vp, sz)
        self.dev_by_name = fn("ggml_backend_dev_by_name", vp, cp)
        self.dev_name = fn("ggml_backend_dev_name", cp, vp)
        self.dev_description = fn("ggml_backend_dev_description", cp, vp)
        self.dev_type = fn("ggml_backend_dev_type", ctypes.c_int, vp)
        self.dev_memory = fn("ggml_backend_dev_memory", None, vp, ctypes.POINTER(sz), ctypes.POINTER(sz))
        self.dev_backend_reg = fn("ggml_backend_dev_backend_reg", vp, vp)
        self.reg_name = fn("ggml_backend_reg_name", cp, vp)
        self.reg_by_name = fn("ggml_backend_reg_by_name", vp, cp)
        self.reg_get_proc_address = fn("ggml_backend_reg_get_proc_address", vp, vp, cp)
        self.register = fn("ggml_backend_register", None, vp)

    @staticmethod
    def _loaded_ggml():
        """The libggml that libllama itself uses. A second copy (the same file under another path, e.g. through
        a build folder's RUNPATH) would have its own device registry, so ask the loader for the library already
        in the process by its soname first; only then look beside libllama."""
        no_load = getattr(os, "RTLD_NOLOAD", 0)
        for soname in ("libggml.so.0", "libggml.so", "libggml.0.dylib", "libggml.dylib"):
            if no_load:
                try:
                    return ctypes.CDLL(soname, mode=no_load | getattr(os, "RTLD_GLOBAL", 0))
                except OSError:
                    continue
        lib_dir = Path(llama_cpp.llama_cpp._base_path)
        names = sorted(lib_dir.glob("libggml.so*")) + sorted(lib_dir.glob("libggml*.dylib")) + \
            sorted(lib_dir.glob("ggml.dll"))
        if not names:
            raise ModelLoadError(f"cannot find llama.cpp's ggml library next to libllama in {lib_dir}")
        return ctypes.CDLL(str(names[0]))

    def device(self, ptr) -> Device:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(ptr, ctypes.byref(free), ctypes.byref(total))
        kind = self.dev_type(ptr)
        return Device(name=self.dev_name(ptr).decode(), description=(self.dev_description(ptr) or b"").decode(),
                      kind=_DEVICE_KINDS[kind] if 0 <= kind < len(_DEVICE_KINDS) else str(kind),
                      backend=(self.reg_name(self.dev_backend_reg(ptr)) or b"").decode(),
                      free=free.value, total=total.value)


_GGML: list[_Ggml] = []


def _ggml() -> _Ggml:
    init_backend()
    if not _GGML:
        _GGML.append(_Ggml())
    return _GGML[0]


def devices() -> list[Device]:
    """Every device llama.cpp can place weights on, in registry order (RPC servers once added)."""
    g = _ggml()
    return [g.device(g.dev_get(i)) for i in range(g.dev_count())]


def supports_rpc() -> bool:
    return bool(llama_cpp.llama_supports_rpc()) if hasattr(llama_cpp, "llama_supports_rpc") else False


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ModelLoadError(f"RPC server {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def rpc_hello(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """Connect to a llama.cpp rpc-server and run its HELLO handshake; returns the server's protocol version.

    llama.cpp aborts the whole process when a server is unreachable or speaks another protocol, so every
    server is asked here first and a failure becomes one ModelLoadError."""
    import socket
    import struct

    host, port = _parse_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ModelLoadError(f"cannot reach the RPC server at {endpoint} ({exc.strerror or exc}); "
                             f"start it there with: rpc-server --host {host} --port {port}") from None
    body = b""
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", _RPC_HELLO, _RPC_CAPS_SIZE) + bytes(_RPC_CAPS_SIZE))
            head = _recv_exact(sock, 8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            body = _recv_exact(sock, size) if 3 <= size <= 4096 else b""
        except OSError:  # reset or timed out mid-handshake: not an rpc-server we can talk to
            pass
    if len(body) < 3:
        raise ModelLoadError(f"the RPC server at {endpoint} did not answer llama.cpp's RPC handshake: it is not an "
                             "rpc-server, or one built from a different llama.cpp version than this llama-cpp-python")
    major, minor, patch = body[0], body[1], body[2]
    return major, minor, patch


def _recv_exact(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def add_rpc_servers(servers: str | Sequence[str]) -> list[Device]:
    """Register llama.cpp RPC servers ("host:port,host:port") as devices; a model loaded afterwards with the
    default device list spreads over them (llama.cpp puts RPC devices first). Returns the servers' devices."""
    endpoints = [s.strip() for s in (servers.split(",") if isinstance(servers, str) else servers) if s.strip()]
    if not endpoints:
        raise ModelLoadError("no RPC servers given (expected host:port[,host:port...])")
    g = _ggml()
    reg = g.reg_by_name(b"RPC")
    add = g.reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not add:
        raise ModelLoadError("this llama-cpp-python was built without llama.cpp's RPC backend; reinstall it with "
                             "CMAKE_ARGS=\"-DGGML_RPC=on\" pip install --force-reinstall --no-cache-dir "
                             "llama-cpp-python")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)
    with _RPC_LOCK:
        for endpoint in endpoints:
            if endpoint in _RPC_ADDED:
                continue
            rpc_hello(endpoint)
            server_reg = add_server(endpoint.encode())
            if not server_reg:
                raise ModelLoadError(f"the RPC server at {endpoint} offers no devices")
            g.register(server_reg)
            _RPC_ADDED.add(endpoint)
    return [d for d in devices() if d.backend == "RPC" and d.description in endpoints]


def _device_list(names: Sequence[str]):
    """A NULL-terminated ggml_backend_dev_t array for llama_model_params.devices."""
    g = _ggml()
    ptrs = []
    for name in names:
        ptr = g.dev_by_name(name.encode())
        if not ptr:
            known = ", ".join(d.name for d in devices()) or "none"
            raise ModelLoadError(f"no device named {name!r} (devices: {known})")
        ptrs.append(ptr)
    return (ctypes.c_void_p * (len(ptrs) + 1))(*ptrs, None)


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
    devices: tuple[str, ...] | None = None  # offload only to these devices ("CUDA1", "RPC0"); () = none; None = all


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
        if options.split_mode == "tensor" and not any(d.kind == "gpu" for d in devices()):
            raise ModelLoadError("split mode 'tensor' (tensor parallelism) needs GPUs, and llama.cpp sees none here")
        if options.tensor_split:
            n_max = llama_cpp.llama_max_devices()
            if len(options.tensor_split) > n_max:
                raise ModelLoadError(f"tensor split has {len(options.tensor_split)} entries; this build allows {n_max}")
            self._tensor_split = (ctypes.c_float * n_max)(*options.tensor_split)
            params.tensor_split = self._tensor_split
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if options.use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
        params.use_extra_bufts = not options.no_repack
        if options.rpc_servers:
            add_rpc_servers(options.rpc_servers)
        if options.devices is not None:
            self._devices = _device_list(options.devices)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)

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
        self._argmax_sampler = None  # a greedy sampler chain attached to seq 0 (set_device_argmax)
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
        if hasattr(params, "n_outputs_max_per_seq"):
            params.n_outputs_max_per_seq = 0  # = n_batch: device argmax of every verified row (set_device_argmax)

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
        if logits != "none" and self._argmax_sampler is not None:
            self.set_device_argmax(False)  # logits wanted: llama.cpp must copy them out again
        if len(tokens) == 1 and logits != "none":
            return self._eval_one(int(tokens[0]))
        ptr = self._decode(tokens, logits)
        if logits == "none":
            return None
        return self._logits_view(ptr, len(tokens) if logits == "all" else 1)

    def eval_argmax(self, tokens: Sequence[int], rows: str = "last") -> list[int]:
        """Decode `tokens` and return the argmax token of the last row ('last') or of every row ('all'): greedy
        decoding's only need. With `set_device_argmax(True)` llama.cpp takes the argmax on the device and no
        logits are copied; otherwise numpy takes it from the logits."""
        if self._argmax_sampler is None:
            if len(tokens) == 1:
                return [int(self._eval_one(int(tokens[0]))[0].argmax())]
            return self._logits_view(self._decode(tokens, rows), len(tokens) if rows == "all" else 1) \
                .argmax(axis=1).tolist()
        if len(tokens) == 1:  # the drafting hot path
            self._decode_one(int(tokens[0]), sync=llama_cpp.llama_synchronize)
        else:
            self._decode(tokens, rows)
        get = llama_cpp.llama_get_sampled_token_ith
        out = [get(self._ptr, i) for i in range(len(tokens))] if rows == "all" and len(tokens) > 1 \
            else [get(self._ptr, -1)]
        if min(out) < 0:
            raise DecodeError("llama.cpp returned no argmax token for an output row")
        return out

    def set_device_argmax(self, on: bool) -> bool:
        """Attach (or detach) a greedy sampler to the sequence so llama.cpp takes each output row's argmax on the
        device (its backend sampling). Returns whether it is attached: builds or devices that cannot run it keep
        the logits path. Any eval that asks for logits detaches it."""
        if on == (self._argmax_sampler is not None):
            return on
        if on:
            if not hasattr(llama_cpp, "llama_set_sampler") or env_flag("LLAMASPEC_NO_DEVICE_ARGMAX"):
                return False
            chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
            with _native_log():
                ok = bool(llama_cpp.llama_set_sampler(self._ptr, 0, chain))
            if not ok:
                llama_cpp.llama_set_sampler(self._ptr, 0, None)
                llama_cpp.llama_sampler_free(chain)
                return False
            self._argmax_sampler = chain
            return True
        llama_cpp.llama_set_sampler(self._ptr, 0, None)
        llama_cpp.llama_sampler_free(self._argmax_sampler)
        self._argmax_sampler = None
        return False

    @property
    def device_argmax(self) -> bool:
        return self._argmax_sampler is not None

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
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise DecodeError(f"token id out of range for {self.model.path.name} (vocabulary of {self.n_vocab})")
        ptr = None
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
                if self._argmax_sampler is None:
                    ptr = llama_cpp.llama_get_logits(self._ptr)  # synchronises with the device
                else:
                    llama_cpp.llama_synchronize(self._ptr)
            self.decode_seconds += time.perf_counter() - t0
            self.decode_calls += 1
            if rc != 0:
                self._decode_failed(rc, m)
            self.tokens.extend(chunk.tolist())
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
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self._ptr, b)
        result = sync(self._ptr) if rc == 0 else None
        self.decode_seconds += time.perf_counter() - t0
        self.decode_calls += 1
        if rc != 0:
            self._decode_failed(rc, 1)
        self.tokens.append(token)
        return result

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
            if self._argmax_sampler is not None:
                self.set_device_argmax(False)
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
