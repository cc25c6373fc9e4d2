"""Drafter kinds as data: one descriptor per kind says what the kind is, and every other module reads it (the CLI's
choices and llama.cpp names, the registry's optional draft file, the header checks and contexts load_pair makes,
how the policy prices a draft). A new kind is its module under drafters/ plus one descriptor here.

This module imports nothing of llamaspec's but errors: config.py and the CLI read it at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidParameterError

# what drafts, and so what load_pair makes and checks for it:
#   "prompt"  the prompt and history themselves (prompt lookup): no draft file, no context
#   "draft"   a draft model of the target's vocabulary (header check: llama.cpp's vocabulary rule), its own context
#   "mtp"     a multi-token-prediction head, the target's own or a head file of its own (mtp-*.gguf; header check:
#             one head that llama.cpp can run), a context over the target's (backend.mtp.MTPContext)
#   "hidden"  a draft file of the kind's own architecture that reads the target's hidden states (header checks:
#             the vocabulary rule and gguf.hidden_pair), a context bound to the target's (backend.hidden)
SOURCES = ("prompt", "draft", "mtp", "hidden")


@dataclass(frozen=True)
class DrafterKind:
    name: str                       # llamaspec's name (--drafter, models.toml's `drafter`, LoadConfig.drafter)
    spec_type: str | None           # llama.cpp's --spec-type name; None for a combination (say both names)
    source: str                     # one of SOURCES: what drafts
    drafter: str                    # "module:Class" under drafters/, built as Class(context, n_vocab)
    title: str = ""                 # how messages name its draft file ("an EAGLE-3 draft")
    draft_cost: str = "per_token"   # how drafting time grows with k: one pass per token, or one per draft
    parts: tuple[str, ...] = ()     # a combination: these kinds, tried in this order
    sidecar: str = ""               # the file-name prefix of its draft files in a Hugging Face repo ("mtp-")
    # the longest draft a policy of unset length asks for on a target whose rollback is bounded by recurrent-state
    # snapshots (qwen35 and kin): llama.cpp keeps one snapshot per draft token and pays for all of them on every
    # decode, drafted or not, so a 12-token reach costs every step what 3-4 tokens do not
    snapshot_k_max: int = 4

    @property
    def draft_file(self) -> str:
        """Whether it drafts from a draft file: "none", "model" (any draft model) or "arch" (a file whose
        architecture is this kind's name)."""
        return {"prompt": "none", "draft": "model", "mtp": "none", "hidden": "arch"}[self.source]

    @property
    def batches(self) -> bool:
        """Whether it drafts for several sequences of one batch (batch.py): prompt lookup, draft models and MTP
        heads do (a head sequence per slot); an EAGLE-3 / DFlash draft follows the target's hidden states one
        sequence at a time."""
        return self.source != "hidden"


KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind("model", "draft-simple", "draft", "model:ModelDrafter"),
    DrafterKind("lookup", "ngram-simple", "prompt", "lookup:PromptLookupDrafter"),
    DrafterKind("lookup+model", None, "draft", "lookup:CombinedDrafter", parts=("lookup", "model")),
    DrafterKind("mtp", "draft-mtp", "mtp", "mtp:MTPDrafter", title="an MTP head", sidecar="mtp-",
                snapshot_k_max=3),   # llama.cpp's draft-mtp default (--spec-draft-n-max 3)
    DrafterKind("lookup+mtp", None, "mtp", "lookup:CombinedDrafter", parts=("lookup", "mtp"), snapshot_k_max=3),
    DrafterKind("eagle3", "draft-eagle3", "hidden", "eagle3:Eagle3Drafter", title="an EAGLE-3 draft",
                sidecar="eagle3-"),
    DrafterKind("dflash", "draft-dflash", "hidden", "dflash:DFlashDrafter", title="a DFlash draft",
                draft_cost="per_pass", sidecar="dflash-", snapshot_k_max=6),   # a block drafter: long drafts
)}

DRAFTER_KINDS = tuple(KINDS)
MTP_DRAFTERS = tuple(k.name for k in KINDS.values() if k.source == "mtp")
HIDDEN_DRAFT_ARCHS = tuple(k.name for k in KINDS.values() if k.source == "hidden")   # archs that pick a kind
NO_DRAFT_FILE = tuple(k.name for k in KINDS.values() if k.draft_file == "none")
SPEC_TYPES = {"none": None, **{k.spec_type: k.name for k in KINDS.values() if k.spec_type}}
COMBINATIONS = {k.parts: k.name for k in KINDS.values() if k.parts}


def drafter_kind(name: str) -> DrafterKind:
    if name not in KINDS:
        raise InvalidParameterError(f"drafter must be one of {', '.join(KINDS)}, got {name!r}", param="drafter")
    return KINDS[name]


def kind_for_file(kind: str, file_kind: str | None, draft_arch: str, path) -> str:
    """The drafter for a draft file that selects `file_kind` (gguf.spec_kind: "mtp" for a separate MTP head file,
    "eagle3", "dflash", or None for a draft model of `draft_arch`), as llama.cpp picks it: the file's kind when the
    default ("model") was asked for, "lookup+<kind>" for "lookup+model" where that combination exists, the asked
    kind when it is the file's or holds it; any other mix of kind and file is refused."""
    own = KINDS.get(file_kind) if file_kind else None
    if own is not None:
        if kind == "model" or kind == own.name:
            return own.name
        parts = KINDS[kind].parts if kind in KINDS else ()
        if own.name in parts:
            return kind
        if parts and "model" in parts and tuple(own.name if p == "model" else p for p in parts) in COMBINATIONS:
            return COMBINATIONS[tuple(own.name if p == "model" else p for p in parts)]
        raise InvalidParameterError(f"{path} is {own.title}: use drafter {own.name!r}, not {kind!r}",
                                    param="drafter")
    asked = drafter_kind(kind)
    if asked.draft_file == "arch":
        raise InvalidParameterError(f"drafter {kind!r} needs {asked.title} GGUF (architecture {kind!r}); {path} is a "
                                    f"{draft_arch!r} model", param="drafter")
    if asked.source == "mtp":
        raise InvalidParameterError(f"drafter {kind!r} drafts with the target's own MTP head or a head file "
                                    f"(mtp-*.gguf); {path} is a {draft_arch!r} model, not a head file",
                                    param="drafter")
    return kind
