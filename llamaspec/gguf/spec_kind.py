"""What a draft file drafts as, from its header alone (no weights), the way llama.cpp decides it
(common_speculative_types_from_gguf in common/speculative.cpp):

- a file whose last block carries `nextn.eh_proj` has a multi-token-prediction (MTP) head. The tensor list
  decides, not `<arch>.nextn_predict_layers`, which llama.cpp's own code distrusts. A head with no trunk
  (no `blk.0.attn_norm`) is a separate head file, such as ggml-org's `mtp-<model>-Q8_0.gguf`: llama.cpp's loader
  reads such a file (`mtp_only` in src/models/qwen35.cpp) and runs it over the target's hidden states;
- a file of arch `dflash` or `eagle3` is a draft of that kind (llama.cpp detects `dflash` from the header and
  `eagle3` from the file name; the arch says it as well);
- a DFlash file of a fork's converter (arch `dflash-draft` or `qwen35-dflash-draft`) is refused in one line: llama.cpp
  reads only `dflash` with `dflash.target_layers`.
"""
from __future__ import annotations

from ..errors import UnsupportedModelError
from .info import ModelInfo

# archs of DFlash drafts written by a fork's converter, which llama.cpp cannot load ("requires 'target_layers'")
FORK_DFLASH_ARCHS = ("dflash-draft", "qwen35-dflash-draft")
UPSTREAM_DFLASH = ("a DFlash draft of arch 'dflash' (models.toml's qwen3.6-27b-dflash pair: "
                   "williamliao/qwen3.6-27B-DFlash-GGUF, Qwen3.6-27B-DFlash-Q8_0.gguf)")


def _names(info: ModelInfo) -> set[str]:
    return {t.name for t in info.tensors}


def has_mtp_head(info: ModelInfo) -> bool:
    """The file's last block is an MTP head (llama.cpp's test: `blk.<block_count - 1>.nextn.eh_proj.weight`)."""
    return info.n_layer > 0 and f"blk.{info.n_layer - 1}.nextn.eh_proj.weight" in _names(info)


def is_mtp_head_file(info: ModelInfo) -> bool:
    """An MTP head alone, without the trunk it drafts for (a sidecar beside the model file)."""
    return has_mtp_head(info) and "blk.0.attn_norm.weight" not in _names(info)


def spec_kind(info: ModelInfo) -> str | None:
    """The drafter kind a draft file selects ("mtp" for a head file, "dflash", "eagle3"), or None for a plain draft
    model (which drafts as "model"). Raises UnsupportedModelError for a file llama.cpp cannot load as a draft."""
    if info.arch in FORK_DFLASH_ARCHS:
        raise UnsupportedModelError(
            f"{info.path}: a DFlash draft in a fork's format (arch {info.arch!r}, without dflash.target_layers), which "
            f"llama.cpp cannot load; download {UPSTREAM_DFLASH}")
    if info.arch == "dflash" and "markov_w1.weight" in _names(info):
        raise UnsupportedModelError(f"{info.path}: a DSpark draft (DFlash with a Markov head); llamaspec has no "
                                    "DSpark drafter")
    if info.arch in ("dflash", "eagle3"):
        return info.arch
    if is_mtp_head_file(info):
        return "mtp"
    return None
