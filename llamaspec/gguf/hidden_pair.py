"""Drafts that read the target's hidden states (EAGLE-3, DFlash): what their GGUF headers say, and whether a draft
fits a target, decided from the two headers before any weights load.

Such a draft carries no full model of its own: its features are the inputs of some of the target's layers
(`<arch>.target_layers`), so it is made for one target's width and depth, and llama.cpp can tap those layers only
in some architectures. Asking any other one aborts the process inside llama.cpp, which is why the list below is
checked here, at the boundary. What differs between EAGLE-3 and DFlash is data, one `HiddenArch` each. This module
reads headers only; the facts about llama.cpp's graphs are those of the
llama.cpp that llama-cpp-python 0.3.36 vendors.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import IncompatiblePairError
from ..kinds import HIDDEN_DRAFT_ARCHS, KINDS
from .reader import ModelInfo


# Target archs whose graph records every layer's input (`res->t_layer_inp[il]` in src/models/*.cpp). Checked with
# the test-llama-archs models: each of these decodes with a tap on every layer; the other archs that tool writes
# abort ("GGML_ASSERT(t_layer_inp[il] != nullptr)"), and qwen4exp aborts too (its rows are hc * n_embd wide).
# gemma4 sets the taps in its source but the tool cannot write one.
TAP_ARCHS = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "gemma4", "gpt-oss", "lfm2", "lfm2moe",
    "bailingmoe3", "deepseek4", "hunyuan-dense", "hunyuan_vl", "mimo2", "minimax-01", "minimax-m2",
    "muse-glimmer", "nanbeige", "nemotron_h", "nemotron_h_moe",
})
# ...and those that also record the last layer's output, tap id n_layer (DFlash's "last hidden state")
HEAD_TAP_ARCHS = frozenset({"deepseek4", "mimo2", "nemotron_h", "nemotron_h_moe"})

DFLASH_DEFAULT_BLOCK_SIZE = 16   # llama.cpp's default when dflash.block_size is absent


@dataclass(frozen=True)
class HiddenArch:
    """What one hidden-state draft architecture asks of its header and of its target, as llama.cpp's graph for it
    reads them."""

    name: str                 # the draft's arch, its drafter kind's name
    n_taps: int | None        # how many target layers it must tap (None: any number)
    taps_last_output: bool    # may tap id n_layer, the last layer's output, on targets that record it (HEAD_TAP_ARCHS)
    width_in_header: bool     # the target width it expects is its `target_hidden_size` (else its own width)
    blocks: bool              # drafts a block at once: block_size, a mask token, attention within the block from
    #                           the header (non-causal without one); without blocks it is causal

    @property
    def title(self) -> str:
        return KINDS[self.name].title

    def top_tap(self, target: ModelInfo) -> int:
        """The highest layer id it may tap in `target`."""
        return target.n_layer if self.taps_last_output and target.arch in HEAD_TAP_ARCHS else target.n_layer - 1

    def target_width(self, info: HiddenDraftInfo) -> int | None:
        """The hidden size of the target it was made for (None: its header does not say)."""
        return info.target_hidden_size if self.width_in_header else info.n_embd


HIDDEN_ARCHS = {a.name: a for a in (
    HiddenArch("eagle3", n_taps=3, taps_last_output=False, width_in_header=True, blocks=False),
    HiddenArch("dflash", n_taps=None, taps_last_output=True, width_in_header=False, blocks=True),
)}
assert set(HIDDEN_ARCHS) == set(HIDDEN_DRAFT_ARCHS)


@dataclass(frozen=True)
class HiddenDraftInfo:
    """What an EAGLE-3 / DFlash header says about the target it was made for."""

    kind: str                         # "eagle3" or "dflash"
    target_layers: tuple[int, ...]    # tapped layer inputs (id n_layer = the last layer's output)
    n_embd: int                       # the draft's own width
    target_hidden_size: int | None    # eagle3: the target width it expects (dflash: its own width)
    block_size: int                   # dflash: tokens per block (draft <= block_size - 1); eagle3: 0
    mask_token_id: int | None         # dflash: the token the block is filled with
    causal: bool                      # dflash: block-internal attention (normally non-causal)
    n_draft_vocab: int | None         # rows of the d2t map (a reduced draft vocabulary), None without one
    has_token_embd: bool
    has_output: bool
    is_variant: str | None            # DFlash2 / DSpark / DSV4 stages: not supported here

    @property
    def arch(self) -> HiddenArch:
        return HIDDEN_ARCHS[self.kind]


DFLASH2 = "DFlash2 (selector lattice)"   # llama.cpp PR #27342: selector_* tensors, dflash.selector_top_k


def hidden_draft_info(draft: ModelInfo) -> HiddenDraftInfo | None:
    """The header's account of an EAGLE-3 or DFlash draft; None for any other arch."""
    arch = HIDDEN_ARCHS.get(draft.arch)
    if arch is None:
        return None
    names = {t.name: t for t in draft.tensors}
    layers = draft.arch_get("target_layers") or ()
    d2t = names.get("d2t")
    variant = None
    if "selector_hidden.weight" in names:
        variant = DFLASH2
    elif "markov_w1.weight" in names:
        variant = "DSpark (Markov head)"
    elif draft.arch_get("hyper_connection.count"):
        variant = "DSpark DeepSeek-V4 stages"
    causal = draft.arch_get("attention.causal")
    hidden = draft.arch_get("target_hidden_size")
    mask = draft.get("tokenizer.ggml.mask_token_id")
    return HiddenDraftInfo(
        kind=arch.name,
        target_layers=tuple(int(x) for x in np.asarray(layers).ravel()),
        n_embd=draft.n_embd,
        target_hidden_size=int(hidden) if hidden is not None else None,
        block_size=int(draft.arch_get("block_size", DFLASH_DEFAULT_BLOCK_SIZE)) if arch.blocks else 0,
        mask_token_id=int(mask) if mask is not None else None,
        causal=bool(causal) if (arch.blocks and causal is not None) else not arch.blocks,
        n_draft_vocab=int(d2t.shape[0]) if d2t is not None else None,
        has_token_embd="token_embd.weight" in names,
        has_output="output.weight" in names,
        is_variant=variant,
    )


def hidden_pair_mismatch(target: ModelInfo, draft: ModelInfo) -> str | None:
    """Why an EAGLE-3/DFlash draft cannot run with this target (None: it can). The vocabulary rule
    (compat.pair_mismatch) is checked separately."""
    info = hidden_draft_info(draft)
    if info is None:
        return None
    arch = info.arch
    if info.is_variant == DFLASH2:
        return ("it is a DFlash2 draft (local convolution + candidate selector); the installed llama.cpp loads it, but "
                "llamaspec's DFlash drafter does not yet read its selector lattice (the top-k candidates and "
                "transition scores llama.cpp packs into the draft's unmasked nextn rows) and takes row argmaxes "
                "instead; use a DFlash (v1) draft, or llama.cpp's --spec-type draft-dflash")
    if info.is_variant:
        return f"it is a {info.is_variant} draft, which llamaspec does not run (plain DFlash and EAGLE-3 only)"
    if target.arch not in TAP_ARCHS:
        return (f"llama.cpp cannot read the hidden states of a {target.arch!r} target ({arch.title} needs the "
                f"inputs of its layers; supported: {', '.join(sorted(TAP_ARCHS))})")
    if not info.target_layers:
        return f"the draft names no target layers ({info.kind}.target_layers is missing)"
    if arch.n_taps is not None and len(info.target_layers) != arch.n_taps:
        return f"{arch.title} taps exactly {arch.n_taps} target layers, this one lists {list(info.target_layers)}"
    n_layer, width = target.n_layer, target.n_embd
    top = arch.top_tap(target)
    bad = [x for x in info.target_layers if not 0 <= x <= top]
    if bad:
        return (f"the draft taps target layer {bad[0]}, but the target has {n_layer} layers (valid: 0..{top}): "
                "it was made for another (deeper) target")
    expected = arch.target_width(info)
    if expected is not None and expected != width:
        return (f"the draft was made for a target of hidden size {expected}; this target's is {width}: "
                "it was made for another target")
    if (not info.has_token_embd or not info.has_output) and info.n_embd != width:
        return (f"the draft borrows the target's token embeddings / output head but its width {info.n_embd} is "
                f"not the target's {width}")
    if info.n_draft_vocab is not None:
        if not info.has_output:
            return "the draft has a d2t vocabulary map but no output head of its own to match it"
        rows = next(t.shape[1] for t in draft.tensors if t.name == "output.weight")
        if rows != info.n_draft_vocab:
            return f"its d2t map has {info.n_draft_vocab} entries but its output head {rows} rows"
        d2t = read_d2t(draft)
        if d2t.size and (d2t.min() < 0 or d2t.max() >= target.n_vocab):
            return f"its d2t map points outside the target's vocabulary of {target.n_vocab} tokens"
    if arch.blocks:
        if info.block_size < 2:
            return f"dflash.block_size is {info.block_size}: a block must hold at least 2 tokens"
        if info.mask_token_id is None or not 0 <= info.mask_token_id < target.n_vocab:
            return (f"its mask token id ({info.mask_token_id}; tokenizer.ggml.mask_token_id) is not a token of the "
                    f"target's vocabulary of {target.n_vocab}")
    return None


def hidden_pair_fields(target: ModelInfo, draft: ModelInfo) -> list[tuple[str, str, str, bool]]:
    """For `llamaspec check`: (label, target value, draft value, ok) of what a hidden-state draft needs; [] for
    other drafts. The verdict is hidden_pair_mismatch's."""
    info = hidden_draft_info(draft)
    if info is None:
        return []
    top, width = info.arch.top_tap(target), info.arch.target_width(info)
    return [
        (f"target arch ({info.kind} taps)", target.arch, info.kind, target.arch in TAP_ARCHS),
        ("tapped target layers", f"0..{top}", ",".join(map(str, info.target_layers)),
         bool(info.target_layers) and all(0 <= x <= top for x in info.target_layers)),
        ("hidden size", str(target.n_embd), str(width), width in (None, target.n_embd)),
    ]


def read_d2t(draft: ModelInfo) -> np.ndarray:
    """The d2t map (draft row -> target token id) from the file's tensor data (int64), empty without one."""
    t = next((t for t in draft.tensors if t.name == "d2t"), None)
    if t is None:
        return np.zeros(0, np.int64)
    return np.fromfile(draft.path, dtype="<i8", count=int(np.prod(t.shape)), offset=draft.data_offset + t.offset)


def check_hidden_pair(target: ModelInfo, draft: ModelInfo) -> None:
    """Raise IncompatiblePairError (one line naming both files) when the draft cannot run with the target."""
    reason = hidden_pair_mismatch(target, draft)
    if reason is not None:
        raise IncompatiblePairError(f"draft {draft.path} cannot speculate for target {target.path}: {reason}")
