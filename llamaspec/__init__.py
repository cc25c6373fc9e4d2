"""llamaspec: speculative decoding for GGUF models on llama.cpp.

    from llamaspec import load_pair
    pair = load_pair("target.gguf", "draft.gguf", n_gpu_layers=-1)
    for piece in pair.stream("def quicksort(arr):", max_tokens=256):
        print(piece.text, end="", flush=True)
    print()
    print(pair.last_stats)

The house, bottom up; a layer imports only from the layers below it:
1. Data and plumbing: errors.py (what users see), kinds.py (one descriptor per drafter kind), config.py (LoadConfig,
   every setting once), bounds.py, stats.py, text.py (UTF-8 and stop strings), interrupt.py, sysinfo.py.
2. Pure numpy: sampling.py (filtered distributions), verify.py (the greedy and rejection rules), modes.py (a
   request's verifier: rows in, a verdict out), shaping.py (grammars, penalties, log-probabilities over rows).
3. gguf/: headers without llama.cpp (the pair check, the memory plan, values llama.cpp would abort on).
4. backend/: the only package that imports llama_cpp: models; contexts of one sequence or of several sharing one
   cache (sequences.py); rollback; MTP heads; hidden states; sampling on the device.
5. drafters/ (where draft tokens come from: the Drafter contract, a module per kind, their batched forms) and
   policy/ (how many to draft). Neither imports backend/: a drafter is handed its context.
6. slots.py: the engine. N slots and one speculative step for all of them (draft, verify, accept, roll back,
   learn, emit text). targets.py, above it: where the slots' sequences live, behind the contract the engine calls:
   the pair's own contexts are one slot (LoneTarget), shared contexts several (SharedTarget).
7. engine.py (Pair: the models, the policy, the front-ends generate / stream / chat / generate_batch), loading.py
   (load_pair), conversation.py, tree.py, bench/.
8. server/ (HTTP; worker.py feeds the engine), hub/ (named pairs, downloads), cli/ (click only).
A new drafter kind is a module under drafters/ (implementing Drafter) and a DrafterKind in kinds.py; a new source of
drafts (a new kind of context) adds its context under backend/ and how it opens in loading.py.
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
