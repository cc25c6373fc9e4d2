"""The speculative loop: a target model, an optional drafter, and a draft-length policy.

Position state: `self._history` is every committed token, and the target's KV cache holds exactly those tokens;
`last` (the newest token) is pending: it is decoded by the next verification. The draft's cache holds a prefix of
history plus whatever it drafted; the drafter catches up on its own. A rollback is one `truncate` per cache.

Plain decoding is the same loop with nothing drafted (a step verifies [last] alone), so comparisons run through
one code path. The engine knows nothing about chat templates or HTTP.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .backend import Context, ContextOptions, Model, ModelOptions, env_flag
from .drafters import CombinedDrafter, ModelDrafter, PromptLookupDrafter, common_prefix_len
from .errors import ContextOverflowError, InvalidParameterError, UnsupportedModelError
from .gguf_meta import ModelInfo, check_pair, read_model_info
from .policy import DraftPolicy, FixedPolicy, make_policy
from .sampling import SamplerConfig, filtered_probs
from .stats import GenerationStats
from .verify import accept_greedy, accept_rejection


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it releases (may be empty: an incomplete UTF-8 sequence, or text held
    back because it may begin a stop string)."""

    text: str
    token: int | None   # None: a final piece that only releases held-back text
    from_draft: bool


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats = field(repr=False)


class StopMatcher:
    """Releases text as it arrives, except a tail that could still begin a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hold = max((len(s) for s in self.stops), default=0)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text to release, stopped)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0
        for n in range(min(self.hold - 1, len(self.pending)), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                keep = n
                break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Pair:
    """A target model with an optional drafter. Not thread-safe: one generation at a time."""

    def __init__(self, target: Model, target_ctx: Context, draft: Model | None = None,
                 draft_ctx: Context | None = None, policy: DraftPolicy | None = None,
                 drafter: str = "model"):
        self.target, self.target_ctx = target, target_ctx
        self.draft, self.draft_ctx = draft, draft_ctx
        self.n_vocab = target.n_vocab
        if drafter not in ("model", "lookup", "lookup+model"):
            raise InvalidParameterError(f"drafter must be model, lookup or lookup+model, got {drafter!r}")
        if drafter != "lookup" and draft_ctx is None:
            drafter = "lookup" if drafter == "lookup+model" else "none"
        self.drafter_kind = drafter
        model_drafter = ModelDrafter(draft_ctx, self.n_vocab) if draft_ctx is not None else None
        lookup = PromptLookupDrafter(n_vocab=self.n_vocab)
        self.drafter = {"model": model_drafter, "lookup": lookup, "none": None,
                        "lookup+model": CombinedDrafter(lookup, model_drafter) if model_drafter else None}[drafter]
        self.policy = policy if policy is not None else (make_policy("auto") if self.drafter else FixedPolicy(0))
        if self.drafter is None:
            self.policy = FixedPolicy(0)
        self._history: list[int] = []
        self.last_stats: GenerationStats | None = None
        self._probs = None         # (k_max, n_vocab) draft distributions, sampling mode only; allocated once
        self._target_probs = None  # (k_max + 1, n_vocab) target distributions, likewise

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.target_ctx.n_ctx

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    def set_policy(self, policy: DraftPolicy) -> None:
        self.policy = policy if self.drafter is not None else FixedPolicy(0)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special, parse_special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.target.detokenize(tokens)

    def reset(self) -> None:
        """Forget the cached conversation: both KV caches are cleared."""
        self.target_ctx.clear()
        if self.draft_ctx is not None:
            self.draft_ctx.clear()
        self._history = []

    def close(self) -> None:
        for obj in (self.draft_ctx, self.target_ctx, self.draft, self.target):
            if obj is not None:
                obj.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- public generation API ------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        pieces = list(self.stream(prompt, **kwargs))
        stats = self.last_stats
        tokens = [p.token for p in pieces if p.token is not None]
        return Completion("".join(p.text for p in pieces), tokens, stats.finish_reason, stats)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: Sequence[str] | str | None = None, add_special: bool = True) -> Iterator[Piece]:
        """Generate from `prompt` (text or token ids), yielding one Piece per token.

        Stops at max_tokens ("length"), an end-of-generation token or a stop string ("stop", neither is
        emitted), or a full context ("context"). Statistics land in `last_stats` when the generator ends,
        also when the consumer stops early ("cancelled").
        """
        cfg = SamplerConfig(temperature, top_k, top_p, min_p, seed)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        tokens = self.tokenize(prompt, add_special) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise InvalidParameterError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or raise the context size (-c / n_ctx)")
        if max(tokens) >= self.n_vocab or min(tokens) < 0:
            raise InvalidParameterError(f"prompt token ids must be in [0, {self.n_vocab})")
        return self._generate(tokens, max_tokens, cfg, stops)

    # -- the loop -------------------------------------------------------------------------------------------
    def _generate(self, prompt: list[int], max_tokens: int, cfg: SamplerConfig, stops: list[str]) -> Iterator[Piece]:
        stats = GenerationStats(policy=self.policy.name if self.drafter else "none", prompt_tokens=len(prompt))
        self.last_stats = stats
        rng = np.random.default_rng(cfg.seed)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        matcher = StopMatcher(stops)
        t_start = time.perf_counter()
        decode_before = self._decode_seconds()
        n_out = 0
        finish = "cancelled"
        stops_hit = False
        try:
            # 1. prefill: reuse what the caches already hold, decode the rest of the prompt but its last token
            self._use_device_argmax(cfg)
            stats.prompt_tokens_cached = self._prefill(prompt[:-1])
            self._last = prompt[-1]
            stats.time_prefill = time.perf_counter() - t_start
            decode_before = self._decode_seconds()

            # 2. speculative steps until a stop condition
            while True:
                if n_out >= max_tokens:
                    finish = "length"
                    break
                if len(self._history) + 1 > self.n_ctx:
                    finish = "context"
                    break
                emitted, n_from_draft = self._step(cfg, rng, max_tokens - n_out, stats)
                for i, token in enumerate(emitted):
                    n_out += 1
                    stats.tokens_generated = n_out
                    if self.target.is_eog(token):
                        finish = "stop"
                        break
                    text, stopped = matcher.push(decoder.decode(self.target.token_bytes(token)))
                    if not stats.time_to_first_token:
                        stats.time_to_first_token = time.perf_counter() - t_start
                    yield Piece(text, token, i < n_from_draft)
                    if stopped:
                        finish = "stop"
                        stops_hit = True
                        break
                    if n_out >= max_tokens:
                        break
                if finish == "stop":
                    break
            if not stops_hit:  # release what was held back (partial UTF-8, a possible stop-string prefix)
                text, stopped = matcher.push(decoder.decode(b"", final=True))
                text += "" if stopped else matcher.flush()
                if text:
                    yield Piece(text, None, False)
        finally:
            # Exactly one place restores consistency after an early exit (Ctrl-C, consumer closed, error):
            # each cache drops anything past what it has recorded, and the target holds exactly the history.
            self.target_ctx.resync()
            self.target_ctx.truncate(len(self._history))
            if self.draft_ctx is not None:
                self.draft_ctx.resync()
            stats.finish_reason = finish
            stats.time_total = time.perf_counter() - t_start
            stats.time_in_decode = self._decode_seconds() - decode_before

    def _use_device_argmax(self, cfg: SamplerConfig) -> None:
        """Greedy decoding needs only argmaxes: let llama.cpp take them on the device, so no logits are copied
        out (the draft too, unless its confidence stop needs its probabilities). Sampling detaches it."""
        self.target_ctx.set_device_argmax(cfg.greedy)
        if self.draft_ctx is not None:
            self.draft_ctx.set_device_argmax(cfg.greedy and self.policy.p_min <= 0)

    def _decode_seconds(self) -> float:
        return self.target_ctx.decode_seconds + (self.draft_ctx.decode_seconds if self.draft_ctx else 0.0)

    def _prefill(self, history: list[int]) -> int:
        """Make the target cache (and the draft's) hold `history`; returns how many tokens were already cached."""
        ctx = self.target_ctx
        common = common_prefix_len(ctx.tokens, history)
        if not ctx.truncate(common):
            ctx.clear()  # recurrent memory cannot drop a tail: start over
            common = 0
        if common < len(history):
            ctx.eval(history[common:], logits="none")
        self._history = list(history)
        if self.drafter is not None and self.policy.next_draft_len() > 0:
            self.drafter.sync(self._history, known_equal=0)  # else the drafter catches up when next used
        return common

    def _step(self, cfg: SamplerConfig, rng: np.random.Generator, budget: int,
              stats: GenerationStats) -> tuple[list[int], int]:
        """Draft, verify, accept, roll back. Returns the emitted tokens and how many of them the draft proposed."""
        history, last = self._history, self._last
        room = self.n_ctx - len(history) - 1           # positions free after `last`
        k = min(self.policy.next_draft_len(), room, budget - 1, self.target_ctx.n_batch - 1)
        k = max(k, 0)

        # 1. draft
        t0 = time.perf_counter()
        drafted: list[int] = []
        if k > 0 and self.drafter is not None:
            probs_out = None
            if not cfg.greedy:
                if self._probs is None or self._probs.shape[0] < k:
                    self._probs = np.zeros((max(k, self.policy.k_max, 1), self.n_vocab), dtype=np.float32)
                probs_out = self._probs
            drafted = self.drafter.draft(history, last, k, self.policy.p_min, cfg, rng, probs_out)
        t1 = time.perf_counter()

        # 2. verify: one target pass over [last, d_1..d_k], logits for every row
        batch = [last] + drafted
        if cfg.greedy:  # the argmax of every row (taken on the device when it can be)
            target_argmax = self.target_ctx.eval_argmax(batch, rows="all")
        else:
            logits = self.target_ctx.eval(batch, logits="all")

        # 3. accept
        draft_arr = np.asarray(drafted, dtype=np.int64)
        if cfg.greedy:
            n_accepted, next_token = accept_greedy(draft_arr, np.asarray(target_argmax))
        else:
            if self._target_probs is None or self._target_probs.shape[0] < len(batch):
                self._target_probs = np.zeros((max(len(batch), self.policy.k_max + 1), self.n_vocab), np.float32)
            rows: dict[int, np.ndarray] = {}

            def target_probs(i: int) -> np.ndarray:
                if i not in rows:  # rows past the first rejection are never computed
                    rows[i] = filtered_probs(logits[i], cfg, out=self._target_probs[i])
                return rows[i]

            n_accepted, next_token = accept_rejection(draft_arr, self._probs if drafted else None,
                                                      target_probs, rng)
        t2 = time.perf_counter()

        # 4. roll back: keep `last` and the accepted draft tokens in the target cache
        self.target_ctx.truncate(len(history) + 1 + n_accepted)
        history.extend(batch[:1 + n_accepted])
        self._last = next_token

        # the policy learns the cost of drafting itself; a catch-up after a pause is not a per-token cost
        catchup = getattr(self.drafter, "catchup_seconds", 0.0) if drafted else 0.0
        self.policy.update(len(drafted), n_accepted, max(t1 - t0 - catchup, 0.0), t2 - t1)
        stats.target_passes += 1
        stats.drafted += len(drafted)
        stats.accepted += n_accepted
        stats.time_draft += t1 - t0
        stats.time_verify += t2 - t1
        if drafted:
            stats.accepted_lengths[n_accepted] += 1
        stats.draft_lengths[len(drafted)] += 1
        return drafted[:n_accepted] + [next_token], n_accepted


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------
def _is_pair_name(name) -> bool:
    from pathlib import Path

    text = str(name)
    return not text.endswith(".gguf") and "/" not in text and "\\" not in text and not Path(text).exists()


def load_pair(
    target: str,
    draft: str | None = None,
    *,
    n_gpu_layers: int = -1,
    draft_n_gpu_layers: int | None = None,
    n_ctx: int = 4096,
    draft_n_ctx: int | None = None,
    n_batch: int = 512,
    n_threads: int | None = None,
    draft_n_threads: int | None = None,
    flash_attn: str = "auto",
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    main_gpu: int = 0,
    draft_main_gpu: int | None = None,
    split_mode: str = "layer",
    tensor_split: Sequence[float] | None = None,
    rpc_servers: str | None = None,
    devices: Sequence[str] | None = None,
    draft_device: str | None = None,
    use_mmap: bool = True,
    no_repack: bool | None = None,
    policy: str | DraftPolicy = "auto",
    draft_max: int | None = None,
    draft_min: int | None = None,
    draft_p_min: float | None = None,
    drafter: str = "model",
    verbose: bool = False,
) -> Pair:
    """Load a target and (optionally) a draft GGUF; the pair is checked from the file headers before any weights
    load. `no_repack=True` (or LLAMASPEC_NO_REPACK=1) turns off llama.cpp's CPU weight repacking.

    Placement is llama.cpp's own: `split_mode`/`tensor_split`/`main_gpu` spread the target over local GPUs,
    `rpc_servers` adds llama.cpp rpc-servers as devices for the target, `devices` names the target's devices
    ("CUDA0,CUDA1"), and `draft_device` puts the whole draft on one device. With RPC servers and no draft device,
    the draft stays on the local GPUs: a draft token must not wait on the network."""
    from .backend import init_backend

    init_backend(verbose)
    if draft is None and _is_pair_name(target):
        from .registry import resolve_pair  # a named pair from models.toml, downloaded on first use

        target, draft, _defaults = resolve_pair(target, assume_yes=True)
    if no_repack is None:
        no_repack = env_flag("LLAMASPEC_NO_REPACK")
    target_info = read_model_info(target)
    draft_info: ModelInfo | None = None
    if draft is not None:
        draft_info = read_model_info(draft)
        check_pair(target_info, draft_info)
        for info in (target_info, draft_info):
            if info.is_recurrent:
                raise UnsupportedModelError(
                    f"{info.path}: {info.arch} is a recurrent model; its state cannot drop rejected draft tokens, "
                    "so speculative decoding is not supported with it (run it without a draft)")
    if isinstance(policy, str):
        policy_obj = make_policy(policy, k=draft_max, k_min=draft_min, p_min=draft_p_min)
    else:
        policy_obj = policy

    ctx_opts = ContextOptions(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads,
                              flash_attn=flash_attn, type_k=cache_type_k, type_v=cache_type_v)
    target_model = Model(target, ModelOptions(n_gpu_layers=n_gpu_layers, main_gpu=main_gpu, split_mode=split_mode,
                                              tensor_split=tuple(tensor_split) if tensor_split else None,
                                              use_mmap=use_mmap, no_repack=no_repack, rpc_servers=rpc_servers,
                                              devices=tuple(devices) if devices is not None else None),
                         info=target_info)
    target_ctx = Context(target_model, ctx_opts)
    draft_model = draft_ctx = None
    if draft is not None:
        if target_model.is_recurrent or target_model.is_hybrid:
            raise UnsupportedModelError(
                f"{target}: recurrent/hybrid models cannot drop rejected draft tokens from their state; "
                "speculative decoding is not supported with this target (run it without a draft)")
        draft_devices: tuple[str, ...] | None = None
        if draft_device is not None:
            draft_devices = (draft_device,)
        elif rpc_servers:
            from .backend import devices as all_devices

            draft_devices = tuple(d.name for d in all_devices() if d.kind == "gpu" and d.backend != "RPC")
        draft_model = Model(draft, ModelOptions(
            n_gpu_layers=n_gpu_layers if draft_n_gpu_layers is None else draft_n_gpu_layers,
            main_gpu=main_gpu if draft_main_gpu is None else draft_main_gpu,
            split_mode="none" if draft_main_gpu is not None or draft_device is not None else split_mode,
            use_mmap=use_mmap, no_repack=no_repack, devices=draft_devices), info=draft_info)
        if draft_model.is_recurrent or draft_model.is_hybrid:
            raise UnsupportedModelError(f"{draft}: recurrent/hybrid draft models are not supported")
        draft_ctx = Context(draft_model, ContextOptions(
            n_ctx=draft_n_ctx or n_ctx, n_batch=n_batch, n_ubatch=n_batch,
            n_threads=draft_n_threads or n_threads, flash_attn=flash_attn, type_k=cache_type_k,
            type_v=cache_type_v))
    return Pair(target_model, target_ctx, draft_model, draft_ctx, policy_obj, drafter=drafter)
