"""Grammars and JSON schemas with a cost bound (backend/grammar.py): a row's mask goes to llama.cpp shortest token
first, a chunk per call, and stops with GrammarCostError once its cost would pass the budget; a new grammar is
tried that way before use; schema counts, optional runs and the GBNF size are bounded before anything is built.
Tiny model with the real Qwen2 vocabulary (151,936 tokens); the budget's measurements are in
benchmarks/results/grammar-cost-bound.md."""
from __future__ import annotations

import time

import numpy as np
import pytest

AMBIGUOUS = "root ::= " + " ".join(["[a-z]*"] * 30)


@pytest.fixture(scope="module")
def model(tiny_models):
    from llamaspec.backend.model import Model
    from llamaspec.config import ModelConfig

    m = Model(tiny_models["target"], ModelConfig(no_repack=True))
    yield m
    m.close()


def one_call_mask(grammar, n_vocab: int) -> np.ndarray:
    """llama.cpp's own answer: every token in one llama_sampler_apply call."""
    from llamaspec.backend.grammar import _Candidates
    from llamaspec.backend.native import llama_cpp

    cand = _Candidates(n_vocab)
    cand.data["id"] = np.arange(n_vocab, dtype=np.int32)
    llama_cpp.llama_sampler_apply(grammar._ptr, cand.ref)
    return np.isneginf(cand.data["logit"])


def test_the_chunked_mask_refuses_exactly_what_one_llama_cpp_call_refuses(model):
    from llamaspec.backend.grammar import JSON_OBJECT_GBNF, Grammar, json_schema_gbnf

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name"]}
    for gbnf in (JSON_OBJECT_GBNF, json_schema_gbnf(schema)):
        state = Grammar.compile(model, gbnf)
        for text in ('{"', 'name', '": "ab', 'c", "n": 1'):
            row = np.zeros(model.n_vocab, np.float32)
            state.mask(row)
            assert np.array_equal(np.isneginf(row), one_call_mask(state, model.n_vocab))
            for token in model.tokenize(text, add_special=False, parse_special=False):
                assert state.allows(token)
                state.accept(token)


def test_an_ambiguous_grammar_is_refused_within_about_its_budget(model):
    from llamaspec.backend.grammar import MASK_BUDGET_S, Grammar, GrammarCostError

    start = time.monotonic()
    with pytest.raises(GrammarCostError, match="too ambiguous") as caught:
        Grammar.compile(model, AMBIGUOUS, "grammar")
    assert time.monotonic() - start < 4 * MASK_BUDGET_S   # minutes a row before
    assert caught.value.param == "grammar"


def test_a_costly_state_deep_in_the_reply_is_stopped_by_the_row_budget(model):
    """The trial sees a cheap start (a literal must come first); the mask of the costly state after it stops
    within about the budget instead of running for minutes inside one llama.cpp call."""
    from llamaspec.backend.grammar import MASK_BUDGET_S, Grammar, GrammarCostError

    grammar = Grammar.compile(model, 'root ::= "qqq " ' + AMBIGUOUS[len("root ::= "):])
    for token in model.tokenize("qqq ", add_special=False, parse_special=False):
        grammar.accept(token)
    start = time.monotonic()
    with pytest.raises(GrammarCostError):
        grammar.mask(np.zeros(model.n_vocab, np.float32))
    assert time.monotonic() - start < 4 * MASK_BUDGET_S


def test_long_runs_of_optional_items_are_refused_before_llama_cpp_sees_them(model):
    from llamaspec.backend.grammar import OPTIONAL_RUN_MAX, Grammar, GrammarCostError, optional_run

    assert optional_run("root ::= ( [a-z]* [a-z]? )* \"x\"{0,3} [a-z]{0,2} # [a-z]* [a-z]*\n") == 3
    assert optional_run('root ::= "[a-z]* [a-z]*" x') == 0   # inside a literal: not items
    start = time.monotonic()
    with pytest.raises(GrammarCostError, match="optional items"):
        Grammar.compile(model, "root ::= " + " ".join(["[a-z]*"] * 5000))   # minutes per token chunk before
    assert time.monotonic() - start < 0.5
    assert optional_run("root ::= " + " ".join(["[a-z]*"] * OPTIONAL_RUN_MAX)) == OPTIONAL_RUN_MAX


@pytest.mark.parametrize("schema,what", [
    ({"type": "string", "minLength": 100000000}, "minLength"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 10**9}}}, "maxLength"),
    ({"type": "string", "pattern": "^a{100000000}$"}, "pattern"),
    ({"type": "string", "pattern": "^(ab){3,}x{2,100000}$"}, "pattern"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 5000}, "minItems"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "minLength": 2000} for i in range(20)}},
     "add up to"),
])
def test_schema_counts_beyond_the_bound_are_refused_before_conversion(schema, what):
    from llamaspec.backend.grammar import json_schema_gbnf
    from llamaspec.errors import InvalidParameterError

    start = time.monotonic()
    with pytest.raises(InvalidParameterError, match=what) as caught:
        json_schema_gbnf(schema, "response_format")
    assert time.monotonic() - start < 0.1   # 39 s and 3.4 GB for minLength 100000000 before
    assert caught.value.param == "response_format"


def test_real_grammars_stay_within_the_bounds(model):
    """JSON, schema and forced tool-call grammars (the server's own) compile, trial included."""
    from llamaspec.backend.grammar import JSON_OBJECT_GBNF, Grammar, json_schema_gbnf
    from llamaspec.server.tools import forced_call_gbnf, forced_call_schema

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 200},
                                         "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}]
    grammars = [JSON_OBJECT_GBNF, json_schema_gbnf({"type": "string", "minLength": 2000}),
                json_schema_gbnf({"type": "string", "pattern": "^[a-z0-9._%+-]+@[a-z0-9.-]+[.][a-z]{2,}$"})]
    grammars += [forced_call_gbnf(json_schema_gbnf(forced_call_schema(tools, "required", f), "tools"), f)
                 for f in ("qwen", "hermes", "llama3", "mistral")]
    for gbnf in grammars:
        Grammar.compile(model, gbnf).close()


def test_grammar_text_is_bounded(model):
    from llamaspec.backend.grammar import GRAMMAR_MAX_CHARS, Grammar
    from llamaspec.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="characters long"):
        Grammar.compile(model, 'root ::= "' + "a" * GRAMMAR_MAX_CHARS + '"')
