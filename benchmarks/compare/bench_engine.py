"""Engine benchmark: plain decoding, every draft policy, and the llama.cpp peers users run, on the same prompts and
files in one run. Prints a markdown report (also written to --out) with ratios against llamaspec's plain decoding
and against the peers, and the exact command of every peer row.

    python benchmarks/compare/bench_engine.py --target T.gguf --draft D.gguf --tools DIR [--ik-tools DIR] [--k 3,5]
    python benchmarks/compare/bench_engine.py --target T-with-MTP.gguf --drafter mtp --tools DIR ...

Peers (--peers; one that cannot run the case gets a row saying why): llama-speculative-simple and llama-server
from --tools (benchmarks/build-llama-tools.sh), ik_llama.cpp's llama-server from --ik-tools. Each runs with its
own default flags plus what the case needs (model, draft, draft length, -ngl, -c, prompt, token count, sampling
regime): no sampler chain, threads or seed added for the comparison (benchmarks/compare/peers.py builds the commands).
llama-server runs on 127.0.0.1, one server per draft length, one request at a time, its `timings` per response.

Regimes (--regimes, all three by default; both engines sample the same distribution in each):
greedy (T=0); filters: llama.cpp's defaults at --temp (top-k 40, top-p 0.95, min-p 0.05 on the untempered
distribution, temperature last; llamaspec with sampler_order="llama.cpp"); temp: temperature only (the peers get
--top-k 0 --top-p 1 --min-p 0). Each llamaspec mode runs every prompt once after one warm-up generation (`--rounds N`:
N times, every mode once a round, each with a fresh policy, so that a mode's spread between rounds shows what one row
of it can tell; sampled, every mode of a round draws with the same seeds and each round with its own, so that rounds
are independent draws of what a policy meets and modes within one are compared on the same draws); the pair is closed
before the peers run. The report says where llamaspec's filters ran (on the device or in numpy). With --drafter mtp
the target's own multi-token-prediction head drafts (no --draft), and the peers run their MTP drafting on the same
file.

A mixed workload (--workload mixed): one session whose requests change character, in this order: code completion,
prose, a copy-heavy edit (the answer repeats much of the prompt), a short answer, a long reasoning-style answer (each
its share of --tokens: MIXED). Every mode runs them as one session (one policy object; `auto+warm` after one
untimed request), and each peer the same requests in the same order; the report adds each request's tok/s, the
session's, and `auto` against the best fixed k, llama-server's best k and ik_llama.cpp's `--spec-autotune` (peer
`ik-autotune`: its server once a regime, drafting up to the longest --k with p_min 0 as its fixed rows, its tuner
choosing the length as it goes; `ik-autotune-own`: the same with its own default p_min), and the ceiling of a policy
that picks one length a request: each request in the mode (plain or a fixed k) that was fastest on it.

Synthetic acceptance (benchmarking only; `--synthetic-rates P0,P1,..` or `--synthetic-len L`): the fixed-k rows keep
draft tokens by the given per-position rates instead of by the target (llamaspec.bench.synthetic), every pass and
rollback still real, and llama-server runs llama.cpp's own `--spec-synth-rates` / `--spec-synth-len` (the other
peers have no such mode and say so). Plain and fixed k only; every line of such a report says "synthetic acceptance".
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

try:
    from . import peers   # imported as benchmarks.compare.bench_engine (the tests)
except ImportError:
    import peers          # run as a script: its folder is on sys.path
from llamaspec import load_pair  # noqa: E402
from llamaspec.config import LoadConfig  # noqa: E402
from llamaspec.gguf.reader import read_model_info  # noqa: E402
from llamaspec.gguf.spec_kind import spec_kind  # noqa: E402
from llamaspec.kinds import drafter_kind  # noqa: E402
from llamaspec.loading import snapshot_reach  # noqa: E402
from llamaspec.errors import InvalidParameterError  # noqa: E402
from llamaspec.backend import default_threads, library_version, supports_gpu_offload  # noqa: E402
from llamaspec.bench import H100_MTP27B_COSTS, auto_state  # noqa: E402
from llamaspec.bench.synthetic import LABEL as SYNTH, SyntheticAcceptance, parse_rates, resolve_rates  # noqa: E402
from llamaspec.policy import AutoPolicy, AutoTuning, make_policy  # noqa: E402

CODE = [
    "def quicksort(arr):",
    "# Python: parse a CSV file and print the mean of the 'price' column\nimport csv\n",
    "function debounce(fn, wait) {",
    "class LRUCache:\n    def __init__(self, capacity):",
]
# the untimed request of a "+warm" mode: in neither set, so no timed prompt was seen before
WARM_PROMPT = "Write a function that merges two sorted lists, then explain its running time."
PROSE = [
    "The history of the printing press begins",
    "Here are five tips for writing clear documentation:\n1.",
    "The main differences between TCP and UDP are",
    "Photosynthesis is the process by which",
]
_EDIT_SOURCE = '''def total(items):
    t = 0
    for i in range(len(items)):
        if items[i]["qty"] > 0:
            t = t + items[i]["price"] * items[i]["qty"]
    return t


def count(items):
    n = 0
    for i in range(len(items)):
        if items[i]["qty"] > 0:
            n = n + items[i]["qty"]
    return n'''
# --workload mixed: one session, requests of changing character: (what it is, the prompt, its share of --tokens)
MIXED = [
    ("code completion", "class LRUCache:\n    def __init__(self, capacity):", 1.0),
    ("prose", "The history of the printing press begins", 1.0),
    ("copy-heavy edit", "Here is a Python module:\n\n" + _EDIT_SOURCE + "\n\nThe same module with the parameter "
     "`items` renamed to `cart` and nothing else changed:\n\n", 1.0),
    ("short answer", "Q: What is the capital of Australia?\nA:", 0.25),
    ("long reasoning", "Question: A shop sells pencils at 3 for 50 cents and pens at 2 for 90 cents. Sam buys 12 "
     "pencils and 5 pens and pays with a 10 dollar note. How much change does he get?\nAnswer: Let's think step "
     "by step.", 2.0),
]


@dataclass
class Row:
    mode: str
    temperature: float
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    overhead: list = field(default_factory=list)   # Python overhead fraction per request
    step_overhead_ms: list = field(default_factory=list)
    draft_seconds: float = 0.0     # time drafting (the cost ratio c = draft time per token / plain's time per pass)
    verify_seconds: float = 0.0    # time verifying (v(k+1) = verify time per pass / plain's)
    rollback_ms: list = field(default_factory=list)  # keep() and checkpoints per target pass (recurrent memories)
    shadow_probes: int = 0         # auto's probes that drafted one token without verifying it
    synthetic: str = ""            # the synthetic acceptance it ran with (SyntheticAcceptance.label), if any
    runs: list = field(default_factory=list)       # tok/s of each request, in order
    run_tokens: list = field(default_factory=list)  # tokens of each request, in order
    round_tps: list = field(default_factory=list)   # with --rounds: the tok/s of each round, in order
    auto_events: list = field(default_factory=list)  # an auto mode's: each round's calls that taught its policy

    @property
    def name(self) -> str:
        return f"{self.mode} [{self.synthetic}]" if self.synthetic else self.mode

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def hardware() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "GPU offload available" if supports_gpu_offload() else "CPU-only build"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            gpu = out.stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs; {gpu}; llama-cpp-python {library_version()}"


def python_speed(steps: int = 2000, repeats: int = 5) -> tuple[float, float]:
    """How fast this host runs a step's Python, to compare Python shares between machines by (the same code spent
    0.22 and 0.49 ms of Python a step on two H100 hosts): (microseconds a step, the median of `repeats`; drafted
    tokens a step) of `auto`'s own hooks over one fixed trace of `steps` steps (70% acceptance, its own lengths,
    shadow and tail probes, a new request every 128 steps; no model)."""
    import random
    from statistics import median

    times, drafted = [], 0
    for _ in range(repeats):
        rng, policy, drafted = random.Random(0), AutoPolicy(draft_max=12), 0
        policy.attach("per_token", H100_MTP27B_COSTS)
        start = time.perf_counter()
        for i in range(steps):
            if i % 128 == 0:
                policy.new_request()
                policy.held(1000 + i)
            k, probe = policy.next_draft_len(), policy.shadow_len()
            accepted = 0
            while accepted < k and rng.random() < 0.7:
                accepted += 1
            if probe:   # a shadow probe (plain), or a tail probe reached where all k were accepted
                policy.shadow(float(rng.random() < 0.7) if accepted == k else None, 0.0025)
            policy.update(k, accepted, 0.00126 * k, 0.0118 + 0.003 * k)
            drafted += k
        times.append((time.perf_counter() - start) / steps)
    return 1e6 * median(times), drafted / steps


def budgets(prompts, n_tokens) -> list[int]:
    """Each prompt's token count: `n_tokens` for all, or one per prompt (a list)."""
    return list(n_tokens) if isinstance(n_tokens, (list, tuple)) else [n_tokens] * len(prompts)


ROUND_SEEDS = 1000   # the rounds' requests draw with seeds 0, 1, ..., then 1000, 1001, ..., then 2000, ...


def run_mode(pair, mode: str, prompts, n_tokens, regime: peers.Regime, seed: int = 0) -> Row:
    row = Row(mode, regime.temperature)
    for i, (prompt, budget) in enumerate(zip(prompts, budgets(prompts, n_tokens))):
        pair.reset()
        c = pair.generate(prompt, max_tokens=budget, seed=seed + i, **regime.llamaspec_kwargs())
        s = c.stats
        row.runs.append(s.tokens_generated / s.decode_time if s.decode_time else 0.0)
        row.run_tokens.append(s.tokens_generated)
        row.tokens += s.tokens_generated
        row.seconds += s.decode_time
        row.drafted += s.drafted
        row.accepted += s.accepted
        row.passes += s.target_passes
        row.draft_seconds += s.time_draft
        row.verify_seconds += s.time_verify
        row.overhead.append(s.python_overhead)
        row.shadow_probes += getattr(s, "shadow_probes", 0)
        if s.target_passes:
            row.step_overhead_ms.append(1000 * (s.decode_time - s.time_in_decode) / s.target_passes)
            row.rollback_ms.append(1000 * s.time_rollback / s.target_passes)
    return row


def merge_rounds(rows: list) -> Row:
    """One mode's rows from interleaved rounds as one row: sums, each request's tok/s over every round (its tokens
    over its time), and each round's tok/s (`round_tps`) for the spread."""
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    out = Row(first.mode, first.temperature, synthetic=first.synthetic)
    for r in rows:
        for name in ("tokens", "seconds", "drafted", "accepted", "passes", "draft_seconds", "verify_seconds",
                     "shadow_probes"):
            setattr(out, name, getattr(out, name) + getattr(r, name))
        out.overhead += r.overhead
        out.step_overhead_ms += r.step_overhead_ms
        out.rollback_ms += r.rollback_ms
        out.round_tps.append(r.tps)
        out.auto_events += r.auto_events
    for i in range(len(first.runs)):
        tokens = sum(r.run_tokens[i] for r in rows)
        seconds = sum(r.run_tokens[i] / r.runs[i] for r in rows if r.runs[i])
        out.runs.append(tokens / seconds if seconds else 0.0)
        out.run_tokens.append(tokens // len(rows))
    return out


def record_steps(policy) -> tuple[list[str], list]:
    """The draft length of every step a policy learns from, one character each (10-35 as a-z), and every call the
    engine makes that teaches it, in order, with its arguments (JSON's `auto_events`: ["policy", longest draft,
    p_min], ["attach", draft cost, the costs measured at load or None], ["request"], ["held", tokens the target
    holds], ["shadow", chance (null: a tail probe not reached), seconds], ["update", drafted, accepted, draft
    seconds, verify seconds]):
    `policy_sim.py --events` replays them into a fresh policy and shows why it chose what it chose."""
    steps: list[str] = []
    events: list = [["policy", policy.draft_max, policy.draft_p_min]]
    update, shadow, new_request, attach = policy.update, policy.shadow, policy.new_request, policy.attach
    held = policy.held

    def on_update(drafted, accepted, draft_seconds, verify_seconds):
        steps.append("0123456789abcdefghijklmnopqrstuvwxyz"[min(drafted, 35)])
        events.append(["update", drafted, accepted, draft_seconds, verify_seconds])
        update(drafted, accepted, draft_seconds, verify_seconds)

    def on_shadow(accepted, seconds):   # a tail probe's (drafting, its chance None short of it) takes no character
        if not policy.next_draft_len():
            steps.append("s" if accepted >= 0.5 else "x")
        events.append(["shadow", accepted, seconds])
        shadow(accepted, seconds)

    def on_new_request():
        steps.append("|")
        events.append(["request"])
        new_request()

    def on_attach(draft_cost="per_token", costs=None):
        events.append(["attach", draft_cost, asdict(costs) if costs is not None else None])
        attach(draft_cost, costs)

    def on_held(tokens):
        events.append(["held", tokens])
        held(tokens)

    policy.update, policy.shadow, policy.new_request, policy.attach = on_update, on_shadow, on_new_request, on_attach
    policy.held = on_held
    return steps, events


PEER_LABELS = {"speculative-simple": "llama-speculative-simple", "llama-server": "llama-server",
               "ik": "ik_llama.cpp llama-server", "ik-autotune": "ik_llama.cpp llama-server --spec-autotune",
               "ik-autotune-own": "ik_llama.cpp llama-server --spec-autotune, its own p_min"}
# peers run once, drafting up to the longest --k, not once per k, and with a fresh server for each regime (so that
# a tuner starts each regime as llamaspec's policy does, not from what the regime before it taught)
ONCE = ("ik-autotune", "ik-autotune-own")


def peer_label(name: str, case: peers.Case) -> str:
    return f"{PEER_LABELS[name]} [{SYNTH}]" if case.synth else PEER_LABELS[name]


def peer_binary(a, name: str, case: peers.Case) -> tuple[Path | None, str]:
    """The peer's binary, or why it cannot run this case."""
    if case.synth and name not in peers.SYNTH_PEERS:
        return None, f"{PEER_LABELS[name]} has no {SYNTH} mode (llama.cpp's --spec-synth-* are llama-server options)"
    ik = name.startswith("ik")
    folder, flag = (a.ik_tools, "--ik-tools") if ik else (a.tools, "--tools")
    if folder is None:
        return None, f"no {flag} folder given"
    exe = folder / ("llama-speculative-simple" if name == "speculative-simple" else "llama-server")
    if not exe.is_file():
        return None, f"{exe} not found"
    if ik and case.spec_type not in peers.IK_STAGES:
        return None, f"ik_llama.cpp has no {case.spec_type} drafting"
    return exe, ""


def speculative_simple_results(exe, why: str, case, k: int, regimes, prompts, n_tokens) -> list:
    """llama-speculative-simple, one process per prompt (its own decode timing, load excluded)."""
    out = []
    for regime in regimes:
        res = peers.PeerResult(peer_label("speculative-simple", case), k, regime.name, skipped=why)
        out.append(res)
        for prompt, budget in zip(prompts, budgets(prompts, n_tokens)) if exe is not None else []:
            cmd = peers.speculative_simple_cmd(exe, case, k, regime, prompt, budget)
            res.cmd = res.cmd or peers.shown(cmd)
            try:
                run = peers.run_speculative_simple(cmd)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                res.skipped = f"failed: {e}"
                break
            res.add(run["tokens"], run["seconds"], run["drafted"], run["accepted"])
        print(f"done: {regime.name} {res.peer} k={k}: {res.tps:.2f} tok/s {res.skipped}", file=sys.stderr)
    return out


def server_results(name: str, exe, why: str, case, k: int, regimes, prompts, n_tokens, timeout: float) -> list:
    """A llama-server (llama.cpp's or ik_llama.cpp's, the latter also with --spec-autotune) started once for this
    k: one warm-up request, then every regime's prompts one request at a time; tokens and seconds from each
    response's timings."""
    label = peer_label(name, case)
    results = {r.name: peers.PeerResult(label, k, r.name, skipped=why) for r in regimes}
    if exe is None:
        return list(results.values())
    port = peers.free_port()
    cmd = peers.ik_server_cmd(exe, case, k, port, autotune=name in ONCE,
                              p_min=None if name == "ik-autotune-own" else 0.0) if name.startswith("ik") \
        else peers.server_cmd(exe, case, k, port)
    try:
        with tempfile.TemporaryDirectory() as tmp, \
                peers.PeerServer(cmd, port, Path(tmp) / "server.log", timeout, timeout) as server:
            server.complete(peers.request_body(regimes[0], "warm up", 16))
            for regime in regimes:
                res = results[regime.name]
                lengths = budgets(prompts, n_tokens)
                body = peers.request_body(regime, prompts[0], lengths[0])
                res.cmd = f"{peers.shown(cmd)} ; POST /completion {json.dumps(body)}"
                for prompt, budget in zip(prompts, lengths):
                    try:
                        run = server.complete(peers.request_body(regime, prompt, budget))
                    except (RuntimeError, OSError) as e:
                        res.skipped = f"failed: {e}"
                        break
                    res.add(run["tokens"], run["seconds"], run["drafted"], run["accepted"])
                print(f"done: {regime.name} {label} k={k}: {res.tps:.2f} tok/s {res.skipped}", file=sys.stderr)
    except (RuntimeError, OSError) as e:   # the server did not start (or died): every regime says why
        for res in results.values():
            if not res.tokens:
                res.cmd = res.cmd or peers.shown(cmd)
                res.skipped = res.skipped or f"failed: {e}"
    return list(results.values())


def peer_results(name: str, exe, why: str, case, ks, regimes, prompts, n_tokens, timeout: float) -> list:
    """One peer's rows: one run per draft length (a llama-server started once for each, every regime on it), or,
    for a tuner (ONCE), one run at the longest with a fresh server for each regime."""
    out = []
    for k in [max(ks)] if name in ONCE else ks:
        if name == "speculative-simple":
            out += speculative_simple_results(exe, why, case, k, regimes, prompts, n_tokens)
        elif name in ONCE:
            for regime in regimes:
                out += server_results(name, exe, why, case, k, [regime], prompts, n_tokens, timeout)
        else:
            out += server_results(name, exe, why, case, k, regimes, prompts, n_tokens, timeout)
    return out


def parse_mode(mode: str) -> tuple[str, bool, float | None, int | None, dict]:
    """"auto+warm:p=0:max=12:tail_seen=3" -> ("auto", True, 0.0, 12, {"tail_seen": 3.0}): the policy's name, whether
    one untimed request warms it (WARM_PROMPT), its confidence stop p_min, its longest draft (max=N: past the snapshots
    the load keeps, each longer draft saving a checkpoint; the load's snapshots stay what a user's load of this pair
    gives) and, for auto, fields of its AutoTuning (a tuning against the defaults in the same run)."""
    name, *options = mode.split(":")
    p_min = draft_max = None
    tuning = {}
    tunable = {f.name: f.type for f in fields(AutoTuning)}
    for option in options:
        key, _, value = option.partition("=")
        try:
            if key == "p":
                p_min = float(value)
            elif key == "max":
                draft_max = int(value)
                if draft_max < 1:
                    raise ValueError
            elif key in tunable and name.removesuffix("+warm") == "auto":
                tuning[key] = int(value) if tunable[key] in (int, "int") else float(value)
                AutoTuning(**tuning)
            else:
                raise ValueError
        except InvalidParameterError as e:   # a field out of its range: AutoTuning says which
            raise ValueError(f"{mode!r}: {e}") from None
        except ValueError:
            raise ValueError(f"{mode!r}: options are p=NUMBER, max=N (N >= 1) and, for auto, FIELD=NUMBER of "
                             f"AutoTuning ({', '.join(tunable)})") from None
    return name.removesuffix("+warm"), name.endswith("+warm"), p_min, draft_max, tuning


def open_reach(target: str, draft: str | None, drafter: str, modes: list[str]) -> dict:
    """{policy name: its longest draft} for the open-ended modes, as a user's load of this pair gives it: on a target
    whose rollback is bounded by recurrent-state snapshots the drafter kind's reach (a longer draft would save a
    checkpoint every step), else None (the policy's own default)."""
    names = [parse_mode(m)[0] for m in modes]
    file_kind = spec_kind(read_model_info(draft)) if draft else None
    target_info, kind = read_model_info(target), drafter_kind(file_kind or drafter)
    return {name: snapshot_reach(LoadConfig(drafter=drafter, policy=name), target_info, kind).drafting.draft_max
            for name in names if name not in ("plain", "fixed")}


def mode_policy(name: str, k: int | None, p_min: float | None, reach: dict, draft_max: int | None = None,
                tuning: dict | None = None):
    """The policy a mode runs: plain is fixed k=0, fixed its k, the open-ended ones their reach (open_reach) or the
    longest draft the mode names (max=N); auto with the tuning fields the mode names."""
    if name == "plain":
        return make_policy("fixed", draft_max=0)
    policy = make_policy(name, draft_max=k if name == "fixed" else draft_max or reach.get(name), draft_p_min=p_min)
    return AutoPolicy(policy.draft_max, policy.draft_p_min, **tuning) if tuning else policy


def warm_ups(pair, longest: int, modes: list[str]) -> dict:
    """{warm-up length: the costs it measured}: the load's longest draft, and each max=N a mode names, as a load with
    draft_max N would warm up (load_pair): each mode starts from what its own load measures (mode_costs)."""
    out = {}
    for n in sorted({longest} | {parse_mode(m)[3] for m in modes} - {None}):
        pair.warm_up(n)
        out[n] = pair.costs
    return out


def mode_costs(costs: dict, longest: int, draft_max: int | None):
    """The costs a mode starts from: its own warm-up's (max=N), else the load's. A warm-up past the snapshots times
    checkpointed passes, which the default's never does (on the H200 one to 12 on 3 snapshots read a 4-token pass as
    2.4-2.7 plain passes, which ran at 1.55, and kept `auto` in that run from drafting 3)."""
    return costs.get(draft_max or longest)


def run_llamaspec(pair, a, regimes, ks: list[int], modes: list[str], prompts, n_tokens) -> dict:
    """Every mode in every regime on the one loaded pair: {regime name: (rows, auto's state lines, where)}. With
    synthetic acceptance (a.synth) the fixed-k rows run inside SyntheticAcceptance, rates resolved for each k."""
    out = {}
    for regime in regimes:
        rounds, states = [], []
        runs = [(mode, k) for mode in modes for k in (ks if mode == "fixed" else [None])]
        for rnd in range(getattr(a, "rounds", 1)):
            rows = []
            rounds.append(rows)
            for mode, k in runs:
                rows.append(run_one(pair, a, regime, mode, k, prompts, n_tokens, states,
                                    f" (round {rnd + 1})" if rnd else "", seed=ROUND_SEEDS * rnd))
        rows = [merge_rounds(same) for same in zip(*rounds)]
        where = "" if regime.greedy else \
            f"; llamaspec's filters ran {'on the device' if pair.target_ctx.device_sampler else 'in numpy'}"
        out[regime.name] = (rows, states, where)
    return out


def run_one(pair, a, regime, mode: str, k: int | None, prompts, n_tokens, states: list, mark: str,
            seed: int = 0) -> Row:
    """One mode (a fixed one at k) over the prompts with a fresh policy: its row; an auto policy's state and draft
    lengths go to `states` (`mark` names the round after the first). `seed`: the round's first sampling seed (the
    prompts take seed, seed + 1, ...; the warm-up request its own)."""
    name, warm, p_min, draft_max, tuning = parse_mode(mode)
    policy = mode_policy(name, k, p_min, a.reach, draft_max, tuning)
    if getattr(a, "costs", None):
        pair.costs = mode_costs(a.costs, a.longest, draft_max)
    label = f"fixed k={k}" if name == "fixed" else mode
    # before the pair takes it (its attach is recorded)
    steps, events = record_steps(policy) if isinstance(policy, AutoPolicy) else (None, None)
    pair.set_policy(policy)
    if warm:
        pair.reset()
        pair.generate(WARM_PROMPT, max_tokens=a.tokens, seed=12345 + seed, **regime.llamaspec_kwargs())
    if a.synth and name == "fixed":
        kind, value = a.synth
        rates = resolve_rates(k, **({"rates": value} if kind == "rates" else {"length": value}))
        with SyntheticAcceptance(pair, rates, seed=k) as synth:
            row = run_mode(pair, label, prompts, n_tokens, regime, seed)
        row.synthetic = synth.label
    else:
        row = run_mode(pair, label, prompts, n_tokens, regime, seed)
    if steps is not None:   # what it measured explains what it chose
        row.auto_events = [events]
        states.append(f"- {label}'s cost model at the end{mark}: {auto_state(policy)}; "
                      f"{row.shadow_probes} shadow probes; draft length by step (s/x: a shadow probe "
                      f"accepted/rejected, | a new request): `{''.join(steps)}`")
    print(f"done: {regime.name} {row.name}{mark}: {row.tps:.2f} tok/s", file=sys.stderr)
    return row


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def regime_section(regime, rows: list, states: list, where: str, results: list) -> list[str]:
    """One regime: every llamaspec mode and peer row with its ratios, then the same draft lengths side by side."""
    plain = next(r for r in rows if r.mode == "plain")
    ran = [r for r in results if not r.skipped]
    best_peer = max(ran, key=lambda r: r.tps, default=None)
    lines = [f"## {regime.describe()}{where}", "",
             "| engine / mode | tok/s | vs llamaspec plain | vs best peer | drafted | acceptance | tokens/pass | "
             "Python overhead | per step | rollback per step | draft per token | verify per pass | command |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    peer_tps = best_peer.tps if best_peer else 0.0
    for r in rows:
        tpp = f"{r.tokens / r.passes:.2f}" if r.passes else "-"
        ovh = f"{100 * sum(r.overhead) / len(r.overhead):.1f}%" if r.overhead else "-"
        step = f"{sum(r.step_overhead_ms) / len(r.step_overhead_ms):.2f} ms" if r.step_overhead_ms else "-"
        rollback = f"{sum(r.rollback_ms) / len(r.rollback_ms):.3f} ms" if r.rollback_ms else "-"
        per_draft = f"{1000 * r.draft_seconds / r.drafted:.2f} ms" if r.drafted else "-"
        per_pass = f"{1000 * r.verify_seconds / r.passes:.2f} ms" if r.passes else "-"
        lines.append(f"| llamaspec {r.name} | {r.tps:.2f} | {_ratio(r.tps, plain.tps)} | {_ratio(r.tps, peer_tps)} | "
                     f"{r.drafted} | {100 * r.acceptance:.1f}% | {tpp} | {ovh} | {step} | {rollback} | {per_draft} | "
                     f"{per_pass} | (top of the report) |")
    for r in results:
        command = f"`{r.cmd}`" if r.cmd else "-"
        if r.skipped:
            lines.append(f"| {r.peer} k={r.k} | not run: {r.skipped.replace('|', '/')} | - | - | - | - | - | - | - | "
                         f"- | - | - | {command} |")
            continue
        acceptance = f"{100 * r.accepted / r.drafted:.1f}%" if r.drafted else "-"
        lines.append(f"| {r.peer} k={r.k} | {r.tps:.2f} | {_ratio(r.tps, plain.tps)} | {_ratio(r.tps, peer_tps)} | "
                     f"{r.drafted} | {acceptance} | - | - | - | - | - | - | {command} |")
    lines += [""] + states + ([""] if states else [])
    spread = [f"{r.name} {' '.join(f'{x:.2f}' for x in r.round_tps)}" for r in rows if len(r.round_tps) > 1]
    if spread:
        lines += [f"llamaspec's rounds (tok/s each round, interleaved): {'; '.join(spread)}", ""]
    fixed = {int(r.mode.split("=")[1]): r for r in rows if r.mode.startswith("fixed k=")}
    synth = f" [{SYNTH}]" if any(r.synthetic for r in rows) else ""
    names = list(dict.fromkeys(r.peer for r in results))
    if fixed and names:
        lines += [f"Same draft length (tok/s; llamaspec fixed k / the peer at k){synth}:", "",
                  f"| k | llamaspec fixed k{synth} | " + " | ".join(names) + " |", "|---" * (2 + len(names)) + "|"]
        for k, mine in sorted(fixed.items()):
            cells = []
            for name in names:
                r = next((r for r in results if r.peer == name and r.k == k), None)
                cells.append("-" if r is None else "not run" if r.skipped else
                             f"{r.tps:.2f} (llamaspec {_ratio(mine.tps, r.tps)})")
            lines.append(f"| {k} | {mine.tps:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def per_request_best(rows: list) -> tuple[float, list[str]] | None:
    """The session's tok/s had each request run in the mode (plain or a fixed k) that was fastest on it (a ceiling
    for a policy that picks one length a request, known only after the run), and which mode that was for each; None
    without a row that ran every request."""
    full = [r for r in rows if r.runs and len(r.run_tokens) == len(r.runs) and all(r.runs)]
    if not full or len({len(r.runs) for r in full}) != 1:
        return None
    tokens = seconds = 0.0
    picks = []
    for i in range(len(full[0].runs)):
        best = max(full, key=lambda r: r.runs[i])
        tokens += best.run_tokens[i]
        seconds += best.run_tokens[i] / best.runs[i]
        picks.append(best.mode.removeprefix("fixed "))
    return tokens / seconds, picks


def session_section(regime, rows: list, results: list) -> list[str]:
    """The mixed session: each request's tok/s and the session's for every mode and peer, then `auto` (and
    `auto+warm`) against the best fixed k, llama-server's best k and ik_llama.cpp's autotune."""
    kinds = [kind for kind, _, _ in MIXED]
    lines = [f"### The mixed session, {regime.describe()}", "",
             "| engine / mode | " + " | ".join(kinds) + " | session tok/s |", "|---" * (len(kinds) + 2) + "|"]
    ran = [r for r in results if not r.skipped]
    for name, r in [(f"llamaspec {r.name}", r) for r in rows] + [(f"{r.peer} k={r.k}", r) for r in ran]:
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}" for x in r.runs) + f" | {r.tps:.2f} |")
    fixed = [r for r in rows if r.mode.startswith("fixed k=")]
    best_fixed = max(fixed, key=lambda r: r.tps, default=None)
    server = max((r for r in ran if r.peer.startswith("llama-server")), key=lambda r: r.tps, default=None)
    autotune = max((r for r in ran if r.peer.startswith(PEER_LABELS["ik-autotune"])), key=lambda r: r.tps,
                   default=None)
    lines.append("")
    oracle = per_request_best([r for r in rows if r.mode == "plain"] + fixed)
    if oracle and best_fixed:
        tps, picks = oracle
        lines.append(f"- ceiling: each request at its own best of plain and the fixed k ({', '.join(picks)}; known "
                     f"only afterwards, no policy has it) {tps:.2f} tok/s, {_ratio(tps, best_fixed.tps)} the best "
                     "single fixed k")
    for auto in (r for r in rows if r.mode.startswith("auto")):
        cells = [f"{auto.mode} / best fixed ({best_fixed.mode}): {_ratio(auto.tps, best_fixed.tps)}"
                 if best_fixed else f"{auto.mode} / best fixed: no fixed k ran"]
        cells.append(f"/ llama-server's best (k={server.k}): {_ratio(auto.tps, server.tps)}" if server
                     else "/ llama-server: not run")
        cells.append(f"/ {autotune.peer}: {_ratio(auto.tps, autotune.tps)}" if autotune
                     else "/ ik_llama.cpp --spec-autotune: not run")
        lines.append("- " + "; ".join(cells))
    return lines + [""]


def summary(regimes, llamaspec: dict, results: list) -> list[str]:
    """Per regime: llamaspec's plain and best mode against each peer's best draft length."""
    names = list(dict.fromkeys(r.peer for r in results))
    lines = ["## Best of each engine (tok/s; llamaspec best / the peer's best)", "",
             "| regime | llamaspec plain | llamaspec best | " + " | ".join(names) + " |",
             "|---" * (3 + len(names)) + "|"]
    for regime in regimes:
        rows = llamaspec[regime.name][0]
        plain = next(r for r in rows if r.mode == "plain")
        best = max(rows, key=lambda r: r.tps)
        cells = []
        for name in names:
            ran = [r for r in results if r.peer == name and r.regime == regime.name and not r.skipped]
            peer = max(ran, key=lambda r: r.tps, default=None)
            why = next((r.skipped for r in results if r.peer == name and r.regime == regime.name), "")
            cells.append(f"{peer.tps:.2f} (k={peer.k}; llamaspec {_ratio(best.tps, peer.tps)})" if peer
                         else f"not run: {why.replace('|', '/')}")
        lines.append(f"| {regime.name} | {plain.tps:.2f} | {best.tps:.2f} ({best.name}; "
                     f"{_ratio(best.tps, plain.tps)} plain) | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", help="draft GGUF (not with --drafter mtp)")
    ap.add_argument("--drafter", default="model", choices=["model", "mtp", "lookup+mtp"],
                    help="mtp: the target's own MTP head drafts; the peers run their MTP drafting (draft-mtp)")
    ap.add_argument("--tools", type=Path, help="folder with llama.cpp's llama-speculative-simple and llama-server")
    ap.add_argument("--ik-tools", type=Path, help="folder with ik_llama.cpp's llama-server (its build/bin)")
    ap.add_argument("--peers", default="speculative-simple,llama-server,ik",
                    help="peers to run (comma-separated): speculative-simple, llama-server, ik, ik-autotune, "
                         "ik-autotune-own")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=default_threads(), help="llamaspec's threads (peers: their own)")
    ap.add_argument("--no-repack", action="store_true", help="CPU only: turn off weight repacking (every engine)")
    ap.add_argument("-ngl", type=int, default=-1, help="target layers on the GPU (-1 = all; peers: -ngl 99)")
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"],
                    help="llamaspec's (the peers keep their default: auto in llama.cpp, on in ik_llama.cpp)")
    ap.add_argument("--k", default="5", help="draft lengths (comma-separated) of the fixed policy and the peers")
    ap.add_argument("--modes", default="plain,fixed,confidence,threshold,auto",
                    help="policies to run; NAME:p=X sets that policy's confidence stop p_min (e.g. auto:p=0), "
                         "NAME:max=N its longest draft (on a hybrid target past the snapshots a user's load keeps, "
                         "which stay as they are: each longer draft saves a checkpoint); "
                         "NAME+warm (auto+warm) runs one untimed request first with the same policy object, as a "
                         "server or chat session keeps it between requests")
    ap.add_argument("--regimes", default="greedy,filters,temp",
                    help="greedy; filters (llama.cpp's default top-k/top-p/min-p, temperature last); temp "
                         "(temperature only)")
    ap.add_argument("--temp", type=float, default=0.8, help="temperature of the sampled regimes")
    ap.add_argument("--prompts", default="code,prose")
    ap.add_argument("--workload", default="sets", choices=["sets", "mixed"],
                    help="sets: --prompts x --per-set, --tokens each; mixed: one session of requests that change "
                         "character (code, prose, a copy-heavy edit, a short answer, a long reasoning answer)")
    ap.add_argument("--per-set", type=int, default=4, help="prompts taken from each set")
    ap.add_argument("--llama-extra", default="",
                    help="flags added to every peer command (the report shows them); the peers run fastest "
                         "without any")
    ap.add_argument("--server-timeout", type=float, default=900,
                    help="seconds a llama-server may take to load, and to answer one request")
    ap.add_argument("--spec-type", default=None,
                    help="the peers' --spec-type [default: from the draft: draft-eagle3 for an EAGLE-3 draft, "
                         "draft-dflash for a DFlash one, else draft-simple; draft-mtp with --drafter mtp]")
    ap.add_argument("--synthetic-rates", metavar="P0,P1,..",
                    help=f"benchmarking only ({SYNTH}): keep draft tokens by these per-position rates, one per "
                         "draft position (--k must be their count); llama-server gets --spec-synth-rates")
    ap.add_argument("--synthetic-len", type=float, metavar="L",
                    help=f"benchmarking only ({SYNTH}): the same from a mean acceptance length L (tokens per "
                         "target pass); llama-server gets --spec-synth-len")
    ap.add_argument("--tree", type=float, metavar="THRESHOLD",
                    help="tree verification (llamaspec.tree, draft model + attention target): a sibling beside the "
                         "chain where the draft's top probability is below THRESHOLD and the measured costs say it "
                         "pays; every llamaspec row runs with it (compare with a run without --tree)")
    ap.add_argument("--tree-siblings", type=int, default=2, help="with --tree: at most this many siblings a pass")
    ap.add_argument("--rounds", type=int, default=1,
                    help="llamaspec's modes run this many times, interleaved (every mode once a round, each with a "
                         "fresh policy); rows sum the rounds and the report prints each round's tok/s")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if (a.draft is None) == (a.drafter == "model"):
        ap.error("give --draft with --drafter model (the default), and no --draft with the MTP drafters")
    try:
        regimes = peers.parse_regimes(a.regimes, a.temp)
        ks = [int(k) for k in a.k.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    a.peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    if any(p not in PEER_LABELS for p in a.peers):
        ap.error(f"--peers: choose from {', '.join(PEER_LABELS)}")
    modes = a.modes.split(",")
    for mode in modes:
        try:
            parse_mode(mode)
        except ValueError as e:
            ap.error(f"--modes: {e}")
    if "plain" not in modes:
        modes.insert(0, "plain")   # every ratio is against it
    a.synth = ()
    if a.synthetic_rates is not None and a.synthetic_len is not None:
        ap.error("--synthetic-rates and --synthetic-len: one of the two")
    if a.synthetic_rates is not None or a.synthetic_len is not None:
        a.synth = ("rates", tuple(parse_rates(a.synthetic_rates))) if a.synthetic_rates is not None \
            else ("len", a.synthetic_len)
        modes = ["plain", "fixed"]   # a policy would learn from acceptance that is not there
        try:
            for k in ks:
                kind, value = a.synth
                resolve_rates(k, **({"rates": value} if kind == "rates" else {"length": value}))
                peers.synth_flags(a.synth, k)
        except (ValueError, InvalidParameterError) as e:
            ap.error(str(e))

    if a.workload == "mixed":
        prompts = [prompt for _, prompt, _ in MIXED]
        n_tokens = [max(int(round(share * a.tokens)), 1) for _, _, share in MIXED]
        a.prompts = "mixed: " + ", ".join(f"{kind} ({n})" for (kind, _, _), n in zip(MIXED, n_tokens))
    else:
        prompts = [p for name in a.prompts.split(",") for p in {"code": CODE, "prose": PROSE}[name][:a.per_set]]
        n_tokens = a.tokens
    if a.spec_type is None:  # the same drafter llamaspec picks for this file
        arch = read_model_info(a.draft).arch if a.draft else None
        a.spec_type = "draft-mtp" if a.draft is None else \
            {"eagle3": "draft-eagle3", "dflash": "draft-dflash"}.get(arch, "draft-simple")
    case = peers.Case(a.target, a.draft, a.spec_type, 2048, a.ngl, a.no_repack, tuple(shlex.split(a.llama_extra)),
                      a.synth)

    # 1. llamaspec, every regime on one load; closed before the peers load the same files
    # a hybrid target keeps one recurrent-state snapshot per token of the longest draft any mode will ask for; the
    # open-ended modes reach as far as load_pair lets them on this target (loading.snapshot_reach)
    a.reach = open_reach(a.target, a.draft, a.drafter, modes)
    longest = max(ks + [make_policy(name, draft_max=reach).draft_max for name, reach in a.reach.items()])
    pair = load_pair(a.target, a.draft, n_ctx=case.n_ctx, n_threads=a.threads, no_repack=a.no_repack,
                     n_gpu_layers=a.ngl, policy="fixed", draft_max=ks[0], flash_attn=a.flash_attn,
                     drafter=a.drafter, n_rs_seq=max(longest, 1))
    try:
        a.costs, a.longest = {}, longest
        if hasattr(pair, "warm_up") and pair.target_ctx.output_on_gpu:
            a.costs = warm_ups(pair, longest, modes)
        if a.tree is not None:
            from llamaspec.tree import TreeSettings, enable_tree

            enable_tree(pair, TreeSettings(a.tree, a.tree_siblings))   # measures the verify costs it needs
            a.costs = {}   # every mode starts from the tree's
        pair.generate("warm up", max_tokens=16)
        mine = run_llamaspec(pair, a, regimes, ks, modes, prompts, n_tokens)
        if a.tree is not None:
            t = pair.tree
            a.tree_line = (f"- tree verification: threshold {a.tree}, at most {a.tree_siblings} siblings; "
                           f"{t.drafter.unsure} drafted positions were unsure (a sibling offered), {t.tree_passes} of "
                           f"{t.passes} passes were trees (the siblings' rows paid), {t.siblings_taken} siblings stood")
    finally:
        pair.close()

    # 2. the peers; the report is written again after each, so a run cut short keeps what it measured
    results, versions = [], []
    us, _ = python_speed()
    hw = f"{hardware()}; Python: `auto`'s own hooks {us:.1f} us a step on a fixed trace (bench_engine.python_speed)"
    write_report(a, hw, case, prompts, regimes, mine, results, versions, final=not a.peers)
    for i, name in enumerate(a.peers):
        exe, why = peer_binary(a, name, case)
        versions.append(f"{PEER_LABELS[name]}: `{exe}` ({peers.tool_version(exe)})" if exe
                        else f"{PEER_LABELS[name]}: not run ({why})")
        results += peer_results(name, exe, why, case, ks, regimes, prompts, n_tokens, a.server_timeout)
        write_report(a, hw, case, prompts, regimes, mine, results, versions, final=i == len(a.peers) - 1)


def write_report(a, hw: str, case, prompts, regimes, mine: dict, results: list, versions: list, final: bool) -> None:
    """The markdown report (printed when final, and written to --out) and the rows as JSON (--json)."""
    def described(path):
        if not path:
            return "none"
        return f"{Path(path).name} ({Path(path).stat().st_size / 2**30:.2f} GiB)"

    title = f"# llamaspec engine benchmark, {SYNTH} ({a.synth[0]} {a.synth[1]}): timing only, the text is not " \
        "the target's" if a.synth else "# llamaspec engine benchmark"
    lines = [title, "",
             f"- command: `{shlex.join([sys.executable, *sys.argv])}`",
             f"- target: {described(a.target)}; draft: {described(a.draft)}; drafter: {a.drafter} "
             f"(peers: {a.spec_type})",
             f"- hardware: {hw}",
             f"- llamaspec: threads {a.threads}, flash attention {a.flash_attn}, context {case.n_ctx}, "
             f"no_repack={a.no_repack}; ratios of sampled regimes are against plain decoding in the same regime"
             + "".join(f"; {name}'s longest draft {reach} (what a load of this target gives it)"
                       for name, reach in getattr(a, "reach", {}).items() if reach is not None),
             *[f"- peer {v}" for v in versions],
             f"- {len(prompts)} prompts ({a.prompts}), "
             f"{'new tokens as given' if a.workload == 'mixed' else f'{a.tokens} new tokens each'}, one warm-up per "
             f"engine{f'; llamaspec in {a.rounds} interleaved rounds' if getattr(a, 'rounds', 1) > 1 else ''}; peer "
             f"commands are shown with the first prompt (the others differ only in it); "
             f"date {time.strftime('%Y-%m-%d %H:%M')}", ""]
    if getattr(a, "tree_line", None):
        lines.insert(-1, a.tree_line)
    if not final:
        lines += ["**Partial: the run has not finished (the peers after the last one listed are missing).**", ""]
    lines += summary(regimes, mine, results)
    for regime in regimes:
        rows, states, where = mine[regime.name]
        if a.workload == "mixed":
            lines += session_section(regime, rows, [r for r in results if r.regime == regime.name])
        lines += regime_section(regime, rows, states, where, [r for r in results if r.regime == regime.name])
    report = "\n".join(lines)
    if final:
        print(report)
    if a.out:
        a.out.write_text(report + "\n")
    if a.json:
        table = []
        for regime in regimes:
            rows = mine[regime.name][0]
            plain = next(r for r in rows if r.mode == "plain")
            table += [{"regime": regime.name, "temperature": regime.temperature, "engine": "llamaspec",
                       "mode": r.mode, "synthetic": r.synthetic or None, "tok_s": r.tps, "vs_plain": r.tps / plain.tps if plain.tps else None,
                       "drafted": r.drafted, "accepted": r.accepted, "acceptance": r.acceptance,
                       "rollback_ms_per_step": sum(r.rollback_ms) / len(r.rollback_ms) if r.rollback_ms else None,
                       "draft_ms_per_token": 1000 * r.draft_seconds / r.drafted if r.drafted else None,
                       "verify_ms_per_pass": 1000 * r.verify_seconds / r.passes if r.passes else None,
                       "request_tok_s": r.runs, "request_tokens": r.run_tokens, "round_tok_s": r.round_tps or None,
                       **({"auto_events": r.auto_events} if r.auto_events else {})}
                      for r in rows]
            table += [{"regime": regime.name, "temperature": regime.temperature, "engine": r.peer,
                       "mode": f"k={r.k}", "synthetic": SYNTH if a.synth else None, "tok_s": r.tps, "vs_plain": r.tps / plain.tps if plain.tps else None,
                       "drafted": r.drafted, "accepted": r.accepted, "command": r.cmd, "skipped": r.skipped or None,
                       "request_tok_s": r.runs}
                      for r in results if r.regime == regime.name]
        a.json.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    from llamaspec.cli.options import handle_errors

    handle_errors(main)()  # a missing or mismatched model: one line, not a traceback
