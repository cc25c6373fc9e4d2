"""A loaded GGUF model: weights, vocabulary and tokenizer."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import ModelConfig
from .. import interrupt
from ..errors import Cancelled, InvalidParameterError, ModelLoadError
from ..gguf.reader import ModelInfo, read_model_info
from .devices import _device_list, add_rpc_servers, devices
from .native import (SPLIT_MODES, NativeHandle, init_backend, llama_cpp, load_error, load_goes_on, load_watcher,
                     native_log)

_VOCAB_KINDS = {"LLAMA_VOCAB_TYPE_SPM": "spm", "LLAMA_VOCAB_TYPE_BPE": "bpe", "LLAMA_VOCAB_TYPE_WPM": "wpm",
                "LLAMA_VOCAB_TYPE_UGM": "ugm", "LLAMA_VOCAB_TYPE_RWKV": "rwkv", "LLAMA_VOCAB_TYPE_PLAMO2": "plamo2"}


def load_mode(use_mmap: bool, use_mlock: bool) -> int:
    """llama_model_params.load_mode for llama.cpp's --no-mmap / --mlock (the two flags as common/arg.cpp sets it)."""
    if use_mlock:
        return llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK if use_mmap else llama_cpp.LLAMA_LOAD_MODE_MLOCK
    return llama_cpp.LLAMA_LOAD_MODE_MMAP if use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE


@dataclass(frozen=True)
class SpecialToken:
    """A token llama.cpp's tokenizer matches as a whole string before it tokenizes the text around it."""

    id: int
    text: bytes
    control: bool   # a control or unknown token: matched only when special tokens are parsed
    lstrip: bool    # eats the whitespace on its left
    rstrip: bool    # eats the whitespace on its right


class Model(NativeHandle):
    """A loaded GGUF model: weights, vocabulary and tokenizer."""

    def __init__(self, path: str | os.PathLike, options: ModelConfig = ModelConfig(), info: ModelInfo | None = None):
        init_backend()
        self.path = Path(path).expanduser()
        self.info = info or read_model_info(self.path)  # missing / not GGUF / truncated: ModelFileError
        self.options = options
        self._ptr = None

        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = options.n_gpu_layers if options.n_gpu_layers >= 0 else 0x7FFFFFFF
        params.main_gpu = options.main_gpu
        if options.split_mode not in SPLIT_MODES:
            raise ModelLoadError(f"split mode {options.split_mode!r} needs a newer llama.cpp than this "
                                 f"llama-cpp-python's (it has {', '.join(SPLIT_MODES)})")
        params.split_mode = SPLIT_MODES[options.split_mode]
        if options.split_mode == "tensor" and not any(d.kind == "gpu" for d in devices()):
            raise ModelLoadError("split mode 'tensor' (tensor parallelism) needs GPUs, and llama.cpp sees none here")
        if options.tensor_split:
            n_max = llama_cpp.llama_max_devices()
            if len(options.tensor_split) > n_max:
                raise ModelLoadError(f"tensor split has {len(options.tensor_split)} entries; this build allows {n_max}")
            self._tensor_split = (ctypes.c_float * n_max)(*options.tensor_split)
            params.tensor_split = self._tensor_split
        params.load_mode = load_mode(options.use_mmap, options.use_mlock)
        params.use_extra_bufts = not options.no_repack
        if options.load_mtp and hasattr(params, "load_mtp"):
            params.load_mtp = True  # the nextn block's tensors; without it llama.cpp skips them
        if options.rpc_servers:
            add_rpc_servers(options.rpc_servers)
        if options.devices is not None:
            self._devices = _device_list(options.devices)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)

        params.progress_callback = load_goes_on   # Ctrl-C (or a cancel) stops the load: interrupt.py
        watcher = load_watcher()                  # the CLI's "loading ..." line, when one is set
        ptr = None
        # the watcher inside too: it asks llama.cpp for the devices, and a Ctrl-C must not land in their log callback
        with native_log() as log:
            if watcher is not None:
                watcher.begins(self.info, options)
            try:
                ptr = llama_cpp.llama_model_load_from_file(str(self.path).encode("utf-8"), params)
            finally:
                if watcher is not None:
                    watcher.ends("done" if ptr else "stopped" if interrupt.requested() else "failed")
        self.load_log = "".join(log)  # llama.cpp's own account of the load (buffer sizes, warnings)
        if not ptr and interrupt.requested():
            raise Cancelled(f"{self.path}: loading was cancelled")
        if not ptr:
            raise load_error("".join(log), f"{self.path}: llama.cpp could not load this model",
                              f"offload fewer layers (-ngl / n_gpu_layers, now {options.n_gpu_layers}) "
                              "or use a smaller quantization")
        self._ptr = ptr
        self.vocab = llama_cpp.llama_model_get_vocab(ptr)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.is_recurrent = bool(llama_cpp.llama_model_is_recurrent(ptr))
        self.is_hybrid = bool(llama_cpp.llama_model_is_hybrid(ptr))
        # multi-token-prediction blocks: counted by the header; their weights are there only with load_mtp
        nextn = getattr(llama_cpp, "llama_model_n_layer_nextn", None)
        self.n_layer_nextn = int(nextn(ptr)) if nextn is not None else 0
        self.mtp_loaded = bool(options.load_mtp and hasattr(params, "load_mtp") and self.n_layer_nextn > 0)
        embd_out = getattr(llama_cpp, "llama_model_n_embd_out", llama_cpp.llama_model_n_embd)
        self.n_embd_out = int(embd_out(ptr))     # width of the final hidden state (the LM head's input)
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

    def is_eog(self, token: int) -> bool:
        return bool(self._eog[token]) if 0 <= token < self.n_vocab else False

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:   # a lone surrogate (U+D800..U+DFFF) has no UTF-8 form
            raise InvalidParameterError(f"the text has a lone surrogate U+{ord(text[e.start]):04X} at character "
                                        f"{e.start}, which is not Unicode text", param="prompt") from None
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

    @property
    def vocab_kind(self) -> str:
        """The tokenizer family: spm, bpe, wpm, ugm, rwkv, plamo2 (or none)."""
        kind = llama_cpp.llama_vocab_type(self.vocab)
        return next((name for attr, name in _VOCAB_KINDS.items() if getattr(llama_cpp, attr, None) == kind), "none")

    def special_tokens(self) -> list[SpecialToken]:
        """Control, unknown and user-defined tokens, as llama.cpp's tokenizer partitions text by them."""
        A = llama_cpp
        control = A.LLAMA_TOKEN_ATTR_CONTROL | A.LLAMA_TOKEN_ATTR_UNKNOWN
        found = []
        for tok in range(self.n_vocab):
            attr = A.llama_vocab_get_attr(self.vocab, tok)
            if attr & (control | A.LLAMA_TOKEN_ATTR_USER_DEFINED):
                text = A.llama_vocab_get_text(self.vocab, tok) or b""
                found.append(SpecialToken(tok, text, bool(attr & control), bool(attr & A.LLAMA_TOKEN_ATTR_LSTRIP),
                                          bool(attr & A.LLAMA_TOKEN_ATTR_RSTRIP)))
        return found

    def max_piece_bytes(self) -> int:
        """The most bytes of text one token stands for, control and unknown tokens aside."""
        A = llama_cpp
        skip = A.LLAMA_TOKEN_ATTR_CONTROL | A.LLAMA_TOKEN_ATTR_UNKNOWN
        buf = ctypes.create_string_buffer(1024)
        longest = 1
        for tok in range(self.n_vocab):
            if not A.llama_vocab_get_attr(self.vocab, tok) & skip:
                n = A.llama_token_to_piece(self.vocab, tok, buf, len(buf), 0, False)
                longest = max(longest, n if n >= 0 else -n)
        return longest

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._ptr is not None:
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None


def check_loads(path: str | os.PathLike) -> None:
    """What llama.cpp's loader says about a file without reading its weights (vocab_only: the architecture and its
    keys, the vocabulary, the pre-tokenizer): the refusals a load gives, for `llamaspec check`'s verdict to be
    `run`'s. Raises ModelLoadError with llama.cpp's reason. Read the header first (read_model_info): it refuses
    what would make llama.cpp abort."""
    init_backend()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    params.progress_callback = load_goes_on
    with native_log() as log:
        ptr = llama_cpp.llama_model_load_from_file(str(Path(path).expanduser()).encode("utf-8"), params)
    if not ptr:
        raise load_error("".join(log), f"{path}: llama.cpp could not load this model", "")
    llama_cpp.llama_model_free(ptr)
