"""Where draft tokens come from. Every kind implements `Drafter` (keep in step with the history, propose up to k
tokens with their distributions when sampling, learn how many were accepted) and is described once in kinds.py;
`make_drafter` builds one from its descriptor. A new kind is one new module plus one descriptor.

Drafters know nothing about acceptance rules, policies or the target's cache (the MTP, EAGLE-3 and DFlash drafters
follow the target's decodes, through the target context's `on_decode`, not its cache). For several sequences at
once (slots.py) a draft model drafts through batched.py and an MTP head through batched_mtp.py (which follows a
shared target context's `on_runs`). Nothing here imports the backend: the contexts drafters decode with, the
batched MTP head's included, are made in backend/ and handed in.
"""
from __future__ import annotations

import importlib

from ..kinds import Opens, drafter_kind
from .base import Draft, Drafter, common_prefix_len
from .dflash import DFlashDrafter
from .eagle3 import Eagle3Drafter
from .lookup import CombinedDrafter, PromptLookupDrafter
from .model import ModelDrafter
from .mtp import MTPDrafter


def make_drafter(kind: str, target, draft_ctx=None) -> Drafter | None:
    """The drafter of `kind` (its descriptor in kinds.py) for `target` (a backend Model) and the context its source
    drafts with: a draft model's, the target's MTP head's (backend.mtp.MTPContext), or an EAGLE-3 / DFlash draft's
    bound to the target's (backend.hidden.HiddenDraftContext). None: nothing to draft with."""
    desc = drafter_kind(kind)
    module, name = desc.drafter.split(":")
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if desc.parts:   # a combination: the first part tried first, the rest where it finds nothing
        parts = [d for d in (make_drafter(part, target, draft_ctx) for part in desc.parts) if d is not None]
        return cls(*parts, kind=kind) if len(parts) == len(desc.parts) else (parts[0] if parts else None)
    if desc.source.opens is Opens.NOTHING:
        return cls(n_vocab=target.n_vocab)
    return cls(draft_ctx, target.n_vocab) if draft_ctx is not None else None


__all__ = ["Draft", "Drafter", "make_drafter", "common_prefix_len", "ModelDrafter",
           "PromptLookupDrafter", "CombinedDrafter", "MTPDrafter", "Eagle3Drafter", "DFlashDrafter"]
