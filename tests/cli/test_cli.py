"""The command line (chat, run, bench, check, doctor) through click's CliRunner, on the tiny models.

The tiny models produce random text; these tests check behaviour (exit codes, one-line errors, JSON shapes,
cache reuse, lossless output), never the text itself.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner
from support.paths import REPO

from llamaspec import sysinfo
from llamaspec.backend import supports_gpu_offload
from llamaspec.cli import main
from llamaspec.config import ModelConfig
from llamaspec.gguf.reader import read_model_info
from llamaspec.gguf.memory import Settings, kv_bytes_per_element, kv_cache_bytes, plan_memory
from llamaspec.bench.prompts import PROMPT_SETS

N_CTX = ["-c", "512"]


def invoke(args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def pair_args(tiny_models, draft="draft"):
    return ["-m", tiny_models["target"], "-md", tiny_models[draft], *N_CTX]


def assert_one_line_error(result, *fragments, code=None):
    assert result.exit_code != 0, result.output
    if code is not None:
        assert result.exit_code == code
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


# ---------------------------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------------------------
def test_help_lists_every_command():
    result = invoke(["--help"])
    assert result.exit_code == 0
    for name in ("chat", "run", "bench", "check", "doctor"):
        assert re.search(rf"^\s+{name}\s", result.output, re.M), name


def test_run_prints_generated_text(tiny_models):
    result = invoke(["run", *pair_args(tiny_models), "Hello there", "-n", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


@pytest.mark.slow
def test_run_json_has_text_finish_reason_and_stats(tiny_models):
    result = invoke(["run", *pair_args(tiny_models), "Hello there", "-n", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert isinstance(data["text"], str) and data["finish_reason"] == "length"
    assert data["stats"]["tokens_generated"] == 8
    assert {"acceptance_rate", "mean_accepted_length", "tokens_per_second", "time_to_first_token"} <= set(data["stats"])


@pytest.mark.slow
def test_run_greedy_text_is_the_same_with_and_without_draft(tiny_models):
    args = ["run", "-m", tiny_models["target"], *N_CTX, "def quicksort(arr):", "-n", "24", "--json"]
    plain = json.loads(invoke([*args, "--no-draft"]).stdout)
    spec = json.loads(invoke([*args, "-md", tiny_models["noisy"], "--policy", "fixed", "--draft-max", "3"]).stdout)
    assert spec["stats"]["drafted"] > 0 and plain["stats"]["drafted"] == 0
    assert spec["text"] == plain["text"]


@pytest.mark.slow
def test_run_reads_the_same_prompt_from_argument_file_and_stdin(tiny_models, tmp_path):
    prompt = "The history of the printing press"
    (tmp_path / "p.txt").write_text(prompt, encoding="utf-8")
    base = ["run", *pair_args(tiny_models), "-n", "6", "--json"]
    texts = {json.loads(invoke([*base, prompt]).stdout)["text"],
             json.loads(invoke([*base, "-f", tmp_path / "p.txt"]).stdout)["text"],
             json.loads(invoke([*base, "-"], input=prompt).stdout)["text"]}
    assert len(texts) == 1


@pytest.mark.slow
def test_run_answers_with_the_chat_template_and_raw_continues_the_text(tiny_models):
    base = ["run", *pair_args(tiny_models), "Hi", "-n", "2", "--json"]
    raw = json.loads(invoke([*base, "--raw"]).stdout)["stats"]["prompt_tokens"]
    default = json.loads(invoke(base).stdout)["stats"]["prompt_tokens"]
    system = "Answer in one short sentence, plainly, without any lists, headings or code."
    templated = json.loads(invoke([*base, "-sys", system]).stdout)["stats"]["prompt_tokens"]
    assert default > raw + 3   # <|im_start|>user ... <|im_start|>assistant: the instruct model is answered
    assert templated > default + 3   # the system message given as llama.cpp's -sys (not -s ys)
    assert json.loads(invoke(["run", *pair_args(tiny_models), "-p", "Hi", "-n", "2", "--json"]).stdout)[
        "stats"]["prompt_tokens"] == default
    assert_one_line_error(invoke([*base, "--raw", "--chat"]), "--raw", code=2)


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line on stderr, non-zero exit, no traceback
# ---------------------------------------------------------------------------------------------------------------
def test_unknown_flag_is_one_line_usage_error(tiny_models):
    assert_one_line_error(invoke(["run", *pair_args(tiny_models), "--no-such-flag", "x"]), "--no-such-flag", code=2)


def test_bad_value_is_one_line_usage_error(tiny_models):
    result = invoke(["run", "-m", tiny_models["target"], "-c", "lots", "x"])
    assert_one_line_error(result, "lots", code=2)


def test_missing_model_file_is_one_line_error(tmp_path):
    assert_one_line_error(invoke(["run", "-m", tmp_path / "nope.gguf", "x"]), "nope.gguf", code=1)


def test_incompatible_pair_is_one_line_error(tiny_models):
    result = invoke(["run", *pair_args(tiny_models, draft="other"), "x"])
    assert_one_line_error(result, "cannot speculate", code=1)


def test_unreadable_prompt_file_is_one_line_error(tiny_models, tmp_path):
    assert_one_line_error(invoke(["run", *pair_args(tiny_models), "-f", tmp_path / "missing.txt"]), "missing.txt")
    bad = tmp_path / "binary.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    assert_one_line_error(invoke(["run", *pair_args(tiny_models), "-f", bad]), "binary.txt")


def test_stdin_that_is_not_utf8_is_one_line_error_naming_the_byte(tiny_models):
    result = invoke(["run", "-m", tiny_models["target"], "-n", "1", "-"], input=b"hi \xff\n")
    assert_one_line_error(result, "stdin: not valid UTF-8: byte 0xff at offset 3", code=1)


def test_prompt_file_that_is_not_utf8_names_the_byte(tiny_models, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 ok".encode("latin-1"))
    result = invoke(["run", "-m", tiny_models["target"], "-n", "1", "-f", bad])
    assert_one_line_error(result, "latin1.txt: not valid UTF-8: byte 0xe9 at offset 3", code=1)


@pytest.mark.parametrize("where", [[], ["--system"], ["--stop"]])
@pytest.mark.parametrize("text, fragment", [("hi \udcff", "byte 0xff at offset 3"),  # argv's undecodable byte
                                            ("x\ud800y", "lone surrogate U+D800 at offset 1")])
def test_argument_text_that_is_not_utf8_is_one_line_usage_error(tiny_models, where, text, fragment):
    args = [*where, text] + (["hi"] if where else [])
    result = invoke(["run", "-m", tiny_models["target"], "-n", "1", *args])
    assert_one_line_error(result, "not valid UTF-8", fragment, code=2)


def test_undecodable_argv_bytes_are_one_line_usage_error(tiny_models):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "llamaspec", "run", "-m", str(tiny_models["target"]), "-n", "1",
                             b"hi \xff"], capture_output=True, env=env, timeout=300)
    lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "byte 0xff at offset 3" in lines[0]


def test_run_help_says_what_it_does_with_input_that_is_not_utf8():
    assert "UTF-8" in invoke(["run", "--help"]).stdout


@pytest.mark.parametrize("template, fragment", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{{ 9**99999 }}", "9 ** 99999"),
    ("{{ 'x' * 10**9 }}", "1,000,000,000 items"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "did not finish"),
    ("{{ messages[0].content.nope() }}", "has no attribute 'nope'"),
])
def test_chat_template_that_fails_is_one_line_error(template, fragment, tmp_path):
    from support.gguf_crafted import STRING, tiny_llama

    model = tiny_llama().set("tokenizer.chat_template", STRING, template).write(tmp_path / "templated.gguf")
    result = invoke(["run", "-m", model, "--chat", "-n", "1", "hi"])
    assert_one_line_error(result, "chat template", fragment, code=1)


def test_prompt_longer_than_context_is_one_line_error(tiny_models):
    result = invoke(["run", "-m", tiny_models["target"], "-c", "256", "word " * 400])
    assert_one_line_error(result, "context", code=1)


def test_missing_prompt_is_one_line_usage_error(tiny_models):
    assert_one_line_error(invoke(["run", *pair_args(tiny_models)]), "no prompt", code=2)


@pytest.mark.parametrize("command", [["run", "hi"], ["chat"]])
def test_no_model_falls_back_to_the_default_pair(command, tmp_path, monkeypatch):
    """Without -m, chat and run use the registry's `default` pair; with no terminal to ask, they say how to get it."""
    for var in ("HF_HOME", "HF_HUB_CACHE", "LLAMASPEC_CONFIG_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_one_line_error(invoke(command), "'default'", code=1)


def test_debug_flag_shows_the_traceback(tmp_path):
    result = invoke(["run", "-m", tmp_path / "nope.gguf", "x", "--debug"])
    assert result.exit_code == 1 and "Traceback" in result.stderr


@pytest.mark.skipif(supports_gpu_offload(), reason="this llama-cpp-python build can offload to a GPU")
@pytest.mark.slow
def test_gpu_layers_on_a_cpu_build_warn_and_run_on_the_cpu(tiny_models):
    result = invoke(["run", *pair_args(tiny_models), "-ngl", "8", "Hello", "-n", "4"])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and "GPU" in result.stderr
    assert result.stdout.strip()


# ---------------------------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------------------------
CACHED = re.compile(r"first token [\d.]+ s \((\d+)/(\d+) prompt tokens cached\)")


@pytest.mark.slow
def test_chat_second_turn_reuses_the_cached_conversation(tiny_models):
    result = invoke(["chat", *pair_args(tiny_models), "-n", "8"], input="Hello\nTell me more\n/exit\n")
    assert result.exit_code == 0, result.output
    turns = [(int(a), int(b)) for a, b in CACHED.findall(result.stdout)]
    assert len(turns) == 2
    (cached1, prompt1), (cached2, prompt2) = turns
    assert cached1 == 0 and prompt2 > prompt1
    assert cached2 >= prompt1  # turn 2 prefills only what turn 1 did not leave in the cache
    assert "tok/s" in result.stdout and "acceptance" in result.stdout and "draft " in result.stdout


def test_chat_slash_commands_change_settings_and_save_json(tiny_models, tmp_path):
    saved = tmp_path / "conv.json"
    script = "\n".join(["/help", "/k 2", "/policy threshold", "/temp 0.5", "/temp hot", "/frobnicate", "Hi there",
                        "/stats", f"/save {saved}", "/reset", "/stats", "/exit"]) + "\n"
    result = invoke(["chat", *pair_args(tiny_models), "-n", "6", "--system", "You are terse."], input=script)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "/policy NAME" in out                         # /help
    assert "[draft length 2, fixed]" in out
    assert "[policy threshold" in out
    assert "[temperature 0.5]" in out and "usage: /temp X" in out
    assert "unknown command /frobnicate" in out
    assert "tokens_generated" in out and "acceptance_rate" in out   # /stats
    assert "[new conversation]" in out and "no reply yet" in out
    record = json.loads(saved.read_text())
    assert record["system"] == "You are terse." and record["sampler"]["temperature"] == 0.5
    assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
    assert record["messages"][0]["content"] == "Hi there"


def _user_pair(tiny_models, tmp_path, monkeypatch, **fields) -> str:
    """A pair in the user's models.toml over the tiny models, with these settings; returns its name."""
    monkeypatch.setenv("LLAMASPEC_CONFIG_DIR", str(tmp_path / "config"))
    (tmp_path / "config").mkdir()
    lines = ["[pairs.mine]", f'target_path = "{tiny_models["target"]}"', f'draft_path = "{tiny_models["draft"]}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    (tmp_path / "config" / "models.toml").write_text("\n".join(lines) + "\n")
    return "mine"


def test_chat_policy_command_keeps_the_pair_entrys_draft_max(tiny_models, tmp_path, monkeypatch):
    name = _user_pair(tiny_models, tmp_path, monkeypatch, n_ctx=512, draft_max=2, policy="fixed")
    result = invoke(["chat", "--pair", name, "-n", "4"], input="/policy confidence\n/policy fixed\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "[policy confidence, next draft length 2]" in result.stdout    # not confidence's own 8
    assert "[policy fixed, next draft length 2]" in result.stdout         # not fixed's own 4


def test_chat_end_of_input_exits_cleanly(tiny_models):
    result = invoke(["chat", *pair_args(tiny_models)], input="")
    assert result.exit_code == 0 and not result.stderr.strip()


@pytest.mark.slow
def test_chat_message_that_is_not_utf8_is_refused_and_the_session_goes_on(tiny_models):
    result = invoke(["chat", "-m", tiny_models["target"], *N_CTX, "-n", "2"], input=b"hi \xff\nhello\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("error: ") == 1 and "not valid UTF-8 (byte 0xff" in result.stderr
    assert "2 tokens" in result.stdout  # the next message got its reply


@pytest.mark.slow
def test_chat_reply_that_fills_the_context_says_so_and_offers_reset(tiny_models):
    # llama.cpp rounds contexts up to a multiple of 256: a long system prompt leaves room for ~30 tokens
    result = invoke(["chat", "-m", tiny_models["target"], "-c", "256", "--system", "word " * 220],
                    input="Hi\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "context is full" in result.stdout and "/reset" in result.stdout


def test_chat_message_longer_than_context_keeps_the_session(tiny_models):
    result = invoke(["chat", "-m", tiny_models["target"], "-c", "256", "-n", "2"],
                    input="word " * 300 + "\nHi\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "error:" in result.stderr and "/reset" in result.stdout
    assert len(CACHED.findall(result.stdout)) == 1    # the short message after it still gets a reply


@pytest.mark.slow
def test_chat_interrupted_reply_keeps_partial_text_and_a_consistent_cache(tiny_models):
    """Ctrl-C (KeyboardInterrupt) mid-reply: the partial reply stays in history, and the next turn generates
    exactly what a fresh pair generates for the same history."""
    from llamaspec import load_pair
    from llamaspec.cli.chat import ChatSession

    sampler = {"max_tokens": 12, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None}
    with load_pair(tiny_models["target"], tiny_models["noisy"], n_ctx=512, policy="fixed", draft_max=3,
                   no_repack=True) as pair:
        session = ChatSession(pair, None, dict(sampler))
        real_stream = pair.stream

        def interrupted_stream(*args, **kwargs):
            for i, piece in enumerate(real_stream(*args, **kwargs)):
                if i == 5:
                    raise KeyboardInterrupt
                yield piece

        pair.stream = interrupted_stream
        session.reply("Hello")
        pair.stream = real_stream
        assert pair.last_stats.finish_reason == "cancelled"
        assert [m["role"] for m in session.messages] == ["user", "assistant"] and session.messages[1]["content"]
        session.reply("Go on")
        continued = session.messages[-1]["content"]
    with load_pair(tiny_models["target"], tiny_models["noisy"], n_ctx=512, no_repack=True) as fresh:
        fresh_session = ChatSession(fresh, None, dict(sampler))
        fresh_session.messages = session.messages[:-1]
        assert fresh.generate(fresh_session.prompt_tokens(), max_tokens=12).text == continued


# ---------------------------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def quicksort(arr):"}\n\n{"prompt": "Hello, my name is"}\n', encoding="utf-8")
    return path


@pytest.mark.slow
def test_bench_json_schema(tiny_models, prompt_file):
    result = invoke(["bench", *pair_args(tiny_models, "noisy"), "--prompts", prompt_file, "-n", "8",
                     "--k", "1,3", "--policies", "auto,threshold", "--json", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"command", "target", "draft", "hardware", "prompts", "n_prompts", "max_tokens", "sampler",
            "results"} <= set(data)
    assert data["n_prompts"] == 2 and data["max_tokens"] == 8
    assert {"cpu", "cores", "threads", "gpus", "gpu_offload"} <= set(data["hardware"])
    assert data["target"]["path"].endswith("tiny-target.gguf") and data["draft"]["path"].endswith("tiny-noisy.gguf")
    assert [r["mode"] for r in data["results"]] == ["plain", "k=1", "k=3", "auto", "threshold"]
    fields = {"mode": str, "policy": str, "prompts": int, "tokens": int, "target_passes": int, "drafted": int,
              "accepted": int, "decode_seconds": float, "tokens_per_second": float, "mean_accepted_length": float,
              "mean_draft_len": float, "speedup": float, "same_output": int}
    for r in data["results"]:
        for name, kind in fields.items():
            assert isinstance(r[name], kind), (r["mode"], name)
        assert r["prompts"] == 2 and r["repeats"] == 2 and r["tokens"] == 2 * 16
        assert len(r["repeat_tokens_per_second"]) == 2 and r["tokens_per_second_min"] <= r["tokens_per_second_max"]
        assert r["same_output"] == 2           # greedy speculation is lossless
    plain, k1, k3 = data["results"][:3]
    assert plain["speedup"] == 1.0 and plain["drafted"] == 0 and plain["acceptance_rate"] is None
    assert plain["draft_len"] == 0 and k1["draft_len"] == 1 and k3["draft_len"] == 3
    assert 0.0 <= k3["acceptance_rate"] <= 1.0 and k3["drafted"] > 0


@pytest.mark.slow
def test_bench_table_shows_command_models_hardware_and_every_mode(tiny_models, prompt_file):
    result = invoke(["bench", *pair_args(tiny_models), "--prompts", prompt_file, "-n", "4", "--no-warmup"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for label in ("target:", "draft:", "hardware:", "CPU:", "threads used", "prompts:"):
        assert label in out
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    for column in ("draft len", "acceptance", "tok/pass", "tok/s", "speedup"):
        assert column in header
    assert re.search(r"^plain\s+0\s", out, re.M) and re.search(r"^k=4\s+4\s", out, re.M)
    assert re.search(r"^auto\s+<=12\s", out, re.M)


def test_bench_csv_has_a_header_and_one_row_per_mode(tiny_models, prompt_file):
    result = invoke(["bench", *pair_args(tiny_models), "--prompts", prompt_file, "-n", "4", "--k", "2", "--csv",
                     "--no-warmup", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("mode,policy,draft_len") and len(lines) == 3
    assert lines[1].startswith("plain,") and lines[2].startswith("k=2,fixed,2,")


@pytest.mark.slow
def test_bench_temperature_sweep_reports_each_mode_at_each_temperature(tiny_models, prompt_file):
    args = ["bench", *pair_args(tiny_models, "noisy"), "--prompts", prompt_file, "-n", "6", "--k", "2",
            "--temps", "0,0.8,1.5", "--top-k", "20", "--no-warmup", "--repeats", "1"]
    result = invoke(args + ["--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["temperatures"] == [0.0, 0.8, 1.5] and data["sampler"]["top_k"] == 20
    assert [(r["temperature"], r["mode"]) for r in data["results"]] == [
        (t, m) for t in (0.0, 0.8, 1.5) for m in ("plain", "k=2")]
    for r in data["results"]:
        assert r["tokens"] == 12 and (r["same_output"] is None) == (r["temperature"] > 0)
        assert r["verdict"] is None   # one repeat measures no noise
        if r["mode"] == "plain":
            assert r["speedup"] == 1.0  # against plain decoding at the same temperature
    table = invoke(args)
    assert table.exit_code == 0, table.output
    assert "temperatures 0, 0.8, 1.5" in table.stdout and "top_k 20" in table.stdout
    assert re.search(r"^temp\s+mode\s", table.stdout, re.M)
    assert re.search(r"^0\.8\s+k=2\s+2\s", table.stdout, re.M) and re.search(r"^1\.5\s+plain\s", table.stdout, re.M)


def test_bench_bad_temperature_list_is_one_line_error(tiny_models):
    assert_one_line_error(invoke(["bench", *pair_args(tiny_models), "--temps", "0,hot"]), "--temps", code=1)
    assert_one_line_error(invoke(["bench", *pair_args(tiny_models), "--temps", "0.8,-1"]), "--temps", code=1)


def test_builtin_prompt_sets_have_six_to_ten_prompts():
    assert set(PROMPT_SETS) == {"code", "prose", "grounded"}
    for name, prompts in PROMPT_SETS.items():
        assert 6 <= len(prompts) <= 10, name
        assert len(set(prompts)) == len(prompts)


@pytest.mark.parametrize("content, fragment", [('{"prompt": "ok"}\nnot json\n', ":2: not JSON"),
                                               ('{"text": "x"}\n', ':1: expected an object'), ("\n", "no prompts")])
def test_bench_malformed_prompt_file_is_one_line_error(tiny_models, tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    assert_one_line_error(invoke(["bench", *pair_args(tiny_models), "--prompts", path]), fragment, code=1)


def test_bench_bad_k_list_is_one_line_error(tiny_models):
    assert_one_line_error(invoke(["bench", *pair_args(tiny_models), "--k", "1,two"]), "--k", code=1)
    assert_one_line_error(invoke(["bench", *pair_args(tiny_models), "--policies", "auto,fixed"]), "fixed", code=1)


def test_bench_plot_without_matplotlib_says_how_to_install(tiny_models, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert_one_line_error(invoke(["bench", *pair_args(tiny_models), "--plot", "x.png"]),
                          "pip install 'llamaspec[plot]'", code=1)


def test_bench_plot_writes_a_png(tiny_models, prompt_file, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    out = tmp_path / "bench.png"
    result = invoke(["bench", *pair_args(tiny_models), "--prompts", prompt_file, "-n", "4", "--k", "1,2",
                     "--policies", "auto", "--no-warmup", "--plot", out])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = tmp_path / "sweep.png"  # against temperature
    result = invoke(["bench", *pair_args(tiny_models), "--prompts", prompt_file, "-n", "4", "--k", "2",
                     "--temps", "0,1", "--no-warmup", "--plot", sweep])
    assert result.exit_code == 0, result.output
    assert sweep.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------------------------
def test_check_compatible_pair_reports_every_field_and_a_memory_plan(tiny_models):
    result = invoke(["check", tiny_models["target"], tiny_models["draft"], "--vram", "24"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for field in ("vocabulary type", "pre-tokenizer", "add-BOS flag", "EOS token id", "vocabulary size", "token text"):
        assert re.search(rf"{field}.*\bOK\b", out), field
    assert "=> compatible" in out and "MISMATCH" not in out
    assert "weights" in out and "KV cache" in out and "compute" in out and "fits fully offloaded" in out


def test_check_pair_plans_with_the_entrys_context_unless_told(tiny_models, tmp_path, monkeypatch):
    name = _user_pair(tiny_models, tmp_path, monkeypatch, n_ctx=1024, cache_type_k="q8_0")
    result = invoke(["check", "--pair", name, "--vram", "24"])
    assert result.exit_code == 0, result.output
    assert "Memory plan: context 1024, KV cache q8_0/f16" in result.stdout    # not 4096 f16/f16
    result = invoke(["check", "--pair", name, "--vram", "24", "-c", "2048"])
    assert "Memory plan: context 2048, KV cache q8_0/f16" in result.stdout


def test_check_incompatible_pair_marks_the_mismatch_and_fails(tiny_models):
    result = invoke(["check", tiny_models["target"], tiny_models["other"]])
    assert result.exit_code == 1
    assert "MISMATCH" in result.stdout and "NOT compatible" in result.stdout
    assert_one_line_error(result, "cannot speculate")


def test_check_small_gpu_lists_options_that_fit(tiny_models):
    result = invoke(["check", tiny_models["target"], tiny_models["draft"], "--vram", "1.2", "-c", "65536",
                     "-fa", "off"])
    assert result.exit_code == 0, result.output
    assert "does not fit" in result.stdout and "fits with -c " in result.stdout


def test_check_takes_the_models_as_m_and_md_too(tiny_models):
    positional = invoke(["check", tiny_models["target"], tiny_models["draft"], "--vram", "24"])
    flags = invoke(["check", "-m", tiny_models["target"], "-md", tiny_models["draft"], "--vram", "24"])
    assert flags.exit_code == 0, flags.output
    assert flags.stdout == positional.stdout and "=> compatible" in flags.stdout
    assert_one_line_error(invoke(["check", tiny_models["target"], "-m", tiny_models["draft"]]), "-m/-md", code=2)


GiB = 2**30


@pytest.mark.parametrize("total, available, verdict", [
    (64 * GiB, 32 * GiB, "=> runs on the CPU; needs {} of RAM, this machine has 64.00 GiB (32.00 GiB available now)"),
    (GiB // 4, GiB // 8, "=> does not fit: needs {} of RAM, this machine has 256 MiB (128 MiB available now)")])
def test_check_without_a_gpu_plans_for_this_machines_ram(tiny_models, monkeypatch, total, available, verdict):
    monkeypatch.setattr(sysinfo, "nvidia_gpus", lambda *a, **k: [])
    monkeypatch.setattr(sysinfo, "total_ram_bytes", lambda: total)
    monkeypatch.setattr(sysinfo, "available_ram_bytes", lambda: available)
    result = invoke(["check", "-m", tiny_models["target"], "-md", tiny_models["draft"]])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "no GPU found: runs on the CPU" in out
    assert "24" not in out.split("Memory plan")[1] and "offloaded" not in out   # no GPU assumed
    need = re.search(r"needs (\S+ \S+) of RAM", out)[1]
    assert verdict.format(need) in out


def test_check_help_explains_every_option():
    cmd = main.commands["check"]
    assert [p.name for p in cmd.params if isinstance(p, click.Option) and not p.help and not p.hidden] == []


def test_check_missing_model_is_one_line_error(tmp_path):
    assert_one_line_error(invoke(["check", tmp_path / "missing.gguf"]), "missing.gguf", code=1)


def test_check_user_pair_naming_a_missing_file_is_one_line_error(tiny_models, tmp_path, monkeypatch):
    _user_pair({**tiny_models, "draft": tmp_path / "gone.gguf"}, tmp_path, monkeypatch)
    assert_one_line_error(invoke(["check", "--pair", "mine"]), "gone.gguf: no such model file", code=1)


@pytest.mark.parametrize("vram", ["nan", "inf", "-inf", "1e400"])
def test_check_vram_that_is_not_a_finite_number_is_one_line_usage_error(tiny_models, vram):
    assert_one_line_error(invoke(["check", tiny_models["target"], "--vram", vram]), "--vram", code=2)


def test_kv_bytes_per_element_follow_ggml_block_sizes():
    assert kv_bytes_per_element("f16") == 2 and kv_bytes_per_element("f32") == 4
    assert kv_bytes_per_element("q8_0") == 34 / 32 and kv_bytes_per_element("q4_0") == 18 / 32


def test_memory_plan_shrinks_with_a_quantized_kv_cache(tiny_models):
    info = read_model_info(tiny_models["target"])
    f16 = kv_cache_bytes(info, Settings(n_ctx=4096))
    assert f16 == 2 * info.n_layer * 4096 * info.n_head_kv * info.head_dim_k * 2
    assert kv_cache_bytes(info, Settings(n_ctx=4096, type_k="q8_0", type_v="q8_0")) == f16 * 34 // 64
    plan = plan_memory(info, info, Settings(n_ctx=4096), vram_bytes=10**12)
    assert plan.fits and plan.gpu_bytes > 2 * info.weights_bytes * 0.5


def _allocations(log: str) -> dict[str, float]:
    """MiB llama.cpp reports for the model, KV and compute buffers on the CPU."""
    def mib(pattern):
        return sum(float(x) for x in re.findall(pattern, log))
    return {"weights": mib(r"CPU(?:_Mapped)? model buffer size =\s+([\d.]+) MiB"),
            "kv": mib(r"CPU KV buffer size =\s+([\d.]+) MiB"),
            "compute": mib(r"CPU compute buffer size =\s+([\d.]+) MiB")}


def _measured(path, n_ctx, flash_attn):
    from llamaspec import backend

    model = backend.Model(path, ModelConfig(no_repack=True))
    weights = _allocations(model.load_log)["weights"]
    ctx = backend.Context(model, ModelConfig(n_ctx=n_ctx, flash_attn=flash_attn, n_threads=1))
    found = _allocations(ctx.load_log)
    ctx.close()
    model.close()
    return {**found, "weights": weights}


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_memory_estimate_matches_what_llama_cpp_allocates(tiny_models, flash_attn):
    from llamaspec.gguf.memory import MiB, model_memory

    info = read_model_info(tiny_models["target"])
    got = _measured(tiny_models["target"], 2048, flash_attn)
    est = model_memory(info, Settings(n_ctx=2048, flash_attn=flash_attn == "on"))
    assert abs(est.weights / MiB - got["weights"]) < 0.1
    assert abs(est.kv_cache / MiB - got["kv"]) < 0.1
    assert abs(est.compute / MiB - got["compute"]) <= 0.05 * got["compute"]


# ---------------------------------------------------------------------------------------------------------------
# doctor and system facts
# ---------------------------------------------------------------------------------------------------------------
def test_doctor_reports_build_gpus_cpu_and_wsl():
    result = invoke(["doctor"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert re.search(r"llama-cpp-python \d+\.\d+\.\d+: GPU offload: (yes|no)", out)
    assert re.search(r"^(GPU \d+: |GPUs: none)", out, re.M)
    assert "CPU:" in out and "AVX" in out or "NEON" in out
    assert re.search(r"^WSL2: (yes|no)$", out, re.M)
    if not supports_gpu_offload():
        assert sysinfo.CUDA_REINSTALL in out


def test_doctor_under_wsl_warns_about_models_on_windows_drives(monkeypatch, tiny_models):
    monkeypatch.setattr(sysinfo, "is_wsl", lambda proc_version=None: True)
    result = invoke(["doctor", "-m", "/mnt/c/Users/me/model.gguf", "-md", tiny_models["draft"]])
    assert result.exit_code == 1                        # the /mnt/c model is also missing here
    out = result.stdout
    assert "WSL2: yes" in out and "/mnt/c/Users/me/model.gguf is on a Windows drive" in out
    assert "GGML_CUDA_NO_PINNED" in out
    assert "tiny-draft.gguf (qwen2" in out


def test_nvidia_smi_rows_parse_into_gpus():
    gpus = sysinfo.parse_nvidia_smi("0, NVIDIA H200, 143771, 143156, 580.159.04\n"
                                    "1, NVIDIA GeForce RTX 4090, 24564, [N/A], 550.54\n")
    assert len(gpus) == 1
    assert gpus[0].name == "NVIDIA H200" and gpus[0].total_mib == 143771 and gpus[0].free_mib == 143156


def test_wsl_is_detected_from_the_kernel_version():
    assert sysinfo.is_wsl("Linux version 5.15.153.1-microsoft-standard-WSL2 (root@...)")
    assert not sysinfo.is_wsl("Linux version 6.8.0-45-generic (buildd@lcy02-amd64-075)")
    assert sysinfo.on_windows_drive("/mnt/c/models/x.gguf") and not sysinfo.on_windows_drive("/home/me/x.gguf")


# ---------------------------------------------------------------------------------------------------------------
# sampler order (--samplers in llama.cpp's spelling, --sampler-order)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, order, filters", [
    ([], "llama.cpp", {"top_k": 20, "top_p": 0.9, "min_p": 0.05}),                  # a llama.cpp user's default
    (["--sampler-order", "openai"], "openai", {"top_k": 20, "top_p": 0.9, "min_p": 0.05}),
    (["--samplers", "temperature;top_k;top_p;min_p"], "openai", {"top_k": 20, "top_p": 0.9, "min_p": 0.05}),
    (["--samplers", "top_k;min_p;temperature", "--sampler-order", "llama.cpp"], "llama.cpp",
     {"top_k": 20, "top_p": 1.0, "min_p": 0.05}),                                    # left out of the list: off
])
def test_run_samples_in_the_order_asked_for(tiny_models, monkeypatch, flags, order, filters):
    from llamaspec.engine import Pair

    seen = {}
    stream = Pair.stream

    def recording(self, prompt, **kwargs):
        seen.update(kwargs)
        return stream(self, prompt, **kwargs)

    monkeypatch.setattr(Pair, "stream", recording)
    result = invoke(["run", "-m", tiny_models["target"], *N_CTX, "-n", "4", "--temp", "0.7", "--top-k", "20",
                     "--top-p", "0.9", "--min-p", "0.05", "--seed", "1", *flags, "hello"])
    assert result.exit_code == 0, result.output
    assert seen["sampler_order"] == order
    assert {name: seen[name] for name in filters} == filters


@pytest.mark.parametrize("flags, fragment", [
    (["--samplers", "top_p;temperature;min_p"], "before both top_p and min_p or after both"),
    (["--samplers", "mirostat;temperature"], "'mirostat' is not a sampler"),
    (["--samplers", "top_k;top_p;temperature", "--sampler-order", "openai"], "disagree"),
    (["--sampler-order", "openai", "--samplers", "top_p;temperature"], "disagree"),
    (["--sampler-order", "hf"], "hf"),
])
def test_bad_sampler_order_is_one_line_usage_error_before_loading(tmp_path, flags, fragment):
    result = invoke(["run", "-m", tmp_path / "never-loaded.gguf", *flags, "x"])
    assert_one_line_error(result, fragment, code=2)


def test_a_stopped_reply_is_put_away_with_ctrl_c_shielded():
    """`interrupt.shielded` (chat: the stopped reply kept and its [stopped] line printed; a second Ctrl-C in
    quick succession had cut that short, the partial reply lost): SIGINT ignored inside, Python's handler back after;
    inactive, nothing changes."""
    import os
    import signal

    from llamaspec.interrupt import shielded

    before = signal.signal(signal.SIGINT, signal.default_int_handler)   # a background run starts with SIG_IGN
    try:
        with shielded():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)   # ignored: no KeyboardInterrupt
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with shielded(False):
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
