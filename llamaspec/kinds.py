"""Drafter kinds as data: one descriptor per kind says what the kind is, and every other module reads it (the CLI's
choices and llama.cpp names, the registry's optional draft file, the header checks and contexts load_pair makes,
how the policy prices a draft). A new kind is its module under drafters/ plus one descriptor here.

What drafts is a kind's `Source` (prompt, draft model, MTP head, hidden states): how its context opens, whether that
context is the target's, which draft file it needs, what `check` plans for it, whether it batches. loading.py,
targets.py, the server and `check` ask the source; a new source is one `Source` here plus how its context opens
(loading.py, and its context class in backend/).

This module imports nothing of llamaspec's but errors: config.py and the CLI read it at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import InvalidParameterError


class Opens(Enum):
    """How a source's drafting context opens (loading.py makes it, from the source alone)."""

    NOTHING = "no context"                        # drafts from the prompt and history themselves
    OWN = "a context of its own"                  # a draft model beside the target
    OVER_TARGET = "a context over the target's"   # llama.cpp's MTP context type on the target's (ctx_other): the
    #                                               target's own head weights or a head file's (backend.mtp)
    BOUND = "a context bound to the target's"     # weights of its own that read the target's hidden states and may
    #                                               borrow its embeddings and output head (ctx_other; backend.hidden)


@dataclass(frozen=True)
class Source:
    """What drafts, and what that takes: every module that must tell the sources apart asks this, not a name."""

    name: str          # how messages and docs name it
    opens: Opens       # how its context opens
    draft_file: str    # "none" (never one), "model" (any draft model of the target's vocabulary, header check:
    #                    llama.cpp's vocabulary rule), "arch" (a file whose architecture is the kind's name, header
    #                    checks: the vocabulary rule and gguf.hidden_pair)
    plan: str          # what `llamaspec check` plans for its memory beside the target: "none", "model" (the draft
    #                    file as a second model: weights, KV cache, compute) or "head" (the MTP head's line: its KV
    #                    cache and compute over the target's, a head file's weights; gguf.memory.mtp_head_memory)
    batches: bool      # drafts for several sequences of one batch (slots.py); hidden-state drafts follow the
    #                    target one sequence at a time

    @property
    def own_context(self) -> bool:
        """Drafts on a context of its own model's: a batch gives it a shared context of its own too."""
        return self.opens is Opens.OWN

    @property
    def shares_target_context(self) -> bool:
        """Runs on the target's context rather than beside it: freed and made again with the target's, and in a
        batch made over the shared target context, a sequence per target sequence."""
        return self.opens is Opens.OVER_TARGET

    @property
    def head(self) -> bool:
        """Drafts with an MTP head: the target's own (loaded with load_mtp, its header checked for a head llama.cpp
        can run), or a head file beside the target when it has none."""
        return self.opens is Opens.OVER_TARGET

    @property
    def free(self) -> bool:
        """Drafting runs no model: there is no drafting time worth measuring."""
        return self.opens is Opens.NOTHING


PROMPT = Source("prompt", Opens.NOTHING, draft_file="none", plan="none", batches=True)
DRAFT_MODEL = Source("draft model", Opens.OWN, draft_file="model", plan="model", batches=True)
MTP_HEAD = Source("MTP head", Opens.OVER_TARGET, draft_file="none", plan="head", batches=True)
HIDDEN_STATES = Source("hidden states", Opens.BOUND, draft_file="arch", plan="model", batches=False)
SOURCES = (PROMPT, DRAFT_MODEL, MTP_HEAD, HIDDEN_STATES)


@dataclass(frozen=True)
class DrafterKind:
    name: str                       # llamaspec's name (--drafter, models.toml's `drafter`, DraftSettings.drafter)
    spec_type: str | None           # llama.cpp's --spec-type name; None for a combination (say both names)
    source: Source                  # what drafts (SOURCES)
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
        return self.source.draft_file

    @property
    def batches(self) -> bool:
        """Whether it drafts for several sequences of one batch (slots.py): prompt lookup, draft models and MTP
        heads do (a head sequence per slot); an EAGLE-3 / DFlash draft follows the target's hidden states one
        sequence at a time."""
        return self.source.batches


KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind("model", "draft-simple", DRAFT_MODEL, "model:ModelDrafter"),
    DrafterKind("lookup", "ngram-simple", PROMPT, "lookup:PromptLookupDrafter"),
    DrafterKind("lookup+model", None, DRAFT_MODEL, "lookup:CombinedDrafter", parts=("lookup", "model")),
    DrafterKind("mtp", "draft-mtp", MTP_HEAD, "mtp:MTPDrafter", title="an MTP head", sidecar="mtp-",
                snapshot_k_max=3),   # llama.cpp's draft-mtp default (--spec-draft-n-max 3)
    DrafterKind("lookup+mtp", None, MTP_HEAD, "lookup:CombinedDrafter", parts=("lookup", "mtp"), snapshot_k_max=3),
    DrafterKind("eagle3", "draft-eagle3", HIDDEN_STATES, "eagle3:Eagle3Drafter", title="an EAGLE-3 draft",
                sidecar="eagle3-"),
    DrafterKind("dflash", "draft-dflash", HIDDEN_STATES, "dflash:DFlashDrafter", title="a DFlash draft",
                draft_cost="per_pass", sidecar="dflash-", snapshot_k_max=6),   # a block drafter: long drafts
)}

DRAFTER_KINDS = tuple(KINDS)
MTP_DRAFTERS = tuple(k.name for k in KINDS.values() if k.source.head)
HIDDEN_DRAFT_ARCHS = tuple(k.name for k in KINDS.values() if k.draft_file == "arch")   # archs that pick a kind
NO_DRAFT_FILE = tuple(k.name for k in KINDS.values() if k.draft_file == "none")
SPEC_TYPES = {"none": None, **{k.spec_type: k.name for k in KINDS.values() if k.spec_type}}
COMBINATIONS = {k.parts: k.name for k in KINDS.values() if k.parts}


def file_source(file_kind: str | None) -> Source:
    """What drafts with a draft file that selects `file_kind` (gguf.spec_kind: a kind's name, None for a draft
    model)."""
    return KINDS[file_kind].source if file_kind is not None else DRAFT_MODEL


def source_of(drafter: str) -> Source | None:
    """What drafts for a pair drafting with `drafter` (a kind's name), None for "none"."""
    kind = KINDS.get(drafter)
    return kind.source if kind is not None else None


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
    if asked.source.head:
        raise InvalidParameterError(f"drafter {kind!r} drafts with the target's own MTP head or a head file "
                                    f"(mtp-*.gguf); {path} is a {draft_arch!r} model, not a head file",
                                    param="drafter")
    return kind
