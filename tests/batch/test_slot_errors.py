"""A slot's failure is that slot's (slots.Engine.step): an error while one slot's rows are verified in the
shared step ends only that slot, with the error kept on it, its sequence repaired; the slots beside it, and a
request that reuses the slot later, get exactly their alone output. Tiny models with a real tokenizer."""
from __future__ import annotations

import pytest

from llamaspec import load_pair
from llamaspec.errors import InvalidParameterError

NO_TOKEN = "root ::= [\\U0010FFFF-\\U00000000]"   # a range that holds no character: no token is ever allowed
PROMPTS = ["def quicksort(arr):", "The history of the printing press begins", "SELECT name FROM"]
SETTINGS = dict(n_ctx=256, n_batch=64, no_repack=True, n_threads=1, flash_attn="off")   # as test_batch's


@pytest.fixture(scope="module")
def pair(tiny_models):
    with load_pair(tiny_models["target"], tiny_models["noisy"], policy="fixed", draft_max=4, **SETTINGS) as p:
        yield p


def no_token_shaping(pair):
    from llamaspec.backend.grammar import Grammar
    from llamaspec.shaping import Shaping

    return Shaping(grammar=Grammar.compile(pair.target, NO_TOKEN))


def run(engine) -> None:
    for _ in range(500):
        if not engine.busy:
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_a_failing_slot_ends_alone_and_the_others_get_their_alone_output(pair):
    expected = [pair.generate(p, max_tokens=24).tokens for p in PROMPTS]
    engine = pair.engine(3, 3 * SETTINGS["n_ctx"])
    first = engine.submit(pair.tokenize(PROMPTS[0]), max_tokens=24)
    failing = engine.submit(pair.tokenize("x"), max_tokens=24, shaping=no_token_shaping(pair))
    second = engine.submit(pair.tokenize(PROMPTS[1]), max_tokens=24)
    run(engine)

    assert isinstance(failing.error, InvalidParameterError) and failing.error.param == "grammar"
    assert failing.done and failing.stats.finish_reason == "error"
    assert first.error is None and second.error is None
    assert [first.tokens, second.tokens] == expected[:2]

    # the failed slot's sequence was repaired: a request that lands in it gets its alone output (the other two
    # prompts take back the slots that hold their caches)
    again = [engine.submit(pair.tokenize(p), max_tokens=24) for p in PROMPTS]
    assert again[2].index == failing.index
    run(engine)
    assert [s.error for s in again] == [None] * 3 and [s.tokens for s in again] == expected


def test_generate_batch_raises_the_failing_prompts_error(pair):
    with pytest.raises(InvalidParameterError, match="allows no token"):
        pair.generate_batch(["x", PROMPTS[0]], max_tokens=8, requests=[
            dict(max_tokens=8, shaping=no_token_shaping(pair)), dict(max_tokens=8)])
