"""The pair: a target model with an optional drafter and a draft-length policy, and its front-ends.

`generate`, `stream`, `generate_tokens`, `chat` and `generate_batch` are thin front-ends over one engine (slots.py): a
single request is a slot of the pair's own contexts (`LoneTarget`), several share a pass in slots of shared contexts
(`SharedTarget`), and both run the same step (draft, verify, accept, roll back, learn, emit text). The pair keeps what
outlives a request: the models and their contexts, the policy (what `auto` learnt carries over), the measured costs
and the resolved settings. It knows nothing about chat templates or HTTP (conversation.py, server/).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from . import modes
from .config import DraftSettings, LoadConfig
from .drafters import Drafter
from .errors import InvalidParameterError
from .gguf.recurrent import rollback_kind
from .policy import Costs, DraftPolicy, FixedPolicy, Hooks, make_policy, policy_for
from .policy.calibration import measure_costs
from .sampling import OPENAI, SamplerConfig
from .shaping import Shaping
from .slots import Completion, Engine, Slot, generate_batch, shadow_acceptance  # noqa: F401
from .stats import GenerationStats
from .targets import LoneTarget, SharedTarget, batch_support  # noqa: F401
from .text import Piece, StopMatcher  # noqa: F401  (re-exported)


def snapshot_bound(pair) -> int | None:
    """The longest draft this pair's target rolls back without a checkpoint: the recurrent-state snapshots its load
    kept where its rollback is bounded by them (a longer draft saves a checkpoint every step), else None (no bound)."""
    if rollback_kind(pair.target.info) != "bounded":
        return None
    return pair.config.target.n_rs_seq or None


class Pair:
    """A target model with an optional drafter. Not thread-safe: one generation at a time on its own contexts
    (a new request ends one still running there), several at once through `generate_batch` or `engine(n)`."""

    def __init__(self, target, target_ctx, drafter: Drafter | None = None, policy: DraftPolicy | None = None,
                 config: LoadConfig | None = None):
        self.target, self.target_ctx = target, target_ctx
        self.config = config if config is not None else LoadConfig()   # as load_pair resolved it
        self.drafter = drafter
        self.n_vocab = target.n_vocab
        self.costs: Costs | None = None   # what the passes cost, measured by warm_up
        self.policy = FixedPolicy(0)
        self.set_policy(policy if policy is not None else make_policy("auto"))
        self.last_stats: GenerationStats | None = None
        self.tree = None   # a tree.TreeVerifier while tree verification is on (tree.enable_tree)
        # The seam for another verification (tree.py, a benchmark's): wrap(chosen, sampling, shaper, scratch)
        # -> modes.Verifier, given the mode's own choice for each request; None: the modes' own.
        self.verifier_wrap = None
        self._lone: Engine | None = None     # the engine over the pair's own contexts (one slot)
        self._shared: Engine | None = None   # the engine over shared contexts (generate_batch, serve --parallel)

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

    @property
    def history(self) -> list[int]:
        """The last request's history on the pair's own contexts (what the target's cache holds after it)."""
        lone = self._lone
        return lone.slots[0].history if lone is not None and lone.slots[0].stats is not None else []

    def set_policy(self, policy: DraftPolicy) -> None:
        self.policy = policy if self.drafter is not None else FixedPolicy(0)
        self.hooks = Hooks(self.policy)
        if self.drafter is not None:
            self.hooks.attach(self.drafter.draft_cost, self.costs)

    def set_drafting(self, drafting: DraftSettings) -> None:
        """Draft by other settings (policy, draft_max, draft_min, draft_p_min; the drafter stays): the policy they
        name replaces the current one, and `config.drafting` says so. Every change at run time comes here (chat's
        /k and /policy, the server's PATCH /admin/config); settings a policy refuses change nothing."""
        drafting = dataclasses.replace(drafting, drafter=self.config.drafting.drafter)
        bound = snapshot_bound(self)
        if drafting.draft_max is None and drafting.policy != "fixed" and bound:
            # an open-ended policy within the recurrent-state snapshots this load kept, as load_pair gives it
            # (loading.snapshot_reach)
            drafting = dataclasses.replace(drafting, draft_max=bound)
        self.set_policy(policy_for(drafting, self.target_ctx.n_batch))
        self.config = dataclasses.replace(self.config, drafting=drafting)

    def warm_up(self, draft_max: int | None = None) -> None:
        """Run every draft length up to draft_max (the policy's) and keep what the warm passes took as `costs`, which
        every policy taken from here on starts from (DraftPolicy.attach); the text is forgotten
        (policy/calibration.py). load_pair calls it on GPU targets."""
        if self.drafter is None:
            return
        policy = self.policy
        try:
            self.costs = measure_costs(self, draft_max) or self.costs
        finally:
            self.set_policy(policy)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.target.detokenize(tokens)

    def reset(self) -> None:
        """Forget the cached conversation: every cache is cleared."""
        if self._lone is not None:
            for slot in self._lone.slots:
                self._lone.cancel(slot)
            if self._lone.target.cache is not None:
                self._lone.target.cache.clear()
        self.target_ctx.clear()
        if self.drafter is not None:
            self.drafter.reset()

    def close(self) -> None:
        for engine in (self._lone, self._shared):
            if engine is not None:
                engine.close()
        self._lone = self._shared = None
        if self.drafter is not None:
            self.drafter.close()
        self.target_ctx.close()
        self.target.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the engine ---------------------------------------------------------------------------------------------
    def engine(self, n_seq: int = 1, n_ctx: int | None = None, **options) -> Engine:
        """The engine of `n_seq` slots: one slot over the pair's own contexts, or n_seq over shared contexts of
        n_ctx tokens in all (kept while n_seq and n_ctx stay the same). A pair that cannot share a pass
        (batch_support) gets the one slot of its own contexts, whose requests take turns."""
        if n_seq <= 1 or batch_support(self) is not None:
            if self._lone is None or not self._lone.target.current():
                self._lone = Engine(self, LoneTarget(self))
            return self._lone
        engine = self._shared
        if engine is None or engine.n_seq != n_seq or (n_ctx and engine.target.ctx.n_ctx != n_ctx) or engine.busy:
            if engine is not None:
                engine.close()
                self._shared = None
            self._shared = Engine(self, SharedTarget(self, n_seq, n_ctx, **options))
        return self._shared

    def verifier(self, sampling, shaper, scratch, own_pass: bool = True) -> modes.Verifier:
        """A request's verification (modes.py), through the seam (`verifier_wrap`) where one is set; `own_pass`:
        whether the slot may take a verifier that makes its own pass (only on the pair's own contexts)."""
        chosen = modes.choose(sampling, shaper, self.target.is_eog, scratch)
        if self.verifier_wrap is not None:
            chosen = self.verifier_wrap(chosen, sampling, shaper, scratch)
            if chosen.own_pass and not own_pass:
                raise InvalidParameterError("this verification runs on the pair's own contexts only, one request "
                                            "at a time")
        return chosen

    # -- public generation API ------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        pieces = list(self.stream(prompt, **kwargs))
        stats = self.last_stats
        tokens = [p.token for p in pieces if p.token is not None]
        return Completion("".join(p.text for p in pieces), tokens, stats.finish_reason, stats)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs) -> list[Completion]:
        """A Completion for each prompt, all decoded together (one target pass verifies every sequence's draft),
        each equal to what `generate(prompt, **kwargs)` gives; see slots.generate_batch."""
        return generate_batch(self, prompts, **kwargs)

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
        top-k/top-p/min-p, "llama.cpp" after them, to the untempered distribution (sampling.py). The request is
        checked before the generator starts.
        """
        engine = self.engine()
        for slot in engine.slots:   # one generation at a time on the pair's own contexts
            engine.cancel(slot)
        slot = engine.submit(prompt, max_tokens, temperature, top_k, top_p, min_p, seed, stop, shaping,
                             sampler_order, add_special=add_special)
        self.last_stats = slot.stats
        return engine.pieces(slot)

    def generate_tokens(self, prompt: str | Sequence[int], max_tokens: int, sampler: SamplerConfig,
                        add_special: bool = True, shaping: Shaping | None = None) -> Iterator[tuple[int, bool]]:
        """The token stream: (token, from_draft) per generated token; the prompt is checked before it starts."""
        pieces = self.stream(prompt, max_tokens, sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p,
                             sampler.seed, None, add_special, shaping, sampler.order)
        return _tokens_of(pieces)


def _tokens_of(pieces) -> Iterator[tuple[int, bool]]:
    try:
        for piece in pieces:
            if piece.token is not None:
                yield piece.token, piece.from_draft
    finally:
        pieces.close()
