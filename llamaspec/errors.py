"""Errors meant for users: each one carries a message a person can act on.

Every error raised on purpose by llamaspec derives from `LlamaspecError`, so a caller (the CLI, the server)
can catch that one type and print `str(err)` as a single line.
"""
from __future__ import annotations


class LlamaspecError(Exception):
    """Base class of every error llamaspec raises for bad input or an unusable environment."""


class ModelFileError(LlamaspecError):
    """A model path is missing, unreadable, not a GGUF file, or truncated."""


class IncompatiblePairError(LlamaspecError):
    """The draft cannot speculate for the target (different tokenizers, special tokens, ...)."""


class UnsupportedModelError(LlamaspecError):
    """The model loads but cannot be used the way it was asked for (e.g. a recurrent target with a draft)."""


class ModelLoadError(LlamaspecError):
    """llama.cpp refused to load a model or create its context."""


class GPUOutOfMemoryError(ModelLoadError):
    """llama.cpp could not allocate GPU memory for weights, KV cache or compute buffers."""


class ContextOverflowError(LlamaspecError):
    """The prompt (plus what must be generated) does not fit in the context window."""


class InvalidParameterError(LlamaspecError, ValueError):
    """A generation or sampler parameter is out of range; the message names the parameter, and `param` holds its
    name (None when no single parameter is at fault)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class DecodeError(LlamaspecError):
    """llama_decode failed mid-generation (the caches are rolled back to the last consistent point)."""


class Cancelled(LlamaspecError):
    """A long call (a load, a prefill, a prompt's tokenization) stopped because it was asked to: the request's
    client left, or the server is stopping (interrupt.py)."""


class RegistryError(LlamaspecError):
    """A named pair is unknown, models.toml is malformed, or its files cannot be found or downloaded."""


class PromptFileError(LlamaspecError):
    """A prompt file cannot be read or has a malformed line."""
