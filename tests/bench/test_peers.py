"""The benchmark's peers: the exact commands bench_engine gives llama.cpp's tools (their defaults plus only what
the case needs), the sampling each regime asks of both engines, and the llama-server client against a fake
llama-server on 127.0.0.1 (tests/support/fake_llama_server.py)."""
import json
import re
import stat
import sys
from pathlib import Path

import pytest

from benchmarks.compare import peers
from llamaspec.policy import AutoTuning
from support.llama_asserts import find_llama_src
from support.paths import SUPPORT

EXE = Path("/tools/llama-speculative-simple")
DRAFT = peers.Case("T.gguf", "D.gguf", "draft-simple")
MTP = peers.Case("T.gguf", None, "draft-mtp")
GREEDY, FILTERS, TEMP = peers.parse_regimes("greedy,filters,temp", 0.8)
CASE_FLAGS = ["-m", "T.gguf", "-md", "D.gguf", "-ngld", "99", "-c", "2048", "-ngl", "99",
              "--spec-type", "draft-simple", "--spec-draft-n-max", "3", "-p", "def f():", "-n", "128"]


@pytest.mark.parametrize("regime, sampling", [
    (GREEDY, ["--temp", "0"]),                                                      # no sampler chain
    (FILTERS, ["--temp", "0.8"]),                                                   # llama.cpp's defaults
    (TEMP, ["--temp", "0.8", "--top-k", "0", "--top-p", "1", "--min-p", "0"]),     # exactly the filters off
])
def test_speculative_simple_gets_the_case_and_the_regime_and_nothing_else(regime, sampling):
    cmd = peers.speculative_simple_cmd(EXE, DRAFT, 3, regime, "def f():", 128)
    assert cmd == [str(EXE), *CASE_FLAGS, *sampling]
    for added in ("--samplers", "-t", "-td", "--threads", "--seed", "-s", "-fa", "--spec-draft-p-min",
                  "--spec-draft-n-min"):
        assert added not in cmd


def test_the_mtp_case_has_no_draft_model_and_user_extras_come_last():
    case = peers.Case("T.gguf", None, "draft-mtp", n_gpu_layers=20, no_repack=True, extra=("-fa", "on"))
    cmd = peers.speculative_simple_cmd(EXE, case, 2, GREEDY, "p", 16)
    assert cmd == [str(EXE), "-m", "T.gguf", "-c", "2048", "-ngl", "20", "--no-repack", "--spec-type", "draft-mtp",
                   "--spec-draft-n-max", "2", "-p", "p", "-n", "16", "--temp", "0", "-fa", "on"]


def test_servers_get_the_files_and_k_on_loopback_and_the_sampling_per_request():
    server = peers.server_cmd(Path("/t/llama-server"), DRAFT, 5, 8123)
    assert server == ["/t/llama-server", "-m", "T.gguf", "-md", "D.gguf", "-ngld", "99", "-c", "2048", "-ngl", "99",
                      "--spec-type", "draft-simple", "--spec-draft-n-max", "5", "--host", "127.0.0.1", "--port", "8123"]
    ik = peers.ik_server_cmd(Path("/ik/llama-server"), MTP, 3, 8124)
    assert ik == ["/ik/llama-server", "-m", "T.gguf", "-c", "2048", "-ngl", "99", "--spec-type", "mtp:n_max=3,p_min=0.0",
                  "--host", "127.0.0.1", "--port", "8124"]
    assert peers.ik_server_cmd(Path("/ik/llama-server"), DRAFT, 4, 1)[1:8] == \
        ["-m", "T.gguf", "-md", "D.gguf", "-ngld", "99", "-c"]
    assert "draft:n_max=4,p_min=0.0" in peers.ik_server_cmd(Path("/ik/llama-server"), DRAFT, 4, 1)
    body = {"prompt": "p", "n_predict": 64, "stream": False}
    assert peers.request_body(GREEDY, "p", 64) == {**body, "temperature": 0.0}
    assert peers.request_body(FILTERS, "p", 64) == {**body, "temperature": 0.8}
    assert peers.request_body(TEMP, "p", 64) == {**body, "temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def test_llamaspec_samples_the_distribution_each_regime_gives_the_peers():
    assert GREEDY.llamaspec_kwargs() == {"temperature": 0.0}
    assert FILTERS.llamaspec_kwargs() == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                          "sampler_order": "llama.cpp"}
    assert TEMP.llamaspec_kwargs() == {"temperature": 0.8}
    with pytest.raises(ValueError, match="topk"):
        peers.parse_regimes("greedy,topk", 0.8)


def test_regime_filters_are_llama_cpps_own_defaults():
    """The values and the order regime "filters" assumes, read from the vendored llama.cpp source."""
    src = find_llama_src()
    if src is None:
        pytest.skip("llama.cpp source not found (benchmarks/build-llama-tools.sh unpacks it; or LLAMASPEC_LLAMA_SRC)")
    header = (src.parent / "common" / "common.h").read_text()
    sampling = header[header.index("struct common_params_sampling"):]
    assert re.search(r"int32_t top_k\s*=\s*(\d+);", sampling).group(1) == str(peers.LLAMA_CPP_TOP_K)
    assert float(re.search(r"float\s+top_p\s*=\s*([\d.]+)f;", sampling).group(1)) == peers.LLAMA_CPP_TOP_P
    assert float(re.search(r"float\s+min_p\s*=\s*([\d.]+)f;", sampling).group(1)) == peers.LLAMA_CPP_MIN_P
    chain = re.search(r"samplers = \{(.*?)\};", sampling, re.S).group(1)
    order = [name for name in re.findall(r"COMMON_SAMPLER_TYPE_(\w+)", chain)
             if name in ("TOP_K", "TOP_P", "MIN_P", "TEMPERATURE")]
    assert order == ["TOP_K", "TOP_P", "MIN_P", "TEMPERATURE"]   # truncation first, temperature last
    draft = header[header.index("struct common_params_speculative_draft"):]
    assert re.search(r"int32_t n_min = (\d+);", draft).group(1) == "0"          # no --spec-draft-n-min needed
    assert re.search(r"float\s+p_min\s*=\s*([\d.]+)f;", draft).group(1) == "0.0"  # nor --spec-draft-p-min
    assert "LLAMA_FLASH_ATTN_TYPE_AUTO" in re.search(r"flash_attn_type\s*=\s*(\w+)", header).group(1)


# -- the llama-server client against a fake server -------------------------------------------------------------
@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """A tools folder whose llama-server is the fake; the requests it saw land in a log."""
    folder = tmp_path / "bin"
    folder.mkdir()
    exe = folder / "llama-server"
    exe.write_text(f"#!{sys.executable}\n" + (SUPPORT / "fake_llama_server.py").read_text())
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_SERVER_LOG", str(log))
    return exe, log


def test_peer_server_waits_for_health_and_reads_the_timings(fake_tools, tmp_path):
    exe, log = fake_tools
    port = peers.free_port()
    with peers.PeerServer(peers.server_cmd(exe, DRAFT, 3, port), port, tmp_path / "server.log",
                          start_timeout=30) as server:
        got = server.complete(peers.request_body(TEMP, "hello", 50))
        process = server.process
    assert got == {"tokens": 50, "seconds": pytest.approx(0.2), "drafted": 100, "accepted": 50, "per_second": 250.0}
    assert json.loads(log.read_text()) == peers.request_body(TEMP, "hello", 50)
    assert process.poll() is not None   # stopped on close


def test_a_server_that_cannot_start_says_why(fake_tools, tmp_path, monkeypatch):
    exe, _ = fake_tools
    monkeypatch.setenv("FAKE_SERVER_FAIL", "1")
    port = peers.free_port()
    with pytest.raises(RuntimeError, match="exited .* cannot load the model"):
        peers.PeerServer(peers.server_cmd(exe, DRAFT, 3, port), port, tmp_path / "server.log", start_timeout=30)


def _bench_engine():
    pytest.importorskip("llama_cpp")
    from benchmarks.compare import bench_engine

    return bench_engine


def test_bench_runs_one_server_per_k_every_regime_one_request_at_a_time(fake_tools):
    bench = _bench_engine()
    exe, log = fake_tools
    prompts = ["a", "b"]
    results = bench.server_results("llama-server", exe, "", DRAFT, 3, [GREEDY, FILTERS, TEMP], prompts, 32, 30)
    assert [(r.regime, r.k, r.tokens, r.skipped) for r in results] == \
        [("greedy", 3, 64, ""), ("filters", 3, 64, ""), ("temp", 3, 64, "")]
    assert all(r.tps == pytest.approx(250.0) and r.drafted == 128 and r.accepted == 64 for r in results)
    bodies = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(bodies) == 1 + 3 * len(prompts)   # one warm-up, then each regime's prompts
    assert bodies[1:] == [peers.request_body(r, p, 32) for r in (GREEDY, FILTERS, TEMP) for p in prompts]
    assert results[2].cmd.startswith(f"{exe} -m T.gguf") and "--spec-draft-n-max 3" in results[2].cmd
    assert '"top_k": 0' in results[2].cmd and "top_k" not in results[1].cmd   # the request shown beside the row


def test_peers_that_cannot_run_get_rows_saying_why(fake_tools, monkeypatch, tmp_path):
    bench = _bench_engine()
    exe, _ = fake_tools

    class Args:
        tools, ik_tools = exe.parent, None

    assert bench.peer_binary(Args, "ik", MTP) == (None, "no --ik-tools folder given")
    assert bench.peer_binary(Args, "speculative-simple", MTP)[1].endswith("llama-speculative-simple not found")
    Args.ik_tools = exe.parent
    eagle = peers.Case("T.gguf", "E.gguf", "draft-eagle3")
    assert bench.peer_binary(Args, "ik", eagle) == (exe, "")
    assert bench.peer_binary(Args, "ik", peers.Case("T.gguf", "X.gguf", "draft-dspark"))[1] == \
        "ik_llama.cpp has no draft-dspark drafting"
    results = bench.server_results("ik", None, "no --ik-tools folder given", MTP, 2, [GREEDY, TEMP], ["a"], 8, 30)
    assert [r.skipped for r in results] == ["no --ik-tools folder given"] * 2
    monkeypatch.setenv("FAKE_SERVER_FAIL", "1")
    failed = bench.server_results("llama-server", exe, "", MTP, 2, [GREEDY], ["a"], 8, 30)
    assert failed[0].skipped.startswith("failed: the server exited") and failed[0].cmd.startswith(str(exe))


def test_ik_autotune_gets_its_flag_and_the_longest_length_as_its_reach():
    cmd = peers.ik_server_cmd(Path("/ik/llama-server"), MTP, 3, 8125, autotune=True)
    assert cmd[cmd.index("--spec-type") + 1:cmd.index("--host")] == ["mtp:n_max=3,p_min=0.0", "--spec-autotune"]
    assert "--spec-autotune" not in peers.ik_server_cmd(Path("/ik/llama-server"), MTP, 3, 8125)


def test_ik_autotune_with_its_own_p_min_names_none():
    cmd = peers.ik_server_cmd(Path("/ik/llama-server"), MTP, 3, 8125, autotune=True, p_min=None)
    assert cmd[cmd.index("--spec-type") + 1:cmd.index("--host")] == ["mtp:n_max=3", "--spec-autotune"]


def test_a_tuner_gets_a_fresh_server_for_each_regime_and_the_others_one_per_length(fake_tools):
    bench = _bench_engine()
    exe, log = fake_tools
    tuned = bench.peer_results("ik-autotune-own", exe, "", MTP, [1, 2, 3], [GREEDY, TEMP], ["a"], 8, 30)
    bodies = [json.loads(line)["prompt"] for line in log.read_text().splitlines()]
    assert bodies == ["warm up", "a", "warm up", "a"]   # a warm-up each: two servers
    assert [(r.k, r.regime) for r in tuned] == [(3, "greedy"), (3, "temp")]
    assert "mtp:n_max=3 --spec-autotune" in tuned[0].cmd and "p_min" not in tuned[0].cmd
    log.unlink()
    fixed = bench.peer_results("ik", exe, "", MTP, [1, 2], [GREEDY, TEMP], ["a"], 8, 30)
    bodies = [json.loads(line)["prompt"] for line in log.read_text().splitlines()]
    assert bodies == ["warm up", "a", "a"] * 2 and [r.k for r in fixed] == [1, 1, 2, 2]


def test_the_ceiling_takes_each_request_at_its_fastest_fixed_length():
    bench = _bench_engine()

    def row(mode, runs, tokens):
        return bench.Row(mode, 0.0, runs=list(runs), run_tokens=list(tokens))

    plain = row("plain", [12.0, 5.0, 6.0], [100, 100, 50])
    k1 = row("fixed k=1", [10.0, 20.0, 5.0], [100, 100, 50])
    k2 = row("fixed k=2", [20.0, 10.0, 4.0], [100, 100, 50])
    tps, picks = bench.per_request_best([plain, k1, k2])
    assert picks == ["k=2", "k=1", "plain"]
    assert tps == pytest.approx(250 / (100 / 20 + 100 / 20 + 50 / 6))
    assert bench.per_request_best([k1, row("fixed k=3", [30.0], [100])]) is None   # a row that did not finish
    assert bench.per_request_best([]) is None


def test_a_mixed_session_sends_each_request_its_own_length_in_order(fake_tools):
    bench = _bench_engine()
    exe, log = fake_tools
    prompts = [prompt for _, prompt, _ in bench.MIXED]
    lengths = [40, 40, 40, 10, 80]
    results = bench.server_results("ik-autotune", exe, "", MTP, 3, [GREEDY], prompts, lengths, 30)
    bodies = [json.loads(line) for line in log.read_text().splitlines()][1:]
    assert [(b["prompt"], b["n_predict"]) for b in bodies] == list(zip(prompts, lengths))
    assert "--spec-autotune" in results[0].cmd and len(results[0].runs) == len(prompts)


def test_the_session_table_compares_auto_with_the_best_fixed_length_and_the_peers():
    bench = _bench_engine()
    n = len(bench.MIXED)

    def row(mode, tps):
        r = bench.Row(mode, 0.0, tokens=int(100 * tps), seconds=100.0)
        r.runs = [tps] * n
        return r

    rows = [row("plain", 10.0), row("fixed k=1", 12.0), row("fixed k=2", 15.0), row("auto", 16.5)]
    server = peers.PeerResult("llama-server", 2, "greedy", tokens=1100, seconds=100.0, runs=[11.0] * n)
    autotune = peers.PeerResult(bench.PEER_LABELS["ik-autotune"], 3, "greedy", tokens=1500, seconds=100.0,
                                runs=[15.0] * n)
    missing = peers.PeerResult("llama-server", 3, "greedy", skipped="failed")
    lines = bench.session_section(GREEDY, rows, [server, autotune, missing])
    assert any(line.startswith("| llamaspec fixed k=2 | 15.00 |") and line.endswith("| 15.00 |") for line in lines)
    ratios = next(line for line in lines if line.startswith("- auto /"))
    assert "best fixed (fixed k=2): 1.10x" in ratios and "(k=2): 1.50x" in ratios and "autotune: 1.10x" in ratios
    own = peers.PeerResult(bench.PEER_LABELS["ik-autotune-own"], 3, "greedy", tokens=1600, seconds=100.0,
                           runs=[16.0] * n)
    ratios = next(line for line in bench.session_section(GREEDY, rows, [server, autotune, own])
                  if line.startswith("- auto /"))
    assert "autotune, its own p_min: 1.03x" in ratios   # the faster of the two tuners
    assert not any("k=3 |" in line and "llama-server |" in line for line in lines)   # a peer that failed: no row


def test_open_ended_modes_draft_as_far_as_a_users_load_lets_them(tmp_path):
    # a hybrid target keeps one recurrent-state snapshot per draft token; a user's load of it gives `auto` the
    # drafter kind's reach (3 for an MTP head), and the benchmark's auto rows must run that policy, not auto's open 12
    # (a draft past the reach saves a checkpoint, which the default never does: its cost and its gains are not the
    # default's, on the H200 a first 6-token pass of the 27B 6.65 plain passes, 12-token drafts 2.85)
    import subprocess
    import sys

    from benchmarks.synthetic import synth_mtp
    from tests.support.gguf_crafted import tiny_llama

    bench = _bench_engine()
    hybrid = tmp_path / "hybrid-mtp.gguf"
    made = subprocess.run([sys.executable, synth_mtp.__file__, str(hybrid), "--preset", "tiny", "--header-only"],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    modes = ["plain", "fixed", "auto", "auto+warm", "auto:p=0.5", "confidence"]
    reach = bench.open_reach(str(hybrid), None, "mtp", modes)
    assert reach == {"auto": 3, "confidence": 3}
    assert bench.mode_policy("auto", None, 0.5, reach).draft_max == 3
    assert bench.mode_policy("fixed", 2, None, reach).draft_max == 2
    assert bench.mode_policy("plain", None, None, reach).draft_max == 0
    # a mode that names its longest draft takes it (the load's snapshots stay the user's)
    name, warm, p_min, longest, tuning = bench.parse_mode("auto+warm:p=0.5:max=12")
    assert (name, warm, p_min, longest, tuning) == ("auto", True, 0.5, 12, {})
    assert bench.mode_policy(name, None, p_min, reach, longest).draft_max == 12
    assert bench.open_reach(str(hybrid), None, "mtp", ["auto:max=12"]) == {"auto": 3}
    # auto's tuning, to run another beside the defaults in the same run
    *_, tuning = bench.parse_mode("auto+warm:tail_seen=5:horizon=8")
    assert tuning == {"tail_seen": 5.0, "horizon": 8} and isinstance(tuning["horizon"], int)
    tuned = bench.mode_policy("auto", None, None, reach, None, tuning)
    assert (tuned.tuning.tail_seen, tuned.tuning.horizon, tuned.draft_max) == (5.0, 8, 3)
    assert bench.mode_policy("auto", None, None, reach).tuning == AutoTuning()
    for bad in ("auto:max=0", "auto:max=x", "auto:q=1", "auto:p=", "fixed:tail_seen=3", "auto:horizon=x"):
        with pytest.raises(ValueError, match="options are"):
            bench.parse_mode(bad)
    for bad, why in (("auto:horizon=0", "horizon must be an integer >= 1"), ("auto:tail_seen=-1", "tail_seen must")):
        with pytest.raises(ValueError, match=why):
            bench.parse_mode(bad)
    plain_kv = tmp_path / "llama.gguf"   # a target whose memory drops rejected tokens itself: auto's own 12
    plain_kv.write_bytes(tiny_llama().to_bytes())
    open_kv = bench.open_reach(str(plain_kv), str(plain_kv), "model", ["auto"])
    assert open_kv == {"auto": None} and bench.mode_policy("auto", None, None, open_kv).draft_max == 12


def test_each_mode_starts_from_the_costs_its_own_load_measures():
    # a mode naming a longer draft warms up to it (as load_pair with that draft_max would); the other modes keep the
    # costs of the load's own warm-up, which never runs a checkpointed pass
    bench = _bench_engine()

    class Pair:
        costs, calls = None, []

        def warm_up(self, n):
            self.calls.append(n)
            self.costs = f"costs to {n}"

    pair = Pair()
    costs = bench.warm_ups(pair, 3, ["plain", "fixed", "auto", "auto+warm:max=12", "auto:max=12"])
    assert pair.calls == [3, 12]
    assert bench.mode_costs(costs, 3, None) == "costs to 3"
    assert bench.mode_costs(costs, 3, bench.parse_mode("auto+warm:max=12")[3]) == "costs to 12"
    assert bench.warm_ups(Pair(), 5, ["auto:max=2", "auto"]) == {2: "costs to 2", 5: "costs to 5"}
