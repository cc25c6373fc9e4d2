"""Two raw contexts over a draft pair, for probes that read both models' logits rows along one text: the files'
headers checked first (one tokenizer, as load_pair checks them), so a wrong pair is one error, not rows compared
across different vocabularies."""
from __future__ import annotations

from llamaspec.backend import Context, Model
from llamaspec.config import ModelConfig
from llamaspec.gguf.compat import check_pair
from llamaspec.gguf.reader import read_model_info


def open_pair(target: str, draft: str, no_repack: bool, n_ctx: int) -> tuple[list[Model], Context, Context, int]:
    """(the two models, the target's context, the draft's, the vocabulary both rows cover)."""
    check_pair(read_model_info(target), read_model_info(draft))
    options = ModelConfig(no_repack=no_repack, n_ctx=n_ctx)
    models = [Model(path, options) for path in (target, draft)]
    target_ctx, draft_ctx = (Context(m, options) for m in models)
    return models, target_ctx, draft_ctx, min(m.n_vocab for m in models)
