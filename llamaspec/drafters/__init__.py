"""Where draft tokens come from. Every kind implements `Drafter` (keep in step with the history, propose up to k
tokens with their distributions when sampling, learn how many were accepted) and is named once in `DRAFTERS`;
`make_drafter` builds one. A new kind is one new module plus one line in `DRAFTERS`.

Drafters know nothing about acceptance rules, policies or the target's cache (the MTP, EAGLE-3 and DFlash drafters
follow the target's decodes, through the target context's `on_decode`, not its cache).
"""
from __future__ import annotations

from typing import Callable

from ..config import DRAFTER_KINDS
from ..errors import InvalidParameterError
from .base import Draft, Drafter, Sampling, common_prefix_len
from .dflash import DFlashDrafter
from .eagle3 import Eagle3Drafter
from .lookup import CombinedDrafter, PromptLookupDrafter
from .model import ModelDrafter
from .mtp import MTPDrafter


def _model(target, draft_ctx):
    return ModelDrafter(draft_ctx, target.n_vocab) if draft_ctx is not None else None


def _lookup(target, draft_ctx):
    return PromptLookupDrafter(n_vocab=target.n_vocab)


def _lookup_model(target, draft_ctx):
    model = _model(target, draft_ctx)
    return CombinedDrafter(_lookup(target, draft_ctx), model) if model else _lookup(target, draft_ctx)


def _mtp(target, draft_ctx):
    return MTPDrafter(draft_ctx, target.n_vocab) if draft_ctx is not None else None   # draft_ctx: an MTPContext


def _lookup_mtp(target, draft_ctx):
    mtp = _mtp(target, draft_ctx)
    return CombinedDrafter(_lookup(target, draft_ctx), mtp, kind="lookup+mtp") if mtp else _lookup(target, draft_ctx)


def _eagle3(target, draft_ctx):
    return Eagle3Drafter(draft_ctx, target.n_vocab) if draft_ctx is not None else None


def _dflash(target, draft_ctx):
    return DFlashDrafter(draft_ctx, target.n_vocab) if draft_ctx is not None else None


# drafter kind -> builder(target model, draft context or None) -> Drafter or None (nothing to draft with);
# mtp takes the target's MTP head context (backend.mtp.MTPContext), eagle3 / dflash the context of such a draft,
# bound to the target's (backend.hidden.HiddenDraftContext)
DRAFTERS: dict[str, Callable] = {
    "model": _model,
    "lookup": _lookup,
    "lookup+model": _lookup_model,
    "mtp": _mtp,
    "lookup+mtp": _lookup_mtp,
    "eagle3": _eagle3,
    "dflash": _dflash,
}
assert tuple(DRAFTERS) == DRAFTER_KINDS


def make_drafter(kind: str, target, draft_ctx=None) -> Drafter | None:
    """The drafter of `kind` for `target` (a backend Model) and the draft model's context, if there is one (for the
    MTP kinds: the backend MTPContext of the target's head)."""
    if kind not in DRAFTERS:
        raise InvalidParameterError(f"drafter must be one of {', '.join(DRAFTERS)}, got {kind!r}", param="drafter")
    return DRAFTERS[kind](target, draft_ctx)


__all__ = ["Draft", "Drafter", "Sampling", "DRAFTERS", "make_drafter", "common_prefix_len", "ModelDrafter",
           "PromptLookupDrafter", "CombinedDrafter", "MTPDrafter", "Eagle3Drafter", "DFlashDrafter"]
