"""A memory plan from GGUF headers alone: weights, KV cache and compute buffers of a target and a draft, whether
both fit on a GPU, and if not, which single change (-ngl, -c, KV type) makes them fit.

The estimates follow what llama.cpp allocates (checked against its load log on CPU):
  weights = sum of tensor bytes (exact: the "model buffer size")
  KV      = n_layer * n_ctx * n_head_kv * (head_dim_k * bytes_k + head_dim_v * bytes_v)   (exact; a hybrid's
            attention layers only)
  state   = recurrent layers * (conv + ssm state) * 4 * (1 + n_rs_seq), plus one device copy for the step
            checkpoint of a speculating model that needs one, and n_checkpoints host copies for turn checkpoints,
            all per slot (n_parallel; the KV cache is one for all slots)                        (gguf/recurrent.py)
  compute = max(logits, attention scores) + (2 or 3) * n_embd * n_ubatch * 4
            logits = n_vocab * n_ubatch * 4 (only where the output layer is); attention scores (no flash
            attention) = 1.1 * n_ctx * n_ubatch * n_head * 4; 3 activation rows with a quantized KV cache or
            without flash attention                                                 (within ~2% on CPU)
Offloading follows llama.cpp: -ngl N puts the last N repeating layers (and their KV) on the GPU, the output layer
only when N > n_layer, and the token embeddings stay on the CPU (a tied output matrix is duplicated on the GPU).
This module knows nothing about llama.cpp itself and loads no weights.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..config import CACHE_TYPES, ModelConfig
from ..errors import InvalidParameterError
from .reader import ModelInfo
from .recurrent import kv_layers, recurrent_state_bytes, rollback_kind

GiB = 2**30
MiB = 2**20
DEFAULT_VRAM_GB = 24.0
# CUDA context, cuBLAS workspace and the like: not in any llama.cpp buffer, a rough per-process estimate.
GPU_RUNTIME_OVERHEAD = 400 * MiB
ATTENTION_SLACK = 1.1
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
_OUTPUT_TENSORS = ("output.weight", "output_norm.weight", "output.bias", "output_norm.bias")


def kv_bytes_per_element(kv_type: str) -> float:
    """f16 = 2, q8_0 = 34/32, q4_0 = 18/32, ... (block bytes / block elements)."""
    if kv_type not in CACHE_TYPES:
        raise InvalidParameterError(f"KV cache type must be one of {', '.join(CACHE_TYPES)}, got {kv_type!r}")
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kv_type.upper()]]
    return type_size / block_size


_LOADED = ModelConfig()   # load_pair's defaults


@dataclass(frozen=True)
class Settings:
    """What the estimate depends on besides the model: the context options of both models."""

    n_ctx: int = _LOADED.n_ctx
    n_ubatch: int = min(_LOADED.n_ubatch or _LOADED.n_batch, _LOADED.n_batch)
    type_k: str = _LOADED.cache_type_k
    type_v: str = _LOADED.cache_type_v
    flash_attn: bool = True     # llama.cpp's "auto" turns it on wherever it is supported
    speculative: bool = False   # a draft runs with the target: rollback snapshots and checkpoints are kept
    n_rs_seq: int = 0           # the target's recurrent-state snapshots (archs with bounded rollback)
    n_checkpoints: int = _LOADED.n_checkpoints   # turn checkpoints of a recurrent state (host memory), a slot
    n_parallel: int = 1         # slots (serve --parallel): one KV cache of n_ctx cells for all (unified), a
    #                             recurrent state with its snapshots and its turn checkpoints each
    cache_ram: int = 0          # bytes of host memory for a prompt cache of saved states (llama-server's
    #                             --cache-ram); 0: none. Planned beside the checkpoints (MemoryPlan.host_bytes)

    @classmethod
    def of(cls, config: ModelConfig, speculative: bool = False, n_rs_seq: int = 0, n_parallel: int = 1,
           cache_ram: int = 0) -> "Settings":
        """What loading a model with `config` would hold (n_ubatch as backend/context.py gives llama.cpp)."""
        return cls(n_ctx=config.n_ctx, n_ubatch=min(config.n_ubatch or config.n_batch, config.n_batch),
                   type_k=config.cache_type_k, type_v=config.cache_type_v, flash_attn=config.flash_attn != "off",
                   speculative=speculative, n_rs_seq=n_rs_seq, n_checkpoints=config.n_checkpoints,
                   n_parallel=n_parallel, cache_ram=cache_ram)


def kv_heads_per_layer(info: ModelInfo) -> list[int]:
    raw = info.arch_get("attention.head_count_kv", info.n_head)
    if isinstance(raw, (list, tuple)) or hasattr(raw, "tolist"):
        heads = [int(h) for h in list(raw)]
        return (heads + [heads[-1] if heads else 0] * info.n_layer)[:info.n_layer]
    return [int(raw)] * info.n_layer


def _kv_bytes_per_cell(info: ModelInfo, settings: Settings) -> list[float]:
    return [h * has_kv * (info.head_dim_k * kv_bytes_per_element(settings.type_k)
                          + info.head_dim_v * kv_bytes_per_element(settings.type_v))
            for h, has_kv in zip(kv_heads_per_layer(info), kv_layers(info))]


def kv_cache_bytes(info: ModelInfo, settings: Settings, n_layers: int | None = None) -> int:
    """KV cache of the last `n_layers` trunk layers (all by default) at settings.n_ctx cells. An MTP head's blocks
    (the last n_layer_nextn) are not the trunk's: their cache belongs to the head's own context (mtp_head_memory)."""
    per_layer = _kv_bytes_per_cell(info, settings)[:info.n_layer - info.n_layer_nextn]
    layers = per_layer if n_layers is None else per_layer[max(len(per_layer) - n_layers, 0):] if n_layers else []
    return int(sum(layers) * settings.n_ctx)


@dataclass(frozen=True)
class MTPHeadMemory:
    """What drafting with a file's multi-token-prediction head adds: its blocks' weights (llama.cpp loads them only
    for it), the KV cache of its own context (its blocks only, at n_ctx) and that context's compute buffer (logits
    rows like the target's)."""

    n_layers: int
    weights: int
    kv_cache: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute


def mtp_head_memory(info: ModelInfo, settings: Settings) -> MTPHeadMemory | None:
    """The MTP head's memory, or None when the file has none."""
    n = info.n_layer_nextn
    if n <= 0:
        return None
    first = info.n_layer - n
    weights = sum(t.n_bytes for t in info.tensors if (m := _LAYER_TENSOR.match(t.name)) and int(m.group(1)) >= first)
    kv = int(sum(_kv_bytes_per_cell(info, settings)[first:]) * settings.n_ctx)
    return MTPHeadMemory(n, weights, kv, compute_buffer_bytes(info, settings))


def compute_buffer_bytes(info: ModelInfo, settings: Settings, with_output: bool = True) -> int:
    logits = info.n_vocab * settings.n_ubatch * 4 if with_output else 0
    scores = 0 if settings.flash_attn else ATTENTION_SLACK * settings.n_ctx * settings.n_ubatch * info.n_head * 4
    # one more activation row per token when the attention reads a quantized cache or runs without flash attention
    extra = settings.type_k not in ("f32", "f16", "bf16") or settings.type_v not in ("f32", "f16", "bf16") \
        or not settings.flash_attn
    activations = (3 if extra else 2) * info.n_embd * settings.n_ubatch * 4
    return int(max(logits, scores) + activations)


def _layer_bytes(info: ModelInfo) -> tuple[list[int], int, int]:
    """(bytes of each repeating layer, bytes of the output layer on a GPU, bytes of the input embeddings)."""
    layers = [0] * info.n_layer
    output = embeddings = 0
    names = {t.name for t in info.tensors}
    for t in info.tensors:
        m = _LAYER_TENSOR.match(t.name)
        if m and int(m.group(1)) < info.n_layer:
            layers[int(m.group(1))] += t.n_bytes
        elif t.name in _OUTPUT_TENSORS:
            output += t.n_bytes
        elif t.name == "token_embd.weight":
            embeddings = t.n_bytes
            if "output.weight" not in names:
                output += t.n_bytes   # tied embeddings: llama.cpp duplicates the matrix for the output layer
    return layers, output, embeddings


@dataclass(frozen=True)
class ModelMemory:
    """One model's memory at one offload setting. `gpu_*` is what lands on the GPU."""

    name: str
    n_layer: int
    n_gpu_layers: int          # as given: -1 = all
    weights: int               # all tensors: RAM for a CPU-only run
    kv_cache: int
    compute: int
    gpu_weights: int
    gpu_kv_cache: int
    gpu_compute: int
    recurrent: int = 0         # recurrent state with its snapshots and device checkpoint (0: attention only)
    gpu_recurrent: int = 0
    checkpoints: int = 0       # host copies of the recurrent state at turn boundaries
    rollback: str = "kv"       # gguf.recurrent.rollback_kind

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.recurrent + self.checkpoints

    @property
    def gpu_total(self) -> int:
        return self.gpu_weights + self.gpu_kv_cache + self.gpu_compute + self.gpu_recurrent

    @property
    def fully_offloaded(self) -> bool:
        return self.n_gpu_layers < 0 or self.n_gpu_layers > self.n_layer


def recurrent_copies(info: ModelInfo, settings: Settings, is_draft: bool = False) -> int:
    """How many device copies of the recurrent state a context keeps: the state, its n_rs_seq snapshots (the
    target of a model with bounded rollback) and the step checkpoint (speculation without snapshots: the target
    of a checkpoint-only model, and any recurrent draft, which decodes one token at a time)."""
    kind = rollback_kind(info)
    if kind == "kv":
        return 0
    snapshots = settings.n_rs_seq if settings.speculative and kind == "bounded" and not is_draft else 0
    step = settings.speculative and (is_draft or kind == "checkpoint")
    return 1 + snapshots + int(step)


def model_memory(info: ModelInfo, settings: Settings, n_gpu_layers: int = -1, is_draft: bool = False) -> ModelMemory:
    layers, output, _embeddings = _layer_bytes(info)
    n_gpu = info.n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, info.n_layer + 1)
    n_repeating = min(n_gpu, info.n_layer)
    output_on_gpu = n_gpu > info.n_layer
    gpu_weights = sum(layers[info.n_layer - n_repeating:]) + (output if output_on_gpu else 0)
    if n_gpu == 0:
        gpu_compute = 0
    elif output_on_gpu:
        gpu_compute = compute_buffer_bytes(info, settings)
    else:
        # partial offload: llama.cpp also runs the CPU-held output matmul on the GPU for large batches,
        # copying that matrix into the compute buffer
        gpu_compute = compute_buffer_bytes(info, settings) + output
    copies = recurrent_copies(info, settings, is_draft) * settings.n_parallel
    return ModelMemory(
        name=info.name, n_layer=info.n_layer, n_gpu_layers=n_gpu_layers, weights=info.weights_bytes,
        kv_cache=kv_cache_bytes(info, settings), compute=compute_buffer_bytes(info, settings),
        gpu_weights=gpu_weights, gpu_kv_cache=kv_cache_bytes(info, settings, n_repeating), gpu_compute=gpu_compute,
        recurrent=copies * recurrent_state_bytes(info), gpu_recurrent=copies * recurrent_state_bytes(info, n_repeating),
        checkpoints=settings.n_parallel * settings.n_checkpoints * recurrent_state_bytes(info) if copies else 0,
        rollback=rollback_kind(info))


@dataclass(frozen=True)
class Suggestion:
    """A change of options that makes the pair fit, and the GPU memory it then needs."""

    flags: str
    gpu_bytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    settings: Settings
    vram_bytes: int
    target: ModelMemory
    draft: ModelMemory | None
    overhead: int = GPU_RUNTIME_OVERHEAD
    suggestions: tuple[Suggestion, ...] = field(default=())

    @property
    def models(self) -> list[ModelMemory]:
        return [m for m in (self.target, self.draft) if m is not None]

    @property
    def gpu_bytes(self) -> int:
        return sum(m.gpu_total for m in self.models) + self.overhead

    @property
    def ram_bytes_cpu_only(self) -> int:
        return sum(m.total for m in self.models) + self.settings.cache_ram

    @property
    def host_bytes(self) -> int:
        """Host memory beside the GPU's: the turn checkpoints of every slot and the prompt cache's budget."""
        return sum(m.checkpoints for m in self.models) + self.settings.cache_ram

    @property
    def fits(self) -> bool:
        return self.gpu_bytes <= self.vram_bytes


def _gpu_need(target: ModelInfo, draft: ModelInfo | None, settings: Settings, ngl: int, ngld: int) -> int:
    total = model_memory(target, settings, ngl).gpu_total + GPU_RUNTIME_OVERHEAD
    return total + (model_memory(draft, settings, ngld, is_draft=True).gpu_total if draft is not None else 0)


def suggest(target: ModelInfo, draft: ModelInfo | None, settings: Settings, vram_bytes: int) -> list[Suggestion]:
    """Single changes that make both models fit fully offloaded, then partial offload of the target."""
    out: list[Suggestion] = []
    quantized = replace(settings, type_k="q8_0", type_v="q8_0")
    if settings.type_k in ("f32", "f16", "bf16") or settings.type_v in ("f32", "f16", "bf16"):
        need = _gpu_need(target, draft, quantized, -1, -1)
        if need <= vram_bytes:
            out.append(Suggestion("-ctk q8_0 -ctv q8_0", need, "8-bit KV cache"))
    n_ctx = settings.n_ctx // 2
    while n_ctx >= 512:
        need = _gpu_need(target, draft, replace(settings, n_ctx=n_ctx), -1, -1)
        if need <= vram_bytes:
            out.append(Suggestion(f"-c {n_ctx}", need, "smaller context"))
            break
        n_ctx //= 2
    best_ngl = 0
    for label, s in (("", settings), ("-ctk q8_0 -ctv q8_0 ", quantized)):
        ngl = _max_layers(lambda n: _gpu_need(target, draft, s, n, -1), target.n_layer, vram_bytes)
        if ngl is not None and ngl > best_ngl:
            best_ngl = ngl
            out.append(Suggestion(f"{label}-ngl {ngl}", _gpu_need(target, draft, s, ngl, -1),
                                  f"{ngl} of {target.n_layer} target layers on the GPU, the rest on the CPU; "
                                  "draft fully on the GPU"))
    if not best_ngl and draft is not None:
        ngld = _max_layers(lambda n: _gpu_need(target, draft, quantized, 0, n), draft.n_layer + 1, vram_bytes)
        if ngld is not None:
            out.append(Suggestion(f"-ctk q8_0 -ctv q8_0 -ngl 0 -ngld {ngld}",
                                  _gpu_need(target, draft, quantized, 0, ngld), "target on the CPU, draft on the GPU"))
    return out


def _max_layers(need, n_layer: int, vram_bytes: int) -> int | None:
    """Largest n in [1, n_layer] with need(n) <= vram (need grows with n), or None."""
    best = None
    for n in range(1, n_layer + 1):
        if need(n) <= vram_bytes:
            best = n
    return best


def plan_memory(target: ModelInfo, draft: ModelInfo | None, settings: Settings, vram_bytes: int,
                n_gpu_layers: int = -1, draft_n_gpu_layers: int | None = None) -> MemoryPlan:
    """The plan for the given offload settings, with suggestions when it does not fit."""
    if settings.n_ctx < 1 or settings.n_ubatch < 1:
        raise InvalidParameterError("context and batch size must be positive")
    ngld = n_gpu_layers if draft_n_gpu_layers is None else draft_n_gpu_layers
    plan = MemoryPlan(settings, vram_bytes, model_memory(target, settings, n_gpu_layers),
                      model_memory(draft, settings, ngld, is_draft=True) if draft is not None else None)
    if not plan.fits:
        plan = replace(plan, suggestions=tuple(suggest(target, draft, settings, vram_bytes)))
    return plan


def largest_full_context(target: ModelInfo, draft: ModelInfo | None, settings: Settings, vram_bytes: int,
                         step: int = 256, with_head: bool = False) -> int | None:
    """The largest context (a multiple of `step`, at most the target's trained context, or 2**20 without one) with
    both models fully on the GPU (and the target's MTP head's context with `with_head`), or None when not even
    `step` tokens fit."""
    def fits(n_ctx: int) -> bool:
        at = replace(settings, n_ctx=n_ctx)
        head = mtp_head_memory(target, at) if with_head else None
        added = head.kv_cache + head.compute if head is not None else 0
        return _gpu_need(target, draft, at, -1, -1) + added <= vram_bytes

    lo, hi = 0, max(target.n_ctx_train, step) // step if target.n_ctx_train > 0 else 2**20 // step
    while lo < hi:   # the need grows with the context: the largest multiple that fits, by bisection
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step if lo else None


def saved_state_bytes(target: ModelInfo, draft: ModelInfo | None, settings: Settings,
                      mtp: "MTPHeadMemory | None" = None) -> int:
    """One slot's state as the host-memory cache saves it (backend/state_cache.py) at a full context: each model's
    KV cache and recurrent state with its turn checkpoints, and an MTP head's KV cache (its ring of hidden states,
    about 1024 rows of n_embd floats, left out)."""
    total = mtp.kv_cache if mtp is not None else 0
    for info in (target, draft):
        if info is not None:
            state = recurrent_state_bytes(info) if rollback_kind(info) != "kv" else 0
            total += kv_cache_bytes(info, settings) + state * (1 + settings.n_checkpoints)
    return total

