"""What models.toml names: a GGUF file (ModelRef: a Hugging Face repo + file, or a local path) and a named pair of
them with its settings (PairEntry). Plain frozen data: the registry parses them, the downloader fetches them."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..config import DraftSettings, ModelConfig

HUB_URL = "https://huggingface.co"


@dataclass(frozen=True)
class ModelRef:
    """One GGUF file: a Hugging Face repo + file (at a revision, default main), or a local path."""

    repo: str | None = None
    file: str | None = None
    revision: str | None = None
    path: str | None = None
    size_gb: float | None = None  # as listed on the hub; None when unknown

    @property
    def is_local(self) -> bool:
        return self.path is not None

    @property
    def label(self) -> str:
        return self.path if self.is_local else f"{self.repo}/{self.file}"

    @property
    def key(self) -> tuple:
        """What makes two references the same file (the listed size does not)."""
        return (self.path,) if self.is_local else (self.repo, self.file, self.revision or "main")

    @property
    def url(self) -> str | None:
        return None if self.is_local else f"{HUB_URL}/{self.repo}/blob/{self.revision or 'main'}/{self.file}"

    def local_path(self) -> Path:
        """The path of a local model with environment variables and ~ expanded."""
        return Path(os.path.expanduser(os.path.expandvars(self.path)))


@dataclass(frozen=True)
class PairEntry:
    """A named target/draft pair and the settings that fit the GPU memory it was chosen for. `draft` is None when
    the drafter needs no draft model (drafter = "mtp": the target's own multi-token-prediction head)."""

    name: str
    target: ModelRef
    draft: ModelRef | None = None
    note: str = ""
    vram_gb: float = 0
    # load_pair's defaults where the entry says nothing
    n_gpu_layers: int = ModelConfig.n_gpu_layers
    draft_n_gpu_layers: int | None = None
    n_ctx: int = ModelConfig.n_ctx
    cache_type_k: str = ModelConfig.cache_type_k
    cache_type_v: str = ModelConfig.cache_type_v
    draft_max: int | None = DraftSettings.draft_max
    policy: str = DraftSettings.policy
    drafter: str | None = None   # one of DRAFTER_KINDS; None: load_pair's default (a draft model)
    verified: bool = False
    default_for_vram: bool = False   # offered when no model is given, on a GPU with about vram_gb free
    source: str = ""  # the models.toml that defined the entry (or last changed it)

    @property
    def models(self) -> tuple[ModelRef, ...]:
        """The files of the pair: the target, then the draft when there is one."""
        return (self.target,) if self.draft is None else (self.target, self.draft)

    def defaults(self) -> dict:
        """Loading and drafting settings, keyed like load_pair's arguments."""
        out = {"n_ctx": self.n_ctx, "n_gpu_layers": self.n_gpu_layers, "draft_n_gpu_layers": self.draft_n_gpu_layers,
               "cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v, "draft_max": self.draft_max,
               "policy": self.policy}
        if self.drafter is not None:
            out["drafter"] = self.drafter
        return out
