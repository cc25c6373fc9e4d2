"""llamaspec: speculative decoding for GGUF models on llama.cpp.

    from llamaspec import load_pair
    pair = load_pair("target.gguf", "draft.gguf", n_gpu_layers=-1)
    for piece in pair.stream("def quicksort(arr):", max_tokens=256):
        print(piece.text, end="", flush=True)
    print(pair.last_stats)
"""
try:
    # llama.cpp's shared libraries must load before numpy's: a CUDA build segfaulted in model load when numpy
    # (and its BLAS) came first, and ran when llama_cpp was imported first.
    import llama_cpp as _llama_cpp  # noqa: F401
except ImportError:  # the engine says how to install it when it is used
    pass

from .config import LoadConfig, ModelConfig
from .errors import (ContextOverflowError, DecodeError, GPUOutOfMemoryError, IncompatiblePairError,
                     InvalidParameterError, LlamaspecError, ModelFileError, ModelLoadError, UnsupportedModelError)
from .policy import AutoPolicy, ConfidencePolicy, DraftPolicy, FixedPolicy, ThresholdPolicy, make_policy
from .sampling import SamplerConfig
from .stats import GenerationStats
from .text import Piece

__version__ = "0.1.0"


def __getattr__(name):
    # Loading imports llama_cpp (a compiled library); load it only when it is used.
    if name == "load_pair":
        from .loading import load_pair

        return load_pair
    if name in ("Pair", "Completion"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'llamaspec' has no attribute {name!r}")


__all__ = [
    "load_pair", "Pair", "Piece", "Completion", "GenerationStats", "SamplerConfig", "LoadConfig", "ModelConfig",
    "DraftPolicy", "AutoPolicy", "FixedPolicy", "ConfidencePolicy", "ThresholdPolicy", "make_policy",
    "LlamaspecError", "ModelFileError", "IncompatiblePairError", "UnsupportedModelError", "ModelLoadError",
    "GPUOutOfMemoryError", "ContextOverflowError", "InvalidParameterError", "DecodeError",
]
