"""Header values that make llama.cpp abort the whole process (a GGML_ASSERT) instead of failing the load, checked
before llama.cpp sees the file; and the value types that `ModelInfo` and the memory plan rely on.

Each check names the llama.cpp code it mirrors (src/llama-model.cpp `load_hparams`, src/llama-vocab.cpp `load`), so
a newer llama.cpp can be compared line by line. Values llama.cpp refuses with an ordinary error (a wrong type, a
per-layer array of the wrong length, a tensor of the wrong shape) are checked here too only where it is cheap and
gives a clearer message than llama.cpp's "failed to load model". This module knows nothing about loading.
"""
from __future__ import annotations

import math
import re
from typing import Mapping

from gguf import GGUFValueType as T

from .graph_archs import HEAD_IS_ROT_ARCHS, HEAD_K_EQ_V_ARCHS, QUERY_IS_N_EMBD_ARCHS

LLAMA_MAX_LAYERS = 512    # src/llama-hparams.h
LLAMA_MAX_EXPERTS = 1024  # src/llama-hparams.h
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # LLAMA_ROPE_SCALING_TYPES in src/llama-model.cpp

_INTEGERS = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}
# Keys ModelInfo reads, by the types it can use. Sizes are integers, head counts an integer or one per layer.
_STRING_KEYS = ("general.architecture", "general.name", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                "tokenizer.chat_template")
_BOOL_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")
_TOKEN_ID_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
_SIZE_SUFFIXES = ("block_count", "context_length", "embedding_length", "attention.key_length",
                  "attention.value_length", "nextn_predict_layers")
# Read with get_key_or_arr(key, n_layer_all): a scalar, or exactly one value per block.
_PER_LAYER_SUFFIXES = ("attention.head_count", "attention.head_count_kv", "feed_forward_length",
                       "expert_used_count")
# The loader reads no hyperparameters for these (load_hparams returns before block_count).
_NO_HPARAMS_ARCHS = ("clip",)
# Whose token embedding is not {embedding_length, n_vocab} (src/models/*.cpp).
_OWN_EMBEDDING_ARCHS = ("eagle3", "dflash", "falcon-h1", "wavtokenizer-dec")
_F32 = 0
_NVFP4 = 40
# the weights llm_graph_context::build_ffn multiplies by (dense feed-forward blocks and shared experts)
_DENSE_FFN_WEIGHT = re.compile(r"blk\.\d+\.ffn_(up|gate|down)(_shexp)?\.weight")
# Besides 1-D tensors: what element-wise and state-space ops take as F32 only (the converters keep them F32).
_F32_SUFFIXES = ("norm.weight", ".bias", ".ssm_a", ".ssm_d")
_NOT_WEIGHT_TYPES = {9: "Q8_1", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64"}  # work types
# Index maps, not weights: EAGLE-3's and DFlash's d2t (draft row -> target token, the source of a GET_ROWS) is I64.
_INDEX_TENSORS = {"d2t": 27}

# Asserts of one architecture's hyperparameters or graph: (arch, key suffix, test(value, info), what it must be).
_ARCH_ASSERTS = (
    ("hrm_text", "hrm.layers_per_stack", lambda v, info: v > 0, "positive"),
    ("hrm_text", "hrm.h_cycles", lambda v, info: v > 0, "positive"),
    ("hrm_text", "hrm.l_cycles", lambda v, info: v > 0, "positive"),
    ("minimax-m3", "attention.indexer.block_size", lambda v, info: v > 0, "positive"),
    ("nanbeige", "num_loops", lambda v, info: v >= 1, "at least 1"),
    ("bailingmoe3", "kda.safe_gate", lambda v, info: v is True, "true"),
    ("bailingmoe3", "kda.gate_lower_bound", lambda v, info: v < 0, "negative"),
    ("hrm_text", "block_count", lambda v, info: v == _hrm_slots(info),
     "hrm.layers_per_stack x h_cycles x (l_cycles + 1)"),
    ("jamba", "ssm.inner_size", lambda v, info: v == 2 * info.n_embd, "twice the embedding length"),
    ("granitehybrid", "ssm.inner_size", lambda v, info: v == 2 * info.n_embd, "twice the embedding length"),
    # gated delta nets: the loader sizes the value heads by state_size x time_step_rank, the graph by inner_size
    *((arch, "ssm.inner_size", lambda v, info: v == _product(info, "ssm.state_size", "ssm.time_step_rank"),
       "ssm.state_size x ssm.time_step_rank") for arch in ("qwen35", "qwen35moe", "qwen3next")),
)
EXPERT_GATING_FUNCS = range(5)  # llama_expert_gating_func_type: none, softmax, sigmoid, softmax_weight, sqrt_softplus
# A rotary dimension of 0 hangs or aborts ggml's rope in most architectures; these rotate nothing by design.
NO_ROPE_ARCHS = frozenset({"glm5-next"})
_NO_VOCAB_MODELS = ("none", "no_vocab")  # llama.cpp loads these, then aborts on the first tokenization
# Loaders that call a tensor optional which the shared Mamba-2 graph (src/models/mamba-base.cpp) then adds
# unconditionally: without it the first decode dereferences a null tensor.
_USED_IF_PRESENT = {arch: (("ssm_conv1d.weight", "ssm_conv1d.bias"),)
                    for arch in ("falcon-h1", "granitehybrid", "nemotron_h", "nemotron_h_moe")}


def header_problem(info, types: Mapping[str, T], elem_types: Mapping[str, T]) -> str | None:
    """The first value in `info` (a ModelInfo) that llama.cpp would abort on or this package cannot use, as a
    phrase naming the key; None when the header is sane. `types` / `elem_types`: each key's GGUF value type and,
    for arrays, element type."""
    for check in (_value_types, _layers, _experts, _rope_scaling, _arch_asserts, _head_sizes, _attention_shapes,
                  _norm_epsilons, _tokens, _embedding_shape, _tensor_types, _tensor_pairs):
        problem = check(info, types, elem_types)
        if problem is not None:
            return problem
    return None


def _value_types(info, types, elem_types) -> str | None:
    def is_int(key):
        return types.get(key) in _INTEGERS

    for key in _STRING_KEYS:
        if key in types and types[key] != T.STRING:
            return f"{key} is a {types[key].name}, not a string"
    for key in _BOOL_KEYS:
        if key in types and types[key] != T.BOOL:
            return f"{key} is a {types[key].name}, not a bool"
    for key in _TOKEN_ID_KEYS:
        if key in types and not is_int(key):
            return f"{key} is a {types[key].name}, not an integer"
    for key in (f"{info.arch}.{s}" for s in _SIZE_SUFFIXES):
        if key in types and not (is_int(key) and info.metadata[key] >= 0):
            return f"{key} is {_show(info.metadata[key])}, not a size"
    for key in (f"{info.arch}.{s}" for s in _PER_LAYER_SUFFIXES):
        if key not in types:
            continue
        values = info.metadata[key]
        if types[key] == T.ARRAY and elem_types[key] in _INTEGERS:
            if any(v < 0 for v in values):
                return f"{key} has a negative entry"
        elif not (is_int(key) and values >= 0):
            return f"{key} is {_show(values)}, not a count (or one count per block)"
    if "tokenizer.ggml.tokens" in types and elem_types.get("tokenizer.ggml.tokens") != T.STRING:
        return "tokenizer.ggml.tokens is not an array of strings"
    return None


def _layers(info, types, elem_types) -> str | None:
    """load_hparams: GGML_ASSERT(n_layer_all > 0 && n_layer_all <= LLAMA_MAX_LAYERS), n_layer_nextn <= n_layer_all;
    wavtokenizer: posnet / convnext block counts <= n_layer_all. Per-layer arrays must have n_layer_all entries."""
    key = f"{info.arch}.block_count"
    if key not in info.metadata or info.arch in _NO_HPARAMS_ARCHS:
        return None
    n_layer = info.metadata[key]
    if not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        return f"{key} is {n_layer:,}; llama.cpp handles 1 to {LLAMA_MAX_LAYERS} blocks"
    bounded = ["nextn_predict_layers"]
    if info.arch == "wavtokenizer-dec":
        bounded += ["posnet.block_count", "convnext.block_count"]
    for suffix in bounded:
        value = _int(info, suffix)
        if value is not None and value > n_layer:
            return f"{info.arch}.{suffix} is {value:,}, more than the {n_layer} blocks ({key})"
    for suffix in _PER_LAYER_SUFFIXES:
        per_layer = f"{info.arch}.{suffix}"
        if types.get(per_layer) == T.ARRAY and len(info.metadata[per_layer]) != n_layer:
            return f"{per_layer} has {len(info.metadata[per_layer]):,} entries for {n_layer} blocks ({key})"
    return None


def _experts(info, types, elem_types) -> str | None:
    """load_hparams' expert asserts: n_expert <= LLAMA_MAX_EXPERTS; the most experts used per token <= n_expert;
    with experts, at least one used and fewer groups than experts (groups dividing them, fewer used than groups);
    without experts, none used and no groups."""
    if info.arch in _NO_HPARAMS_ARCHS or f"{info.arch}.block_count" not in info.metadata:
        return None
    n_expert = _int(info, "expert_count") or 0
    used = info.arch_get("expert_used_count", 0)
    n_used = max(used, default=0) if isinstance(used, list) else int(used)
    n_groups = _int(info, "expert_group_count") or 0
    n_group_used = _int(info, "expert_group_used_count") or 0
    if info.arch in ("hunyuan_vl", "hunyuan-dense") and n_expert <= 1:  # load_hparams zeroes both for them
        n_expert = n_used = 0
    a = info.arch
    gating = _int(info, "expert_gating_func")
    if gating is not None and gating not in EXPERT_GATING_FUNCS:
        return f"{a}.expert_gating_func is {gating}; llama.cpp knows 0 to {EXPERT_GATING_FUNCS[-1]}"
    if n_expert > LLAMA_MAX_EXPERTS:
        return f"{a}.expert_count is {n_expert:,}; llama.cpp handles at most {LLAMA_MAX_EXPERTS} experts"
    if n_used > n_expert:
        return f"{a}.expert_used_count is {n_used:,}, more than the {n_expert} experts ({a}.expert_count)"
    if n_expert > 0 and n_used == 0:
        return f"{a}.expert_used_count is 0 for a model of {n_expert} experts"
    if n_groups and n_groups >= max(n_expert, 1):
        return f"{a}.expert_group_count is {n_groups:,} for {n_expert} experts"
    if n_groups > 1 and (n_expert % n_groups or not 0 < n_group_used < n_groups):
        return (f"{a}.expert_group_count {n_groups} and {a}.expert_group_used_count {n_group_used} do not fit "
                f"{n_expert} experts")
    return None


def _rope_scaling(info, types, elem_types) -> str | None:
    """load_hparams: GGML_ASSERT(rope_scaling_type_train != LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED)."""
    key = f"{info.arch}.rope.scaling.type"
    if types.get(key) == T.STRING and info.metadata[key] not in ROPE_SCALING_TYPES:
        return f"{key} is {info.metadata[key]!r}, not one of {', '.join(ROPE_SCALING_TYPES)}"
    return None


def _arch_asserts(info, types, elem_types) -> str | None:
    for arch, suffix, test, want in _ARCH_ASSERTS:
        value = info.arch_get(suffix) if info.arch == arch else None
        if isinstance(value, (int, float)) and not test(value, info):
            return f"{arch}.{suffix} is {value!r}; llama.cpp requires it {want}"
    return None


def _product(info, *suffixes: str) -> int | None:
    values = [_int(info, s) for s in suffixes]
    return None if None in values else math.prod(values)


def _hrm_slots(info) -> int | None:
    parts = [_int(info, f"hrm.{k}") for k in ("layers_per_stack", "h_cycles", "l_cycles")]
    return None if None in parts else parts[0] * parts[1] * (parts[2] + 1)


def _head_sizes(info, types, elem_types) -> str | None:
    """Head sizes as load_hparams derives them (`_heads`). ggml's rope asserts an even rotary dimension no larger
    than the head it turns, for full and sliding-window layers alike; the graphs of HEAD_K_EQ_V_ARCHS assert
    n_embd_k_gqa(il) == n_embd_v_gqa(il), on sliding-window layers too (src/models/lfm2.cpp)."""
    a = info.arch
    if a in HEAD_K_EQ_V_ARCHS and f"{a}.block_count" in info.metadata \
            and max(_per_layer(info, "attention.head_count", 1), default=0) <= 0:
        return f"{a}.attention.head_count is missing or 0 in an attention model"
    heads = _heads(info)
    if heads is None:
        return None
    n_head, n_embd, head_k, head_v, n_rot = heads
    # sliding-window head sizes default to the full ones; a 0 given is a 0 (the graph then asserts on it)
    swa = tuple(full if given is None else given for full, given in
                ((head_k, _int(info, "attention.key_length_swa")), (head_v, _int(info, "attention.value_length_swa"))))
    for suffix, head in (("", head_k), ("_swa", swa[0])):
        rot = _int(info, f"rope.dimension_count{suffix}")
        if rot is not None and (rot % 2 or rot > head or (rot == 0 and a not in NO_ROPE_ARCHS)):
            return (f"{a}.rope.dimension_count{suffix} is {rot}; it must be even, above 0 and at most the head size "
                    f"{head}")
    scale = info.arch_get("attention.temperature_scale")
    if a == "deepseek2" and isinstance(scale, float) and scale != 0 and not _int(info, "attention.temperature_length"):
        return f"{a}.attention.temperature_scale is {scale} without a temperature_length (its graph asserts both)"
    sections = info.arch_get("rope.dimension_sections")
    sections = [sections] * 4 if isinstance(sections, int) else sections  # get_key_or_arr(..., 4): one or four
    if isinstance(sections, list) and all(isinstance(v, int) for v in sections) and sum(sections) > head_k:
        return f"{a}.rope.dimension_sections {sections} add up to more than the head size {head_k}"
    if a in HEAD_K_EQ_V_ARCHS and (head_k != head_v or swa[0] != swa[1]):
        return f"{a} needs equal key and value head sizes, the header gives {head_k}/{head_v} (sliding window: {swa})"
    if a in HEAD_IS_ROT_ARCHS and n_rot != head_v:
        return f"{a} rotates the whole head: rope.dimension_count {n_rot} must equal the head size {head_v}"
    if a in QUERY_IS_N_EMBD_ARCHS and isinstance(info.arch_get("attention.head_count"), int) \
            and head_k * n_head != n_embd:
        return f"{a}: {n_head} heads of {head_k} do not make the embedding length {n_embd}"
    return None


def _latent_attention(info) -> str | None:
    """Latent attention (MLA) as the converters write it: the cache holds one head of kv_lora_rank values plus the
    rotary part, and the decompressed query head (key_length_mla) must be longer than its rotary part (deepseek2's
    loader asserts n_embd_head_qk_nope >= 1)."""
    a, heads = info.arch, _heads(info)
    rank, k_mla = _int(info, "attention.kv_lora_rank") or 0, _int(info, "attention.key_length_mla") or 0
    if heads is None or rank <= 0:
        return None
    _, _, head_k, head_v, n_rot = heads
    if a in ("deepseek2", "hy_v4") and (k_mla or head_k) <= n_rot:
        return f"{a}: the query head ({k_mla or head_k}) must be longer than its rotary part ({n_rot})"
    if k_mla and max(_per_layer(info, "attention.head_count_kv", 1), default=1) > 1:
        return f"{a}: latent attention caches one key/value head, the header asks for more"
    if k_mla and (head_k != rank + n_rot or head_v != rank):
        return (f"{a}: latent attention needs key_length = kv_lora_rank + rope.dimension_count and value_length "
                f"= kv_lora_rank; the header gives {head_k} and {head_v} for rank {rank} and {n_rot} rotary")
    return None


def _attention_shapes(info, types, elem_types) -> str | None:
    """The attention projections of each block against the head counts and sizes: K and V project to
    n_head_kv heads, Q to n_head (twice that where a gate rides along), the output from n_head value heads, a fused
    QKV to all three. llama.cpp checks most of these shapes, but not where a loader assumes n_embd (the graph's
    reshape then aborts). Latent attention (MLA) projects differently and is left to llama.cpp."""
    n_layer = _int(info, "block_count") or 0
    q_heads = _per_layer(info, "attention.head_count", n_layer)
    kv_heads = _per_layer(info, "attention.head_count_kv", n_layer) or q_heads
    for il, (n_q, n_kv) in enumerate(zip(q_heads, kv_heads)):
        if n_kv > n_q:
            return f"block {il} has {n_kv} key/value heads for {n_q} query heads"
    heads = _heads(info)
    latent = (_int(info, "attention.kv_lora_rank") or 0) > 0 or (_int(info, "attention.key_length_mla") or 0) > 0
    if latent:
        return _latent_attention(info)
    if heads is None:
        return None
    _, _, head_k, head_v, _ = heads
    shapes = {t.name: t.shape for t in info.tensors}
    # the recurrent blocks of a hybrid (Gated DeltaNet, Mamba: ssm_* tensors) have projections of their own shapes,
    # also where they reuse the attention names (qwen35's linear-attention attn_qkv)
    recurrent = {t.name.split(".")[1] for t in info.tensors if t.name.startswith("blk.") and ".ssm_" in t.name}
    for il, (n_q, n_kv) in enumerate(zip(q_heads, kv_heads)):
        if n_q <= 0 or str(il) in recurrent:
            continue  # a recurrent block of a hybrid
        want = {"attn_k": (1, (head_k * n_kv,)), "attn_v": (1, (head_v * n_kv,)),
                "attn_q": (1, (head_k * n_q, 2 * head_k * n_q)), "attn_output": (0, (head_v * n_q,)),
                "attn_qkv": (1, (head_k * (n_q + n_kv) + head_v * n_kv,))}
        for part, (dim, sizes) in want.items():
            shape = shapes.get(f"blk.{il}.{part}.weight")
            if shape is not None and (len(shape) <= dim or shape[dim] not in sizes):
                return (f"tensor blk.{il}.{part}.weight has shape {list(shape)}, which does not fit {n_q} heads "
                        f"({n_kv} for keys and values) of size {head_k}/{head_v}")
    return None


def _heads(info) -> tuple[int, int, int, int, int] | None:
    """(n_head of block 0, n_embd, key head size, value head size, rotary dimension) as load_hparams derives
    them: attention.key_length / value_length, else n_embd / n_head; rope.dimension_count, else the key head
    size. None for a model without attention heads in its first block."""
    n_head = (_per_layer(info, "attention.head_count", 1) or [0])[0]
    n_embd = _int(info, "embedding_length")
    if n_head <= 0 or n_embd is None or info.arch in _NO_HPARAMS_ARCHS:
        return None
    head_k, head_v = (_int(info, f"attention.{kv}_length") for kv in ("key", "value"))
    head_k = n_embd // n_head if head_k is None else head_k
    head_v = n_embd // n_head if head_v is None else head_v
    n_rot = _int(info, "rope.dimension_count")
    return n_head, n_embd, head_k, head_v, head_k if n_rot is None else n_rot


def _per_layer(info, suffix: str, n_layer: int) -> list[int]:
    """A per-layer count as a list (a scalar repeated n_layer times); [] when absent or not integers."""
    value = info.arch_get(suffix)
    if isinstance(value, int):
        return [value] * n_layer
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return value
    return []


def _norm_epsilons(info, types, elem_types) -> str | None:
    """ggml_norm / ggml_rms_norm: GGML_ASSERT(eps >= 0.0f), at the first decode."""
    for key, value in info.metadata.items():
        if key.endswith("norm_epsilon") or key.endswith("norm_rms_epsilon"):
            if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                return f"{key} is {value}; a norm epsilon must be a finite number >= 0"
    return None


def _tokens(info, types, elem_types) -> str | None:
    """llama_vocab::load: GGML_ASSERT(id_to_token.size() == token_to_id.size()), i.e. every token text is unique
    (an empty text counts as "[EMPTY_<id>]"); an empty vocabulary divides by zero later."""
    model = info.get("tokenizer.ggml.model")
    if model in _NO_VOCAB_MODELS:
        return f"tokenizer.ggml.model is {model!r}: the model has no vocabulary to tokenize text with"
    if "tokenizer.ggml.tokens" not in types:
        return None
    tokens = info.tokens
    if not tokens:
        return "tokenizer.ggml.tokens is empty"
    if len(set(tokens)) == len(tokens) and b"" not in tokens:
        return None
    seen: dict[bytes, int] = {}
    for i, token in enumerate(tokens):
        text = token or f"[EMPTY_{i}]".encode()
        if text in seen:
            return f"tokens {seen[text]} and {i} have the same text {text.decode('utf-8', 'replace')!r}"
        seen[text] = i
    return None


def _embedding_shape(info, types, elem_types) -> str | None:
    """create_tensor(token_embd.weight, {n_embd, n_vocab}) in nearly every architecture's load_arch_tensors (a
    clearer message than llama.cpp's; llama.cpp refuses a mismatch itself)."""
    embd = next((t for t in info.tensors if t.name == "token_embd.weight"), None)
    n_embd = _int(info, "embedding_length")
    if embd is None or len(embd.shape) != 2 or n_embd is None or info.arch in _OWN_EMBEDDING_ARCHS:
        return None
    n_vocab = len(info.tokens) or embd.shape[1]
    if tuple(embd.shape) != (n_embd, n_vocab):
        return (f"token_embd.weight has shape {list(embd.shape)}, but {info.arch}.embedding_length and the "
                f"vocabulary say [{n_embd}, {n_vocab}]")
    return None


def _tensor_types(info, types, elem_types) -> str | None:
    """ggml's CPU element-wise ops take only an F32 vector (binary-ops.cpp aborts otherwise), and its state-space ops
    only F32 A, D and convolution tensors, so these must be F32, as every converter writes them; F64, integer and
    work types are no type for a weight matrix."""
    for t in info.tensors:
        if _INDEX_TENSORS.get(t.name) == t.ggml_type:
            continue
        vector = all(d == 1 for d in t.shape[1:]) or t.name.endswith(_F32_SUFFIXES) or ".ssm_conv1d." in t.name
        if t.ggml_type != _F32 and vector:
            return f"tensor {t.name!r} {list(t.shape)} is {t.type_name}; norms, biases and other vectors must be F32"
        if t.ggml_type in _NOT_WEIGHT_TYPES:
            return f"tensor {t.name!r} is {_NOT_WEIGHT_TYPES[t.ggml_type]}, which is no weight type"
    return None


def _tensor_pairs(info, types, elem_types) -> str | None:
    """Tensors that need another one, or exclude one. llm_graph_context::build_ffn asserts that an NVFP4 up, gate or
    down weight has its per-tensor scale (`.scale`, loaded for every architecture) or a bias, not both: the scale
    would be applied after the bias."""
    names = {t.name for t in info.tensors}
    for present, needed in _USED_IF_PRESENT.get(info.arch, ()):
        for name in sorted(names):
            if name.endswith("." + present) and name[:-len(present)] + needed not in names:
                return f"tensor {name} comes without {name[:-len(present)] + needed}, which {info.arch} needs with it"
    for t in info.tensors:
        if t.ggml_type == _NVFP4 and _DENSE_FFN_WEIGHT.fullmatch(t.name):
            stem = t.name.removesuffix("weight")
            if stem + "scale" in names and stem + "bias" in names:
                return (f"tensor {t.name} is NVFP4 with both {stem}scale and {stem}bias; llama.cpp takes an NVFP4 "
                        "feed-forward weight with a scale or a bias, not both")
    return None


def _int(info, suffix: str) -> int | None:
    value = info.arch_get(suffix)
    return int(value) if isinstance(value, int) else None


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
