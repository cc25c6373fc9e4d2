"""benchmarks/probes/auto_step_cost.py: auto's cost a step inside the engine, apart from the lengths it chooses."""
from benchmarks.probes.auto_step_cost import Replay
from llamaspec.policy import FixedPolicy
from support.scripts import run_script


def run(*args):
    return run_script("probes/auto_step_cost.py", *args)


def test_replay_drafts_a_traces_lengths_from_each_requests_start_and_tells_its_watcher():
    told = FixedPolicy(0)
    seen = []
    told.update = lambda *step: seen.append(step)
    replay = Replay("0s31", 2, 3, inner=told)
    lengths = []
    for _ in range(6):
        lengths.append(replay.next_draft_len())
        replay.update(lengths[-1], 0, 0.0, 0.01)
    replay.new_request()
    assert lengths == [0, 2, 3, 1, 2, 2]            # a shadow probe's step drafts k; past the trace, k
    assert replay.next_draft_len() == 0              # a new request starts the trace again
    assert [step[0] for step in seen] == lengths     # the watcher is told every step, as the engine told the replay


def test_the_five_variants_run_on_a_hybrids_mtp_head_at_the_traces_reach(tiny_mtp):
    model = tiny_mtp
    done = run("--target", str(model), "--drafter", "mtp", "-n", "16", "--repeat", "1", "--mix", "0s0332",
               "--no-repack")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "mtp drafter, k=2, reach 3, 16 tokens, 1 interleaved rounds", lines[0]
    rows = [line.split(" | ")[0].lstrip("| ") for line in lines[3:]]
    assert rows == ["fixed", "replay", "replay-mix", "replay+auto", "auto"], done.stdout
    drafted = {line.split(" | ")[0].lstrip("| "): float(line.split(" | ")[2]) for line in lines[3:]}
    assert drafted["fixed"] == drafted["replay"] > 1.5, done.stdout   # k=2 but where the 16 tokens' end cuts a draft


def test_a_bad_trace_says_so_in_one_line(tmp_path):
    done = run("--target", str(tmp_path / "t.gguf"), "--drafter", "mtp", "--mix", "02y")
    assert done.returncode == 2 and "--mix" in done.stderr and "Traceback" not in done.stderr
    none = run("--target", str(tmp_path / "t.gguf"), "--drafter", "mtp", "--repeat", "0")
    assert none.returncode == 2 and "--repeat" in none.stderr and "Traceback" not in none.stderr
