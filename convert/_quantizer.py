"""llama.cpp's quantizer, for convert/quantize.py (the runtime never quantizes)."""
from __future__ import annotations

import ctypes
import os
import re

from llamaspec.backend.native import default_threads, init_backend, llama_cpp, native_log
from llamaspec.errors import ModelLoadError

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
_LIVE_LOG: list[list[str]] = []   # the log lines of the quantize_model call running now


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, ftype: str, *, n_threads: int | None = None,
                   allow_requantize: bool = False) -> None:
    """Write `src` quantized to `ftype` (a QUANT_FTYPES name) at `dst`. Blocks until done: run it in a thread to
    show progress with quantize_progress()."""
    init_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_FTYPES[ftype]
    params.nthread = n_threads or default_threads()
    params.allow_requantize = allow_requantize
    # the quantizer reports progress only through llama.cpp's log: collect it for the length of this call
    with native_log() as lines:
        _LIVE_LOG[:] = [lines]
        rc = llama_cpp.llama_model_quantize(str(src).encode("utf-8"), str(dst).encode("utf-8"),
                                            ctypes.byref(params))
    if rc != 0:
        failure = [ln.split("failed to quantize:", 1)[1].strip() for ln in lines if "failed to quantize:" in ln]
        raise ModelLoadError(f"{src}: llama.cpp could not quantize it to {ftype} "
                             f"({failure[-1] if failure else 'no details'})")


def quantize_progress() -> tuple[int, int] | None:
    """(tensors started, tensors in all) of the quantize_model call running now, from llama.cpp's log."""
    lines = _LIVE_LOG[0] if _LIVE_LOG else []
    for line in reversed(lines[-50:]):
        match = _QUANT_TENSOR_LINE.search(line)
        if match:
            return int(match[1]), int(match[2])
    return None
