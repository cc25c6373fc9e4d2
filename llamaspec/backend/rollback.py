"""How a context's memory goes back to its first n tokens: the one cache operation the engine asks for after a
verification ("keep n"). Which way a model takes is decided here, per context, from what llama.cpp says of it;
nothing above the backend learns which kind of memory a model has.

- `TailDrop`: attention KV caches drop any tail (`llama_memory_seq_rm`).
- `NoRollback`: recurrent state that can only be cleared; speculation is refused for it, plain decoding works.
"""
from __future__ import annotations

from .native import llama_cpp


class Rollback:
    """The contract: `before_decode` runs before every decode of `n_tokens` (a kind that checkpoints does it
    there), `keep(ctx, n)` drops positions >= n and says whether it could."""

    name = "none"
    speculative = False          # can it drop rejected draft tokens, i.e. serve speculation?

    def before_decode(self, ctx, n_tokens: int) -> None:
        pass

    def keep(self, ctx, n: int) -> bool:
        return False

    def describe(self) -> str:
        return self.name


class TailDrop(Rollback):
    """Attention-only memory: any tail can be dropped."""

    name = "kv"
    speculative = True

    def keep(self, ctx, n: int) -> bool:
        return bool(llama_cpp.llama_memory_seq_rm(ctx.memory, 0, n, -1))


class NoRollback(Rollback):
    """Recurrent state this llama.cpp cannot take back: cleared and re-decoded when the history changes."""

    name = "none"

    def describe(self) -> str:
        return "none (recurrent state cannot drop a tail)"


def choose_rollback(model, params) -> Rollback:
    """The rollback for a context of `model` created with `params` (llama_context_params)."""
    if model.is_recurrent or model.is_hybrid:
        return NoRollback()
    return TailDrop()
