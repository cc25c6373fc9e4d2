"""The line while a model loads (`loading NAME (SIZE) on DEVICE ...`): a bar on a terminal when a load is long, one
plain line in a server's log, nothing from the other commands when stderr is not a terminal, never on stdout; and
llama.cpp's progress reaching the watcher of each model a pair loads."""
from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llamaspec.backend import LoadWatcher, watch_loads
from llamaspec.cli.loadline import LoadLine, load_line, placement
from llamaspec.config import ModelConfig
from support.paths import REPO


@dataclass
class FakeInfo:
    path: Path
    file_size: int
    n_layer: int = 64


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@dataclass
class GPU:
    name: str


def test_on_a_terminal_the_line_ends_with_the_time_and_a_bar_appears_only_when_the_load_is_long():
    out, clock = io.StringIO(), Clock()
    line = LoadLine(out, terminal=True, bar_after=1.0, clock=clock)
    line.begins(FakeInfo(Path("/m/Qwen3.6-27B-Q4_K_M.gguf"), 16_740_812_704), ModelConfig(n_gpu_layers=0))
    assert out.getvalue() == "loading Qwen3.6-27B-Q4_K_M.gguf (16.7 GB) on CPU ..."
    clock.now += 0.5
    line.progress(0.2)
    assert "[" not in out.getvalue()                 # a short load: no bar
    clock.now += 1.0
    line.progress(0.5)
    assert out.getvalue().endswith("\rloading Qwen3.6-27B-Q4_K_M.gguf (16.7 GB) on CPU ... "
                                   "[############............]  50%")
    clock.now += 0.05
    line.progress(0.6)                               # within a tenth of a second: not redrawn
    assert out.getvalue().count("\r") == 1
    clock.now += 0.5
    line.ends("done")
    assert out.getvalue().endswith("\r\x1b[Kloading Qwen3.6-27B-Q4_K_M.gguf (16.7 GB) on CPU ... done (2.0 s)\n")


def test_off_a_terminal_the_line_is_one_plain_line_and_progress_writes_nothing():
    out = io.StringIO()
    line = LoadLine(out, terminal=False, bar_after=0.0, clock=Clock())
    line.begins(FakeInfo(Path("tiny.gguf"), 5_000_000), ModelConfig())
    line.progress(0.5)
    line.ends("failed")
    assert out.getvalue() == "loading tiny.gguf (5 MB) on CPU ...\n"


def test_only_a_server_logs_the_line_when_stderr_is_not_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert load_line(stream=io.StringIO()) is None                      # run / chat / bench into a pipe or file
    assert not load_line(log_always=True, stream=io.StringIO()).terminal  # serve's log
    assert load_line(stream=Terminal()).terminal


def test_placement_names_the_devices_llama_cpp_puts_the_layers_on():
    gpus = [GPU("CUDA0"), GPU("CUDA1")]
    assert placement(ModelConfig(), gpus, 64) == "CUDA0+CUDA1"
    assert placement(ModelConfig(split_mode="none", main_gpu=1), gpus, 64) == "CUDA1"
    assert placement(ModelConfig(devices=("CUDA1",)), gpus, 64) == "CUDA1"
    assert placement(ModelConfig(devices=()), gpus, 64) == "CPU"
    assert placement(ModelConfig(n_gpu_layers=0), gpus, 64) == "CPU"
    assert placement(ModelConfig(), [], 64) == "CPU"
    assert placement(ModelConfig(n_gpu_layers=20, split_mode="none"), gpus, 64) == \
        "CUDA0 (20 of 64 layers, the rest on the CPU)"


def test_every_model_a_pair_loads_is_watched_with_llama_cpps_progress(tiny_models):
    from llamaspec import load_pair

    class Recorder(LoadWatcher):
        def __init__(self):
            self.events = []

        def begins(self, info, options):
            self.events.append(("begins", info.path.name))

        def progress(self, fraction):
            self.events.append(("progress", fraction))

        def ends(self, outcome):
            self.events.append(("ends", outcome))

    recorder = Recorder()
    with watch_loads(recorder):
        load_pair(str(tiny_models["target"]), str(tiny_models["draft"]), n_ctx=256, n_threads=1).close()
    names = [e for e in recorder.events if e[0] != "progress"]
    assert names == [("begins", "tiny-target.gguf"), ("ends", "done"), ("begins", "tiny-draft.gguf"), ("ends", "done")]
    per_load = []
    for kind, value in recorder.events:
        if kind == "begins":
            per_load.append([])
        elif kind == "progress":
            per_load[-1].append(value)
    for fractions in per_load:   # each load from 0 to 1, as llama.cpp reads it
        assert fractions and fractions == sorted(fractions) and fractions[-1] == 1.0
    seen = len(recorder.events)
    load_pair(str(tiny_models["target"]), n_ctx=256, n_threads=1).close()   # the block is over: nobody watches
    assert len(recorder.events) == seen


def test_the_cli_shows_the_line_on_a_terminal_and_keeps_stdout_and_piped_stderr_clean(tiny_models):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               LLAMASPEC_NO_REPACK="1")
    cmd = [sys.executable, "-m", "llamaspec", "run", "-m", str(tiny_models["target"]), "-c", "256", "-t", "1",
           "-n", "2", "--raw", "hi"]
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    while True:   # read the terminal until the child closes it (a pty must be drained, or the child blocks)
        if select.select([leader], [], [], 60)[0]:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    stdout = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, seen
    terminal = seen.decode(errors="replace")
    assert "loading tiny-target.gguf (" in terminal and " MB) on CPU ... done (" in terminal
    assert "loading" not in stdout
    piped = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert piped.returncode == 0 and "loading" not in piped.stderr + piped.stdout
