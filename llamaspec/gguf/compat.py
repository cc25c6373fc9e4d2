"""The pair compatibility check, field by field, for `llamaspec check`.

The fields are those of `gguf_meta.pair_mismatch` (llama.cpp's rule plus the pre-tokenizer); the verdict is
pair_mismatch itself, so the report and the engine cannot disagree about whether a pair loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from .hidden_pair import hidden_pair_fields, hidden_pair_mismatch
from .reader import VOCAB_CHECK_START_ID, VOCAB_MAX_SIZE_DIFFERENCE, ModelInfo, pair_mismatch


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
