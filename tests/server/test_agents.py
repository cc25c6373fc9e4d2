"""What coding agents and scripts ask of the endpoint, with the official `openai` client against a real `serve` on
loopback and the real Qwen2.5-Coder 1.5B pair: a two-step tool round trip, JSON-schema output that validates,
log-probabilities equal to plain decoding's, and llama-server's `timings`. Greedy constrained speculation is also
held to greedy constrained plain decoding, token for token, in the library."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("starlette")

from support.servers import start_server  # noqa: E402

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                  "minItems": 1, "maxItems": 3}},
     "required": ["colours"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
     "required": ["ok", "score"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def real_server(real_models, tmp_path_factory):
    from conftest import REAL_DRAFT, REAL_TARGET

    models = {"target": real_models / REAL_TARGET, "draft": real_models / REAL_DRAFT}
    srv = start_server(models, tmp_path_factory.mktemp("agents") / "server.log", "--policy", "fixed",
                       "--draft-max", "4", draft="draft", n_ctx=2048)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="none", max_retries=0, timeout=600)


def test_tool_round_trip_with_the_official_client(client):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(model="x", messages=messages, tools=[WEATHER], max_tokens=64,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})}]
    final = client.chat.completions.create(model="x", messages=messages, tools=[WEATHER], max_tokens=48,
                                           temperature=0)
    answer = final.choices[0].message
    assert final.choices[0].finish_reason in ("stop", "length") and not answer.tool_calls
    assert "21" in answer.content


def test_streamed_forced_tool_call_arrives_as_tool_call_deltas(client):
    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather in Rome?"}],
                                            tools=[WEATHER], tool_choice="required", max_tokens=64, temperature=0,
                                            stream=True)
    names, arguments, finish, timings = [], "", None, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            names += [call.function.name] if call.function.name else []
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
        timings = (chunk.model_extra or {}).get("timings", timings)
    assert names == ["get_weather"] and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert timings["predicted_n"] > 0 and "draft_n" in timings


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "colours", "score"])
def test_every_json_schema_reply_parses_and_validates(client, schema, seed):
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Reply with an example JSON object."}], max_tokens=96,
        temperature=0.8, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_mode_returns_an_object(client):
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "A JSON object, please."}],
                                       max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_logprobs_and_timings_come_back(client):
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Count to five."}],
                                       max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:   # greedy: the emitted token is the best of its row
        assert c.logprob <= 0 and c.top_logprobs[0].token == c.token and len(c.top_logprobs) == 3
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == r.usage.completion_tokens and timings["prompt_n"] > 0


def test_greedy_constrained_speculation_equals_constrained_plain_decoding(real_models):
    from conftest import REAL_DRAFT, REAL_TARGET

    from llamaspec.backend.grammar import Grammar, json_schema_gbnf
    from llamaspec import load_pair
    from llamaspec.policy import make_policy
    from llamaspec.shaping import Penalties, Shaping

    gbnf = json_schema_gbnf(SCHEMAS[0])
    prompt = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
    with load_pair(str(real_models / REAL_TARGET), str(real_models / REAL_DRAFT), n_ctx=512, n_threads=2) as pair:
        def run(policy):
            pair.set_policy(make_policy("fixed", draft_max=4 if policy == "fixed" else 0))
            pair.reset()
            shaping = Shaping(Grammar.compile(pair.target, gbnf), Penalties(repeat=1.1), top_logprobs=0)
            out = pair.generate(prompt, max_tokens=64, shaping=shaping)
            return out, [x.logprob for x in shaping.logprobs], pair.last_stats

        plain, plain_lp, _ = run("none")
        spec, spec_lp, stats = run("fixed")
    assert stats.drafted > 0
    assert spec.tokens == plain.tokens
    jsonschema.validate(json.loads(spec.text), SCHEMAS[0])
    # the same rows, batched or one by one: equal up to the backend's rounding
    assert spec_lp == pytest.approx(plain_lp, abs=0.3)
