"""benchmarks/probes/warm_up_layouts.py: the load's warm-up timed in two layouts on one pair, alternately."""
import re

from support.scripts import run_script


def run(*args):
    return run_script("probes/warm_up_layouts.py", *args)


def test_both_layouts_price_every_size_up_to_the_heads_reach(tiny_mtp):
    model = tiny_mtp
    done = run("--target", str(model), "--drafter", "mtp", "--repeat", "2", "--layouts", "1x5,3x2", "--no-repack")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "longest draft timed 3" in out, out     # the head's reach on a hybrid: its snapshots
    for name in ("layout 1x5", "layout 3x2"):
        section = out.split(name, 1)[1].split("\nlayout ", 1)[0]
        assert re.search(r"warm_up\(3\) [\d.]+, [\d.]+ s", section), section   # two warm-ups of each
        sizes = re.findall(r"^\s+(\d+)-token pass / 1-token: ([\d. ]+?)\s+spread", section, re.M)
        assert [int(n) for n, _ in sizes] == [1, 2, 3, 4], section            # plain, and drafts of 1-3
        assert all(len(prices.split()) == 2 for _, prices in sizes), section


def test_a_bad_layout_or_a_missing_file_says_so_in_one_line(tmp_path):
    bad = run("--target", str(tmp_path / "t.gguf"), "--drafter", "mtp", "--layouts", "3y2")
    assert bad.returncode == 2 and "SWEEPSxWARM" in bad.stderr and "Traceback" not in bad.stderr
    zero = run("--target", str(tmp_path / "t.gguf"), "--drafter", "mtp", "--layouts", "0x2")
    assert zero.returncode == 2 and "Traceback" not in zero.stderr
    short = run("--target", str(tmp_path / "t.gguf"), "--drafter", "mtp", "--draft-max", "0")
    assert short.returncode == 2 and "--draft-max" in short.stderr and "Traceback" not in short.stderr
    missing = run("--target", str(tmp_path / "t.gguf"), "--drafter", "mtp")
    assert missing.returncode == 1 and "no such model file" in missing.stderr and "Traceback" not in missing.stderr
