"""llama.cpp's flags that `run`, `chat` and `serve` take as llama.cpp users type them (--repeat-penalty,
--grammar / -j, --no-mmap, --mlock, -ub, --chat-template-file, --jinja), each reaching what it sets, and chat's
progress line while a long prompt is read. On the tiny models."""
from __future__ import annotations

import json
import re

import llama_cpp
import pytest
from click.testing import CliRunner

from llamaspec.backend.model import load_mode
from llamaspec.cli import main
from llamaspec.cli.pair_choice import load_pair_from_options

N_CTX = ["-c", "512"]


def invoke(args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def pair_args(tiny_models):
    return ["-m", tiny_models["target"], "-md", tiny_models["draft"], *N_CTX]


def one_line_error(result, *fragments, code=None):
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    if code is not None:
        assert result.exit_code == code
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


# ---------------------------------------------------------------------------------------------------------------
# loading: --no-mmap, --mlock, -ub
# ---------------------------------------------------------------------------------------------------------------
def test_no_mmap_and_mlock_map_to_llama_cpps_load_modes():
    assert load_mode(True, False) == llama_cpp.LLAMA_LOAD_MODE_MMAP
    assert load_mode(False, False) == llama_cpp.LLAMA_LOAD_MODE_NONE
    assert load_mode(True, True) == llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK
    assert load_mode(False, True) == llama_cpp.LLAMA_LOAD_MODE_MLOCK


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_loading_flags_reach_the_config_of_both_models(command, monkeypatch, tmp_path):
    import llamaspec.loading

    seen = {}
    monkeypatch.setattr(llamaspec.loading, "load_pair", lambda target, draft, config: seen.setdefault("c", config))
    args = ["-m", tmp_path / "t.gguf", "-md", tmp_path / "d.gguf", "--no-mmap", "--mlock", "-ub", "64", "--jinja"]
    opts = main.commands[command].make_context(command, [str(a) for a in args]).params
    load_pair_from_options(opts)
    config = seen["c"]
    for model in (config.target, config.draft_config()):
        assert (model.use_mmap, model.use_mlock, model.n_ubatch) == (False, True, 64)
    defaults = main.commands[command].make_context(command, ["-m", str(tmp_path / "t.gguf")]).params
    seen.clear()
    load_pair_from_options(defaults)
    # llama-server's -b 2048 -ub 512 unless told otherwise
    assert (seen["c"].target.use_mmap, seen["c"].target.use_mlock, seen["c"].target.n_ubatch) == (True, False, 512)


def test_ubatch_reaches_the_llama_context_and_the_loaded_pair_runs(tiny_models):
    from llamaspec import load_pair

    with load_pair(tiny_models["target"], tiny_models["draft"], n_ctx=512, n_batch=64, n_ubatch=16, use_mmap=False,
                   no_repack=True) as pair:
        assert llama_cpp.llama_n_ubatch(pair.target_ctx._ptr) == 16
        assert llama_cpp.llama_n_batch(pair.target_ctx._ptr) == 64
        assert pair.generate("Hello there, how are", max_tokens=6).stats.tokens_generated == 6
    result = invoke(["run", *pair_args(tiny_models), "--no-mmap", "--mlock", "-ub", "32", "--jinja", "Hi", "-n", "4"])
    assert result.exit_code == 0, result.output


def test_a_ubatch_out_of_range_is_one_line_usage_error(tiny_models):
    one_line_error(invoke(["run", *pair_args(tiny_models), "-ub", "0", "Hi"]), "-ub", code=2)


# ---------------------------------------------------------------------------------------------------------------
# shaping: penalties, grammars, JSON schemas
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def streamed(monkeypatch):
    """The keyword arguments of every Pair.stream call."""
    from llamaspec.engine import Pair

    calls, original = [], Pair.stream

    def recording(self, prompt, **kwargs):
        calls.append(kwargs)
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(Pair, "stream", recording)
    return calls


def test_penalties_reach_the_request_in_run_and_chat(tiny_models, streamed):
    flags = ["--repeat-penalty", "1.3", "--repeat-last-n", "32", "--presence-penalty", "0.5",
             "--frequency-penalty", "0.25"]
    assert invoke(["run", *pair_args(tiny_models), *flags, "Hi", "-n", "4"]).exit_code == 0
    result = invoke(["chat", *pair_args(tiny_models), *flags, "-n", "4"], input="Hi\nAgain\n/exit\n")
    assert result.exit_code == 0, result.output
    assert len(streamed) == 3
    for kwargs in streamed:
        penalties = kwargs["shaping"].penalties
        assert (penalties.repeat, penalties.last_n, penalties.presence, penalties.frequency) == (1.3, 32, 0.5, 0.25)
    streamed.clear()
    assert invoke(["run", *pair_args(tiny_models), "Hi", "-n", "4"]).exit_code == 0
    assert streamed[0]["shaping"] is None      # nothing asked: the unshaped fast path


@pytest.mark.parametrize("value, fragment", [("0", "repeat_penalty"), ("nan", "repeat_penalty"), ("11", "[0.01, 10]")])
def test_a_bad_penalty_is_one_line_before_anything_loads(tmp_path, value, fragment):
    one_line_error(invoke(["run", "-m", tmp_path / "absent.gguf", "--repeat-penalty", value, "Hi"]), fragment,
                   code=2)


def test_grammar_inline_or_from_a_file_constrains_the_reply(tiny_models, tmp_path):
    grammar = 'root ::= "yes" | "no"'
    inline = json.loads(invoke(["run", *pair_args(tiny_models), "--grammar", grammar, "Well?", "-n", "8",
                                "--json"]).stdout)
    assert inline["text"] in ("yes", "no") and inline["finish_reason"] == "stop"
    (tmp_path / "g.gbnf").write_text(grammar, encoding="utf-8")
    from_file = json.loads(invoke(["run", *pair_args(tiny_models), "--grammar-file", tmp_path / "g.gbnf", "Well?",
                                   "-n", "8", "--json"]).stdout)
    assert from_file["text"] == inline["text"]


def test_json_schema_constrains_the_reply_to_valid_json(tiny_models, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    result = invoke(["run", *pair_args(tiny_models), "-j", json.dumps(schema), "Answer in JSON", "-n", "24",
                     "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    if data["finish_reason"] == "stop":
        assert set(json.loads(data["text"])) == {"ok"}
    else:   # cut by -n: still a prefix of such an object
        assert data["text"].startswith("{")
    (tmp_path / "s.json").write_text(json.dumps({"type": "boolean"}), encoding="utf-8")
    answer = json.loads(invoke(["run", *pair_args(tiny_models), "-jf", tmp_path / "s.json", "Yes or no?", "-n", "8",
                                "--json"]).stdout)
    assert answer["text"] in ("true", "false")


def test_bad_grammar_or_schema_is_one_line(tiny_models, tmp_path):
    one_line_error(invoke(["run", *pair_args(tiny_models), "--grammar", "root ::= (", "Hi"]), "--grammar", code=1)
    one_line_error(invoke(["run", *pair_args(tiny_models), "-j", "{not json", "Hi"]), "--json-schema", "not JSON",
                   code=2)
    one_line_error(invoke(["run", *pair_args(tiny_models), "-j", "[1]", "Hi"]), "--json-schema", code=2)
    one_line_error(invoke(["run", *pair_args(tiny_models), "--grammar-file", tmp_path / "none.gbnf", "Hi"]),
                   "none.gbnf", code=2)
    one_line_error(invoke(["run", *pair_args(tiny_models), "--grammar", 'root ::= "a"', "-j", "{}", "Hi"]),
                   "--grammar and --json-schema", code=2)


def test_chat_keeps_the_grammar_for_every_reply(tiny_models):
    result = invoke(["chat", *pair_args(tiny_models), "--grammar", 'root ::= "yes" | "no"', "-n", "8"],
                    input="One?\nTwo?\n/exit\n")
    assert result.exit_code == 0, result.output
    replies = [line.split("]")[-1].strip() for line in result.stdout.splitlines()
               if line.strip().endswith(("yes", "no"))]
    assert len(replies) == 2


# ---------------------------------------------------------------------------------------------------------------
# --chat-template-file
# ---------------------------------------------------------------------------------------------------------------
def test_chat_template_file_replaces_the_gguf_template(tiny_models, tmp_path):
    def prompt_tokens(*extra):
        result = invoke(["run", *pair_args(tiny_models), "Hi", "-n", "1", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["stats"]["prompt_tokens"]

    (tmp_path / "bare.jinja").write_text("{{ messages[0].content }}", encoding="utf-8")
    (tmp_path / "long.jinja").write_text("{% for m in messages %}" + "[turn] " * 20 + "{{ m.content }}{% endfor %}",
                                         encoding="utf-8")
    assert prompt_tokens("--chat-template-file", tmp_path / "bare.jinja") == prompt_tokens("--raw")
    assert prompt_tokens("--chat-template-file", tmp_path / "long.jinja") > prompt_tokens() + 20


def test_chat_template_file_reaches_the_server(tiny_models, tmp_path):
    pytest.importorskip("starlette", reason="the server extra is not installed")
    from llamaspec.server import ServerConfig, create_app

    (tmp_path / "t.jinja").write_text("<<{{ messages[-1].content }}>>", encoding="utf-8")
    opts = main.commands["serve"].make_context("serve", [str(a) for a in [*pair_args(tiny_models), "--no-repack",
                                                                          "--chat-template-file",
                                                                          tmp_path / "t.jinja"]]).params
    pair = load_pair_from_options(opts)
    try:
        app = create_app(pair, ServerConfig(model_id="t"))
        assert app.state.service.template.source == "<<{{ messages[-1].content }}>>"
        app.state.service.stop()
    finally:
        pair.close()


@pytest.mark.parametrize("content, fragment", [(b"{% for %}", "does not parse"), (b"\xff{{ x }}", "UTF-8")])
def test_bad_chat_template_file_is_one_line_naming_it(tiny_models, tmp_path, content, fragment):
    (tmp_path / "bad.jinja").write_bytes(content)
    one_line_error(invoke(["run", *pair_args(tiny_models), "--chat-template-file", tmp_path / "bad.jinja", "Hi"]),
                   "bad.jinja", fragment, code=1)


# ---------------------------------------------------------------------------------------------------------------
# chat: a long prefill is not a silent wait
# ---------------------------------------------------------------------------------------------------------------
def test_chat_shows_the_prompt_being_read_when_it_takes_long(tiny_models, monkeypatch):
    from llamaspec.cli import chat

    long_message = "word " * 300 + "\n"
    monkeypatch.setattr(chat, "PROGRESS_AFTER_S", 0.0)
    result = invoke(["chat", *pair_args(tiny_models), "-b", "32", "-n", "2"], input=long_message + "/exit\n")
    assert result.exit_code == 0, result.output
    counts = [int(n) for n in re.findall(r"\[reading the prompt: (\d+) tokens, \d+ tok/s\]",
                                                      result.stderr)]
    assert counts and counts == sorted(counts) and counts[0] == 32 and counts[-1] > 300
    assert result.stderr.endswith("]" + "\r" + " " * len(result.stderr.split("\r")[-2]) + "\r")   # then erased


def test_the_prompt_line_appears_after_a_second_and_only_until_the_first_token(capsys):
    from llamaspec.cli.chat import PrefillProgress

    class Ctx:
        on_decode = None

    ctx, now, followed = Ctx(), [0.0], []
    ctx.on_decode = lambda tokens, first: followed.append(len(tokens))   # an MTP head following the target
    with PrefillProgress(ctx, clock=lambda: now[0]) as progress:
        for t in (0.3, 0.9):
            now[0] = t
            ctx.on_decode([0] * 64, 0)
        assert capsys.readouterr().err == ""                 # under a second: nothing
        now[0] = 1.6
        ctx.on_decode([0] * 64, 128)
        assert capsys.readouterr().err == "\r[reading the prompt: 192 tokens, 120 tok/s]"
        progress.done()                                     # the first token
        ctx.on_decode([0] * 3, 192)                         # decodes of the reply: not the prompt
        assert capsys.readouterr().err == "\r" + " " * len("[reading the prompt: 192 tokens, 120 tok/s]") + "\r"
    assert followed == [64, 64, 64, 3]                      # the follower saw every decode
    assert ctx.on_decode is not None and ctx.on_decode([0], 0) is None and followed[-1] == 1   # and is back


def test_chat_load_says_how_many_tokens_the_next_reply_reads(tiny_models, tmp_path):
    saved = tmp_path / "c.json"
    saved.write_text(json.dumps({"system": None, "messages": [{"role": "user", "content": "word " * 50},
                                                              {"role": "assistant", "content": "ok"}]}))
    result = invoke(["chat", *pair_args(tiny_models), "-n", "2"], input=f"/load {saved}\n/exit\n")
    assert result.exit_code == 0, result.output
    assert f"[loaded 2 messages from {saved}]" in result.stdout
    tokens = int(re.search(r"\[(\d+) tokens, read before the next reply\]", result.stdout)[1])
    assert tokens > 50
