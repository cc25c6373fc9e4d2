"""The peers bench_engine.py compares with, run at their fastest: llama.cpp's llama-speculative-simple and
llama-server, and ik_llama.cpp's llama-server. Each gets its own defaults plus only what the case needs (model,
draft, draft length, offload, context, prompt, token count, the sampling regime); the commands are built here,
one function each, and the tests check them.

Sampling regimes (the same distribution on both sides):
- greedy: `--temp 0` alone (no sampler chain; llama.cpp's default chain keeps the argmax);
- filters: llama.cpp's defaults, `--temp T` alone: top-k 40, top-p 0.95, min-p 0.05 on the untempered
  distribution, temperature last (common/common.h and common/sampling.cpp in the vendored llama.cpp; the same in
  ik_llama.cpp's common/sampling.h). llamaspec samples it with sampler_order="llama.cpp";
- temp: pure temperature, `--temp T --top-k 0 --top-p 1 --min-p 0` (llama.cpp's slow path; llamaspec: temperature
  alone).

Defaults the commands rely on (llama.cpp 0.3.36's vendored source): flash attention auto, threads = the CPU's
math cores, --spec-draft-n-min 0, --spec-draft-p-min 0, draft layers on the GPU as -ngl ("auto"), random seed;
ik_llama.cpp: flash attention on, but p_min 0.75 unless its --spec-type entry says otherwise (p_min=0.0 here, so
that k means the same draft length everywhere).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# llama.cpp's default sampling (common/common.h, common_params_sampling), which regime "filters" reproduces
LLAMA_CPP_TOP_K, LLAMA_CPP_TOP_P, LLAMA_CPP_MIN_P = 40, 0.95, 0.05


@dataclass(frozen=True)
class Regime:
    name: str
    temperature: float

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def llamaspec_kwargs(self) -> dict:
        """Pair.generate's sampling keywords for the distribution the peers sample."""
        if self.name == "filters":
            return {"temperature": self.temperature, "top_k": LLAMA_CPP_TOP_K, "top_p": LLAMA_CPP_TOP_P,
                    "min_p": LLAMA_CPP_MIN_P, "sampler_order": "llama.cpp"}
        return {"temperature": self.temperature}

    def cli_flags(self) -> list[str]:
        """llama.cpp's sampling flags: the temperature, and in regime temp the three filters off."""
        flags = ["--temp", f"{self.temperature:g}"]
        if self.name == "temp":
            flags += ["--top-k", "0", "--top-p", "1", "--min-p", "0"]
        return flags

    def request_fields(self) -> dict:
        """The same for a llama-server request (its other sampling fields keep the server's defaults)."""
        fields = {"temperature": self.temperature}
        if self.name == "temp":
            fields.update(top_k=0, top_p=1.0, min_p=0.0)
        return fields

    def describe(self) -> str:
        if self.greedy:
            return "greedy (T=0)"
        if self.name == "filters":
            return (f"T={self.temperature:g} with llama.cpp's default filters (top-k {LLAMA_CPP_TOP_K}, top-p "
                    f"{LLAMA_CPP_TOP_P}, min-p {LLAMA_CPP_MIN_P} on the untempered distribution, temperature last)")
        return f"T={self.temperature:g}, temperature only (top-k 0, top-p 1, min-p 0)"


REGIME_NAMES = ("greedy", "filters", "temp")


def parse_regimes(text: str, temperature: float) -> list[Regime]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in REGIME_NAMES]
    if bad or not names:
        raise ValueError(f"--regimes: {bad[0] if bad else text!r} is not one of {', '.join(REGIME_NAMES)}")
    return [Regime(n, 0.0 if n == "greedy" else temperature) for n in dict.fromkeys(names)]


@dataclass(frozen=True)
class Case:
    """What every engine runs: the files, the drafter, where the layers go."""
    target: str
    draft: str | None            # None: the target's MTP head drafts
    spec_type: str               # llama.cpp's name: draft-simple, draft-eagle3, draft-dflash or draft-mtp
    n_ctx: int = 2048
    n_gpu_layers: int = -1       # -1: every layer (llama.cpp's -ngl 99)
    no_repack: bool = False      # the CPU-only --no-repack (weight repacking SIGILLs on some CPUs)
    extra: tuple = ()            # flags the user asked for, passed to every llama.cpp peer as given
    synth: tuple = ()            # synthetic acceptance (benchmarking only): llama-server's --spec-synth-* flags

    def model_flags(self) -> list[str]:
        ngl = str(99 if self.n_gpu_layers < 0 else self.n_gpu_layers)
        flags = ["-m", self.target]
        if self.draft:
            flags += ["-md", self.draft, "-ngld", ngl]
        return flags + ["-c", str(self.n_ctx), "-ngl", ngl] + (["--no-repack"] if self.no_repack else [])


def speculative_simple_cmd(exe: Path, case: Case, k: int, regime: Regime, prompt: str, n_tokens: int) -> list[str]:
    return [str(exe), *case.model_flags(), "--spec-type", case.spec_type, "--spec-draft-n-max", str(k),
            "-p", prompt, "-n", str(n_tokens), *regime.cli_flags(), *case.extra]


def server_cmd(exe: Path, case: Case, k: int, port: int) -> list[str]:
    """llama.cpp's llama-server on the loopback interface (its default host, said explicitly); with synthetic
    acceptance, its --spec-synth-rates / --spec-synth-len for this k (synth_flags)."""
    return [str(exe), *case.model_flags(), "--spec-type", case.spec_type, "--spec-draft-n-max", str(k),
            "--host", "127.0.0.1", "--port", str(port), *synth_flags(case.synth, k), *case.extra]


# which peers have llama.cpp's synthetic acceptance (common/arg.cpp: --spec-synth-* are llama-server and llama-cli
# options only; ik_llama.cpp has none)
SYNTH_PEERS = ("llama-server",)


def synth_flags(synth: tuple, k: int) -> list[str]:
    """("rates", (P0, P1, ..)) -> --spec-synth-rates P0,P1,..; ("len", L) -> --spec-synth-len L; () -> none. Rates
    must have k values (llama.cpp refuses other counts)."""
    if not synth:
        return []
    kind, value = synth
    if kind == "len":
        return ["--spec-synth-len", f"{value:g}"]
    if len(value) != k:
        raise ValueError(f"synthetic rates have {len(value)} values, the draft length is {k}")
    return ["--spec-synth-rates", ",".join(f"{r:g}" for r in value)]


# llama.cpp's --spec-type -> ik_llama.cpp's stage name (its common/speculative.cpp)
IK_STAGES = {"draft-simple": "draft", "draft-mtp": "mtp", "draft-eagle3": "eagle3", "draft-dflash": "dflash"}


def ik_server_cmd(exe: Path, case: Case, k: int, port: int, autotune: bool = False,
                  p_min: float | None = 0.0) -> list[str]:
    """ik_llama.cpp's llama-server: the draft length inside its --spec-type entry, with p_min 0 (its default is
    0.75) so that k drafts are k drafts as in the other engines; p_min None leaves its default. `autotune`: its
    --spec-autotune, whose tuner (common/spec-tuner.cpp) picks n_max from 1..max(16, k) as it goes (1..k on a
    recurrent target, such as the qwen35 hybrids), and for a draft model p_min and n_min too, starting from the
    values given here (for the MTP head it tunes n_max only: p_min stays what is given)."""
    stage = f"{IK_STAGES[case.spec_type]}:n_max={k}" + ("" if p_min is None else f",p_min={p_min}")
    return [str(exe), *case.model_flags(), "--spec-type", stage, *(["--spec-autotune"] if autotune else []),
            "--host", "127.0.0.1", "--port", str(port), *case.extra]


def request_body(regime: Regime, prompt: str, n_tokens: int) -> dict:
    """One /completion request: the prompt as text, the token count, the regime's sampling fields."""
    return {"prompt": prompt, "n_predict": n_tokens, "stream": False, **regime.request_fields()}


# -- results --------------------------------------------------------------------------------------------------
@dataclass
class PeerResult:
    """One peer at one draft length and regime over every prompt, or why it did not run (`skipped`)."""
    peer: str
    k: int
    regime: str
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    cmd: str = ""
    skipped: str = ""
    runs: list = field(default_factory=list)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add(self, tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.drafted += drafted
        self.accepted += accepted
        self.runs.append(tokens / seconds if seconds else 0.0)


def tool_env(tools: Path) -> dict:
    """The environment a peer binary runs in: its own folder first on the library path."""
    return dict(os.environ, LD_LIBRARY_PATH=f"{tools}:{os.environ.get('LD_LIBRARY_PATH', '')}")


def tool_version(exe: Path) -> str:
    """The binary's own `--version` line (llama.cpp prints "version: N (commit)"), or why there is none."""
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, errors="replace",
                             env=tool_env(exe.parent), timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no version ({e.__class__.__name__})"
    found = re.search(r"version: .*", out.stdout + out.stderr)
    return found.group(0).strip() if found else "no version line"


# -- llama-speculative-simple ----------------------------------------------------------------------------------
def run_speculative_simple(cmd: list[str], timeout: float = 1800) -> dict:
    """One run: tokens, decode seconds, drafted and accepted, from the tool's closing statistics."""
    env = tool_env(Path(cmd[0]).parent)
    # llama.cpp's log is written by a thread it never flushes at exit (common/log.cpp): on a busy CPU the last
    # lines, the statistics, can be lost. Run again when they are.
    for _ in range(5):
        out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=timeout)
        log = out.stdout + out.stderr
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        if decoded or out.returncode != 0:
            break
    if out.returncode != 0 or not decoded:
        raise RuntimeError(f"exit {out.returncode}: {last_lines(log)}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    return {"tokens": int(decoded.group(1)), "seconds": float(decoded.group(2)),
            "drafted": int(drafted.group(1)) if drafted else 0, "accepted": int(accepted.group(1)) if accepted else 0}


def last_lines(log: str, n: int = 3) -> str:
    lines = [line.strip() for line in log.strip().splitlines() if line.strip()]
    return " / ".join(lines[-n:])[-600:] or "no output"


# -- a llama-server, one request at a time -------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer:
    """A llama-server process on 127.0.0.1: started with `cmd`, ready when /health answers 200 (at most
    `start_timeout` seconds), asked one request at a time, and stopped (terminate, then kill) on close. Its log
    goes to a file, whose last lines explain a failure."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, start_timeout: float = 900,
                 request_timeout: float = 900):
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.request_timeout = request_timeout
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=tool_env(Path(cmd[0]).parent))
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}) while loading: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass    # not listening yet, or 503 while the model loads
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s: {self.log_tail()}")

    def complete(self, body: dict) -> dict:
        """POST /completion; the response's `timings` as tokens, seconds, drafted, accepted."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
        timings = reply.get("timings") if isinstance(reply, dict) else None
        if not isinstance(timings, dict) or "predicted_n" not in timings or "predicted_ms" not in timings:
            raise RuntimeError(f"no timings in the reply: {json.dumps(reply)[:300]}")
        return {"tokens": int(timings["predicted_n"]), "seconds": float(timings["predicted_ms"]) / 1000.0,
                "drafted": int(timings.get("draft_n", 0)), "accepted": int(timings.get("draft_n_accepted", 0)),
                "per_second": float(timings.get("predicted_per_second", 0.0))}

    def log_tail(self) -> str:
        self._log.flush()
        try:
            return last_lines(self.log_path.read_text(errors="replace"))
        except OSError:
            return "no log"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def shown(cmd: list[str]) -> str:
    return shlex.join(cmd)
