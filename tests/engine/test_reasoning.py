"""Thinking models: `--reasoning on|off` (the template's enable_thinking), the <think> part apart from the answer in
`pair.chat`, `chat`, `run` and the server (`reasoning_content`, streamed too, `chat_template_kwargs`), and the
tokens generated unchanged by any of it."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llamaspec.chat_template import ChatTemplate
from llamaspec.conversation import chat, chat_prompt
from llamaspec.reasoning import ThinkSplitter, opens_thinking, split_reply, template_kwargs
from llamaspec.text import Piece

# Qwen3.5-style: thinking opens <think> in the prompt; enable_thinking=false closes an empty block there
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                  "{% else %}<think>\n{% endif %}{% endif %}")
REPLY = "<think>\nThe user wants 2+2.\nIt is 4.\n</think>\n\nThe answer is 4."


def test_a_tag_cut_anywhere_splits_the_same_as_the_whole_reply():
    whole = split_reply(REPLY)
    assert whole == ("The user wants 2+2.\nIt is 4.", "The answer is 4.")
    for cut in range(1, len(REPLY)):
        for second in (cut + 1, cut + 3, len(REPLY)):
            splitter = ThinkSplitter()
            parts = [*splitter.feed(REPLY[:cut]), *splitter.feed(REPLY[cut:second]), *splitter.feed(REPLY[second:]),
                     *splitter.flush()]
            reasoning = "".join(p.text for p in parts if p.kind == "reasoning").strip()
            content = "".join(p.text for p in parts if p.kind == "content")
            assert (reasoning, content) == whole, (cut, second)


def test_a_reply_that_starts_inside_the_prompts_think_block_and_later_tags_are_text():
    assert split_reply("I think 4.</think>\n\n4 <think>x</think>", starts_inside=True) == (
        "I think 4.", "4 <think>x</think>")
    assert split_reply("No thinking here.") == ("", "No thinking here.")
    assert split_reply("Answer with <think> inside") == ("", "Answer with <think> inside")


def test_reasoning_switch_sets_the_templates_enable_thinking():
    template = ChatTemplate(THINK_TEMPLATE)
    messages = [{"role": "user", "content": "2+2?"}]
    on = template.render(messages, **template_kwargs("on"))
    off = template.render(messages, **template_kwargs("off"))
    auto = template.render(messages, **template_kwargs("auto"))
    assert opens_thinking(on) and opens_thinking(auto) and not opens_thinking(off)
    assert off.endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError):
        template_kwargs("maybe")


class ScriptedPair:
    """Just what llamaspec.conversation uses: the target's template, tokenize, and a stream of crafted pieces."""

    def __init__(self, template: str, pieces: list[str]):
        self.target = SimpleNamespace(info=SimpleNamespace(chat_template=template, tokens=(), bos_id=None,
                                                           eos_id=None))
        self.pieces, self.rendered = pieces, []
        self.last_stats = None

    def tokenize(self, text, add_special=True):
        self.rendered.append(text)
        return [1, 2, 3]

    def stream(self, tokens, **kwargs):
        self.last_stats = SimpleNamespace(finish_reason="stop")
        return (Piece(text, i, False) for i, text in enumerate(self.pieces))


def test_pair_chat_gives_the_thinking_apart_with_tags_cut_across_tokens():
    pair = ScriptedPair(THINK_TEMPLATE, ["Let me", " add.</th", "ink>", "\n\n", "4", "."])
    reply = chat(pair, [{"role": "user", "content": "2+2?"}])
    assert (reply.reasoning, reply.content, reply.finish_reason) == ("Let me add.", "4.", "stop")
    assert pair.rendered[-1].endswith("<think>\n")
    off = chat(ScriptedPair(THINK_TEMPLATE, ["4."]), [{"role": "user", "content": "2+2?"}], reasoning="off")
    assert (off.reasoning, off.content) == ("", "4.")


# ---------------------------------------------------------------------------------------------------------------
# A real tiny pair: the same tokens, split differently
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking_pair(tiny_models):
    from llamaspec import load_pair

    pair = load_pair(str(tiny_models["target"]), str(tiny_models["draft"]), n_ctx=512, n_threads=1)
    pair._chat_template = ChatTemplate(THINK_TEMPLATE)
    yield pair
    pair.close()


def test_pair_chat_reasons_over_the_same_tokens_and_reuses_the_cache(thinking_pair):
    pair = thinking_pair
    messages = [{"role": "user", "content": "Say something."}]
    tokens, inside = chat_prompt(pair, messages)
    assert inside
    plain = pair.generate(tokens, max_tokens=12).text   # the model never writes </think>: all of it is thinking
    reply = pair.chat(messages, max_tokens=12)
    assert reply.content == "" and reply.reasoning == plain.strip()
    off = pair.chat(messages, reasoning="off", max_tokens=12)
    assert off.reasoning == "" and off.content == pair.generate(chat_prompt(pair, messages, "off")[0],
                                                                max_tokens=12).text.lstrip()
    follow_up = [*messages, {"role": "assistant", "content": off.content}, {"role": "user", "content": "More."}]
    before = chat_prompt(pair, messages, "off")[0]
    after = chat_prompt(pair, follow_up, "off")[0]
    shared = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(before))
    pair.chat(follow_up, reasoning="off", max_tokens=4)
    assert shared > 5 and pair.last_stats.prompt_tokens_cached >= shared - 1   # only the new turn is prefilled
    parts = list(pair.chat_stream(messages, max_tokens=12))
    assert {p.kind for p in parts} == {"reasoning"} and "".join(p.text for p in parts).strip() == plain.strip()


def test_server_returns_reasoning_content_streamed_too_and_honours_chat_template_kwargs(thinking_pair):
    from starlette.testclient import TestClient

    from llamaspec.server import ServerConfig, create_app

    app = create_app(thinking_pair, ServerConfig(model_id="tiny"))
    service = app.state.service
    service.template = service.worker.template = ChatTemplate(THINK_TEMPLATE)
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12, "temperature": 0}
    with TestClient(app, base_url="http://localhost") as client:
        thinking = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert thinking["content"] == "" and thinking["reasoning_content"]
        events = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json={**body, "stream": True})
                  .text.splitlines() if line.startswith("data: {")]
        streamed = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events if e["choices"])
        assert streamed.strip() == thinking["reasoning_content"]
        answer = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}}
                             ).json()["choices"][0]["message"]
        assert "reasoning_content" not in answer and answer["content"]
        bad = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"messages": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_serve_reasoning_is_the_servers_default_and_a_request_overrides_it(thinking_pair):
    from starlette.testclient import TestClient

    from llamaspec.server import ServerConfig, create_app

    app = create_app(thinking_pair, ServerConfig(model_id="tiny", reasoning="off"))
    service = app.state.service
    service.template = service.worker.template = ChatTemplate(THINK_TEMPLATE)
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12, "temperature": 0}
    with TestClient(app, base_url="http://localhost") as client:
        off = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert "reasoning_content" not in off and off["content"]
        on = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": True}}
                         ).json()["choices"][0]["message"]
        assert on["content"] == "" and on["reasoning_content"]


def test_serve_reasoning_flag_reaches_the_server(thinking_pair, monkeypatch):
    import sys

    from click.testing import CliRunner

    import llamaspec.server
    from llamaspec.cli import main

    class Unclosed:   # the module's pair outlives the command
        def __getattr__(self, name):
            return getattr(thinking_pair, name)

        def close(self):
            pass

    served = []
    monkeypatch.setattr(sys.modules["llamaspec.cli.serve"], "load_pair_from_options", lambda opts, **kw: Unclosed())
    monkeypatch.setattr(llamaspec.server, "serve", lambda app, sock, **kw: (served.append(app), sock.close()))
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--reasoning" in help_text
    assert "chat_template_kwargs.enable_thinking overrides" in " ".join(help_text.split())
    for flag, expected in ((["--reasoning", "off"], {"enable_thinking": False}),
                           (["-rea", "on"], {"enable_thinking": True}), ([], {})):
        result = CliRunner().invoke(main, ["serve", "-m", "x.gguf", "--port", "0", *flag])
        assert result.exit_code == 0, result.output
        assert served.pop().state.service.worker.template_defaults == expected
