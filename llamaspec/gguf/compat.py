"""The pair compatibility check (llama.cpp's rule plus the pre-tokenizer): `check_pair` at load, and the same check
field by field for `llamaspec check`, whose verdict is pair_mismatch itself, so the report and the engine cannot
disagree about whether a pair loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import IncompatiblePairError
from .hidden_pair import hidden_pair_fields, hidden_pair_mismatch
from .reader import ModelInfo

# llama.cpp's common_speculative_are_compatible: token text is compared from this id up.
VOCAB_CHECK_START_ID = 5
VOCAB_MAX_SIZE_DIFFERENCE = 128


@dataclass(frozen=True)
class FieldCheck:
    label: str
    target: str
    draft: str
    ok: bool


@dataclass(frozen=True)
class CompatibilityReport:
    fields: tuple[FieldCheck, ...]
    mismatch: str | None     # pair_mismatch's answer: None = the engine will accept the pair

    @property
    def compatible(self) -> bool:
        return self.mismatch is None


def _first_token_difference(target: ModelInfo, draft: ModelInfo) -> int | None:
    n = min(target.n_vocab, draft.n_vocab)
    if target.tokens[VOCAB_CHECK_START_ID:n] == draft.tokens[VOCAB_CHECK_START_ID:n]:
        return None
    return next(i for i in range(VOCAB_CHECK_START_ID, n) if target.tokens[i] != draft.tokens[i])


def compatibility_report(target: ModelInfo, draft: ModelInfo) -> CompatibilityReport:
    fields = []
    for label, key in (("vocabulary type", "tokenizer.ggml.model"), ("pre-tokenizer", "tokenizer.ggml.pre"),
                       ("add-BOS flag", "tokenizer.ggml.add_bos_token"),
                       ("add-EOS flag", "tokenizer.ggml.add_eos_token")):
        t, d = target.get(key), draft.get(key)
        fields.append(FieldCheck(label, str(t), str(d), t == d))
    if target.add_bos:
        fields.append(FieldCheck("BOS token id", str(target.bos_id), str(draft.bos_id),
                                 target.bos_id == draft.bos_id))
    fields.append(FieldCheck("EOS token id", str(target.eos_id), str(draft.eos_id), target.eos_id == draft.eos_id))
    fields.append(FieldCheck(f"vocabulary size (within {VOCAB_MAX_SIZE_DIFFERENCE})", str(target.n_vocab),
                             str(draft.n_vocab), abs(target.n_vocab - draft.n_vocab) <= VOCAB_MAX_SIZE_DIFFERENCE))
    n = min(target.n_vocab, draft.n_vocab)
    first = _first_token_difference(target, draft)
    if first is None:
        fields.append(FieldCheck(f"token text, ids {VOCAB_CHECK_START_ID}..{n - 1}", "same", "same", True))
    else:
        show = lambda info: info.tokens[first].decode("utf-8", errors="replace")  # noqa: E731
        fields.append(FieldCheck(f"token text, id {first}", repr(show(target)), repr(show(draft)), False))
    # an EAGLE-3 / DFlash draft reads the target's hidden states: (label, target, draft, ok) for what it needs
    fields += [FieldCheck(*row) for row in hidden_pair_fields(target, draft)]
    return CompatibilityReport(tuple(fields), pair_mismatch(target, draft) or hidden_pair_mismatch(target, draft))


def pair_mismatch(target: ModelInfo, draft: ModelInfo) -> str | None:
    """The first reason the draft cannot speculate for the target, or None when they are compatible."""
    for label, key in (("vocabulary type", "tokenizer.ggml.model"), ("pre-tokenizer", "tokenizer.ggml.pre"),
                       ("add-BOS flag", "tokenizer.ggml.add_bos_token"),
                       ("add-EOS flag", "tokenizer.ggml.add_eos_token")):
        t, d = target.get(key), draft.get(key)
        if t != d:
            return f"{label} ({key}) differs: target {t!r}, draft {d!r}"
    if target.add_bos and target.bos_id != draft.bos_id:
        return f"BOS token id differs: target {target.bos_id}, draft {draft.bos_id}"
    if target.eos_id != draft.eos_id:
        return f"EOS token id differs: target {target.eos_id}, draft {draft.eos_id}"
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        return (f"vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}: "
                f"target {target.n_vocab}, draft {draft.n_vocab}")
    n = min(target.n_vocab, draft.n_vocab)
    if target.tokens[VOCAB_CHECK_START_ID:n] != draft.tokens[VOCAB_CHECK_START_ID:n]:
        for i in range(VOCAB_CHECK_START_ID, n):
            if target.tokens[i] != draft.tokens[i]:
                t = target.tokens[i].decode("utf-8", errors="replace")
                d = draft.tokens[i].decode("utf-8", errors="replace")
                return f"token {i} differs: target {t!r}, draft {d!r}"
    return None


def check_pair(target: ModelInfo, draft: ModelInfo) -> None:
    """Raise IncompatiblePairError naming both files and the first mismatch."""
    reason = pair_mismatch(target, draft)
    if reason is not None:
        raise IncompatiblePairError(
            f"draft {draft.path} cannot speculate for target {target.path}: {reason}. "
            "Target and draft must share one tokenizer (e.g. the same model family)."
        )
