"""The range of every number a user or a client can give, declared once: the click options (cli/options.py), the
library's configurations (config.py, sampling.py, policy/) and the server's request and admin checks
(server/validation.py) all ask this table, so a value is refused with the same one line everywhere.

Each range means something: a context whose KV cache this machine's memory can hold, threads no more than the
machine's logical CPUs, a draft no longer than a batch can verify, seeds in 64 bits. What only the model file or
the backend knows (the KV cache's size per token, the GPUs present) is checked at load against the same rows with
`known=`. Knows nothing about click, HTTP or llama.cpp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from .errors import InvalidParameterError
from .sysinfo import cpu_count

MAX_CTX = 1 << 24        # 16 Mi tokens: more than any model is trained for, far below llama.cpp's uint32 sizes
MAX_BATCH = 1 << 14      # llama.cpp lowers n_batch to n_ctx; its compute buffers grow with it
MAX_SEED = (1 << 64) - 1
MAX_TOP_K = 1 << 20      # more than any vocabulary (the engine treats top_k >= the vocabulary as off)
MAX_TEMPERATURE = 2.0    # OpenAI's range; beyond it sampling is noise
MAX_SECONDS = 24 * 3600.0


@dataclass(frozen=True)
class Bound:
    """A closed range [low, high] (an open end where `low_open` / `high_open`); `high` may depend on what is known
    (the batch size, the memory a context may take, the GPU count), given to `check` as `known`."""

    name: str
    low: float
    high: float | Callable[[Mapping], float]
    why: str                     # what the upper end stands for, shown when a value goes past it
    integer: bool = True
    low_open: bool = False
    high_open: bool = False
    least_positive: float = 0.0  # a value above `low` must be at least this (a temperature of 1e-300 overflows)

    def upper(self, known: Mapping | None = None) -> float:
        return self.high(known or {}) if callable(self.high) else self.high

    def check(self, value, known: Mapping | None = None, name: str | None = None):
        """`value` unchanged when it is in range, else InvalidParameterError (one line naming `name`)."""
        problem = self.problem(value, known)
        if problem is not None:
            raise InvalidParameterError(f"{name or self.name} {problem}", param=name or self.name)
        return value

    def problem(self, value, known: Mapping | None = None) -> str | None:
        """None when `value` is in range, else what is wrong ("must be an integer in [0, 511]: ...; got 2000")."""
        high = self.upper(known)
        if self.integer:
            ok_type = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok_type = not isinstance(value, bool) and (isinstance(value, int) or
                                                       isinstance(value, float) and math.isfinite(value))
        if not ok_type or not (value > self.low if self.low_open else value >= self.low):
            return f"must be {self.describe(known)}, got {_shown(value)}"
        if not (value < high if self.high_open else value <= high):
            return f"must be {self.describe(known)}: {self.why}; got {_shown(value)}"
        if self.low < value < self.least_positive:
            return f"must be {_num(self.low)} or at least {self.least_positive:g}, got {_shown(value)}"
        return None

    def describe(self, known: Mapping | None = None) -> str:
        kind = "an integer" if self.integer else "a number"
        high = self.upper(known)
        return f"{kind} in {'(' if self.low_open else '['}{_num(self.low)}, {_num(high)}{')' if self.high_open else ']'}"


def _num(x: float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        x = int(x)
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def _shown(value) -> str:
    try:
        text = repr(value)
    except ValueError:   # an integer too long to print
        return "a number too long to show"
    return text if len(text) <= 40 else text[:37] + "..."


def _batch_draft(known: Mapping) -> int:
    # a verification decodes the draft and the pending token in one batch, every row with logits
    return known.get("n_batch", MAX_BATCH) - 1


def _ctx(known: Mapping) -> int:
    # n_ctx_memory: the most tokens whose KV cache fits in this machine's RAM and GPU memory (loading.py)
    return min(known.get("n_ctx_memory", MAX_CTX), MAX_CTX)


def _gpus(known: Mapping) -> int:
    return max(known.get("n_gpus", 16) - 1, 0)   # llama.cpp handles at most 16 devices


_ROWS = [
    # loading (config.ModelConfig / LoadConfig, the CLI's pair options, the server's start-up)
    Bound("n_ctx", 16, _ctx, "its KV cache must fit in the memory free now, and at most 2^24"),
    Bound("n_batch", 1, MAX_BATCH, "llama.cpp's compute buffers grow with the batch"),
    Bound("n_threads", 1, lambda known: cpu_count(), "this machine's logical CPUs"),
    Bound("n_gpu_layers", -1, (1 << 31) - 1, "llama.cpp's 32-bit layer count"),
    Bound("main_gpu", 0, _gpus, "the GPUs llama.cpp sees"),
    Bound("n_rs_seq", 0, MAX_BATCH - 2, "a batch must hold the snapshots and two tokens"),
    Bound("n_checkpoints", 0, 64, "each checkpoint holds a whole recurrent state"),
    Bound("cache_ram", -1, 1 << 30, "1 PiB (-1: no limit, 0: no cache)"),
    # drafting (config.LoadConfig, policy.make_policy, the server's /admin/config)
    Bound("draft_max", 0, _batch_draft, "a verification must fit in one batch (-b)"),
    Bound("draft_min", 0, _batch_draft, "a verification must fit in one batch (-b)"),
    Bound("draft_p_min", 0.0, 1.0, "a probability", integer=False, high_open=True),
    # sampling (sampling.SamplerConfig, the CLI's sampler options, the server's request fields)
    Bound("max_tokens", 1, MAX_CTX, "no context holds more"),
    Bound("temperature", 0.0, MAX_TEMPERATURE, "OpenAI's range", integer=False, least_positive=1e-6),
    Bound("top_k", 0, MAX_TOP_K, "more than any vocabulary"),
    Bound("top_p", 0.0, 1.0, "a probability", integer=False, low_open=True),
    Bound("min_p", 0.0, 1.0, "a probability", integer=False),
    Bound("seed", 0, MAX_SEED, "seeds are 64-bit"),
    # serving (cli/serve.py)
    Bound("port", 0, 65535, "TCP ports"),
    Bound("max_queue", 0, 1 << 16, "each waiting request holds its prompt in memory"),
    Bound("parallel", 1, 256, "llama.cpp's sequences per context (LLAMA_MAX_SEQ)"),
    Bound("max_body_bytes", 1024, 1 << 30, "1 GiB"),
    Bound("shutdown_timeout", 0.0, MAX_SECONDS, "a day", integer=False),
    Bound("read_timeout", 0.1, MAX_SECONDS, "a day", integer=False),
]
BOUNDS: dict[str, Bound] = {b.name: b for b in _ROWS}


def check(name: str, value, known: Mapping | None = None, param: str | None = None):
    """`value` when BOUNDS[name] admits it; else InvalidParameterError naming `param` (default: `name`)."""
    return BOUNDS[name].check(value, known, param)


def check_tensor_split(values) -> tuple[float, ...]:
    """Finite, non-negative shares with a positive sum."""
    shares = tuple(values)
    finite = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                 for x in shares)
    if not finite or not shares or sum(shares) <= 0:
        raise InvalidParameterError("tensor_split must be finite shares >= 0 with a positive sum, got "
                                    f"{','.join(map(str, shares))[:60]}", param="tensor_split")
    return tuple(float(x) for x in shares)
