"""The speculative loop: a target model, an optional drafter, and a draft-length policy.

Position state: `self._history` is every committed token, and the target's cache holds exactly those tokens;
`last` (the newest token) is pending: it is decoded by the next verification. A drafter keeps its own state in
step through its contract (drafters/). After a verification the one cache operation is `keep(n)` on the target's
context; how the memory does it (drop a KV tail, restore a snapshot, ...) is the backend's business.

Plain decoding is the same loop with nothing drafted (a step verifies [last] alone), so comparisons run through
one code path. Layers, as in mlx-lm: `generate_tokens` owns the steps and the cache repair in its `finally`;
`stream` adds text (UTF-8, stop strings, text.py) on top. The engine knows nothing about chat templates or HTTP.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .config import DraftSettings, LoadConfig
from .drafters import Drafter, common_prefix_len
from .errors import ContextOverflowError, DecodeError, InvalidParameterError
from .policy import Costs, DraftPolicy, FixedPolicy, Hooks, make_policy, policy_for
from .policy.calibration import measure_costs
from . import modes
from .sampling import OPENAI, SamplerConfig, Sampling, as_dist
from .shaping import Shaper, Shaping
from .stats import GenerationStats
from .text import Piece, StopMatcher, stream_text  # noqa: F401  (Piece, StopMatcher: re-exported)


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats = field(repr=False)


class Pair:
    """A target model with an optional drafter. Not thread-safe: one generation at a time."""

    def __init__(self, target, target_ctx, drafter: Drafter | None = None, policy: DraftPolicy | None = None,
                 config: LoadConfig | None = None):
        self.target, self.target_ctx = target, target_ctx
        self.config = config if config is not None else LoadConfig()   # as load_pair resolved it
        self.drafter = drafter
        self.n_vocab = target.n_vocab
        self.costs: Costs | None = None   # what the passes cost, measured by warm_up
        self.policy = FixedPolicy(0)
        self.set_policy(policy if policy is not None else make_policy("auto"))
        self._history: list[int] = []
        self._last = 0
        self.last_stats: GenerationStats | None = None
        self._target_scratch = np.zeros((0, self.n_vocab), np.float32)  # dense target rows, numpy sampling only
        self.tree = None   # a tree.TreeVerifier while tree verification is on (tree.enable_tree)
        self._batch = None   # the BatchEngine of generate_batch / a server's slots (batch.py), made when asked

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.target_ctx.n_ctx

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def drafter_kind(self) -> str:
        return self.drafter.kind if self.drafter is not None else "none"

    @property
    def draft_ctx(self):
        """The draft model's context, when the drafter has one."""
        return self.drafter.contexts[0] if self.drafter is not None and self.drafter.contexts else None

    @property
    def draft(self):
        """The draft model, when the drafter has one (an MTP head is part of the target, not a draft model)."""
        ctx = self.draft_ctx
        return ctx.model if ctx is not None and ctx.model is not self.target else None

    def set_policy(self, policy: DraftPolicy) -> None:
        self.policy = policy if self.drafter is not None else FixedPolicy(0)
        self._hooks = Hooks(self.policy)
        if self.drafter is not None:
            self._hooks.attach(self.drafter.draft_cost, self.costs)

    def set_drafting(self, drafting: DraftSettings) -> None:
        """Draft by other settings (a policy name, k, k_min, p_min; the drafter stays): the policy they name
        replaces the current one, and `config.drafting` says so."""
        drafting = dataclasses.replace(drafting, drafter=self.config.drafting.drafter)
        self.set_policy(policy_for(drafting, self.target_ctx.n_batch))
        self.config = dataclasses.replace(self.config, drafting=drafting)

    def warm_up(self, k_max: int | None = None) -> None:
        """Run every draft length up to k_max (the policy's) and keep what the warm passes took as `costs`, which
        every policy taken from here on starts from (DraftPolicy.attach); the text is forgotten
        (policy/calibration.py). load_pair calls it on GPU targets."""
        if self.drafter is None:
            return
        policy = self.policy
        try:
            self.costs = measure_costs(self, k_max) or self.costs
        finally:
            self.set_policy(policy)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.target.detokenize(tokens)

    def reset(self) -> None:
        """Forget the cached conversation: every cache is cleared."""
        self.target_ctx.clear()
        if self.drafter is not None:
            self.drafter.reset()
        self._history = []

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self.drafter is not None:
            self.drafter.close()
        self.target_ctx.close()
        self.target.close()

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

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs) -> list[Completion]:
        """A Completion for each prompt, all decoded together (one target pass verifies every sequence's draft),
        each equal to what `generate(prompt, **kwargs)` gives; see batch.generate_batch."""
        from .batch import generate_batch

        return generate_batch(self, prompts, **kwargs)

    def batch_engine(self, n_seq: int, n_ctx: int | None = None, **options):
        """The pair's BatchEngine of n_seq slots over n_ctx tokens (batch.py), kept while those stay the same."""
        from .batch import BatchEngine

        engine = self._batch
        if engine is None or engine.n_seq != n_seq or (n_ctx and engine.target.n_ctx != n_ctx) or engine.busy:
            if engine is not None:
                engine.close()
                self._batch = None
            self._batch = BatchEngine(self, n_seq, n_ctx, **options)
        return self._batch

    def chat(self, messages: list[dict], reasoning: str | None = None, **kwargs):
        """Reply to a conversation (rendered with the target's chat template): a ChatReply with `content`,
        `reasoning` (a thinking model's <think> part), `finish_reason` and `stats`. See llamaspec.conversation."""
        from .conversation import chat

        return chat(self, messages, reasoning, **kwargs)

    def chat_stream(self, messages: list[dict], reasoning: str | None = None, **kwargs):
        """The reply to a conversation as Parts (`kind` "reasoning" or "content", `text`)."""
        from .conversation import chat_stream

        return chat_stream(self, messages, reasoning, **kwargs)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: Sequence[str] | str | None = None, add_special: bool = True,
               shaping: Shaping | None = None, sampler_order: str = OPENAI) -> Iterator[Piece]:
        """Generate from `prompt` (text or token ids), yielding one Piece per token.

        Stops at max_tokens ("length"), an end-of-generation token or a stop string ("stop", neither is
        emitted), or a full context ("context"). Statistics land in `last_stats` when the generator ends,
        also when the consumer stops early ("cancelled"). `shaping`: a grammar, penalties or log-probabilities
        (shaping.py), applied exactly to the target's rows. `sampler_order`: "openai" applies temperature before
        top-k/top-p/min-p, "llama.cpp" after them, to the untempered distribution (sampling.py).
        """
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        sampler = SamplerConfig(temperature, top_k, top_p, min_p, seed, sampler_order)
        tokens = self.generate_tokens(prompt, max_tokens, sampler, add_special, shaping)
        stats = self.last_stats

        def stopped():
            stats.finish_reason = "stop"

        return stream_text(tokens, self.target.token_bytes, stops, stopped)

    def generate_tokens(self, prompt: str | Sequence[int], max_tokens: int, sampler: SamplerConfig,
                        add_special: bool = True, shaping: Shaping | None = None) -> Iterator[tuple[int, bool]]:
        """The token stream: (token, from_draft) per generated token; the prompt is checked before it starts."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
        tokens = self.tokenize(prompt, add_special) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise InvalidParameterError("the prompt is empty", param="prompt")
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or raise the context size (-c / n_ctx)")
        if max(tokens) >= self.n_vocab or min(tokens) < 0:
            raise InvalidParameterError(f"prompt token ids must be in [0, {self.n_vocab})", param="prompt")
        self.last_stats = GenerationStats(policy=self.policy.name if self.drafter else "none",
                                          prompt_tokens=len(tokens))
        shaper = Shaper(shaping, self.n_vocab) if shaping is not None and shaping.active else None
        return self._token_steps(tokens, max_tokens, sampler, self.last_stats, shaper)

    # -- the loop -------------------------------------------------------------------------------------------
    def _token_steps(self, prompt: list[int], max_tokens: int, cfg: SamplerConfig,
                     stats: GenerationStats, shaper: Shaper | None = None) -> Iterator[tuple[int, bool]]:
        rng = np.random.default_rng(cfg.seed)
        # shaped rows are numpy's: the target's logits come back, so nothing filters on the device
        sampling = None if cfg.greedy else Sampling(cfg, rng, device=self._device_sampling(
            cfg if shaper is None and self.tree is None else None, rng))   # a tree's rows are filtered in numpy
        t_start = time.perf_counter()
        decode_before = self._decode_seconds()
        rollback_before = self._rollback_totals()
        n_out = 0
        stats.finish_reason = "cancelled"
        try:
            # 1. prefill: reuse what the caches already hold, decode the rest of the prompt but its last token
            # greedy needs argmaxes only: taken on the device where rows are verified; a pair that never drafts
            # copies its one row out instead (measured faster for single rows on the H200:
            # benchmarks/results/h200-plain-gap-qwen35.md)
            self.target_ctx.set_device_argmax(sampling is None and shaper is None and self.drafter is not None)
            stats.prompt_tokens_cached = self._prefill(prompt[:-1], sampling)
            verify = self._verifier(sampling, shaper)
            self._last = prompt[-1]
            stats.time_prefill = time.perf_counter() - t_start
            decode_before = self._decode_seconds()

            # 2. speculative steps until a stop condition
            while n_out < max_tokens:
                if len(self._history) + 1 > self.n_ctx:
                    stats.finish_reason = "context"
                    return
                emitted, n_from_draft = self._step(verify, max_tokens - n_out, stats)
                for i, token in enumerate(emitted):
                    n_out += 1
                    stats.tokens_generated = n_out
                    if self.target.is_eog(token):
                        stats.finish_reason = "stop"
                        return
                    if not stats.time_to_first_token:
                        stats.time_to_first_token = time.perf_counter() - t_start
                    yield token, i < n_from_draft
                    if n_out >= max_tokens:
                        break
            stats.finish_reason = "length"
        finally:
            # Exactly one place restores consistency after an early exit (Ctrl-C, consumer closed, error):
            # each cache drops anything past what it has recorded, and the target holds exactly the history.
            self.target_ctx.resync()
            self.target_ctx.keep(len(self._history))
            for ctx in self.drafter.contexts if self.drafter is not None else ():
                ctx.resync()
            stats.time_total = time.perf_counter() - t_start
            stats.time_in_decode = self._decode_seconds() - decode_before
            seconds, replayed = self._rollback_totals()
            stats.time_rollback = seconds - rollback_before[0]
            stats.tokens_replayed = replayed - rollback_before[1]
            stats.end_reply()

    def _device_sampling(self, cfg: SamplerConfig | None, rng: np.random.Generator) -> bool:
        """Filter on the device (llama.cpp's sampler chains) when every context prefers it and can run it;
        otherwise none does: draft and target must filter by one rule, which keeps rejection sampling exact.
        None: none does (shaped rows are filtered in numpy)."""
        contexts = [self.target_ctx, *(self.drafter.contexts if self.drafter is not None else ())]
        wanted = cfg is not None and all(ctx.prefers_device_sampling for ctx in contexts)
        # Every chain's draws follow the request's seed (the draft's too: the same draft draws in every request
        # would bias the output across seeds), or none at all; a chain with unchanged filters stays attached.
        if wanted and all([ctx.set_device_sampler(cfg, None if cfg.seed is None else int(rng.integers(1, 2**31)))
                           for ctx in contexts]):
            return True
        for ctx in contexts:
            ctx.set_device_sampler(None)
        return False

    def _decode_seconds(self) -> float:
        seconds = self.target_ctx.decode_seconds
        for ctx in self.drafter.contexts if self.drafter is not None else ():
            seconds += ctx.decode_seconds
        return seconds

    def _rollback_totals(self) -> tuple[float, int]:
        """Seconds spent rolling caches back (saves, restores, trims) and tokens replayed, over all contexts."""
        contexts = (self.target_ctx, *(self.drafter.contexts if self.drafter is not None else ()))
        return sum(c.rollback_seconds for c in contexts), sum(c.replayed_tokens for c in contexts)

    def _prefill(self, history: list[int], sampling: Sampling | None) -> int:
        """Make the target cache hold `history` and start the drafter; returns how many tokens were reused."""
        ctx = self.target_ctx
        common = common_prefix_len(ctx.tokens, history)
        if not ctx.keep(common):
            ctx.clear()  # the memory cannot go back to the common prefix: start over
            common = 0
        cached = ctx.n_in_memory  # a checkpoint restore may leave part of the common prefix to decode again
        if common < len(history):
            ctx.eval(history[common:], logits="none")
        # a turn boundary: a later prompt that leaves this one's answer (a chat template that re-renders it, a
        # regenerated answer) restarts here. A prompt that extends the whole history needs no checkpoint at all.
        ctx.checkpoint(turn=True)
        self._history = list(history)
        self._hooks.new_request()
        if self.drafter is not None:  # a drafter the policy will not use yet catches up when first asked
            self.drafter.begin(self._history, sampling, self.policy.p_min, prefill=self.policy.next_draft_len() > 0)
        return cached

    def _verifier(self, sampling: Sampling | None, shaper: Shaper | None):
        """This request's verification (modes.py): one path per mode, chosen once."""
        ctx = self.target_ctx
        if shaper is not None:
            return functools.partial(modes.shaped, ctx, sampling, shaper, self.target.is_eog)
        if self.tree is not None:
            return self.tree.make(ctx, sampling, self._scratch)
        if sampling is None:
            return functools.partial(modes.greedy, ctx)
        if sampling.device:
            return functools.partial(modes.on_device, ctx, sampling)
        return functools.partial(modes.in_numpy, ctx, sampling, self._scratch)

    def _scratch(self, n: int) -> np.ndarray:
        """Dense rows for n of the target's filtered distributions (numpy sampling), grown once to the longest."""
        if self._target_scratch.shape[0] < n:
            self._target_scratch = np.zeros((max(n, self.policy.k_max + 1), self.n_vocab), np.float32)
        return self._target_scratch

    def _step(self, verify, budget: int, stats: GenerationStats) -> tuple[list[int], int]:
        """Draft, verify, accept, roll back. Returns the emitted tokens and how many of them the draft proposed."""
        history, last = self._history, self._last
        room = self.n_ctx - len(history) - 1           # positions free after `last`
        k = max(min(self.policy.next_draft_len(), room, budget - 1, self.target_ctx.n_batch - 1), 0)

        # 1. draft (or, on a plain step, a shadow probe where the policy asks for one)
        t0 = time.perf_counter()
        draft = self.drafter.propose(history, last, k, self.policy.p_min) if k > 0 else None
        probe = self._shadow_probe(room) if not k else None
        drafted = draft.tokens if draft is not None else []
        t1 = time.perf_counter()

        # 2. verify and accept: one target pass over [last, d_1..d_k], an opinion for every row
        n_accepted, next_token, target_probs = verify(history, last, drafted, draft.probs if drafted else None)

        # 3. roll back: keep `last` and the accepted draft tokens (a recurrent memory may restore a checkpoint)
        if not self.target_ctx.keep(len(history) + 1 + n_accepted):
            raise DecodeError("the target's cache could not drop the rejected draft tokens")
        t3 = time.perf_counter()
        if drafted or probe is not None:
            self.drafter.accepted(n_accepted if drafted else 0)   # a probe's token is never kept
        history.append(last)
        history.extend(drafted[:n_accepted])
        self._last = next_token
        t4 = time.perf_counter()
        if probe is not None:
            stats.shadow_probes += 1
            self._hooks.shadow(shadow_acceptance(probe, next_token, target_probs), t1 - t0 + (t4 - t3))

        # the policy learns the cost of drafting itself; a catch-up after a pause is not a per-token cost.
        # Rolling back is part of each phase's cost, so `auto` drafts less where it is expensive.
        setup = draft.setup_seconds if drafted else 0.0
        self.policy.update(len(drafted), n_accepted, max(t1 - t0 - setup, 0.0) + (t4 - t3), t3 - t1)
        stats.record_step(len(drafted), n_accepted, t1 - t0 + (t4 - t3), t3 - t1)
        return drafted[:n_accepted] + [next_token], n_accepted

    def _shadow_probe(self, room: int):
        """On a plain step, one draft token the target does not verify (its pass stays one token, which a GPU
        replays from a captured graph), where the policy asks for it; the token the target emits judges it."""
        if room <= 0 or self.drafter is None or self._hooks.shadow_len() <= 0:
            return None
        return self.drafter.propose(self._history, self._last, 1, self.policy.p_min)


def shadow_acceptance(probe, emitted: int, target_probs) -> float:
    """The chance a shadow probe's token would have been accepted as a draft: greedy (no target_probs), whether it
    is the token the target emitted; sampling, min(1, p(x) / q(x)) with p the target's row the token came from."""
    if not probe.tokens:
        return 0.0   # the drafter stopped short of its confidence bound: a real draft would have been empty too
    x = probe.tokens[0]
    if target_probs is None:
        return float(x == emitted)
    p, q = as_dist(target_probs(0)).prob(x), as_dist(probe.probs[0]).prob(x)
    return min(1.0, p / q) if q > 0 else 0.0
