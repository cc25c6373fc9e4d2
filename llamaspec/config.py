"""One configuration for loading a pair: what each model needs (placement, context, cache) and how to draft.

`LoadConfig` is what `load_pair` builds from its keyword arguments, what the CLI options, the registry's named
pairs and the server read their defaults and choices from. Every list of choices is declared here once. This module
knows nothing about llama.cpp: the backend maps these names onto llama.cpp's enums.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Sequence

from . import bounds
from .errors import InvalidParameterError
from .kinds import DRAFTER_KINDS, MTP_DRAFTERS  # noqa: F401  (where draft tokens come from: kinds.py)

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
FLASH_ATTN_MODES = ("auto", "on", "off")
SPLIT_MODES = ("none", "layer", "row", "tensor")   # "tensor": llama.cpp's tensor parallelism (needs GPUs)
POLICY_NAMES = ("auto", "fixed", "confidence", "threshold")

DEFAULT_N_CTX = 4096
DEFAULT_CACHE_RAM = 8192   # MiB, llama-server's --cache-ram default


@dataclass(frozen=True)
class ModelConfig:
    """How one model (target or draft) is loaded and what its context holds."""

    # placement (llama.cpp's model parameters)
    n_gpu_layers: int = -1                   # -1 = all (ignored by a CPU-only build)
    main_gpu: int = 0
    split_mode: str = "layer"                # one of SPLIT_MODES
    tensor_split: tuple[float, ...] | None = None
    devices: tuple[str, ...] | None = None   # offload only to these ("CUDA1", "RPC0"); () = none; None = all
    rpc_servers: str | None = None           # "host:port,..." for llama.cpp's RPC backend
    use_mmap: bool = True                    # False: read the weights into memory (llama.cpp's --no-mmap)
    use_mlock: bool = False                  # keep the weights in RAM, never swapped out (llama.cpp's --mlock)
    no_repack: bool = False                  # True turns off llama.cpp's CPU weight repacking
    # context (llama.cpp's context parameters)
    n_ctx: int = DEFAULT_N_CTX
    n_batch: int = 2048                      # tokens per llama_decode call (a prompt's chunk): llama-server's -b
    n_ubatch: int | None = 512               # tokens per physical batch (llama.cpp's -ub, at most n_batch; None:
                                             # n_batch): llama-server's, sizes the compute buffers
    n_threads: int | None = None             # None: physical cores
    flash_attn: str = "auto"                 # one of FLASH_ATTN_MODES
    cache_type_k: str = "f16"                # one of CACHE_TYPES
    cache_type_v: str = "f16"
    n_rs_seq: int = 0                        # recurrent-state snapshots for rollback (hybrids); 0: load_pair
                                             # sizes them to the longest draft
    n_checkpoints: int = 32                  # turn checkpoints of a recurrent state, a slot, for prompt reuse
    #                                          (llama-server's --ctx-checkpoints and its default: host copies)
    load_mtp: bool = False                   # load the multi-token-prediction (nextn) head too, if the file has one

    def __post_init__(self):
        _choice("split_mode", self.split_mode, SPLIT_MODES)
        _choice("flash_attn", self.flash_attn, FLASH_ATTN_MODES)
        _choice("cache_type_k", self.cache_type_k, CACHE_TYPES)
        _choice("cache_type_v", self.cache_type_v, CACHE_TYPES)
        for name in ("n_ctx", "n_batch", "n_rs_seq", "n_checkpoints", "n_gpu_layers", "main_gpu"):
            bounds.check(name, getattr(self, name))
        if self.n_threads is not None:
            bounds.check("n_threads", self.n_threads)
        if self.n_ubatch is not None:
            bounds.check("n_batch", self.n_ubatch, param="n_ubatch")
        if self.tensor_split is not None:
            object.__setattr__(self, "tensor_split", bounds.check_tensor_split(self.tensor_split))
        if self.devices is not None and not isinstance(self.devices, tuple):
            object.__setattr__(self, "devices", tuple(self.devices))

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class DraftSettings:
    """How to draft, each value checked here once: the policy's name, the draft length (fixed) or the longest draft
    (the others) `draft_max`, the shortest (threshold) `draft_min`, the confidence stop `draft_p_min` (None: the
    policy's own default) and the drafter kind. The same names run from the CLI flags (--draft-max, ...) and
    models.toml through here to the policy's constructor. It travels whole: load_pair keeps it on the pair
    (`pair.config.drafting`), and a change (chat's /k and /policy, the server's PATCH /admin/config) is a
    `dataclasses.replace` of it given to `Pair.set_drafting`."""

    policy: str = "auto"                     # one of POLICY_NAMES
    draft_max: int | None = None
    draft_min: int | None = None
    draft_p_min: float | None = None
    drafter: str = "model"                   # one of DRAFTER_KINDS

    def __post_init__(self):
        _choice("policy", self.policy, POLICY_NAMES)
        _choice("drafter", self.drafter, DRAFTER_KINDS)

    def check(self, known: dict | None = None) -> "DraftSettings":
        """Each number against its row in bounds.py, where the batch size is known (`known`): the LoadConfig that
        holds these settings checks them so (make_policy asks the same rows)."""
        for name in ("draft_max", "draft_min", "draft_p_min"):
            if getattr(self, name) is not None:
                bounds.check(name, getattr(self, name), known)
        return self

    def policy_settings(self) -> dict:
        """What the policy is built from (the drafter aside), as the admin API shows it."""
        return {name: getattr(self, name) for name in POLICY_SETTINGS}


POLICY_SETTINGS = ("policy", "draft_max", "draft_min", "draft_p_min")   # DraftSettings' fields that make the policy
_DRAFT_FIELDS = POLICY_SETTINGS + ("drafter",)

# load_pair's keyword arguments for the draft: `draft_<name>` overrides the draft's copy of the target's setting
_DRAFT_OVERRIDES = ("n_gpu_layers", "main_gpu", "n_ctx", "n_threads")
_MODEL_FIELDS = tuple(f.name for f in fields(ModelConfig))


@dataclass(frozen=True, init=False)
class LoadConfig:
    """Everything `load_pair` needs besides the two paths.

    `target` configures the target; the draft runs with the same context and cache settings unless `draft` is
    given: on the target's main GPU, unsplit (`draft_config()`). `draft_device` puts the whole draft on one device.
    `drafting` may also be given by its fields (`LoadConfig(policy="fixed", draft_max=3)`).
    """

    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig | None = None
    draft_device: str | None = None
    drafting: DraftSettings = field(default_factory=DraftSettings)
    warm_up: bool | None = None              # run and time each draft length at load (None: on a GPU target)
    verbose: bool = False
    # host memory (MiB) for saved slot states, so that a session whose slot another took resumes where it was
    # (llama-server's --cache-ram; -1: no limit, 0: none): backend/state_cache.py
    cache_ram: int = DEFAULT_CACHE_RAM

    def __init__(self, target: ModelConfig | None = None, draft: ModelConfig | None = None,
                 draft_device: str | None = None, drafting: DraftSettings | None = None, warm_up: bool | None = None,
                 verbose: bool = False, cache_ram: int | None = None, **settings):
        unknown = sorted(set(settings) - set(_DRAFT_FIELDS))
        if unknown:
            raise TypeError(f"LoadConfig() got an unexpected keyword argument {unknown[0]!r}")
        drafting = drafting if drafting is not None else DraftSettings()
        if any(v is not None for v in settings.values()):
            drafting = dataclasses.replace(drafting, **{n: v for n, v in settings.items() if v is not None})
        for name, value in (("target", target if target is not None else ModelConfig()), ("draft", draft),
                            ("draft_device", draft_device), ("drafting", drafting), ("warm_up", warm_up),
                            ("verbose", verbose), ("cache_ram", DEFAULT_CACHE_RAM if cache_ram is None else cache_ram)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        self.drafting.check({"n_batch": self.target.n_batch})   # a draft must fit in one batch
        bounds.check("cache_ram", self.cache_ram)
        if self.warm_up is not None and not isinstance(self.warm_up, bool):
            raise InvalidParameterError(f"warm_up must be true, false or None, got {self.warm_up!r}", param="warm_up")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LoadConfig":
        """Build from load_pair-style keywords: the ModelConfig names for the target, `draft_<name>` for the draft's
        own n_gpu_layers / main_gpu / n_ctx / n_threads, and the LoadConfig names."""
        return cls().replace(**kwargs)

    def replace(self, **kwargs) -> "LoadConfig":
        """A copy with load_pair-style keywords changed (see from_kwargs); None leaves a setting as it is."""
        target, draft, own, drafting = {}, {}, {}, {}
        for name, value in kwargs.items():
            if value is None:
                continue
            if name in _MODEL_FIELDS:
                target[name] = value
            elif name.startswith("draft_") and name[6:] in _DRAFT_OVERRIDES:
                draft[name[6:]] = value
            elif name in _DRAFT_FIELDS:
                drafting[name] = value
            elif name in _LOAD_FIELDS and name not in ("target", "draft"):
                own[name] = value
            else:
                raise InvalidParameterError(f"unknown setting {name!r}", param=name)
        if drafting:
            own["drafting"] = dataclasses.replace(own.get("drafting", self.drafting), **drafting)
        config = dataclasses.replace(self, target=self.target.replace(**target), **own)
        if draft:
            config = dataclasses.replace(config, draft=(config.draft or config._derived_draft()).replace(**draft))
        return config

    def _derived_draft(self) -> ModelConfig:
        t = self.target
        return t.replace(split_mode="none" if self.draft_device is not None else t.split_mode,
                         tensor_split=None, rpc_servers=None, devices=None)

    def draft_config(self) -> ModelConfig:
        """The draft's settings: `draft` as given, else the target's without its multi-device placement."""
        config = self.draft if self.draft is not None else self._derived_draft()
        if self.draft is not None and config.main_gpu != self.target.main_gpu:
            config = config.replace(split_mode="none")
        return config


_LOAD_FIELDS = tuple(f.name for f in fields(LoadConfig))


def _choice(name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise InvalidParameterError(f"{name} must be one of {', '.join(choices)}, got {value!r}", param=name)
