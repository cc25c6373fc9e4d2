"""The server's request fields, tool-call syntaxes, `timings` and llama.cpp-named metrics, without a model: crafted
model outputs for each tool-call family, bodies for the validation, GenerationStats for the figures."""
from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from llamaspec.server.apierror import APIError  # noqa: E402
from llamaspec.server.formats import ResponseFormat  # noqa: E402
from llamaspec.server.metrics import ServerMetrics  # noqa: E402
from llamaspec.server.timings import timings  # noqa: E402
from llamaspec.server.tools import (ToolStream, family_of, forced_call_gbnf, forced_call_schema,  # noqa: E402
                                    parse_tool_calls)
from llamaspec.server.validation import parse_chat, parse_completion  # noqa: E402
from llamaspec.stats import GenerationStats  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# -- tool-call syntaxes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,text", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("gemma", '```tool_code\nget_weather(city="Oslo")\n```'),
    ("gemma", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
])
def test_each_family_syntax_parses_into_a_call(family, text):
    content, calls = parse_tool_calls(text, family)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert "tool_call" not in content and "get_weather" not in content


def test_several_calls_parse_in_order():
    hermes = "".join(f'<tool_call>\n{{"name": "f{i}", "arguments": {{"i": {i}}}}}\n</tool_call>\n' for i in range(3))
    llama = '{"name": "f0", "parameters": {"i": 0}}; {"name": "f1", "parameters": {"i": 1}}'
    assert [c.name for c in parse_tool_calls(hermes, "hermes")[1]] == ["f0", "f1", "f2"]
    assert [c.name for c in parse_tool_calls(llama, "llama3")[1]] == ["f0", "f1"]


@pytest.mark.parametrize("family,text", [
    ("hermes", "Plain text with {braces} and no call."),
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("llama3", '{"answer": 42}'),
    ("llama3", '{"name": "f", "parameters": {"a": 1}} and then prose'),
    ("gemma", "```tool_code\nimport os\n```"),
])
def test_text_that_only_looks_like_a_call_stays_text(family, text):
    content, calls = parse_tool_calls(text, family)
    assert calls == [] and content == text


def test_family_is_told_by_the_template():
    assert family_of("{% if tools %}<tool_call>{% endif %}<|im_start|>") == "hermes"
    assert family_of("<|start_header_id|>ipython<|end_header_id|><|eom_id|>") == "llama3"
    assert family_of("<start_of_turn>user\n") == "gemma"


@pytest.mark.parametrize("family", ["hermes", "llama3", "gemma"])
def test_streamed_text_before_a_call_is_sent_and_the_call_is_held(family):
    call = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            "gemma": '```tool_code\nget_weather(city="Oslo")\n```'}[family]
    prefix = "" if family == "llama3" else "Checking. "
    stream, sent = ToolStream(family), ""
    for i in range(0, len(prefix + call), 3):
        sent += stream.push((prefix + call)[i:i + 3])
    assert sent == prefix.rstrip(" ") or sent == prefix
    rest, calls = stream.finish()
    assert [c.name for c in calls] == ["get_weather"]
    assert (sent + rest).strip() == prefix.strip()


def test_streamed_plain_text_is_not_held_back():
    stream = ToolStream("hermes")
    assert stream.push("Hello ") == "Hello "
    assert stream.push("world <tool") == "world "
    assert stream.push("s are fine") == "<tools are fine"
    assert stream.finish() == ("", [])


def test_forced_call_grammar_wraps_the_families_syntax():
    schema = forced_call_schema([WEATHER], {"name": "get_weather"}, "hermes")
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert "arguments" in schema["required"]
    assert "parameters" in forced_call_schema([WEATHER], "required", "llama3")["required"]
    gbnf = forced_call_gbnf('root ::= "{" x "}"\nx ::= "a"\n', "hermes")
    assert 'call ::= "{" x "}"' in gbnf and 'root ::= "<tool_call>\\n" call "\\n</tool_call>"' in gbnf


def test_chat_response_carries_tool_calls_and_finish_reason():
    fmt = ResponseFormat(True, "m", "hermes")
    stats = GenerationStats(finish_reason="stop", tokens_generated=5, prompt_tokens=3)
    body = fmt.full('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', stats)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


# -- request fields --------------------------------------------------------------------------------------------
def _error(parse, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("field,value", [("some_future_field", 1), ("grammar_lazy", True), ("dry_multiplier", 0.5)])
def test_unknown_fields_are_refused_naming_them(field, value):
    assert _error(parse_chat, {"messages": MESSAGES, field: value}).param == field
    assert _error(parse_completion, {"prompt": "x", field: value}).param == field


@pytest.mark.parametrize("field,value", [("mirostat", 2), ("n", 3), ("top_logprobs", 2), ("repeat_penalty", 0),
                                         ("presence_penalty", 3), ("logit_bias", {"x": 1}), ("grammar", 5),
                                         ("response_format", {"type": "xml"}), ("tool_choice", "required"),
                                         ("tool_choice", {"type": "function", "function": {"name": "nope"}}),
                                         ("tools", [{"type": "function"}]), ("chat_template_kwargs", {"tools": 1}),
                                         ("logprobs", 3)])
def test_bad_values_are_refused_naming_the_field(field, value):
    error = _error(parse_chat, {"messages": MESSAGES, field: value})
    assert error.param.split("[")[0] == field


def test_llama_server_extras_and_openai_fields_are_read():
    req = parse_chat({"messages": MESSAGES, "repeat_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.5,
                      "frequency_penalty": 0.1, "seed": 3, "n_probs": 2, "cache_prompt": True, "mirostat": 0,
                      "chat_template_kwargs": {"enable_thinking": False}, "logit_bias": {"5": -100},
                      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                                 "schema": {"type": "object"}}},
                      "user": "u", "metadata": {}, "parallel_tool_calls": True})
    x = req.extras
    assert x.penalties == {"repeat": 1.1, "last_n": 32, "presence": 0.5, "frequency": 0.1}
    assert x.top_logprobs == 2 and x.logit_bias == {5: -100.0} and x.json_schema == {"type": "object"}
    assert req.template_vars == {"enable_thinking": False}
    assert req.sampling["seed"] == 3
    assert parse_chat({"messages": MESSAGES, "response_format": {"type": "json_object"}}).extras.json_schema == \
        {"type": "object"}
    assert parse_chat({"messages": MESSAGES, "logprobs": True, "top_logprobs": 4}).extras.top_logprobs == 4
    assert parse_chat({"messages": MESSAGES, "logprobs": False}).extras.top_logprobs is None
    assert parse_completion({"prompt": "x", "logprobs": 0}).extras.top_logprobs == 0


def test_tool_messages_reach_the_template_with_parsed_arguments():
    req = parse_chat({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": [WEATHER], "tool_choice": "auto"})
    assistant, tool = req.prompt[1], req.prompt[2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and assistant["content"] == ""
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert req.extras.tool_choice == "auto" and req.extras.tools[0]["function"]["name"] == "get_weather"


# -- timings and metrics -----------------------------------------------------------------------------------------
def _stats() -> GenerationStats:
    s = GenerationStats(policy="auto", prompt_tokens=100, prompt_tokens_cached=40, tokens_generated=21,
                        target_passes=8, drafted=20, accepted=13, time_prefill=0.59, time_to_first_token=0.7,
                        time_total=2.69, finish_reason="stop")
    s.accepted_lengths = Counter({0: 2, 1: 1, 3: 2, 4: 1})
    return s


def test_timings_have_llama_servers_names_and_meaning():
    t = timings(_stats())
    assert t["cache_n"] == 40 and t["prompt_n"] == 60
    # the prefill decoded 59 of the 60 (the first verification decodes the last with the first draft)
    assert t["prompt_ms"] == pytest.approx(590) and t["prompt_per_second"] == pytest.approx(100)
    assert t["prompt_per_token_ms"] == pytest.approx(10)
    # generation: from the end of the prefill, every token's work included
    assert t["predicted_n"] == 21 and t["predicted_ms"] == pytest.approx(2100)
    assert t["predicted_per_token_ms"] == pytest.approx(100) and t["predicted_per_second"] == pytest.approx(10)
    assert (t["draft_n"], t["draft_n_accepted"]) == (20, 13)
    assert t["draft_acceptance"] == pytest.approx(0.65) and t["policy"] == "auto"
    plain = timings(GenerationStats(prompt_tokens=5, tokens_generated=1, time_prefill=0.08, time_to_first_token=0.1,
                                    time_total=0.1))
    assert "draft_n" not in plain and plain["predicted_per_second"] == pytest.approx(50)


def test_a_reply_that_ends_in_its_first_step_reports_that_steps_rate():
    """Four tokens from one verification of 120 ms after a 400 ms prefill; the reply ends 0.3 ms after its first
    token. The rate is the step's (4 / 0.12 s), not one from the 0.3 ms after the first token."""
    s = GenerationStats(policy="fixed", prompt_tokens=11, tokens_generated=4, target_passes=1, drafted=3, accepted=3,
                        time_prefill=0.4, time_to_first_token=0.52, time_total=0.5203, finish_reason="length")
    t = timings(s)
    assert t["predicted_n"] == 4 and t["predicted_ms"] == pytest.approx(120.3)
    assert t["predicted_per_second"] == pytest.approx(4 / 0.1203)
    assert t["predicted_per_token_ms"] == pytest.approx(120.3 / 4)
    assert t["prompt_ms"] == pytest.approx(400) and t["prompt_per_second"] == pytest.approx(10 / 0.4)


def test_a_rate_is_zero_where_its_span_decoded_nothing():
    cached = timings(GenerationStats(prompt_tokens=30, prompt_tokens_cached=29, tokens_generated=3,
                                     time_prefill=0.0002, time_to_first_token=0.05, time_total=0.15))
    assert cached["prompt_n"] == 1 and cached["prompt_per_second"] == 0.0 and cached["prompt_per_token_ms"] == 0.0
    assert cached["predicted_per_second"] == pytest.approx(3 / 0.1498)
    before_any = timings(GenerationStats(prompt_tokens=30, time_total=0.2, finish_reason="cancelled"))
    assert before_any["predicted_n"] == 0 and before_any["predicted_ms"] == 0.0
    assert before_any["predicted_per_second"] == 0.0 and before_any["prompt_ms"] == pytest.approx(200)


def test_metrics_carry_llama_cpps_speculative_counters():
    m = ServerMetrics(lambda: {}, lambda: (0, 0))
    m.record_generation(_stats())
    text = m.render().decode()
    assert "llamacpp:spec_decode_num_draft_tokens_total 20.0" in text
    assert "llamacpp:spec_decode_num_accepted_tokens_total 13.0" in text
    assert "llamacpp:spec_decode_num_drafts_total 6.0" in text
    # position i: drafts with more than i accepted (lengths 0,0,1,3,3,4)
    for position, n in enumerate([4, 3, 3, 1]):
        assert f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}} {n:.1f}' in text


def test_a_streamed_hermes_call_is_announced_once_its_name_is_complete_and_its_arguments_follow_at_its_end():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    stream, sent, announced = ToolStream("hermes"), "", []
    for i in range(0, len(call), 2):
        sent += stream.push(call[i:i + 2])
        got = stream.announce()
        announced += [(i, index, c.name) for index, c in got]
    (at, index, name), = announced
    assert (index, name) == (0, "get_weather") and call.index('"get_weather"') < at < call.index('"arguments": {')
    rest, calls = stream.finish()
    assert sent == "" and rest == "" and calls == stream.opened and calls[0].id == stream.opened[0].id
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_announced_calls_pair_with_their_blocks_and_a_cut_one_keeps_empty_arguments():
    text = ('Two calls. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y": ')
    stream = ToolStream("hermes")
    sent = stream.push(text)
    assert [(i, c.name) for i, c in stream.announce()] == [(0, "a"), (1, "b")] and stream.announce() == []
    rest, calls = stream.finish()
    assert (sent + rest).strip() == "Two calls." and [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'),
                                                                                                ("b", "")]
    late = ToolStream("hermes")   # "arguments" before "name": not announced, parsed whole at the end
    late.push('<tool_call>\n{"arguments": {"x": 1}, "name": "a"}\n</tool_call>')
    assert late.announce() == [] and [c.name for c in late.finish()[1]] == ["a"]


def test_the_event_stream_sends_a_calls_name_before_its_arguments_are_generated():
    """EventStream over a scripted job: the delta with the call's id and name goes out right after the piece that
    completes the name, before the rest of the call is generated; the arguments follow under the same index."""
    import asyncio
    from types import SimpleNamespace

    from llamaspec.server.formats import EventStream

    pieces = ['Checking.\n<tool_call>\n{"name": "get_wea', 'ther", "argu', 'ments": {"city": ', '"Oslo"}}\n</tool_call>']

    async def run():
        events = asyncio.Queue()
        job = SimpleNamespace(events=events, request=SimpleNamespace(include_usage=False, prompt_field="messages",
                                                                     extras=SimpleNamespace(top_logprobs=None)))
        sent, seen_pieces = [], []

        async def send(message):
            body = message.get("body", b"").decode()
            for line in body.splitlines():
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    sent.append((len(seen_pieces), json.loads(line[6:])))

        async def feed():
            for piece in pieces:
                seen_pieces.append(piece)
                await events.put(("text", piece))
                await asyncio.sleep(0.01)
            await events.put(("done", GenerationStats(finish_reason="stop", tokens_generated=20, prompt_tokens=3)))

        never = asyncio.ensure_future(asyncio.sleep(30))
        stream = EventStream(job, ResponseFormat(True, "m", "hermes"), never, lambda: None)
        await asyncio.gather(stream._pump(send), feed())
        never.cancel()
        return sent

    sent = asyncio.run(run())
    calls = [(n, d["choices"][0]["delta"]["tool_calls"]) for n, d in sent
             if d["choices"] and d["choices"][0]["delta"].get("tool_calls")]
    (n_first, first), (n_last, last) = calls
    assert n_first == 2 and first == [{"index": 0, "id": first[0]["id"], "type": "function",
                                       "function": {"name": "get_weather", "arguments": ""}}]
    assert n_last == len(pieces) and last == [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]
    text = "".join(d["choices"][0]["delta"].get("content") or "" for _, d in sent if d["choices"])
    assert text.strip() == "Checking." and sent[-1][1]["choices"][0]["finish_reason"] == "tool_calls"
