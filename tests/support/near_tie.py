"""Where greedy outputs may part: batched and one-token decoding round differently (different matmul kernels), so
two greedy runs that decode in different batches (speculative vs plain, several sequences vs one) may pick different
tokens where the target's top two logits nearly tie. A divergence is accepted only there: where the top-two gap is
within the rounding noise measured on the model under test, at that very context, and the two diverging tokens are
those top two. Anything else fails."""
from __future__ import annotations

from typing import Sequence

import numpy as np

NOISE_ROWS = 8   # positions over which batched and one-token logits are compared


def rounding_noise(ctx, context: Sequence[int], rows: int = NOISE_ROWS) -> tuple[float, np.ndarray]:
    """The largest |batched - one-token| logit difference over the last `rows` positions of `context` (the whole
    context decoded in one batch, then again a token at a time over those positions), and the one-token logits
    after `context`. Leaves `ctx` cleared."""
    context = list(context)
    rows = max(1, min(rows, len(context) - 1))
    ctx.clear()
    batched = np.array(ctx.eval(context, logits="all")[-rows:])
    ctx.clear()
    ctx.eval(context[:-rows], logits="none")
    single = np.stack([np.array(ctx.eval([token], logits="last")[0]) for token in context[-rows:]])
    ctx.clear()
    return float(np.abs(batched - single).max()), single[-1]


def assert_same_or_near_tie(ctx, prompt: Sequence[int], got: Sequence[int], expected: Sequence[int]) -> None:
    """`got` equals `expected` token for token, or they part at a near-tie of the target (`ctx`, its context)."""
    if list(got) == list(expected):
        return
    i = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    assert i < min(len(got), len(expected)), f"one output is a prefix of the other: {len(got)} vs {len(expected)}"
    noise, logits = rounding_noise(ctx, list(prompt) + list(expected[:i]))
    top2 = np.argsort(logits)[-2:]
    gap = float(logits[top2[1]] - logits[top2[0]])
    assert gap <= 2 * noise + 1e-6 and {got[i], expected[i]} <= set(top2.tolist()), (
        f"diverged at token {i} ({got[i]} vs {expected[i]}): the target's top two are {top2.tolist()[::-1]}, "
        f"{gap:.3f} apart, beyond the rounding noise {noise:.3f} measured there")
