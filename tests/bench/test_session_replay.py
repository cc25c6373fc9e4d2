"""The session replay benchmark (benchmarks/compare/session_replay.py): its scripted sessions, the servers'
commands, the client against a fake llama-server (the requests it sends, the figures it reads, a server error
ending the run with the turn and the log), and one real replay against `llamaspec serve` on loopback."""
import itertools
import json
import stat
import sys
from pathlib import Path

import pytest

from benchmarks.compare import session_replay as replay
from benchmarks.compare import sessions
from support.gguf_factory import find_vocab_file
from support.paths import SUPPORT

from llamaspec.chat_template import ChatTemplate
from llamaspec.server.validation import parse_chat

REAL_MODEL = "qwen2.5-coder-0.5b-instruct.gguf"
QWEN_TEMPLATE = Path(replay.__file__).parents[1] / "synthetic" / "templates" / "Qwen3.5-4B.jinja"


# -- the sessions ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(sessions.SESSIONS))
def test_a_session_is_deterministic_and_scales(name):
    small = sessions.build(name, target_tokens=2000)
    assert sessions.build(name, target_tokens=2000).digest == small.digest
    full = sessions.build(name)
    kind, size = sessions.SESSIONS[name]
    assert 0.75 * size <= full.approx_tokens <= 1.25 * size
    assert 10 <= len(full.requests) <= 21
    assert 3 <= len(small.requests) <= 4 and small.approx_tokens <= 3000
    assert len(full.tools) >= 8 and full.messages[0]["role"] == "system"


def test_each_request_extends_the_last_by_its_scripted_answer():
    s = sessions.build("agent-32k", target_tokens=20000)
    for i in range(1, len(s.requests)):
        before, now = s.request_messages(i - 1), s.request_messages(i)
        assert now[:len(before)] == before
        assert now[len(before)] == s.scripted_answer(i - 1)       # the scripted answer, not a generated one
        assert now[-1]["role"] in ("tool", "user")
    calls = [(m["tool_calls"][0]["function"], s.messages[i + 1]) for i, m in enumerate(s.messages)
             if m.get("tool_calls")]
    assert {"read_file", "grep", "run_command"} <= {call["name"] for call, _ in calls}
    read, result = next((call, reply["content"]) for call, reply in calls if call["name"] == "read_file")
    path = json.loads(read["arguments"])["path"]
    first_line = (sessions.REPO / path).read_text().splitlines()[0]
    assert result.splitlines()[0] == f"     1\t{first_line}"       # the file from disk, numbered


def test_the_edit_session_rewrites_what_it_read_with_small_changes():
    s = sessions.build("edit-32k")
    calls = [json.loads(m["tool_calls"][0]["function"]["arguments"]) | {"tool": m["tool_calls"][0]["function"]["name"]}
             for m in s.messages if m.get("tool_calls")]
    writes = [c for c in calls if c["tool"] == "write_file"]
    assert len(writes) >= 2
    for w in writes:
        original = (sessions.REPO / w["path"]).read_text()
        kept = set(original.splitlines())
        new = w["content"].splitlines()
        assert len([line for line in new if line not in kept]) <= 2 and len(new) >= len(kept) * 0.9


# -- the commands --------------------------------------------------------------------------------------------------
SETUP = replay.Setup("T.gguf", None, "mtp", k=3, n_ctx=65536, kv_type="q8_0")


def test_every_server_gets_the_same_context_kv_slot_and_draft_length():
    ours = replay.llamaspec_cmd(["llamaspec"], SETUP, 8001, [])
    server = replay.llama_server_cmd("/b/llama-server", SETUP, 8002, [])
    ik = replay.ik_server_cmd("/ik/llama-server", SETUP, 8003, ["--spec-autotune"])
    for cmd in (ours, server, ik):
        flags = dict(zip(cmd, cmd[1:]))
        assert (flags["-m"], flags["-c"], flags["-ctk"], flags["-ctv"], flags["-np"], flags["-fa"]) == \
            ("T.gguf", "65536", "q8_0", "q8_0", "1", "on")
        assert flags["--host"] == "127.0.0.1"
    assert ours[ours.index("--drafter") + 1] == "mtp" and ours[ours.index("--draft-max") + 1] == "3"
    assert server[server.index("--spec-type") + 1] == "draft-mtp"
    assert server[server.index("--spec-draft-n-max") + 1] == "3"
    assert {"--ctx-checkpoints", "--cache-ram", "--jinja"} <= set(server) and "--cache-reuse" not in server
    assert ik[ik.index("--spec-type") + 1] == "mtp:n_max=3,p_min=0.0" and "--jinja" in ik
    assert ik[-1] == "--spec-autotune"
    plain = replay.Setup("T.gguf", None, "none", no_repack=True)
    assert "--no-draft" in replay.llamaspec_cmd(["llamaspec"], plain, 1, [])
    assert "--spec-type" not in replay.llama_server_cmd("s", plain, 1, []) and "--no-repack" in \
        replay.llama_server_cmd("s", plain, 1, [])
    assert "--no-repack" not in replay.ik_server_cmd("ik", plain, 1, [])
    pair = replay.Setup("T.gguf", "D.gguf", "draft")
    assert replay.llama_server_cmd("s", pair, 1, [])[1:5] == ["-m", "T.gguf", "-md", "D.gguf"]
    assert "draft:n_max=3,p_min=0.0" in replay.ik_server_cmd("ik", pair, 1, [])


def test_a_drafter_in_the_extra_flags_replaces_the_default_one():
    ours = replay.llamaspec_cmd(["llamaspec"], SETUP, 1, ["--drafter", "lookup+mtp"])
    assert ours.count("--drafter") == 1 and ours[ours.index("--drafter") + 1] == "lookup+mtp"
    assert ours[ours.index("--draft-max") + 1] == "3"
    assert "--drafter" not in replay.llamaspec_cmd(["llamaspec"], SETUP, 1, ["--no-draft"])


def test_prompt_lookup_runs_as_the_same_kind_on_both_sides_at_their_default_lengths():
    lookup = replay.Setup("T.gguf", None, "lookup", k=3)
    ours = replay.llamaspec_cmd(["llamaspec"], lookup, 1, [])
    server = replay.llama_server_cmd("s", lookup, 1, [])
    assert ours[ours.index("--drafter") + 1] == "lookup" and "--draft-max" not in ours
    assert server[server.index("--spec-type") + 1] == "ngram-simple" and "--spec-draft-n-max" not in server
    with pytest.raises(replay.ReplayError, match="lookup"):
        replay.ik_server_cmd("ik", lookup, 1, [])


# -- the template's floor: what a re-rendered prompt makes new -------------------------------------------------------
@pytest.fixture(scope="module")
def qwen35_vocab():
    found = find_vocab_file("ggml-vocab-qwen35.gguf")
    if found is None:
        pytest.skip("llama.cpp's ggml-vocab-qwen35.gguf unavailable (set LLAMASPEC_VOCAB_DIR or LLAMASPEC_LLAMA_SRC)")
    return str(found)


def test_the_floor_is_the_growth_until_a_new_user_message_drops_the_earlier_answers_thinking(qwen35_vocab):
    session = sessions.build("agent-64k", target_tokens=8000, turns=8)
    floors = replay.template_floors(session, qwen35_vocab, QWEN_TEMPLATE.read_text())
    template = ChatTemplate(QWEN_TEMPLATE.read_text())
    texts = [template.render(parse_chat({"messages": session.request_messages(i)}).prompt, tools=list(session.tools))
             for i in range(len(session.requests))]
    lengths = replay.count_tokens(qwen35_vocab, texts)
    n = len(session.requests)
    after_user = [i for i in range(1, n)
                  if any(m["role"] == "user" for m in session.messages[session.requests[i - 1]:session.requests[i]])]
    assert floors[0] is None and after_user and n > after_user[0] + 1
    for i in range(1, n):
        growth = lengths[i] - lengths[i - 1]
        if i in after_user:   # the answers since the previous user message are rendered without their thinking:
            # the prompt differs from where the first of them began, several requests back
            assert floors[i] > growth + 100 and floors[i] > lengths[i] - lengths[after_user[0] - 2]
        else:
            assert 0 <= floors[i] - growth <= 2, (i, floors[i], growth)


def test_without_a_template_or_vocabulary_the_floor_is_unknown(tmp_path):
    session = sessions.build("edit-32k", target_tokens=2000)
    fake = tmp_path / "T.gguf"
    fake.write_bytes(b"not a model")
    assert replay.template_floors(session, str(fake)) == [None] * len(session.requests)


# -- against a fake llama-server ------------------------------------------------------------------------------------
@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\n" + (SUPPORT / "fake_llama_server.py").read_text())
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_SERVER_LOG", str(log))
    target = tmp_path / "T.gguf"
    target.write_bytes(b"not a model")
    args = ["--target", str(target), "--drafter", "none", "--server", "llama-server", "--llama-server", str(exe),
            "--target-tokens", "2000", "--max-tokens", "8", "--ctx", "4096", "--start-timeout", "30", "--timeout", "30"]
    return args, log


def test_the_replay_sends_the_scripted_history_and_reads_the_servers_figures(fake_server, tmp_path, capsys):
    args, log = fake_server
    out = tmp_path / "report.md"
    assert replay.main(args + ["--sessions", "agent-32k,edit-32k", "--out", str(out)]) == 0
    session = sessions.build("agent-32k", target_tokens=2000)
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    sent = [body for body in sent if body["messages"][0]["role"] == "system"]    # not the warm-ups
    assert len(sent) == len(session.requests) + len(sessions.build("edit-32k", target_tokens=2000).requests)
    for i, body in enumerate(sent[:len(session.requests)]):
        assert body["messages"] == session.request_messages(i) and body["tools"] == list(session.tools)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 8 and body["temperature"] == 0.0
    dump = json.loads(out.with_suffix(".json").read_text())
    turns = dump["runs"][0]["turns"]
    assert [t["turn"] for t in turns] == list(range(len(session.requests)))
    for before, now in zip(turns, turns[1:]):
        assert now["prompt_tokens"] > before["prompt_tokens"]
        assert now["growth"] == now["prompt_tokens"] - before["prompt_tokens"]
        assert now["reprocessed"] == now["processed"] - now["growth"]
        assert now["reused"] > 0 and now["last_answer_estimated"]   # no tokenizer in a fake file: estimated
    assert all(t["reused"] + t["processed"] == t["prompt_tokens"] for t in turns)
    assert all(t["decode_tps"] == 250.0 and t["decode_from"] == "server" for t in turns)
    text = capsys.readouterr().out
    assert out.read_text() == text
    assert "## llama-server: agent-32k, greedy" in text and "--ctx-checkpoints 32" in text
    assert text.count("| llama-server | ") == 2    # the summary: one row per session


def test_a_server_error_ends_the_run_naming_the_turn_and_the_log(fake_server, monkeypatch, capsys):
    args, _ = fake_server
    monkeypatch.setenv("FAKE_SERVER_CHAT_FAIL_AT", "2")     # the warm-up, then turn 0, then turn 1 fails
    assert replay.main(args + ["--sessions", "edit-32k"]) == 1
    err = capsys.readouterr().err
    assert "llama-server, session edit-32k, sampling greedy: turn 1 of" in err
    assert "HTTP 500" in err and "failed to decode the prompt" in err
    assert "decode: failed to render request 2" in err          # the server's log tail


def test_a_server_that_does_not_start_fails_the_run(fake_server, monkeypatch, capsys):
    args, _ = fake_server
    monkeypatch.setenv("FAKE_SERVER_FAIL", "1")
    assert replay.main(args) == 1
    assert "did not start" in capsys.readouterr().err


# -- against llamaspec serve on loopback ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_real_replay_reuses_the_cache_on_every_later_turn(real_models, tmp_path, capsys):
    model = real_models / REAL_MODEL
    if not model.is_file():
        pytest.skip(f"{REAL_MODEL} not in $LLAMASPEC_TEST_MODELS")
    out = tmp_path / "report.md"
    rc = replay.main(["--target", str(model), "--drafter", "none", "--server", "llamaspec", "--sessions",
                      "agent-32k", "--target-tokens", "2000", "--max-turns", "3", "--max-tokens", "8", "--ctx", "3072",
                      "--no-repack", "--timeout", "120", "--start-timeout", "120", "--out", str(out),
                      "--llamaspec-args", "-t 2"])
    assert rc == 0, capsys.readouterr().err
    turns = json.loads(out.with_suffix(".json").read_text())["runs"][0]["turns"]
    assert len(turns) == 3
    for before, now in zip(turns, turns[1:]):
        assert now["prompt_tokens"] > before["prompt_tokens"]
        assert now["reused"] >= before["prompt_tokens"] - 8          # the cache kept: at least the last prompt
        assert now["within_goal"] is True and not now["last_answer_estimated"]
    assert all(t["reused"] + t["processed"] == t["prompt_tokens"] for t in turns)
    assert all(t["completion_tokens"] > 0 and t["decode_tps"] > 0 for t in turns)
    assert "## llamaspec serve: agent-32k, greedy" in out.read_text()


def test_last_only_sends_the_whole_conversation_once_and_reports_prompt_speed(fake_server, tmp_path):
    args, log = fake_server
    out = tmp_path / "report.md"
    assert replay.main(args + ["--sessions", "agent-32k", "--last-only", "--out", str(out)]) == 0
    session = sessions.build("agent-32k", target_tokens=2000)
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    sent = [body for body in sent if body["messages"][0]["role"] == "system"]    # not the warm-up
    assert len(sent) == 1 and sent[0]["messages"] == session.request_messages(len(session.requests) - 1)
    run = json.loads(out.with_suffix(".json").read_text())["runs"][0]
    (turn,) = run["turns"]
    assert turn["turn"] == len(session.requests) - 1 and turn["growth"] is None
    assert turn["reused"] < 10 and turn["processed"] + turn["reused"] == turn["prompt_tokens"]  # the warm-up's start
    assert run["summary"]["prompt_tps"] == pytest.approx(turn["processed"] / turn["prompt_s"])
    assert "prompt tok/s" in out.read_text()


def test_a_recorded_run_is_reported_again_with_the_same_figures(fake_server, tmp_path):
    args, _ = fake_server
    first = tmp_path / "first.md"
    assert replay.main(args + ["--sessions", "edit-32k", "--out", str(first)]) == 0
    again = tmp_path / "again.md"
    target = args[args.index("--target") + 1]
    assert replay.main(["--report-from", str(first.with_suffix(".json")), "--target", target,
                        "--out", str(again)]) == 0
    old, new = (json.loads(p.with_suffix(".json").read_text()) for p in (first, again))
    assert new["runs"][0]["turns"] == old["runs"][0]["turns"] and new["argv"] == old["argv"]
    assert new["runs"][0]["summary"] == old["runs"][0]["summary"]
    assert "Re-reported from first.json" in again.read_text()
    recorded = json.loads(first.with_suffix(".json").read_text())
    recorded["sessions"][0]["digest"] = "0" * 12                 # the sessions have changed since
    first.with_suffix(".json").write_text(json.dumps(recorded))
    assert replay.main(["--report-from", str(first.with_suffix(".json")), "--target", target]) == 1


def test_a_committed_dump_is_reported_again_from_the_files_of_its_commit(qwen35_vocab, tmp_path, capsys):
    """The sessions quote the repository's files, so the working tree gives other sessions once it moves on: a dump
    names the commit it was built from, and --report-from builds them from that commit's files (git archive) when
    the working tree's differ. A commit git cannot give is one line and exit 1."""
    import subprocess

    dump = Path(replay.__file__).parents[1] / "results" / "h200-session-replay-agent-64k-at-8cda068.json"
    data = json.loads(dump.read_text())
    known = subprocess.run(["git", "-C", str(sessions.REPO), "cat-file", "-e", data["commit"] + "^{commit}"],
                           capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"this checkout has no commit {data['commit'][:7]} (a shallow clone or an export)")
    again = tmp_path / "again.md"
    args = ["--report-from", str(dump), "--target", qwen35_vocab, "--chat-template", str(QWEN_TEMPLATE)]
    assert replay.main(args + ["--out", str(again)]) == 0, capsys.readouterr().err
    new = json.loads(again.with_suffix(".json").read_text())
    assert new["commit"] == data["commit"] and new["sessions"] == data["sessions"]
    assert [r["summary"]["wall_s"] for r in new["runs"]] == [r["summary"]["wall_s"] for r in data["runs"]]
    capsys.readouterr()
    assert replay.main(args + ["--sessions-at", "0" * 40]) == 1
    err = capsys.readouterr().err.strip()
    assert "git cannot give commit" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(SystemExit):   # a run builds its sessions from this checkout
        replay.main(["--target", "T.gguf", "--sessions-at", data["commit"]])


def test_a_report_from_bad_input_is_one_line_and_exit_1(tmp_path, capsys):
    recorded = tmp_path / "run.json"
    recorded.write_text(json.dumps({"argv": ["--bogus"], "setup": {}, "sessions": [], "runs": [], "hardware": ""}))
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    bad_template = tmp_path / "t.jinja"
    bad_template.write_text("{% if %}")
    cases = [(["--report-from", str(tmp_path / "none.json")], "cannot read"),
             (["--report-from", str(listing)], "not a session replay's JSON dump"),
             (["--report-from", str(recorded)], "a command line this script does not take")]
    for args, said in cases:
        assert replay.main(args + ["--target", "T.gguf"]) == 1
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1 and "Traceback" not in err
    good = json.loads(recorded.read_text()) | {"argv": ["--target", "T.gguf", "--sessions", "edit-32k"],
                                                "setup": {"target": "T.gguf"}}
    recorded.write_text(json.dumps(good))
    assert replay.main(["--report-from", str(recorded), "--target", "T.gguf", "--chat-template",
                        str(bad_template)]) == 1
    assert "does not parse" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # argparse: a run takes the target's own template
        replay.main(["--target", "T.gguf", "--chat-template", str(bad_template)])


def test_a_fixed_length_llamaspec_run_replays_beside_auto_and_is_compared_with_it(fake_server, tmp_path, capsys):
    """--server llamaspec,llamaspec-fixed:2: the same server command twice, the second with --policy fixed and its
    own draft length, each its own run, the fixed one in the comparison table; a bad length is refused."""
    args, _ = fake_server
    given = dict(zip(args[::2], args[1::2]))
    given.update({"--server": "llamaspec,llamaspec-fixed:2,llamaspec-max:2", "--llamaspec": given["--llama-server"],
                  "--drafter": "mtp", "--k": "3", "--sessions": "edit-32k"})
    out = tmp_path / "report.md"
    assert replay.main([*itertools.chain(*given.items()), "--out", str(out)]) == 0
    text = out.read_text()
    dump = json.loads(out.with_suffix(".json").read_text())
    auto, fixed, capped = dump["runs"]
    assert auto["server"] == "llamaspec" and fixed["server"] == "llamaspec-fixed:2"
    assert "--draft-max 3" in auto["cmd"] and "--policy" not in auto["cmd"]
    assert "--policy fixed" in fixed["cmd"] and "--draft-max 2" in fixed["cmd"]
    # llamaspec-max:K: its own policy with the fixed row's load (the longest draft K)
    assert capped["server"] == "llamaspec-max:2" and "--draft-max 2" in capped["cmd"] and "--policy" not in capped["cmd"]
    assert "## llamaspec serve, fixed k=2: edit-32k, greedy" in text
    assert "## llamaspec serve, draft-max 2: edit-32k, greedy" in text
    rows = [r for r in text.split("## llamaspec / each peer")[1].splitlines() if r.startswith("| llamaspec serve")]
    assert len(rows) == 2 and rows[0].startswith("| llamaspec serve, fixed k=2 | edit-32k | greedy |")
    assert rows[1].startswith("| llamaspec serve, draft-max 2 | edit-32k | greedy |")
    assert all(r.endswith("| 1.00x |") for r in rows)    # decode: the fake's 250 tok/s on each
    for bad in ("llamaspec-fixed:0", "llamaspec-max:x"):
        with pytest.raises(SystemExit) as stop:
            replay.main(["--target", given["--target"], "--server", bad])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "llamaspec-fixed:K (K >= 1)" in err and "llamaspec-max:K (K >= 1)" in err


def test_a_fixed_length_run_fixes_prompt_lookups_length_too():
    """Prompt lookup runs at its default lengths (no --draft-max) where auto chooses; llamaspec-fixed:K gives it K."""
    from types import SimpleNamespace

    a = SimpleNamespace(llamaspec="llamaspec", llamaspec_args="")
    lookup = replay.Setup(target="T.gguf", drafter="lookup")
    assert "--draft-max" not in replay.server_command("llamaspec", a, lookup, 1)
    fixed = replay.server_command("llamaspec-fixed:4", a, lookup, 1)
    assert fixed[fixed.index("--policy") + 1] == "fixed" and fixed[fixed.index("--draft-max") + 1] == "4"
    capped = replay.server_command("llamaspec-max:4", a, lookup, 1)
    assert "--policy" not in capped and capped[capped.index("--draft-max") + 1] == "4"
