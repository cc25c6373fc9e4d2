"""The device side of a context's sampling: llama.cpp's backend sampler chains attached to the sequence, so that
each output row's argmax (greedy), or its filtered distribution and a draw from it (sampling), is taken in the graph
and only the result comes back. A part of Context (context.py), which owns the chain and decodes."""
from __future__ import annotations

import bisect
import ctypes
import os
from typing import Sequence

import numpy as np

from ..errors import DecodeError
from ..sampling import LLAMA_CPP, Dist, SamplerConfig
from .native import env_flag, llama_cpp, native_log, supports_gpu_offload


class DeviceSampling:
    """Context's sampler-chain methods (its `_ptr`, `_chain`, `_chain_kind`, `_chain_key`, `_sorted_rows`,
    `_views`, `_decode`, `_decode_one`, `_prefix` and `n_pending` are Context's)."""

    def set_device_argmax(self, on: bool) -> bool:
        """Attach (or detach) a greedy sampler to the sequence so llama.cpp takes each output row's argmax on the
        device (its backend sampling). Returns whether it is attached: builds or devices that cannot run it keep
        the logits path. Any eval that asks for logits detaches it."""
        if on == (self._chain_kind == "argmax"):
            return on
        if not on:
            self._detach_chain()
            return False
        chain = greedy_chain()
        return chain is not None and self._attach_chain(chain, "argmax")

    @property
    def device_argmax(self) -> bool:
        return self._chain_kind == "argmax"

    # -- filtered distributions on the device ------------------------------------------------------------------
    @property
    def prefers_device_sampling(self) -> bool:
        """Whether sampling filters should run in llama.cpp's graph: when the output layer runs on a GPU. On the
        CPU backend numpy's filters cost less (top-p alone sorts the whole vocabulary there). The environment
        variable LLAMASPEC_DEVICE_SAMPLING=1 or 0 forces it on or off."""
        forced = os.environ.get("LLAMASPEC_DEVICE_SAMPLING", "").strip().lower()
        if forced in ("1", "on", "true", "yes", "0", "off", "false", "no"):
            return forced in ("1", "on", "true", "yes")
        return self.output_on_gpu

    @property
    def output_on_gpu(self) -> bool:
        """Whether the output layer (and so every layer before it, as llama.cpp offloads) runs on a GPU."""
        o = self.model.options
        return supports_gpu_offload() and o.devices != () and \
            (o.n_gpu_layers < 0 or o.n_gpu_layers > self.model.info.n_layer)

    def set_device_sampler(self, cfg: SamplerConfig | None, seed: int | None = 0) -> bool:
        """Attach a chain [temp, top-k, top-p, min-p, dist(seed)], or [top-k, top-p, min-p, temp, dist(seed)] in
        llama.cpp's order (only the filters cfg turns on), so that llama.cpp filters every output row on the device
        and draws a token from it; `eval_dists` reads the results. None detaches. Returns whether it is attached:
        every sampler must run in the graph (a build or device that cannot keeps nothing attached, and the caller
        filters logits with numpy instead).
        Attaching makes llama.cpp reserve its graphs again at the next decode (tens of milliseconds for a large
        model), so a chain with the same filters stays attached and takes the state of a fresh one instead
        (llama_sampler_copy: its random generator, seeded from `seed`, or at random for None): the same draws as a
        fresh chain, without the re-reserve."""
        if cfg is None or cfg.greedy or not hasattr(llama_cpp, "llama_get_sampled_probs_ith"):
            self._detach_chain()
            return False
        key = chain_key(cfg, self.n_vocab)
        fresh = sampling_chain(key, seed)
        if self._chain_kind == "sample" and self._chain_key == key and hasattr(llama_cpp, "llama_sampler_copy"):
            llama_cpp.llama_sampler_copy(fresh, self._chain)
            llama_cpp.llama_sampler_free(fresh)
            return True
        self._sorted_rows = sorted_rows(key)  # top-p sorts the vocabulary: the kept ids come first
        attached = self._attach_chain(fresh, "sample")
        self._chain_key = key if attached else None
        return attached

    @property
    def device_sampler(self) -> bool:
        return self._chain_kind == "sample"

    def eval_dists(self, tokens: Sequence[int], rows: str = "last") -> "Sequence[Dist]":
        """Decode `tokens` with the chain of `set_device_sampler` attached: the filtered distribution of the last
        row ('last') or of every row ('all'), each with the device's draw. Every row is read when first asked for
        (the rejection rule stops at the first rejection: the rows after it are never read). The weights are views
        into llama.cpp's buffers, valid until the next decode: `Dist.copy` what must outlive it."""
        if self._chain_kind != "sample":
            raise DecodeError("internal: eval_dists without a device sampler (set_device_sampler)")
        if len(tokens) == 1 and not self.n_pending:   # drafting: reading the draw waits for the device (the sync)
            out = [self._sampled_dist(-1, self._decode_one(int(tokens[0]), sync=last_sampled_token))]
            n_rows = 1
        else:  # a replay left by a checkpoint restore goes in front: the rows asked for follow it
            self._decode(tokens, rows)
            n_rows = len(tokens) if rows == "all" else 1
            out = LazyRows(self._sampled_dist, self._prefix, n_rows) if n_rows > 1 else [self._sampled_dist(-1)]
        # With several outputs per sequence, llama.cpp's dist sampler replays its random draws in the next decode
        # unless they are committed (one accept per draw): commit them all, so that every draw is fresh.
        for _ in range(n_rows):
            llama_cpp.llama_sampler_accept(self._chain, 0)
        return out

    def _sampled_dist(self, i: int, token: int | None = None) -> Dist:
        """Output row i's filtered distribution and draw (`read_dist`, with this context's one chain)."""
        dist, self._row_shape = read_dist(self, i, token, self._row_shape, self._sorted_rows)
        return dist

    def _array_view(self, address: int, n: int, dtype) -> np.ndarray:
        key = (address, n, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[key] = np.frombuffer((ctypes.c_char * (n * np.dtype(dtype).itemsize))
                                                    .from_address(address), dtype=dtype)
        return view

    def _attach_chain(self, chain, kind: str) -> bool:
        """Attach a sampler chain (this context owns it from here, attached or not)."""
        self._detach_chain()
        if not attach(self._ptr, 0, chain):
            return False
        self._chain, self._chain_kind, self._row_shape = chain, kind, None
        return True

    def _detach_chain(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_set_sampler(self._ptr, 0, None)
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = self._chain_kind = self._chain_key = self._row_shape = None


def read_dist(owner: DeviceSampling, i: int, token: int | None, shape: tuple | None,
              sorted_rows: bool) -> tuple[Dist, tuple]:
    """Output (batch) row i's filtered distribution and draw from the chain that sampled it, and the chain's row
    shape. A chain's rows all have the shape its filters give them in the graph (top-k: k candidates; no top-k: the
    whole vocabulary), so their lengths are asked once per chain (`shape`, None at first); a row then costs two or
    three calls into llama.cpp, each of which waits for the device first, not five (the draw is passed in where the
    decode's sync read it). `sorted_rows`: a chain with top-p and no top-k, whose candidates come best first."""
    ctx = owner._ptr
    if token is None:
        token = llama_cpp.llama_get_sampled_token_ith(ctx, i)
    probs_at = _probs_address(ctx, i)
    if token < 0 or not probs_at:
        raise DecodeError("llama.cpp returned no sampled distribution for an output row")
    if shape is None:
        shape = (llama_cpp.llama_get_sampled_probs_count_ith(ctx, i),
                 llama_cpp.llama_get_sampled_candidates_count_ith(ctx, i))
    n_probs, n_ids = shape
    probs = owner._array_view(probs_at, n_probs, np.float32)
    if not n_ids:
        return Dist(None, probs, 1.0, draw=token), shape  # every id, in id order
    ids = owner._array_view(_candidates_address(ctx, i), n_ids, np.int32)
    if sorted_rows:  # sorted by probability, top-p's and min-p's cuts are zeros at the end
        n_kept = bisect.bisect_left(probs, True, key=_is_zero)
        ids, probs = ids[:n_kept], probs[:n_kept]
    return Dist(ids, probs, 1.0, draw=token), shape


def chain_key(cfg: SamplerConfig, n_vocab: int) -> tuple:
    """What a sampling chain for `cfg` is made of (its filters and their order), for `sampling_chain`."""
    return (cfg.temperature, cfg.top_k if 0 < cfg.top_k < n_vocab else 0, cfg.top_p, cfg.min_p, cfg.order)


def sorted_rows(key: tuple) -> bool:
    """Whether the rows of a chain of `key` come sorted best first with their cuts at the end (top-p, no top-k)."""
    return key[2] < 1.0 and not key[1]


def sampling_chain(key: tuple, seed: int | None):
    """A chain of `key`'s filters (chain_key) and a draw seeded from `seed` (None: at random)."""
    temperature, top_k, top_p, min_p, order = key
    samplers = []
    if top_k:
        samplers.append(llama_cpp.llama_sampler_init_top_k(top_k))
    if top_p < 1.0:
        samplers.append(llama_cpp.llama_sampler_init_top_p(top_p, 1))
    if min_p > 0.0:
        samplers.append(llama_cpp.llama_sampler_init_min_p(min_p, 1))
    samplers.insert(len(samplers) if order == LLAMA_CPP else 0, llama_cpp.llama_sampler_init_temp(temperature))
    samplers.append(llama_cpp.llama_sampler_init_dist(llama_cpp.LLAMA_DEFAULT_SEED if seed is None
                                                      else seed & 0x7FFFFFFF))
    return _chain_of(samplers)


def greedy_chain():
    """A chain of llama.cpp's greedy sampler alone (each output row's argmax), or None where this build or the
    environment (LLAMASPEC_NO_DEVICE_ARGMAX=1) keeps argmaxes on the host."""
    if not hasattr(llama_cpp, "llama_set_sampler") or env_flag("LLAMASPEC_NO_DEVICE_ARGMAX"):
        return None
    return _chain_of([llama_cpp.llama_sampler_init_greedy()])


def attach(ctx, seq_id: int, chain) -> bool:
    """Attach `chain` to sequence `seq_id` of context `ctx` so that llama.cpp samples that sequence's output rows in
    its graph. llama.cpp attaches a chain even when only a prefix of it can run there (the rest would be left for
    the host); after attaching, each sampler that runs there is named with a leading '+' ('?': a no-op, such as
    temperature 1). Only a chain that runs whole stays attached; one that does not is freed (the caller owns an
    attached one) and False comes back."""
    with native_log():
        ok = bool(llama_cpp.llama_set_sampler(ctx, seq_id, chain))
    names = [llama_cpp.llama_sampler_name(llama_cpp.llama_sampler_chain_get(chain, i)) or b""
             for i in range(llama_cpp.llama_sampler_chain_n(chain))]
    if not ok or not all(name[:1] in (b"+", b"?") for name in names):
        llama_cpp.llama_set_sampler(ctx, seq_id, None)
        llama_cpp.llama_sampler_free(chain)
        return False
    return True


class LazyRows:
    """The rows of one decode, each read from llama.cpp's buffers when first asked for (row i: output `start + i`)."""

    __slots__ = ("_read", "_start", "_rows")

    def __init__(self, read, start: int, n: int):
        self._read, self._start, self._rows = read, start, [None] * n

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> Dist:
        row = self._rows[i]
        if row is None:
            row = self._rows[i] = self._read(self._start + range(len(self._rows))[i])
        return row

    def __iter__(self):
        return (self[i] for i in range(len(self._rows)))


def last_sampled_token(ctx) -> int:
    """The last output row's token from the attached chain (greedy: its argmax; sampling: its draw). Every llama.cpp
    getter waits for the device first, so this read can end a decode's timed span in place of llama_synchronize
    (one wait, not two)."""
    return llama_cpp.llama_get_sampled_token_ith(ctx, -1)


def _address_of(getter):
    """llama.cpp's `getter(ctx, i) -> pointer` as one that returns the address as an int (0 for NULL): a numpy view
    is made from it without a ctypes cast per row."""
    if not hasattr(llama_cpp, getter):
        return None
    fn = getattr(llama_cpp, getter)
    return ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(ctypes.cast(fn, ctypes.c_void_p).value)


_probs_address = _address_of("llama_get_sampled_probs_ith")
_candidates_address = _address_of("llama_get_sampled_candidates_ith")


def _is_zero(p) -> bool:
    return p <= 0.0


def _chain_of(samplers: list):
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for sampler in samplers:
        llama_cpp.llama_sampler_chain_add(chain, sampler)
    return chain
