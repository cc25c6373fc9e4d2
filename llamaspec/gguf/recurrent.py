"""What a GGUF's architecture says about its memory, from the header alone: an attention KV cache, a recurrent state
with rollback snapshots, or a recurrent state that needs checkpoints; and how large that state is.

The arch tables mirror llama.cpp's `llm_arch_is_recurrent`, `llm_arch_is_hybrid` and
`llm_arch_supports_rs_rollback` (src/llama-arch.cpp of the llama.cpp inside llama-cpp-python 0.3.36); the state
sizes follow `llama_hparams::n_embd_r` / `n_embd_s` (src/llama-hparams.cpp), kept in F32 by llama.cpp. The backend
decides for real from the loaded context (backend/rollback.py); this module is what `check` and `doctor` can say
without loading anything. It knows nothing about llama.cpp itself.
"""
from __future__ import annotations

import re

from .reader import ModelInfo

RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "qwen3next",
    "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01",
})
# archs whose recurrent state keeps n_rs_seq snapshots, so the last tokens of a decode can be dropped
RS_ROLLBACK_ARCHS = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe", "lfm2",
    "lfm2moe", "bailingmoe3",
})

ROLLBACK_DESCRIPTIONS = {
    "kv": "kv: the attention cache drops rejected draft tokens",
    "bounded": "bounded: recurrent-state snapshots (n_rs_seq) drop the rejected tokens of a verification, "
               "a checkpoint beyond",
    "checkpoint": "checkpoint: the recurrent state is saved before each verification and restored on a "
                  "rejection (a restore and a replay per rejecting step)",
}
DRAFT_CHECKPOINT = ("checkpoint: a draft decodes one token at a time, so each drafting run starts from a saved "
                    "recurrent state")
_RECURRENT_TENSOR = re.compile(r"^blk\.(\d+)\.(ssm_|shortconv|time_mix_)")
_ATTENTION_TENSOR = re.compile(r"^blk\.(\d+)\.(attn_k|attn_qkv|attn_kv)[._]")
F32 = 4


def is_recurrent(info: ModelInfo) -> bool:
    """Has a recurrent state (a pure recurrent model or a hybrid)."""
    return info.arch in RECURRENT_ARCHS or info.arch in HYBRID_ARCHS


def rollback_kind(info: ModelInfo) -> str:
    """How llama.cpp will drop rejected draft tokens for this model: "kv", "bounded" or "checkpoint"."""
    if not is_recurrent(info):
        return "kv"
    return "bounded" if info.arch in RS_ROLLBACK_ARCHS else "checkpoint"


def describe_rollback(info: ModelInfo, draft: bool = False) -> str:
    """One line for `check` and `doctor`: how rejected draft tokens leave this model's memory."""
    kind = rollback_kind(info)
    return DRAFT_CHECKPOINT if draft and kind != "kv" else ROLLBACK_DESCRIPTIONS[kind]


def recurrent_layers(info: ModelInfo) -> list[int]:
    """The layers that keep a recurrent state: those with SSM, short-convolution or RWKV time-mix tensors."""
    if not is_recurrent(info):
        return []
    found = {int(m.group(1)) for t in info.tensors if (m := _RECURRENT_TENSOR.match(t.name))}
    return sorted(i for i in found if i < info.n_layer)


def kv_layers(info: ModelInfo) -> list[bool]:
    """Which layers have an attention KV cache: all of them for an attention model; for a hybrid, the layers with
    attention keys that are not recurrent."""
    if not is_recurrent(info):
        return [True] * info.n_layer
    recurrent = set(recurrent_layers(info))
    attention = {int(m.group(1)) for t in info.tensors if (m := _ATTENTION_TENSOR.match(t.name))}
    return [i in attention and i not in recurrent for i in range(info.n_layer)]


def _int(info: ModelInfo, key: str) -> int:
    value = info.arch_get(key, 0)
    return int(value[0] if isinstance(value, (list, tuple)) else value or 0)


def state_floats_per_layer(info: ModelInfo) -> int:
    """F32 values of one sequence's recurrent state in one recurrent layer: convolution (r) + recurrence (s)."""
    n_embd = info.n_embd
    if _int(info, "wkv.head_size"):                       # RWKV: token shift + wkv state
        return _int(info, "token_shift_count") * n_embd + n_embd * _int(info, "wkv.head_size")
    if _int(info, "shortconv.l_cache"):                   # LFM2: short convolution only
        return n_embd * (_int(info, "shortconv.l_cache") - 1)
    d_conv, d_inner = _int(info, "ssm.conv_kernel"), _int(info, "ssm.inner_size")
    d_state, n_group = _int(info, "ssm.state_size"), _int(info, "ssm.group_count")
    conv = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)   # Mamba's conv_states (Gated DeltaNet alike)
    return conv + d_state * d_inner                                  # + ssm_states


def recurrent_state_bytes(info: ModelInfo, n_layers: int | None = None) -> int:
    """One copy of one sequence's recurrent state (what a checkpoint holds), over the last `n_layers` layers."""
    layers = recurrent_layers(info)
    if n_layers is not None:
        layers = [i for i in layers if i >= info.n_layer - n_layers]
    return len(layers) * state_floats_per_layer(info) * F32
