"""What a GGUF header says, as data: ModelInfo (metadata, tensors, tokens) and its views (arch, sizes, special
tokens). reader.py fills it from a file; nothing here reads one."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

_EXTRA_TYPE_NAMES = {42: "Q2_0"}   # types newer than the gguf package's table


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return _EXTRA_TYPE_NAMES.get(self.ggml_type, f"type{self.ggml_type}")


@dataclass(frozen=True)
class ModelInfo:
    """The header of one GGUF file."""

    path: Path
    file_size: int
    version: int
    metadata: dict  # key -> scalar, string, or (for arrays) a list / numpy array / ("skipped", length)
    tensors: tuple[TensorInfo, ...]
    tokens: tuple[bytes, ...] = field(repr=False)
    data_offset: int = 0

    # -- convenience views over the metadata ---------------------------------------------------------------------
    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def arch_get(self, suffix: str, default=None):
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    @property
    def arch(self) -> str:
        return self.metadata.get("general.architecture", "unknown")

    @property
    def name(self) -> str:
        return self.metadata.get("general.name") or self.path.name

    @property
    def n_layer(self) -> int:
        return int(self.arch_get("block_count", 0))

    @property
    def n_layer_nextn(self) -> int:
        """Multi-token-prediction (nextn) blocks at the end of the file's blocks (counted in n_layer)."""
        return int(self.arch_get("nextn_predict_layers", 0) or 0)

    @property
    def n_ctx_train(self) -> int:
        return int(self.arch_get("context_length", 0))

    @property
    def n_embd(self) -> int:
        return int(self.arch_get("embedding_length", 0))

    @property
    def n_head(self) -> int:
        return _first_int(self.arch_get("attention.head_count", 0))

    @property
    def n_head_kv(self) -> int:
        return _first_int(self.arch_get("attention.head_count_kv", self.n_head)) or self.n_head

    @property
    def head_dim_k(self) -> int:
        return int(self.arch_get("attention.key_length", 0)) or (self.n_embd // max(self.n_head, 1))

    @property
    def head_dim_v(self) -> int:
        return int(self.arch_get("attention.value_length", 0)) or (self.n_embd // max(self.n_head, 1))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.metadata.get("tokenizer.ggml.bos_token_id")

    @property
    def eos_id(self) -> int | None:
        return self.metadata.get("tokenizer.ggml.eos_token_id")

    @property
    def add_bos(self) -> bool | None:
        return self.metadata.get("tokenizer.ggml.add_bos_token")

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    @property
    def weights_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def is_recurrent(self) -> bool:
        # Mamba / RWKV style models carry an ssm or wkv block; llama.cpp decides precisely at load time.
        return any(k.startswith(f"{self.arch}.ssm.") or k.startswith(f"{self.arch}.wkv.") for k in self.metadata)


def _first_int(value) -> int:
    """Per-layer arrays (e.g. head_count_kv on some models) collapse to their first element."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return int(value[0]) if len(value) else 0
    return int(value)
