"""Keep a subset of a model's transformer blocks (convert/prune_draft.py): the blocks renumbered from 0, the block
count and per-block metadata rewritten. Tensor data is copied as it is (edit.py)."""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from gguf import GGUFValueType

from ..errors import InvalidParameterError, ModelFileError, UnsupportedModelError
from .edit import Field, GGUFContents

# Architectures whose blocks are all alike and whose loader knows nothing about a block's index, so any subset of
# blocks renumbered from 0 still loads and means the same thing. Models with leading dense blocks, MTP blocks,
# recurrent blocks or index-based layer kinds (no-RoPE every 4th layer, MoE every other layer) are left out.
PRUNABLE_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "mistral3", "phi3", "granite", "olmo", "olmo2",
                  "starcoder2", "stablelm", "internlm2", "exaone", "command-r", "minicpm", "gemma",
                  "gemma2", "gemma3", "cohere2")
# Architectures whose sliding-window layers follow the block index (llama.cpp's set_swa_pattern(n)): every n-th
# block is global. A pruned model gets an explicit per-block pattern so each kept block keeps its kind.
SWA_PATTERN_ARCHS = {"gemma2": 2, "gemma3": 6, "cohere2": 4}


_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def parse_layer_list(text: str) -> list[int]:
    """'0,1,2,5' or '0-11,20' -> block indices (InvalidParameterError on anything else)."""
    layers: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise InvalidParameterError(f"layers: {part!r} is not a block index or a range like 0-11")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise InvalidParameterError(f"layers: range {part!r} runs backwards")
        layers.extend(range(first, last + 1))
    return layers


def select_blocks(n_layer: int, *, keep_first: int | None = None, drop_last: int | None = None,
                  layers: Sequence[int] | None = None) -> list[int]:
    """The block indices to keep, from exactly one of the three ways of saying it."""
    given = [name for name, v in (("--keep-first", keep_first), ("--drop-last", drop_last), ("--layers", layers))
             if v is not None]
    if len(given) != 1:
        raise InvalidParameterError("give exactly one of --keep-first, --drop-last, --layers"
                                    + (f" (got {', '.join(given)})" if given else ""))
    if keep_first is not None:
        keep = list(range(min(keep_first, n_layer)))
    elif drop_last is not None:
        if drop_last < 0:
            raise InvalidParameterError(f"--drop-last must be >= 0, got {drop_last}")
        keep = list(range(max(n_layer - drop_last, 0)))
    else:
        keep = list(layers)
        outside = [i for i in keep if not 0 <= i < n_layer]
        if outside:
            raise InvalidParameterError(f"layers: block {outside[0]} does not exist (the model has blocks "
                                        f"0-{n_layer - 1})")
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise InvalidParameterError("layers: give each block once, in increasing order")
    if not keep:
        raise InvalidParameterError(f"nothing left to keep: the model has {n_layer} blocks")
    if len(keep) == n_layer:
        raise InvalidParameterError(f"nothing to prune: all {n_layer} blocks would be kept")
    return keep


def check_prunable(contents: GGUFContents) -> None:
    """UnsupportedModelError unless the model's blocks can be dropped and renumbered freely."""
    if contents.arch not in PRUNABLE_ARCHS:
        raise UnsupportedModelError(
            f"{contents.path}: architecture {contents.arch!r} is not supported for pruning (supported: "
            f"{', '.join(PRUNABLE_ARCHS)})")
    if f"{contents.arch}.block_count" not in contents.fields:
        raise ModelFileError(f"{contents.path}: no {contents.arch}.block_count in the metadata; not a model file")


def prune_blocks(contents: GGUFContents, keep: Sequence[int]) -> GGUFContents:
    """Keep the blocks `keep` (renumbered 0..len-1); per-block metadata arrays keep the same entries."""
    check_prunable(contents)
    arch, n_layer = contents.arch, contents.n_layer
    new_index = {old: new for new, old in enumerate(keep)}
    present = {int(m[1]) for m in (_BLOCK_TENSOR.fullmatch(t.name) for t in contents.tensors) if m}
    missing = [i for i in keep if i not in present]
    if missing:
        raise ModelFileError(f"{contents.path}: block {missing[0]} has no tensors; the file is damaged")

    tensors = []
    for tensor in contents.tensors:
        match = _BLOCK_TENSOR.fullmatch(tensor.name)
        if match is None:
            tensors.append(tensor)
        elif int(match[1]) in new_index:
            tensors.append(dataclasses.replace(tensor, name=f"blk.{new_index[int(match[1])]}.{match[2]}"))

    changed = [contents.fields[f"{arch}.block_count"].replaced(len(keep))]
    for field in contents.fields.values():
        if (field.key.startswith(f"{arch}.") and field.vtype == GGUFValueType.ARRAY
                and len(field.value) == n_layer):
            changed.append(field.replaced([field.value[i] for i in keep]))
    swa = _swa_pattern_field(contents, keep)
    if swa is not None:
        changed.append(swa)
    name = contents.get("general.name")
    if isinstance(name, str):
        changed.append(contents.fields["general.name"].replaced(f"{name} ({len(keep)} of {n_layer} blocks)"))
    return dataclasses.replace(contents.with_fields(*changed), tensors=tuple(tensors))


def _swa_pattern_field(contents: GGUFContents, keep: Sequence[int]) -> Field | None:
    """An explicit per-block sliding-window pattern when the index-based one would change a kept block's kind."""
    arch = contents.arch
    key = f"{arch}.attention.sliding_window_pattern"
    if arch not in SWA_PATTERN_ARCHS:
        return None
    field = contents.fields.get(key)
    if field is not None and field.vtype == GGUFValueType.ARRAY:
        return None  # an explicit per-block array: already pruned with the other per-block arrays
    period = int(field.value) if field is not None else SWA_PATTERN_ARCHS[arch]

    def is_swa(index: int) -> bool:  # llama_hparams::set_swa_pattern(period, dense_first=false)
        return period == 0 or index % period < period - 1

    kept_kinds = [is_swa(i) for i in keep]
    if kept_kinds == [is_swa(i) for i in range(len(keep))]:
        return None
    return Field(key, GGUFValueType.ARRAY, kept_kinds, GGUFValueType.BOOL)
