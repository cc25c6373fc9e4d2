"""llama.cpp itself: the import of llama_cpp, its enums under llamaspec's names, backend start-up, and llama.cpp's
log while a model or context is created (kept for error messages instead of reaching the terminal)."""
from __future__ import annotations

import abc
import contextlib
import ctypes
import os
import re
import sys
import threading

from .. import interrupt
from ..config import CACHE_TYPES
from ..errors import GPUOutOfMemoryError, ModelLoadError

try:
    import llama_cpp
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "llamaspec needs llama-cpp-python: pip install llama-cpp-python "
        "(for NVIDIA GPUs: CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install llama-cpp-python)"
    ) from exc

# ggml_type ids of the KV cache types (config.CACHE_TYPES)
CACHE_TYPE_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
assert set(CACHE_TYPE_IDS) == set(CACHE_TYPES)
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
# llama.cpp's log: one callback (llama_log_set) for the process. While a model or context is created the lines are
# collected instead (native_log), so the terminal stays clean and a failure can be explained; otherwise errors go
# to stderr, and everything with verbose (LLAMASPEC_VERBOSE=1), as llama-cpp-python's own callback does.
# ---------------------------------------------------------------------------------------------------------------
_LOG_STATE = {"verbose": env_flag("LLAMASPEC_VERBOSE"), "last_level": 0}
_CAPTURES: list[list[str]] = []
_INIT_LOCK = threading.Lock()
_INITIALISED = False
_LOG_ERROR, _LOG_CONT = 4, 5   # ggml_log_level: GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT (continues the last line)


@llama_cpp.llama_log_callback
def _log_callback(level, text, user_data):  # pragma: no cover - called from C
    message = text.decode("utf-8", errors="replace") if text else ""
    if level != _LOG_CONT:
        _LOG_STATE["last_level"] = level
    if _CAPTURES:
        _CAPTURES[-1].append(message)
    elif _LOG_STATE["verbose"] or _LOG_STATE["last_level"] == _LOG_ERROR and not interrupt.requested():
        # (a decode stopped on request logs its failure as an error: that is no news to whoever asked)
        sys.stderr.write(message)
        sys.stderr.flush()


@llama_cpp.llama_progress_callback
def load_goes_on(progress, user_data):  # pragma: no cover - called from C
    """A model load's progress callback: tells the load's watcher how far it is; False (stop loading) once a stop
    is requested (interrupt.py)."""
    watcher = load_watcher()
    if watcher is not None:
        try:
            watcher.progress(float(progress))
        except Exception:   # raised here, it would be printed by ctypes and lost; the load goes on
            pass
    return not interrupt.requested()


# ---------------------------------------------------------------------------------------------------------------
# Watching model loads (the CLI's "loading ..." line and bar): the library prints nothing itself; a watcher set with
# watch_loads hears of each model load, and of llama.cpp's progress in between.
# ---------------------------------------------------------------------------------------------------------------
class LoadWatcher:
    """Told of each model load while `watch_loads(watcher)` is on: `begins(info, options)` before llama.cpp reads
    the file, `progress(fraction)` as it reads the weights (0 to 1, llama.cpp's progress callback), `ends(outcome)`
    after ("done", "stopped" on a requested stop, "failed")."""

    def begins(self, info, options) -> None:
        """A load of the model file `info` describes (its ModelInfo, from the header) starts, placed by `options`
        (a ModelConfig)."""

    def progress(self, fraction: float) -> None:
        """llama.cpp has read this share of the weights."""

    def ends(self, outcome: str) -> None:
        """The load is over: "done", "stopped" or "failed"."""


_WATCHERS: list[LoadWatcher] = []


@contextlib.contextmanager
def watch_loads(watcher: LoadWatcher):
    """Tell `watcher` of every model load while the block runs."""
    _WATCHERS.append(watcher)
    try:
        yield watcher
    finally:
        _WATCHERS.remove(watcher)


def load_watcher() -> LoadWatcher | None:
    return _WATCHERS[-1] if _WATCHERS else None


@llama_cpp.ggml_abort_callback
def decode_stops(user_data):  # pragma: no cover - called from C
    """A CPU decode's abort callback, asked between graph nodes: True (abort) once a stop is requested."""
    return interrupt.requested()


def init_backend(verbose: bool | None = None) -> None:
    global _INITIALISED
    if verbose is not None:
        _LOG_STATE["verbose"] = verbose or env_flag("LLAMASPEC_VERBOSE")
    with _INIT_LOCK:
        if not _INITIALISED:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _INITIALISED = True


@contextlib.contextmanager
def native_log():
    """Collect what llama.cpp logs while the block runs; yields the list of lines (live: a watcher may read it).
    With verbose on, the lines reach stderr as well, afterwards. A Ctrl-C meanwhile stops the call where llama.cpp
    asks (the progress callback of a load) and raises KeyboardInterrupt after the block (interrupt.py): raised in
    the log callback, it would be printed and lost."""
    lines: list[str] = []
    _CAPTURES.append(lines)
    try:
        with interrupt.signals_stop():
            yield lines
    finally:
        _CAPTURES.remove(lines)
        if _LOG_STATE["verbose"]:
            sys.stderr.write("".join(lines))
            sys.stderr.flush()


_OOM_PATTERN = re.compile(r"out of memory|failed to allocate|cudaMalloc failed|ErrorOutOfDeviceMemory|"
                          r"unable to allocate", re.IGNORECASE)
_LOAD_REASON = re.compile(r"error loading model: (.+)")


def load_error(log: str, what: str, oom_hint: str) -> ModelLoadError:
    if _OOM_PATTERN.search(log):
        return GPUOutOfMemoryError(f"{what}: out of memory; {oom_hint}")
    reasons = _LOAD_REASON.findall(log)  # llama.cpp's own reason, before its generic "failed to load model"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    detail = " ".join(reasons[-1].split()) if reasons else lines[-1] if lines else "no details from llama.cpp"
    return ModelLoadError(f"{what} ({detail})")


# ---------------------------------------------------------------------------------------------------------------
# Multi-token prediction (nextn): llama.cpp's hidden-state functions live in its C++ staging API (llama-ext.h), bound
# by llama-cpp-python's llama_cpp_ext module, which looks the mangled names up in libllama and raises at import when
# a symbol is missing (older builds, other platforms' name mangling). Resolved once; never fatal.
# ---------------------------------------------------------------------------------------------------------------
_NEXTN: list = []


def nextn_functions():
    """(llama_cpp_ext module, None), or (None, why this build cannot do MTP)."""
    if not _NEXTN:
        missing = [name for name in ("LLAMA_CONTEXT_TYPE_MTP", "llama_model_n_layer_nextn", "llama_model_n_embd_out")
                   if not hasattr(llama_cpp, name)]
        fields = {f for f, _ in llama_cpp.llama_context_params._fields_} | \
            {f for f, _ in llama_cpp.llama_model_params._fields_}
        missing += [name for name in ("ctx_type", "load_mtp") if name not in fields]
        ext, reason = None, None
        if missing:
            reason = f"llama_cpp lacks {', '.join(missing)}"
        else:
            try:
                from llama_cpp import llama_cpp_ext as ext
            except (ImportError, AttributeError, OSError) as exc:
                reason = f"llama_cpp_ext: {exc}"
        _NEXTN.append((ext, None if ext is not None else
                       f"this llama-cpp-python ({library_version()}) cannot run an MTP head ({reason}); "
                       "MTP drafting needs llama-cpp-python 0.3.36 or newer"))
    return _NEXTN[0]


def supports_gpu_offload() -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


def system_info() -> str:
    return llama_cpp.llama_print_system_info().decode("utf-8", errors="replace")


def library_version() -> str:
    return getattr(llama_cpp, "__version__", "unknown")


class NativeHandle(abc.ABC):
    """Something that holds llama.cpp memory (a model, a context): `close()` frees it and may run twice; an
    object nobody closed is closed when it is collected."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the llama.cpp memory (a no-op once freed)."""

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
