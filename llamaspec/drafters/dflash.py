"""DFlash: block-diffusion drafting (llama.cpp's common_speculative_impl_draft_dflash).

The draft's cache holds, at each target position, its projection of the target's fused layer inputs. A draft is one
non-causal pass over [last, MASK x n] at positions pos0..pos0+n (pos0 = position of `last`): row i of the output
predicts the token at pos0 + i, so rows 1..n give n tokens at once, n <= block_size - 1. The block's entries are
dropped afterwards; the verification's features take their place.

The tokens are the rows' argmaxes (what the draft was trained for; llama.cpp does the same), so in sampling mode q
is a point mass on each drafted token, as for prompt lookup. The rejection rule stays exact with it: token x is
kept with probability min(1, p(x) / 1) = p(x), otherwise the next token is drawn from normalize(max(0, p - q)),
which is p without x: together exactly p.

Cost: the whole block is one draft pass (its descriptor in kinds.py says "per_pass"): drafting n tokens costs
about as much as drafting one, unlike a draft model's n sequential passes.
"""
from __future__ import annotations

import numpy as np

from ..sampling import max_prob
from .base import NO_DRAFT, Draft
from .features import HiddenStateDrafter


class DFlashDrafter(HiddenStateDrafter):
    kind = "dflash"

    def __init__(self, ctx, n_vocab_target: int):
        super().__init__(ctx, n_vocab_target)
        self.block_size, self.mask_token_id = ctx.info.block_size, ctx.info.mask_token_id
        self.max_draft = max(self.block_size - 1, 0)   # [last, MASK x n] fills one trained block
        self._block = np.full(min(self.block_size, ctx.n_batch), self.mask_token_id, np.int64)

    def _feed(self, tokens, rows, first_pos) -> None:
        self.ctx.inject(rows, first_pos)

    def propose(self, history, last, max_len, p_min) -> Draft:
        pos0 = len(history)
        n = min(max_len, self.max_draft, len(self._block) - 1)
        ready, setup = self._catch_up(pos0, max_len)
        if not ready or n <= 0:
            return NO_DRAFT
        ctx = self.ctx
        block = self._block[:n + 1]
        block[0] = last
        ctx.set_device_argmax(p_min <= 0)   # argmaxes only: taken on the device, no logits copied
        ctx.decode(block, pos0, outputs=n)
        if p_min <= 0:
            drafted = ctx.argmax(n)
        else:  # llama.cpp's rule: stop at the first row whose top probability is below p_min
            drafted = []
            for row in ctx.logits(n):
                token = int(row.argmax())
                if max_prob(row, self._scratch, row[token]) < p_min:
                    break
                drafted.append(token)
        block[0] = self.mask_token_id
        ctx.keep(pos0)   # drop the block: the verification's features take its place
        cut = next((i for i, t in enumerate(drafted) if t >= self.n_vocab_target), len(drafted))
        drafted = [int(t) for t in drafted[:cut]]
        return Draft(drafted, self._point_masses(drafted), setup)
