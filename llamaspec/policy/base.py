"""The draft-policy contract: each policy answers one question ("how many tokens next?") and learns from one thing
("this many were drafted, this many accepted, this long it took").

`draft_p_min` is the confidence stop every policy may carry: the engine stops drafting early once the draft's top
probability falls below it (llama.cpp's --draft-p-min). Policies know nothing about models or tokens.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

from .. import bounds
from ..errors import InvalidParameterError

DRAFT_COSTS = ("per_token", "per_pass")


@dataclass
class Costs:
    """What a pair's passes cost on this machine, measured at load (calibration.py), in seconds: the warm target pass
    over n tokens (`verify[n]`), a drafted token (a draft pass, for a "per_pass" drafter), and what the first two
    passes after a change of batch size took beyond a warm one (`excess`, one entry per pass: a change's first, then
    its second, size by size), and a warm drafting step of k tokens (`drafts[k]`)."""

    verify: dict = field(default_factory=dict)
    draft: float | None = None
    excess: list = field(default_factory=list)
    drafts: dict = field(default_factory=dict)


class DraftPolicy(abc.ABC):
    """What every policy answers and learns from; subclass it for your own. The hooks below are no-ops here."""

    name = "base"
    draft_p_min = 0.0   # the confidence stop (llama.cpp's p_min)
    draft_max = 0       # the longest draft it proposes

    @abc.abstractmethod
    def next_draft_len(self) -> int:
        """How many tokens to draft next (0 = plain decoding)."""

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """One speculative step is done: `drafted` proposed, `accepted` kept, and what each phase cost."""

    def describe(self) -> dict:
        return {"policy": self.name, "draft_len": self.next_draft_len(), "p_min": self.draft_p_min}

    def attach(self, draft_cost: str = "per_token", costs: Costs | None = None) -> None:
        """A pair takes this policy (Pair.set_policy says it once): its drafter costs "per_token" (a draft model,
        an MTP head: one pass per token) or "per_pass" (DFlash: one pass for the whole block); `costs` are the
        pair's passes as measured at load, where it has them (given to calibrate); the engine runs shadow probes
        (shadow_len)."""
        if costs is not None:
            self.calibrate(costs)

    def calibrate(self, costs: Costs) -> None:
        """The pair's costs as measured at load: a policy may start from them instead of measuring its first
        drafts."""

    def new_request(self) -> None:
        """A request's prompt was just processed (the engine says it before the first step): a batch of another size
        ran since the last step."""

    def held(self, tokens: int) -> None:
        """The target holds `tokens` (the request's prompt, with whatever of it the cache kept) before the request's
        first step (the engine says it after new_request): a pass costs more the more it holds."""

    def shadow_len(self) -> int:
        """Tokens (0 or 1) to draft past the next step's draft without verifying them: on a plain step a shadow
        probe (the target's pass stays one token; the draft token is judged against the token the target emits), on
        a drafting step of k a tail probe (the target verifies k; the token past them is judged against the token the
        target emits after all k, where they are accepted). The engine may not run one (a batch of sequences runs
        tail probes of none)."""
        return 0

    def shadow(self, accepted: float, seconds: float) -> None:
        """A shadow or tail probe's result, before that step's update(): `accepted` is the chance the draft token
        would have been accepted (0 or 1 greedy, min(1, p/q) sampling; a tail probe's None where a draft token
        before it was rejected), `seconds` what drafting it took, catch-up included (a tail probe's: the step's
        whole draft, which update() reports too)."""


def check_k(name: str, value: int, low: int = 0) -> int:
    # a draft length (and any count a policy keeps per length) is at most what one batch verifies (bounds.py)
    high = bounds.MAX_BATCH - 1
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidParameterError(f"{name} must be an integer in [{low}, {high}], got {value!r}"[:120], param=name)
    return value


def check_p(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not (0.0 <= value < 1.0):
        raise InvalidParameterError(f"{name} must be in [0, 1), got {value!r}", param=name)
    return float(value)


def check_draft_cost(kind: str) -> str:
    if kind not in DRAFT_COSTS:
        raise InvalidParameterError(f"draft cost must be 'per_token' or 'per_pass', got {kind!r}")
    return kind


class Hooks:
    """A policy's hooks as the engine calls them: its own where it is a DraftPolicy or has them, no-ops where a
    duck-typed policy has only the two methods. Resolved once, when the pair takes the policy."""

    __slots__ = ("attach", "new_request", "held", "shadow_len", "shadow")

    def __init__(self, policy):
        for name in self.__slots__:
            setattr(self, name, getattr(policy, name, None) or getattr(_NO_HOOKS, name))
        calibrate = getattr(policy, "calibrate", None)
        if not hasattr(policy, "attach") and calibrate is not None:   # a duck-typed policy with calibrate only
            self.attach = lambda draft_cost="per_token", costs=None: costs is not None and calibrate(costs)


class _NoHooks(DraftPolicy):
    def next_draft_len(self) -> int:
        return 0


_NO_HOOKS = _NoHooks()
