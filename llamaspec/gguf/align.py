"""Align a draft's vocabulary with its target's (convert/align_vocab.py): pad or trim tokens, token types, scores
and the embedding and output rows, where only padding entries differ."""
from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
from gguf import GGUFValueType

from ..errors import IncompatiblePairError
from .compat import pair_mismatch
from .edit import Field, GGUFContents, TensorData
from .reader import ModelInfo, read_model_info

TOKEN_TYPE_UNUSED = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: a padding entry no text maps to
_PAD_TOKEN = re.compile(rb"\[PAD\d+\]")


def vocab_mismatch_ignoring_size(target: ModelInfo, draft: ModelInfo) -> str | None:
    """pair_mismatch over the vocabulary range both files have: None when only the padding differs."""
    n = min(target.n_vocab, draft.n_vocab)
    return pair_mismatch(dataclasses.replace(target, tokens=target.tokens[:n]),
                         dataclasses.replace(draft, tokens=draft.tokens[:n]))


def align_vocab(draft: GGUFContents, target_path: str | os.PathLike) -> GGUFContents:
    """Pad or trim the draft's vocabulary (tokens, token types, scores, embedding and output rows) to the target's.

    New rows are zero blocks (all-zero bytes decode to zeros in every GGML type), so quantized tensors keep their
    type. Trimming drops only padding entries; IncompatiblePairError when real tokens differ or would be lost.
    """
    target = read_model_info(target_path, keep_all=True)
    draft_info = read_model_info(draft.path)
    reason = vocab_mismatch_ignoring_size(target, draft_info)
    if reason is not None:
        raise IncompatiblePairError(f"draft {draft.path} and target {target.path} have different tokenizers, "
                                    f"not just different padding: {reason}")
    n_draft, n_target = draft_info.n_vocab, target.n_vocab
    if n_target < n_draft:
        _check_trimmable(draft, draft_info, n_target)
    tensors = tuple(_resize_rows(t, n_target) if _is_vocab_tensor(t, n_draft) else t for t in draft.tensors)
    return dataclasses.replace(draft.with_fields(*_resized_vocab_fields(draft, target, n_target)), tensors=tensors)


def _is_vocab_tensor(tensor: TensorData, n_vocab: int) -> bool:
    """token_embd / output and the like: a matrix outside the blocks with one row per token."""
    return len(tensor.shape) == 2 and tensor.shape[1] == n_vocab and not tensor.name.startswith("blk.")


def _check_trimmable(draft: GGUFContents, draft_info: ModelInfo, n_keep: int) -> None:
    types = draft.get("tokenizer.ggml.token_type") or []
    for i in range(n_keep, draft_info.n_vocab):
        unused = i < len(types) and types[i] == TOKEN_TYPE_UNUSED
        if not unused and not _PAD_TOKEN.fullmatch(draft_info.tokens[i]):
            text = draft_info.tokens[i].decode("utf-8", errors="replace")
            raise IncompatiblePairError(
                f"draft {draft.path}: token {i} ({text!r}) is a real token beyond the target's vocabulary of "
                f"{n_keep}; only padding can be trimmed")
    for key, field in draft.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and int(field.value) >= n_keep:
            raise IncompatiblePairError(f"draft {draft.path}: {key} = {field.value} lies in the padding that "
                                        f"would be trimmed (target vocabulary {n_keep})")


def _resized_vocab_fields(draft: GGUFContents, target: ModelInfo, n_vocab: int) -> list[Field]:
    """tokens / token_type / scores cut to n_vocab or extended with the target's own entries."""
    changed = []
    for key, filler in (("tokenizer.ggml.tokens", None), ("tokenizer.ggml.token_type", TOKEN_TYPE_UNUSED),
                        ("tokenizer.ggml.scores", 0.0)):
        field = draft.fields.get(key)
        if field is None:
            continue
        values = list(field.value[:n_vocab])
        if len(values) < n_vocab:
            # the new ids get the target's own entries (target read with keep_all), else the filler
            source = target.tokens if key == "tokenizer.ggml.tokens" else target.get(key)
            extra = [_as_element(v, field.sub_type) for v in source[len(values):n_vocab]] if source is not None else []
            values += extra + [filler] * (n_vocab - len(values) - len(extra))
        changed.append(field.replaced(values))
    vocab_size = draft.fields.get(f"{draft.arch}.vocab_size")
    if vocab_size is not None:
        changed.append(vocab_size.replaced(n_vocab))
    return changed


def _as_element(value, sub_type: GGUFValueType | None):
    if sub_type == GGUFValueType.STRING:
        return value if isinstance(value, bytes) else str(value).encode("utf-8")
    if sub_type == GGUFValueType.FLOAT32 or sub_type == GGUFValueType.FLOAT64:
        return float(value)
    return int(value)


def _resize_rows(tensor: TensorData, n_rows: int) -> TensorData:
    """Cut a (n_embd, n_vocab) tensor to n_rows token rows, or append all-zero rows (zero in any GGML type)."""
    n_bytes = n_rows * tensor.row_bytes
    if n_bytes <= tensor.data.nbytes:
        data = tensor.data[:n_bytes]
    else:
        data = np.zeros(n_bytes, dtype=np.uint8)
        data[:tensor.data.nbytes] = tensor.data
    return dataclasses.replace(tensor, shape=(tensor.shape[0], n_rows), data=data)
