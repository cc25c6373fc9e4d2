"""benchmarks/probes/profile_step.py: where a step's Python time goes, for a draft model or a drafter of the target's
own (the MTP head), on the pair a user's load of those settings gives."""
from support.scripts import run_script


def run(*args):
    return run_script("probes/profile_step.py", *args)


def test_the_mtp_head_is_profiled_within_the_snapshots_a_users_load_keeps(tiny_mtp):
    # a hybrid target's default `auto` drafts at most the MTP kind's reach (3 snapshots), fixed k as given
    model = tiny_mtp
    auto = run("--target", str(model), "--drafter", "mtp", "--policy", "auto", "-n", "16", "--no-repack",
               "--top", "3")
    assert auto.returncode == 0, auto.stderr
    lines = auto.stdout.splitlines()
    assert lines[0] == "mtp drafter, auto policy, longest draft 3", lines[0]
    assert any("Python" in line and "ms per step" in line for line in lines), auto.stdout
    fixed = run("--target", str(model), "--drafter", "mtp", "--k", "2", "-n", "8", "--no-repack", "--top", "3")
    assert fixed.returncode == 0 and fixed.stdout.startswith("mtp drafter, fixed policy, longest draft 2\n"), \
        fixed.stdout + fixed.stderr


def test_without_a_draft_or_a_drafter_it_says_so_in_one_line(tmp_path):
    done = run("--target", str(tmp_path / "t.gguf"))
    assert done.returncode == 2 and "give --draft or --drafter" in done.stderr and "Traceback" not in done.stderr
    missing = run("--target", str(tmp_path / "missing.gguf"), "--drafter", "mtp")
    assert missing.returncode != 0 and "no such model file" in missing.stderr and "Traceback" not in missing.stderr
