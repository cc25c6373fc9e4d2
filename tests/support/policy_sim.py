"""A fake clock for draft-length policies: requests on a machine described by its cost curves, stepped the way the
engine steps them (what a policy sees and what the clock charges follow engine.py and drafters/model.py).

Times are in units of one plain target pass. Per request: the target processes the prompt; the drafter is
prefilled only when the policy will draft first (begin(prefill=...)); each step drafts k = min(policy's k,
budget - 1) tokens, the drafter first catching up on the tokens it missed in one batch (restarting on the last 64
tokens when more than 128 are missing). The engine reports that catch-up, and the first token decoded with it,
as setup, which the policy does not see; the clock charges it. Acceptance is a Bernoulli run per position.

    PYTHONPATH=. python tests/support/policy_sim.py   # auto against plain and every fixed k on CPU-like and GPU-like machines
    PYTHONPATH=. python tests/support/policy_sim.py --recorded   # auto against the best fixed k, recorded H200 cases
    PYTHONPATH=. python tests/support/policy_sim.py --mixed      # the same on mixed sessions (requests of changing acceptance)
    PYTHONPATH=. python tests/support/policy_sim.py --traces     # the same on acceptance recorded on a real pair
    PYTHONPATH=. python tests/support/policy_sim.py --calibration   # the synthetic MTP file's own answers, the load's
                                                                    # costs measured with errors
    PYTHONPATH=. python tests/support/policy_sim.py --deep   # the same answers in an agent session 30K-87K tokens deep
    PYTHONPATH=. python tests/support/policy_sim.py --replay REPORT.md   # a bench_engine report's auto: its choices
                                                                          # replayed, beside the simulator's auto
    PYTHONPATH=. python tests/support/policy_sim.py --events REPORT.json [--steps]   # its auto's recorded steps fed
                                                      # to a fresh policy: what it believed at each request's end
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable

from llamaspec.policy import AutoPolicy, AutoTuning, Costs, DraftPolicy, FixedPolicy, Hooks, make_policy
from llamaspec.policy.calibration import _SWEEPS, _WARM_SAMPLES

WINDOW, MAX_CATCHUP = 64, 128   # ModelDrafter's defaults
# the load's errors where a report draws them: 3% a pass, each size's warm passes as calibration.py times them
LOAD_ERRORS = (0.03, _WARM_SAMPLES, _SWEEPS)


@dataclass(frozen=True)
class Machine:
    name: str
    verify: Callable[[int], float]      # one target pass over n tokens
    draft_cost: float                   # one draft token (one draft pass over one token)
    prefill_per_token: float            # target prompt processing per token (batched)
    noise: float = 0.0                  # relative timing noise (uniform +-), for a shared machine
    spikes: float = 0.0                 # chance that a phase takes 5x its time (another process took the cores)
    switch: tuple = (0.0, 0.0)          # extra time of the first and second target pass after its batch size
                                        # changed (a GPU re-captures its CUDA graph: one pass uncaptured, one captured)
    draft_switch: float = 0.0           # extra draft time of a step whose draft length differs from the last one's
    first_draft: float = 0.0            # extra draft time of a request's first draft (attaching its sampler)
    draft_step: float = 0.0             # draft time of a drafting step beyond its tokens' (the drafter's bookkeeping)
    gpu: bool = False                   # load_pair warms the pair up and measures its costs (Pair.warm_up)
    per_context: float = 0.0            # a target pass's extra time a token of context, whatever its size (a GPU
                                        # reads the attention layers' KV cache once a pass)
    draft_per_context: float = 0.0      # ... a drafted token's (the drafter's own attention)

    def verify_at(self, n: int, same_before: int, context: int = 0) -> float:
        """A target pass over n tokens after `same_before` passes of that size in a row, `context` tokens held."""
        extra = self.switch[0] if same_before == 0 else self.switch[1] if same_before == 1 else 0.0
        return self.verify(n) + extra + self.per_context * context

    def costs(self, k_max: int, noise: float = 0.0, samples: int = 1, rng: random.Random | None = None,
              sweeps: int = 1, stretch: float = 0.0) -> Costs:
        """What Pair.warm_up measures (on a short prompt: no context): warm passes of every size, a drafted token,
        the cold passes' excess; with `noise`, each pass and drafting step it times off by a normal error of that
        relative size, and the median of `samples` of them kept (calibration.py's warm samples of each size), taken
        in `sweeps` sweeps over the sizes (samples / sweeps of a size in a row each). `stretch`: a slow stretch of the
        machine while one sweep timed one size (drawn), all of its passes there that much slower."""
        slow = (rng.randrange(1, k_max + 2), rng.randrange(sweeps)) if stretch else None

        each = max(samples // sweeps, 1)   # a size's samples in a row, each sweep

        def timed(seconds: float, n: int = 0) -> float:
            if not noise and not stretch:
                return seconds
            return median(seconds * (1.0 + noise * rng.gauss(0.0, 1.0)) * (1.0 + stretch if (n, i // each) == slow
                                                                          else 1.0) for i in range(samples))
        return Costs({n: timed(self.verify(n), n) for n in range(1, k_max + 2)}, self.draft_cost + self.draft_step,
                     [self.switch[0], self.switch[1]] * (k_max + 1),
                     {k: timed(self.draft_step + k * self.draft_cost) for k in range(1, k_max + 1)})

    def draft_batch(self, n: int) -> float:
        """The draft over n tokens at once: one token is a draft step, more are prompt-like processing."""
        return self.draft_cost if n <= 1 else self.draft_cost * (1.0 + self.prefill_per_token * (n - 1))


CPU = Machine("cpu v(n)=n c=0.3", lambda n: float(n), 0.3, 0.15)
GPU = Machine("gpu v(n)=1+0.12(n-1) c=0.05", lambda n: 1.0 + 0.12 * (n - 1), 0.05, 0.01, gpu=True)


@dataclass(frozen=True)
class GreedyRuns:
    """Greedy decoding's agreement, as one request's `acceptance`: from a position, the drafter's proposals agree
    with the target's tokens for a run of L tokens, L = 0 with chance 1 - `first`, else 1 plus a geometric number,
    each further token with chance `stay`. The drafter's proposals depend only on the text before them, so a step
    that starts inside a run sees what is left of it (its k tokens and the target's own are the run's next k + 1
    when L > k), and one that starts after a disagreement draws a new run. Drafts of every length then see the same
    text, as fixed k on one greedy answer do; a Bernoulli draw per position would make every step independent."""

    first: float
    stay: float

    def draw(self, rng: random.Random) -> int:
        if rng.random() >= self.first:
            return 0
        n = 1
        while rng.random() < self.stay:
            n += 1
        return n


@dataclass(frozen=True)
class Trace:
    """A recorded request (benchmarks/probes/record_acceptance.py): the chance that a token drafted at each position
    of the answer is accepted, given the text before it; greedy, 1 or 0 (the draft's argmax is the target's token),
    so a draft from position i keeps exactly the run of agreements from i, at any length. Past its end the last
    position repeats."""

    chances: tuple

    def at(self, position: int) -> float:
        return self.chances[min(position, len(self.chances) - 1)]


@dataclass
class RunResult:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list = field(default_factory=list)       # per request: prompt, drafter prefill, first step
    drafted: int = 0
    draft_prefills: int = 0                        # requests whose drafter was prefilled before the first step
    shadows: int = 0                               # shadow probes
    tails: int = 0                                 # tail probes (one token drafted past k, not verified)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


class Load:
    """How much slower than usual the machine runs at each moment (bins of one plain pass): the same pattern for
    every policy run with one seed, so that comparisons see the same interference."""

    def __init__(self, machine: Machine, seed: int):
        self.machine, self.rng, self.bins = machine, random.Random(seed ^ 0x5EED), []

    def factor(self, now: float) -> float:
        m = self.machine
        while len(self.bins) <= int(now):
            f = 1.0 + m.noise * (2 * self.rng.random() - 1) if m.noise else 1.0
            self.bins.append(f * (5.0 if m.spikes and self.rng.random() < m.spikes else 1.0))
        return self.bins[int(now)]


def simulate(policy: DraftPolicy, machine: Machine, acceptance: float, requests: int = 12, prompt_len: int = 40,
             max_tokens: int = 64, seed: int = 0, run_on: float | None = None,
             session: list | None = None, calibration: tuple = (0.0, 1)) -> RunResult:
    """One policy object over `requests` requests (fresh caches each, as the benchmarks reset them). Each draft
    token is accepted with chance `acceptance`, or, with `run_on`, the first one is and every later one with chance
    `run_on` once the one before it was (greedy decoding, where agreement comes in runs). `acceptance` may also be a
    list: the chance at each draft position given the ones before it were accepted (the last repeats), as measured
    by position on a real pair. `session`, a list of (acceptance, max_tokens), replaces `requests`, `acceptance`
    and `max_tokens` by one request each (a mixed workload: requests of changing character); a request's acceptance
    may be a `Trace`, recorded on a real pair, or `GreedyRuns`; an entry (acceptance, max_tokens, held) is a request
    whose prompt follows `held` tokens the caches already hold (an agent session's turn: only its prompt is
    processed, every pass pays for the context; Machine.per_context). `calibration`: (noise, samples) of the costs a
    GPU machine measures at load (Machine.costs, on a short prompt), drawn from the seed."""
    rng, load = random.Random(seed), Load(machine, seed)
    plan = session if session is not None else [(acceptance, max_tokens)] * requests
    by_position, flat, trace, n_out = None, acceptance, None, 0

    def chance(accepted: int) -> float:   # of accepting draft position accepted + 1, the ones before accepted
        if trace is not None:
            return trace.at(n_out + accepted)
        if by_position is not None:
            return by_position[min(accepted, len(by_position) - 1)]
        return flat if run_on is None or not accepted else run_on

    out = RunResult()
    hooks = Hooks(policy)   # as Pair.set_policy takes a policy
    noise, samples, *layout = calibration
    hooks.attach("per_token", machine.costs(policy.draft_max, noise, samples, random.Random(seed ^ 0xCA1), *layout)
                 if machine.gpu else None)

    def spend(seconds: float) -> float:   # a phase that starts now, on the loaded machine
        return seconds * load.factor(out.seconds)

    for acceptance, max_tokens, *held in plan:
        held = held[0] if held else 0
        by_position = list(acceptance) if isinstance(acceptance, (list, tuple)) else None
        flat = acceptance
        runs = acceptance if isinstance(acceptance, GreedyRuns) else None
        trace = acceptance if isinstance(acceptance, Trace) else None
        run = runs.draw(rng) if runs else 0   # the agreeing tokens from the next step's first position on
        start = out.seconds
        hooks.new_request()
        hooks.held(held + prompt_len - 1)
        out.seconds += spend(machine.prefill_per_token * (prompt_len - 1))  # the prompt but its last token
        history = prompt_len - 1            # committed tokens (the target's cache); `last` is pending
        in_draft = 0                        # history tokens the drafter holds
        if policy.next_draft_len() > 0:     # begin(prefill=True): the drafter catches up before the first step
            out.seconds += spend(machine.draft_batch(history))
            in_draft = history
            out.draft_prefills += 1
        n_out, size, same = 0, 0, 0           # the target's last batch size and how often in a row
        last_k, drafted_yet = 0, False
        while n_out < max_tokens:
            asked = policy.next_draft_len()
            k = max(min(asked, max_tokens - n_out - 1), 0)
            # a shadow probe on a plain step, a tail probe (one token past k) on a drafting one (Engine._draft_lens)
            shadow = (k > 0 or not asked) and hooks.shadow_len() > 0
            setup = draft = 0.0
            if k or shadow:
                missing = history - in_draft
                if missing > MAX_CATCHUP:
                    missing = min(history, WINDOW)
                first = spend(machine.draft_batch(missing + 1))   # the missed tokens and `last`: d_1
                context = held + history
                tail = shadow and k > 0
                rest = spend(machine.draft_cost * max(k - 1 + tail, 0) + (machine.draft_switch if k != last_k else 0.0)
                             + (0.0 if drafted_yet else machine.first_draft) + machine.draft_step
                             + machine.draft_per_context * context * max(k + tail, 1))
                drafted_yet = True
                setup, draft = (first, rest) if missing > 2 else (0.0, first + rest)
                out.seconds += first + rest
            if shadow and not k:   # judged against the token the target emits; the target's pass stays one token
                hooks.shadow(1.0 if (run > 0 if runs else rng.random() < chance(0)) else 0.0, setup + draft)
                out.shadows += 1
                setup = draft = 0.0
            last_k = k
            same = same + 1 if size == k + 1 else 0
            size = k + 1
            verify = spend(machine.verify_at(k + 1, same, held + history))
            out.seconds += verify
            accepted, agreeing = 0, run
            if runs:
                accepted = min(k, run)
                run = run - k - 1 if run > k else runs.draw(rng)
            while not runs and accepted < k and rng.random() < chance(accepted):
                accepted += 1
            if shadow and k:   # a tail probe: judged by the token the target emits after all k, if accepted
                reached = accepted == k
                hooks.shadow((1.0 if (agreeing > k if runs else rng.random() < chance(k)) else 0.0) if reached else None,
                             0.0)
                out.tails += 1
            policy.update(k, accepted, draft, verify)
            if n_out == 0:
                out.ttft.append(out.seconds - start)
            n_out += min(accepted + 1, max_tokens - n_out)
            history += 1 + accepted
            in_draft = history if k or shadow else in_draft   # after accepted(n) the drafter holds the new history
            out.drafted += k
        out.tokens += n_out
    return out


def compare(machine: Machine, acceptance: float, k_max: int = 12, **kwargs) -> dict:
    """auto, plain and every fixed k on the same machine, load pattern and acceptance."""
    runs = {"plain": simulate(FixedPolicy(0), machine, acceptance, **kwargs),
            "auto": simulate(make_policy("auto", draft_max=k_max), machine, acceptance, **kwargs)}
    for k in range(1, k_max + 1):
        runs[f"k={k}"] = simulate(FixedPolicy(k), machine, acceptance, **kwargs)
    best = max((name for name in runs if name.startswith("k=")), key=lambda name: runs[name].throughput)
    return {"runs": runs, "best_fixed": best}


# Verify cost v(n) / v(1) of a 32B-shaped Q4_0 target on an H200 (benchmarks/results/h200-cost-curve.json); the
# 2-layer drafts cost 0.046 of a target token, the 0.5B-shaped one 0.119.
H200_V = [1.0, 1.07, 1.23, 1.42, 1.58, 1.77, 1.89, 2.11, 2.26, 2.31, 2.31, 2.30, 2.33, 2.35, 2.34, 2.33, 2.55]
H200 = Machine("h200 curve c=0.046", lambda n: H200_V[n - 1], 0.046, 0.01, gpu=True)
H200_BIG_DRAFT = Machine("h200 curve c=0.119", lambda n: H200_V[n - 1], 0.119, 0.01, gpu=True)
# the same with llama.cpp's CUDA graphs as measured on the H200 (benchmarks/results/h200-switch-cost.md): the two
# passes after a change of batch size take 0.34 and 0.46 of a plain pass more, the draft 0.3 more at a change
GRAPHS = dict(switch=(0.34, 0.46), draft_switch=0.3, gpu=True)
H200_GRAPHS = Machine("h200 curve c=0.046, graphs", lambda n: H200_V[n - 1], 0.046, 0.01, **GRAPHS)
H200_GRAPHS_BIG_DRAFT = Machine("h200 curve c=0.119, graphs", lambda n: H200_V[n - 1], 0.119, 0.01, **GRAPHS)
# a 27B qwen35-shaped hybrid target with its MTP head on the H200 (results/h200-auto-before-after.md: fixed k=2 and
# k=3 verified in 1.34 and 1.59 plain passes, a drafted token 0.11, a cold pass 0.6-1.0 plain passes slower)
V27 = [1.0, 1.09, 1.34, 1.59, 1.70, 1.82, 1.94, 2.06, 2.18, 2.30, 2.42, 2.54, 2.66]
H200_MTP = Machine("h200 27B hybrid + MTP c=0.11, graphs", lambda n: V27[n - 1], 0.11, 0.01,
                   switch=(0.7, 0.7), draft_switch=0.1, gpu=True)
# the real 2-core CPU pair's costs (a perfect draft about breaks even), on a shared machine: +-30% timing noise,
# 2% of moments five times slower
SHARED_CPU = Machine("cpu v(n)=1+0.45(n-1) c=0.58, shared", lambda n: 1.0 + 0.45 * (n - 1), 0.58, 0.15,
                     noise=0.3, spikes=0.02)
CHAT, LONG = dict(requests=12, max_tokens=64), dict(requests=4, max_tokens=128)
TABLE = [(CPU, CHAT, (1.0, 0.7, 0.0)), (SHARED_CPU, CHAT, (0.9, 0.5)), (GPU, LONG, (1.0, 0.7, 0.0)),
         (H200, LONG, (1.0, 0.7)), (H200_BIG_DRAFT, LONG, (0.0,)), (H200_GRAPHS, LONG, (1.0, 0.7)),
         (H200_GRAPHS_BIG_DRAFT, LONG, (0.0,)), (H200_MTP, LONG, (0.8, 0.6))]


# Recorded on the H200 (results/h200-peers-mtp27b-k123.md, h200-auto-warm-32b-draft70.md): the qwen35 27B MTP head's
# costs, and the 32B ~70% draft's; acceptance by position as fixed k = 1, 2, 3 (and 5) measured it
V27_RECORDED = [1.0, 1.11, 1.345, 1.60, 1.75, 1.9, 2.05, 2.2, 2.35, 2.5, 2.65, 2.8, 2.95]
MTP_RECORDED = Machine("h200 27B + MTP, recorded", lambda n: V27_RECORDED[n - 1], 0.099, 0.01, switch=(0.6, 0.6),
                       draft_switch=0.1, gpu=True)
D70_RECORDED = Machine("h200 32B + ~70% draft, recorded", lambda n: H200_V[n - 1], 0.078, 0.01,
                       switch=(0.45, 0.45), draft_switch=0.3, gpu=True)
# the same pair with its draft's cost per step as the H200 timed it (h200-uniform-32b-draft70-at-c25a40d.md: 2.70 ms
# for 3 tokens, 3.24-3.44 for 4, 3.70 for 5 against 10.4 ms a plain pass): a step 0.115 of a pass, a token 0.048
D70_STEP = Machine("h200 32B + ~70% draft, a step's own cost", lambda n: H200_V[n - 1], 0.048, 0.01,
                   switch=(0.45, 0.45), draft_switch=0.3, gpu=True, draft_step=0.115)
# the 32B pair's greedy answers (results/h200-uniform-32b-draft70-at-b907a91.md: fixed k=3 and k=5 made 3.20 and 4.27
# tokens a pass; GreedyRuns(0.55, 0.93) makes 3.21 and 4.25)
D70_GREEDY = GreedyRuns(0.55, 0.93)
# The auto suite's synthetic 27B hybrid with a 70% MTP head on the H200 (results/h200-auto-suite-uniform-mtp-greedy-at-
# a627829.md): warm passes of 1..4 tokens in 1.00, 1.07, 1.31, 1.56 plain passes (11.5 ms), a drafted token 0.10, a cold
# pass 0.5 slower; fixed k=1, 2, 3 made 1.66, 2.18, 2.52 tokens a pass (acceptance by position 0.667, 0.77, 0.66). The
# run made `auto` 0.934 (cold) and 0.985 (warm) of fixed k=2; this machine makes it about 0.977 and 0.989.
V27_SYNTH = [1.0, 1.07, 1.31, 1.56, 1.70, 1.82, 1.94, 2.06]
MTP_SYNTH_H200 = Machine("h200 synthetic 27B + 70% MTP head", lambda n: V27_SYNTH[n - 1], 0.10, 0.01, switch=(0.5, 0.5),
                         draft_switch=0.1, gpu=True)
RECORDED = [("MTP, greedy", MTP_RECORDED, [0.69, 0.70, 0.69], 3),
            ("MTP, T=0.8 temperature only", MTP_RECORDED, [0.82, 0.71, 0.66], 3),
            ("32B ~70%, T=0.8, acceptance rising along the draft", D70_RECORDED, [.81, .88, .85, .97, .97, .85], 12),
            ("32B ~70%, the same mean acceptance, flat (0.7)", D70_RECORDED, 0.7, 12),
            ("32B ~70%, greedy: runs of agreement", D70_RECORDED, D70_GREEDY, 12),
            ("synthetic MTP 70%, greedy (H200 at a627829)", MTP_SYNTH_H200, [0.667, 0.77, 0.66], 3),
            ("32B ~70% flat, a draft step's own cost (0.115)", D70_STEP, 0.7, 12),
            ("32B ~70% greedy runs, a draft step's own cost", D70_STEP, D70_GREEDY, 12)]


def cold_and_warm(machine: Machine, acceptance, k_max: int, seeds: int = 6) -> tuple[list, list]:
    """auto against the best fixed k of 1..k_max, 4 requests x 128 tokens, one ratio a seed: cold (a fresh policy)
    and warm (after one request)."""
    cold, warm = [], []
    for seed in range(seeds):
        best = max(simulate(FixedPolicy(k), machine, acceptance, requests=4, max_tokens=128, seed=seed).throughput
                   for k in range(1, k_max + 1))
        cold.append(simulate(make_policy("auto", draft_max=k_max), machine, acceptance, requests=4, max_tokens=128,
                             seed=seed).throughput / best)
        policy = make_policy("auto", draft_max=k_max)
        simulate(policy, machine, acceptance, requests=1, max_tokens=128, seed=seed + 100)
        warm.append(simulate(policy, machine, acceptance, requests=4, max_tokens=128, seed=seed).throughput / best)
    return cold, warm


# The suite's synthetic 27B MTP file (agreement 0.7) on an H100 (results/h100-auto-suite-uniform-mtp-greedy-at-
# 93beae3.md), its costs from the fixed rows: passes of 1..4 tokens 11.92, 13.07, 15.60, 18.20 ms; a drafting step
# 1.41, 2.62, 3.72 ms for 1..3 tokens (0.022 of a pass and 0.097 a token); a cold pass 0.56 slower. Its greedy
# answers' exact acceptance is the file's own walk (benchmarks/probes/synth_walk.py -> synth_mtp27b_walk.json), on
# which this machine makes fixed k=1 and k=3 0.958 and 0.962 of k=2, as the run measured them (0.958, 0.963).
V27_H100 = [1.0, 1.0965, 1.3087, 1.5268, 1.75, 1.97, 2.19, 2.41]
MTP_SYNTH_H100 = Machine("h100 synthetic 27B + 70% MTP head, fixed rows", lambda n: V27_H100[n - 1], 0.0969, 0.01,
                         switch=(0.56, 0.56), draft_switch=0.05, gpu=True, draft_step=0.0222)
WALK_FILE = Path(__file__).with_name("synth_mtp27b_walk.json")
# The same file at T=0.8, temperature only, on the H100 at f19e918 (results/h100-auto-suite-uniform-mtp-temp-at-
# f19e918.md): fixed k=1, 2, 3 made 1.50, 1.73, 1.86 tokens a pass (0.50, 0.46, 0.57 by position), and a change's two
# cold passes took 5.5 and 14.7 ms beyond 12.9 ms warm ones. Its two rounds drew the same seeds (bench_engine drew one
# set for every round then): one draw, `auto` 0.954 of k=1 cold. Here, 24 draws: 0.987 on average, 0.969 at worst
# with the costs exact, 0.955 at worst with the load's errors at 3% (acceptance drawn by position, not a walk).
MTP_SYNTH_H100_TEMP = dataclasses.replace(MTP_SYNTH_H100, name="h100 synthetic 27B + 70% MTP head, T=0.8 temperature "
                                          "only", switch=(0.46, 1.23))
RECORDED += [("synthetic MTP 70%, T=0.8 temperature only (H100 at f19e918)", MTP_SYNTH_H100_TEMP, [0.50, 0.46, 0.57],
              3)]


def walk_session(set_names=("code", "prose"), path: Path = WALK_FILE) -> list:
    """The synthetic MTP file's greedy answers (or `path`'s: PAIR_WALK_FILE) as a session, (Trace, the answer's
    length) each."""
    requests = json.loads(path.read_text())["requests"]
    return [(Trace(tuple(r["greedy"])), len(r["greedy"]) - 1) for r in requests if r["set"] in set_names]


# the same file on the H200 at 7beabe5, its costs as auto measured them there (h200-auto-suite-summary-at-7beabe5.md):
# with the load's errors, some seeds keep one-token drafts from the first request on, as the run's greedy rounds did.
# A change of batch size cost 5 ms on its first pass (llama.cpp runs it without a CUDA graph) and 13 on its second (it
# captures one) over 11.2 ms plain passes: the run's cold passes, `policy_sim.py --events` on its report
MTP_SYNTH_H200 = Machine("h200 synthetic 27B + 70% MTP head, auto's costs at 7beabe5",
                         lambda n: (1.0, 1.11, 1.36, 1.59)[min(n, 4) - 1] + 0.23 * max(n - 4, 0), 0.09, 0.01,
                         switch=(0.45, 1.16), draft_switch=0.05, gpu=True, draft_step=0.027)


# The auto suite's synthetic 32B pair (agreement 0.7) on an H100 at f19e918 (results/h100-auto-suite-uniform-pair-
# greedy-at-f19e918.md), its costs from the fixed rows: verification passes of k + 1 = 2, 3, 4, 6, 9 tokens 13.33,
# 16.17, 19.04, 23.43, 23.84 ms against a plain pass's 12.32 (llama.cpp's kernels make 9 tokens cost about 6); a
# drafting step 1.14 ms at k=1 to 5.2 at k=8 (0.045 of a pass and 0.048 a token). The pair's greedy answers are its
# own walk (synth_walk.py --pair -> synth_pair32b_walk.json): fixed k drafted exactly what the run's fixed rows drafted,
# and this machine makes k=1, 3, 5, 8 0.957, 0.966, 0.885, 0.883 of k=2 where the run measured 0.962, 0.971, 0.887,
# 0.896. The run made `auto` 0.955 of k=2 cold and 0.952 warm (three rounds): one round in three held one-token drafts
# from the first request's start to the end (its first drafts met text the draft gets wrong, rejected at position 1).
V32_PAIR_H100 = [1.0, 1.082, 1.3125, 1.545, 1.72, 1.902, 1.916, 1.924, 1.935]
PAIR_SYNTH_H100 = Machine("h100 synthetic 32B + 70% draft, fixed rows",
                          lambda n: V32_PAIR_H100[min(n, 9) - 1] + 0.01 * max(n - 9, 0), 0.048, 0.01,
                          switch=(0.55, 0.55), draft_switch=0.05, gpu=True, draft_step=0.045)
PAIR_WALK_FILE = Path(__file__).with_name("synth_pair32b_walk.json")
# the same costs with a useless draft (the suite's useless-pair agrees 4%): a shadow probe accepted by chance after
# requests of rejections must not start 20 steps of one-token drafts (the H100 run at f19e918 did, twice: 0.969 of
# plain)
TABLE += [(dataclasses.replace(PAIR_SYNTH_H100, name="h100 synthetic 32B pair's costs, a useless draft"), LONG,
           (0.04, 0.1))]


def walk_cold_and_warm(seeds: int, calibration: tuple = (0.0, 1), machine: Machine = MTP_SYNTH_H100,
                       pair: bool = False, tuning: AutoTuning | None = None) -> tuple[list, list]:
    """auto against the best fixed k on the synthetic MTP file's own answers (MTP_SYNTH_H100 unless told; with
    `pair` the synthetic pair's, k up to 12 against fixed 1, 2, 3, 5, 8 as the suite runs them): cold, and warm after
    bench_engine's warm-up request; greedy answers are one trace, so seeds vary only the calibration's errors.
    `tuning`: auto's, where not the defaults."""
    path, ks, k_max = (PAIR_WALK_FILE, (1, 2, 3, 5, 8), 12) if pair else (WALK_FILE, (1, 2, 3), 3)
    session, warm_up = walk_session(path=path), walk_session(("warm",), path)
    best = max(simulate(FixedPolicy(k), machine, 0.0, session=session).throughput for k in ks)
    cold, warm = [], []
    auto = (lambda: AutoPolicy(draft_max=k_max, tuning=tuning)) if tuning else \
        (lambda: make_policy("auto", draft_max=k_max))
    for seed in range(seeds):
        cold.append(simulate(auto(), machine, 0.0, session=session, seed=seed,
                             calibration=calibration).throughput / best)
        policy = auto()
        simulate(policy, machine, 0.0, session=warm_up, seed=seed, calibration=calibration)
        warm.append(simulate(policy, machine, 0.0, session=session, seed=seed).throughput / best)
    return cold, warm


def calibration(seeds: int = 40) -> None:
    """The synthetic MTP file's own answers with the costs measured at load off by a normal error a pass, and the
    median of 1, 3 or 5 warm passes of a size in a row kept, or of 6 taken in 3 sweeps over the sizes (what
    calibration.py keeps); then a slow stretch of the machine while the load timed one size in one sweep (all of
    those passes 6% slow, as one H100 load priced a 3-token pass): auto against the best fixed k."""
    def row(label: str, layout: str, cal: tuple, **kw) -> None:
        cold, warm = walk_cold_and_warm(seeds if cal[0] else 1, cal, **kw)
        print(f"| {label} | {layout} | {sum(cold) / len(cold):.3f} [{min(cold):.3f}] | "
              f"{sum(warm) / len(warm):.3f} [{min(warm):.3f}] |")

    now = f"{_WARM_SAMPLES} in {_SWEEPS} sweeps"
    print(f"{seeds} draws of the load's errors; the synthetic 27B MTP file's greedy answers on the H100's costs")
    print("| error a pass | warm passes kept | cold mean [min] | warm mean [min] |")
    print("|---|---|---|---|")
    for noise in (0.0, 0.01, 0.02, 0.03):
        for samples in ((1,) if not noise else (1, 3, 5)):
            row(f"{noise:.0%}", str(samples), (noise, samples))
        if noise:
            row(f"{noise:.0%}", now, (noise, _WARM_SAMPLES, _SWEEPS))
    row("3%, the H200's costs (7beabe5)", now, LOAD_ERRORS, machine=MTP_SYNTH_H200)
    row("3%, the 32B pair's answers on the H100's costs (f19e918)", now, LOAD_ERRORS, machine=PAIR_SYNTH_H100,
        pair=True)
    for name, kw in (("", {}), (", the 32B pair's answers", {"machine": PAIR_SYNTH_H100, "pair": True})):
        row(f"1% and a slow stretch: one size 6% slow in one sweep{name}", "5 in a row", (0.01, 5, 1, 0.06), **kw)
        row(f"1% and a slow stretch: one size 6% slow in one sweep{name}", now, (0.01, _WARM_SAMPLES, _SWEEPS, 0.06),
            **kw)


# the synthetic 27B on the H100 at depth: a pass reads the KV cache of its 16 attention layers (4 KV heads of 256, f16:
# 64 KiB a token, at ~3.3 TB/s ~20 ns, 1.66e-6 of a plain pass), the MTP head its one layer's
MTP_SYNTH_H100_DEEP = dataclasses.replace(MTP_SYNTH_H100, name="h100 synthetic 27B + MTP head, KV read a pass",
                                          per_context=1.66e-6, draft_per_context=1.04e-7)


def agent_session(first: int = 30_000, turns: int = 20, growth: int = 3_000) -> list:
    """An agent session on the synthetic MTP file's own answers: `turns` requests (its code and prose answers in
    turn) after first, first + growth, ... tokens already held."""
    answers = walk_session()
    return [(*answers[i % len(answers)], first + i * growth) for i in range(turns)]


def deep(seeds: int = 12) -> None:
    """auto against the best fixed k over an agent session 30K-87K tokens deep, where every pass pays for the context
    the load's short warm-up prompt did not hold (MTP_SYNTH_H100_DEEP): told the depth of each request (the engine's
    `held`), and not (a policy that ignores it: the load's prices of the sizes not running stay shallow), beside the
    same answers at no depth."""
    print(f"{seeds} draws of the load's errors (3% a pass, median of 5); the synthetic 27B MTP file's greedy answers "
          "in an agent session of 20 turns")
    print("| session | best fixed k | auto / best fixed, mean [min] |")
    print("|---|---|---|")
    session = agent_session()
    cases = [("no depth", MTP_SYNTH_H100, [(a, n) for a, n, _ in session], True),
             ("30K-87K held, auto not told the depth", MTP_SYNTH_H100_DEEP, session, False),
             ("30K-87K held", MTP_SYNTH_H100_DEEP, session, True)]
    for name, machine, plan, told in cases:
        fixed = {k: simulate(FixedPolicy(k), machine, 0.0, session=plan).throughput for k in (1, 2, 3)}
        best = max(fixed, key=fixed.get)
        ratios = []
        for seed in range(seeds):
            policy = make_policy("auto", draft_max=3)
            if not told:
                policy.held = lambda tokens: None
            ratios.append(simulate(policy, machine, 0.0, session=plan, seed=seed,
                                   calibration=LOAD_ERRORS).throughput / fixed[best])
        print(f"| {name} | k={best} | {sum(ratios) / seeds:.3f} [{min(ratios):.3f}] |")


# The suite's 32B pair at T=0.8 with llama.cpp's filters on the H100 at 43795e6 (results/h100-auto-suite-uniform-pair-
# filters-at-43795e6.md): the warm-up request agreed deep in the draft (auto's estimates by position at its end), the
# timed ones did not (what the fixed rows imply); auto warm tried 9 tokens and sat at 4 for 25 steps in the fourth
# timed request (0.877 of k=2 on it, 0.963 over the row). The timed rates' warm-up is the control.
DEEP_WARM_UP = [0.80, 0.86, 0.74, 0.87, 0.93, 0.97, 0.74, 0.83, 0.89, 0.6]
PAIR_FILTERS_TIMED = [0.67, 0.72, 0.67, 0.68, 0.66, 0.65, 0.62, 0.6]


def deep_warm_up(seeds: int = 24, warm_up: list = DEEP_WARM_UP) -> tuple[list, list]:
    """auto against the best of fixed k = 1, 2, 3, 5, 8 (the suite's) on the pair's H100 costs, the load's costs off by
    3% a pass: cold, and warm after one request drawn at `warm_up` by position; 4 timed requests x 128 tokens at
    PAIR_FILTERS_TIMED."""
    cold, warm = [], []
    for seed in range(seeds):
        best = max(simulate(FixedPolicy(k), PAIR_SYNTH_H100, PAIR_FILTERS_TIMED, requests=4, max_tokens=128,
                            seed=seed).throughput for k in (1, 2, 3, 5, 8))
        cold.append(simulate(make_policy("auto", draft_max=12), PAIR_SYNTH_H100, PAIR_FILTERS_TIMED, requests=4,
                             max_tokens=128, seed=seed, calibration=LOAD_ERRORS).throughput / best)
        policy = make_policy("auto", draft_max=12)
        simulate(policy, PAIR_SYNTH_H100, warm_up, requests=1, max_tokens=128, seed=seed + 100,
                 calibration=LOAD_ERRORS)
        warm.append(simulate(policy, PAIR_SYNTH_H100, PAIR_FILTERS_TIMED, requests=4, max_tokens=128,
                             seed=seed).throughput / best)
    return cold, warm


def recorded(seeds: int = 6) -> None:
    """auto against the best fixed k on the recorded H200 cases, cold (a fresh policy) and warm (after one
    request): 4 requests x 128 tokens; then the H100 pair's warm-up that agreed deep in the draft (24 seeds)."""
    print("| case | cold | warm |")
    print("|---|---|---|")
    for name, machine, acceptance, k_max in RECORDED:
        cold, warm = cold_and_warm(machine, acceptance, k_max, seeds)
        print(f"| {name} | {sum(cold) / seeds:.3f} [{min(cold):.3f}] | {sum(warm) / seeds:.3f} [{min(warm):.3f}] |")
    for name, warm_up in (("a warm-up agreeing deep in the draft", DEEP_WARM_UP),
                          ("the same, the warm-up at the timed rates", PAIR_FILTERS_TIMED)):
        cold, warm = deep_warm_up(warm_up=warm_up)
        print(f"| 32B pair's H100 costs, T=0.8 filters (43795e6), {name} (24 seeds) | {sum(cold) / len(cold):.3f} "
              f"[{min(cold):.3f}] | {sum(warm) / len(warm):.3f} [{min(warm):.3f}] |")


# the mixed workload of benchmarks/compare/bench_engine.py --workload mixed --tokens 128 on the synthetic MTP model
# with runs of agreement (synth_mtp.py --agree 0.95,0.7,0.4,0.1): five requests of 128, 128, 128, 32 and 256 tokens,
# each in a run of one rate, which run by chance
MIXED_RATES, MIXED_TOKENS = (0.95, 0.7, 0.4, 0.1), (128, 128, 128, 32, 256)


def mixed_session(seed: int) -> list:
    rng = random.Random(seed)
    return [(rng.choice(MIXED_RATES), n) for n in MIXED_TOKENS]


# The same workload as the H200 saw it greedy (results/h200-mixed-mtp27b-at-8515c74.md): fixed k=1's speed on each
# request puts them at about 95, 10, 95, 40 and 95% agreement; knowing each request's best k in advance made 1.125x
# the best single k there, 1.15x here
MIXED_RECORDED = [(0.95, 128), (0.1, 128), (0.95, 128), (0.4, 32), (0.95, 256)]


# The mixed workload on a synthetic draft-model pair whose agreement changes in runs (benchmarks/synthetic/
# synth_pair.py --agree 0.95,0.7,0.4,0.1 --agree-run 2048 over Qwen2's vocabulary): the rates bench_engine's five
# mixed requests walk into, read off the file's construction, with --seed 4 and --seed 0
MIXED_PAIR = {4: [(0.95, 128), (0.11, 128), (0.68, 128), (0.91, 32), (0.34, 256)],
              0: [(0.96, 128), (0.10, 128), (0.12, 128), (0.97, 32), (0.43, 256)]}


def mixed(seeds: int = 40) -> None:
    """auto against the best fixed k (1-3) and against k=1 on mixed sessions with the recorded MTP costs."""
    vs_best, vs_one = [], []
    for seed in range(seeds):
        session = mixed_session(seed)
        fixed = {k: simulate(FixedPolicy(k), MTP_RECORDED, 0.0, session=session, seed=seed).throughput
                 for k in (1, 2, 3)}
        auto = simulate(make_policy("auto", draft_max=3), MTP_RECORDED, 0.0, session=session, seed=seed).throughput
        vs_best.append(auto / max(fixed.values()))
        vs_one.append(auto / fixed[1])
    print(f"mixed sessions ({seeds} seeds, rates {MIXED_RATES} by chance, tokens {MIXED_TOKENS}), recorded MTP costs: "
          f"auto / best fixed k {sum(vs_best) / seeds:.3f} [{min(vs_best):.3f}], auto / k=1 "
          f"{sum(vs_one) / seeds:.3f} [{min(vs_one):.3f}]")
    recorded_session = [simulate(make_policy("auto", draft_max=3), MTP_RECORDED, 0.0, session=MIXED_RECORDED,
                                 seed=seed).throughput /
                        max(simulate(FixedPolicy(k), MTP_RECORDED, 0.0, session=MIXED_RECORDED, seed=seed).throughput
                            for k in (1, 2, 3)) for seed in range(seeds)]
    print(f"the recorded mixed session: auto / best fixed k {sum(recorded_session) / seeds:.3f} "
          f"[{min(recorded_session):.3f}]")
    for file_seed, session in MIXED_PAIR.items():
        ratios = [simulate(make_policy("auto"), D70_RECORDED, 0.0, session=session, seed=seed).throughput /
                  max(simulate(FixedPolicy(k), D70_RECORDED, 0.0, session=session, seed=seed).throughput
                      for k in range(1, 13)) for seed in range(seeds // 4)]
        print(f"the 32B pair's mixed session (synth_pair.py --seed {file_seed}): auto / best fixed k "
              f"{sum(ratios) / len(ratios):.3f} [{min(ratios):.3f}]")


# Acceptance recorded on the real Qwen2.5-Coder 1.5B Q4_K_M + 0.5B pair along its target's answers to bench_engine's
# requests (benchmarks/probes/record_acceptance.py; the file names the pair): greedy agreement and T=0.8 chances
RECORDED_FILE = Path(__file__).with_name("recorded_acceptance.json")


def recorded_session(set_name: str, mode: str = "greedy") -> list:
    """The recorded requests of one set (mixed, code, prose) as a session: (Trace, the answer's length) each."""
    requests = json.loads(RECORDED_FILE.read_text())["requests"]
    return [(Trace(tuple(float(c) for c in r[mode])), len(r[mode])) for r in requests if r["set"] == set_name]


def traces(seeds: int = 6) -> None:
    """auto against the best fixed k (1-8) on the recorded real traces, with the H200's recorded costs of a cheap
    draft (2 layers of the 32B) and of a 0.5B-shaped one; cold, and warm after the set's first request."""
    print("| machine | set | mode | auto / best fixed k (cold) | warm | best k |")
    print("|---|---|---|---|---|---|")
    for machine in (D70_RECORDED, H200_GRAPHS_BIG_DRAFT):
        for set_name in ("mixed", "code", "prose"):
            for mode in ("greedy", "sampled"):
                session = recorded_session(set_name, mode)
                cold, warm, bests = [], [], []
                for seed in range(seeds):
                    fixed = {k: simulate(FixedPolicy(k), machine, 0.0, session=session, seed=seed).throughput
                             for k in range(1, 9)}
                    best = max(fixed, key=fixed.get)
                    bests.append(best)
                    cold.append(simulate(make_policy("auto", draft_max=8), machine, 0.0, session=session,
                                         seed=seed).throughput / fixed[best])
                    policy = make_policy("auto", draft_max=8)
                    simulate(policy, machine, 0.0, session=session[:1], seed=seed + 100)
                    warm.append(simulate(policy, machine, 0.0, session=session, seed=seed).throughput / fixed[best])
                cell = lambda xs: f"{sum(xs) / len(xs):.3f} [{min(xs):.3f}]"  # noqa: E731
                print(f"| {machine.name} | {set_name} | {mode} | {cell(cold)} | {cell(warm)} | "
                      f"{'/'.join(str(b) for b in sorted(set(bests)))} |")


class TraceReplay(DraftPolicy):
    """Draft the lengths a real run's `auto` drafted, request by request (a report's trace: digits, s/x for a shadow
    probe's plain step), past a request's end its last length: what those choices cost on a simulated machine."""

    name = "replay"

    def __init__(self, requests: list[str], draft_max: int):
        self.requests, self.draft_max, self.r, self.i = requests, draft_max, -1, 0

    def new_request(self) -> None:
        self.r, self.i = self.r + 1, 0

    def next_draft_len(self) -> int:
        trace = self.requests[self.r] if 0 <= self.r < len(self.requests) else ""
        c = trace[self.i] if self.i < len(trace) else trace[-1] if trace else "0"
        return 0 if c in "sx" else int(c, 36)

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        self.i += 1


def read_report(path: Path) -> dict:
    """What bench_engine's report of one regime says of llamaspec's rows: each fixed k's tokens a pass (acceptance by
    position follows), auto's and auto+warm's tok/s, traces and the costs auto measured (its machine)."""
    text = path.read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 7 and cells[0].startswith("llamaspec "):
            rows.setdefault(cells[0][len("llamaspec "):], (float(cells[1]), float(cells[6])))
    fixed = sorted((int(mode.split("=")[1]), tps, per_pass) for mode, (tps, per_pass) in rows.items()
                   if mode.startswith("fixed k="))
    acceptance, reach, tokens, k_before = [], 1.0, 1.0, 0
    for k, _, per_pass in fixed:   # tokens(k) - tokens(k') = sum over j in (k', k] of a_1 ... a_j: one rate a per gap
        gap, diff = k - k_before, max(per_pass - tokens, 0.0)
        low, high = 0.0, 1.0
        for _ in range(40):
            a = (low + high) / 2
            low, high = (a, high) if reach * sum(a ** m for m in range(1, gap + 1)) < diff else (low, a)
        acceptance += [a] * gap
        reach, tokens, k_before = reach * a ** gap, per_pass, k
    out = {"fixed": {k: tps for k, tps, _ in fixed}, "acceptance": acceptance, "auto": {}}
    for mode in ("auto", "auto+warm"):
        found = re.findall(rf"^- {re.escape(mode)}'s cost model at the end(?: \(round \d+\))?: (.*?)draft length by "
                           r"step[^`]*`([^`]*)`", text, re.M)   # one a round (bench_engine --rounds)
        if not found or mode not in rows:
            continue
        model, trace = found[0]
        v = [float(x) for _, x in sorted(((int(n), x) for n, x in re.findall(r"v\((\d+)\)=([\d.]+)", model)))]
        cost = re.search(r"cost per token ([\d.]+)", model)
        cold = re.search(r"a cold pass ([\d.]+) plain passes slower", model)
        step = re.search(r"a drafting step's own cost ([\d.]+)", model)
        rounds = [t.split("|")[1 + (mode == "auto+warm"):] for _, t in found]   # auto+warm: its warm-up first
        out["auto"][mode] = dict(tps=rows[mode][0], requests=rounds[0], rounds=rounds,
                                 v=v, draft=float(cost.group(1)) if cost else 0.1,
                                 cold=float(cold.group(1)) if cold else 0.0,
                                 step=float(step.group(1)) if step else 0.0)
    return out


def replay(path: str, seeds: int = 24) -> None:
    """A real run's `auto` beside the simulator's: its recorded choices (each round's, bench_engine --rounds) replayed
    on a machine of the costs it measured (the first round's: passes, a drafted token, a drafting step's own cost, a
    cold pass) and the acceptance by position its fixed rows show, against the best fixed k there, next to the
    simulator's own `auto` on that machine and what the run measured. Where the replayed choices come out near the
    measurement, the run lost to its choices; where they come out higher, to what its steps cost beyond the
    simulator's (Python, timing noise between the rows)."""
    if not Path(path).read_text().startswith("# llamaspec engine benchmark"):
        raise SystemExit(f"{path}: not a bench_engine report (its first line names it)")
    if "--workload mixed" in Path(path).read_text():
        raise SystemExit(f"{path}: a mixed session (its requests differ in acceptance): --replay takes uniform reports")
    report = read_report(Path(path))
    acceptance, fixed = report["acceptance"], report["fixed"]
    if not fixed or not report["auto"]:
        raise SystemExit(f"{path}: no fixed-k rows or no auto trace to replay")
    best_measured = max(fixed.values())
    k_max = max(fixed)
    print(f"acceptance by position from the fixed rows: {', '.join(f'{a:.3f}' for a in acceptance)}")
    print("| mode | measured / best fixed | its choices replayed here | the simulator's auto here |")
    print("|---|---|---|---|")
    for mode, run in report["auto"].items():
        v = run["v"] + [run["v"][-1] + (run["v"][-1] - run["v"][-2]) * i for i in range(1, 8)]
        machine = Machine(f"{path} {mode}", lambda n, v=v: v[n - 1], run["draft"], 0.01,
                          switch=(run["cold"], run["cold"]), gpu=True, draft_step=run["step"])
        tokens = 128
        replayed, own = [], []
        for seed in range(seeds):
            run_of = lambda policy: simulate(policy, machine, acceptance, requests=4, max_tokens=tokens,  # noqa: E731
                                             seed=seed).throughput
            best = max(run_of(FixedPolicy(k)) for k in fixed)
            replayed += [run_of(TraceReplay(requests, k_max)) / best for requests in run["rounds"]]
            policy = make_policy("auto", draft_max=k_max)
            if mode == "auto+warm":
                simulate(policy, machine, acceptance, requests=1, max_tokens=tokens, seed=seed + 100)
            own.append(run_of(policy) / best)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(f"| {mode} | {run['tps'] / best_measured:.3f} | {mean(replayed):.3f} | {mean(own):.3f} |")


def replay_events(events: list, verify: dict | None = None, until_departure: bool = False) -> list[dict]:
    """Feed a run's recorded calls (bench_engine's `auto_events`) to a fresh AutoPolicy, in order, and return one
    record a drafted or plain step: the length the policy chose before it (`chosen`), the length the engine ran
    (`drafted`: shorter where a request's end or the context clamped it), and after it the policy's acceptance
    estimates, the tok/s its cost model predicts for each k, and the gain over the current k a change must show to
    repay its two cold passes within `horizon` steps. The policy is deterministic in what it is told, so where
    every `chosen` is `drafted` (or the engine's clamp), the replay is the run's own policy.
    `verify` ({size: seconds}): the load's price of those passes otherwise than the run's load measured them; with
    `until_departure` the replay ends at the first step whose `chosen` is not what the run drafted (the recorded calls
    after it answer lengths this policy would not have drafted), a shorter draft where the request's last tokens cut
    it (the engine's clamp) not counted."""
    policy, request, out = None, 0, []
    left = [0] * (len(events) + 1)   # tokens the steps from each event on emit within its request
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        left[i] = 0 if e[0] == "request" else left[i + 1] + (e[2] + 1 if e[0] == "update" else 0)
    for i, event in enumerate(events):
        kind = event[0]
        if kind == "policy":
            policy = make_policy("auto", draft_max=event[1], draft_p_min=event[2])
        elif kind == "attach":
            c = event[2]
            costs = None if c is None else Costs({**{int(n): t for n, t in c["verify"].items()}, **(verify or {})},
                                                 c["draft"], list(c["excess"]),
                                                 {int(k): t for k, t in c["drafts"].items()})
            policy.attach(event[1], costs)
        elif kind == "request":
            request += 1
            policy.new_request()
        elif kind == "held":
            policy.held(event[1])
        elif kind == "shadow":   # the engine asked shadow_len before the step: a drafting one's asks a tail probe
            policy.shadow_len()
            policy.shadow(event[1], event[2])
        elif kind == "update":
            drafted, accepted, draft_seconds, verify_seconds = event[1:5]
            chosen = policy.next_draft_len()
            policy.update(drafted, accepted, draft_seconds, verify_seconds)
            model, k_max = policy.model, policy.draft_max
            estimates = policy.accept.estimates()
            speeds = dict(model.speeds(estimates, k_max, False))
            k = policy.next_draft_len()
            best = model.best_k(estimates, k_max, False) if speeds else k
            needed = model.change_needs(best) if best != k and k in speeds and best in speeds else None
            out.append(dict(request=request, chosen=chosen, drafted=drafted, accepted=accepted,
                            draft_ms=1000 * draft_seconds, verify_ms=1000 * verify_seconds, next=k,
                            estimates=estimates[1:k_max + 1], speeds=speeds, best=best, needed=needed))
            if until_departure and chosen != drafted and (drafted > chosen or drafted + 2 < left[i]):
                break
    return out


def load_against_run(events: list) -> dict:
    """{batch size: (what the load measured, the median of the run's warm passes of it or None)}, in seconds: a pass
    is warm after two of its size in a row within a request (as CostModel counts them); a size the load priced off
    and the run never ran warm is one `auto` kept believing."""
    load: dict = {}
    warm: dict = {}
    last = run = 0
    for event in events:
        if event[0] == "attach" and event[2]:
            load = {int(n): t for n, t in event[2]["verify"].items()}
        elif event[0] == "request":
            last = run = 0
        elif event[0] == "update":
            n = event[1] + 1
            if n == last and run >= 2:
                warm.setdefault(n, []).append(event[4])
            run, last = (run + 1 if n == last else 1), n
    return {n: (load.get(n), median(warm[n]) if n in warm else None) for n in sorted(set(load) | set(warm))}


def events(path: str, every_step: bool = False) -> None:
    """What each auto row's policy believed in a bench_engine run (its JSON's `auto_events`): the replay checked
    against the lengths the run drafted, each pass size as the load priced it beside the run's warm passes of it,
    then each request's end (and with `every_step`, every step)."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"{path}: not a bench_engine JSON report ({error})")
    found = [r for r in rows if isinstance(r, dict) and r.get("auto_events")] if isinstance(rows, list) else []
    if not found:
        raise SystemExit(f"{path}: no auto row with recorded steps (bench_engine writes `auto_events` for auto rows; "
                         "older reports have none)")
    for row in found:
        for rnd, recorded in enumerate(row["auto_events"]):
            steps = replay_events(recorded)
            same = sum(s["chosen"] == s["drafted"] for s in steps)
            clamped = sum(s["drafted"] < s["chosen"] for s in steps)
            print(f"## {row['regime']} {row['mode']}, round {rnd + 1}: {len(steps)} steps; the replayed policy chose "
                  f"the length run at {same}, a longer one the engine cut at {clamped}, another at "
                  f"{len(steps) - same - clamped}")
            ms = lambda t: f"{1000 * t:.2f}" if t is not None else "-"  # noqa: E731
            print("a pass of n tokens, ms, the load's / the run's warm median: " + ", ".join(
                f"n={n} {ms(at_load)} / {ms(in_run)}" for n, (at_load, in_run) in load_against_run(recorded).items()))
            for i, s in enumerate(steps):
                last = i + 1 == len(steps) or steps[i + 1]["request"] != s["request"]
                if not (every_step or last):
                    continue
                speeds = " ".join(f"k={k} {v:.1f}" for k, v in s["speeds"].items())
                gain = f"; a change to k={s['best']} needs {100 * s['needed']:.1f}% more" if s["needed"] else ""
                print(f"request {s['request']} {'end ' if last else ''}k={s['drafted']} accepted {s['accepted']} "
                      f"draft {s['draft_ms']:.2f} ms verify {s['verify_ms']:.2f} ms | acceptance "
                      f"{' '.join(f'{a:.2f}' for a in s['estimates'])} | tok/s {speeds} | next k={s['next']}{gain}")


def main(seeds: int = 5) -> None:
    print(f"mean [min] over {seeds} seeds; CPU rows: 12 requests x 64 tokens, GPU rows: 4 x 128; prompts of 40 tokens")
    print()
    print("| machine | acceptance | auto / plain | best fixed k / plain | auto / best fixed | auto drafted | "
          "max TTFT auto / plain |")
    print("|---|---|---|---|---|---|---|")
    for machine, shape, acceptances in TABLE:
        for acceptance in acceptances:
            vs_plain, vs_best, best_vs_plain, drafted, ttft, bests = [], [], [], [], [], set()
            for seed in range(seeds):
                result = compare(machine, acceptance, seed=seed, **shape)
                runs, best = result["runs"], result["best_fixed"]
                auto, plain = runs["auto"], runs["plain"]
                vs_plain.append(auto.throughput / plain.throughput)
                vs_best.append(auto.throughput / runs[best].throughput)
                best_vs_plain.append(runs[best].throughput / plain.throughput)
                drafted.append(auto.drafted)
                ttft.append(max(a / b for a, b in zip(auto.ttft, plain.ttft)))
                bests.add(best)
            cell = lambda xs: f"{sum(xs) / len(xs):.3f} [{min(xs):.3f}]"  # noqa: E731
            print(f"| {machine.name} | {acceptance:g} | {cell(vs_plain)} | {'/'.join(sorted(bests))} "
                  f"{cell(best_vs_plain)} | {cell(vs_best)} | {sum(drafted) / len(drafted):.0f} | "
                  f"{max(ttft):.3f} |")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--events"]:
        if len(sys.argv) not in (3, 4) or sys.argv[3:] not in ([], ["--steps"]) or not Path(sys.argv[2]).is_file():
            raise SystemExit("usage: policy_sim.py --events REPORT.json [--steps] (a bench_engine JSON report)"
                             + (f": no file {sys.argv[2]}" if len(sys.argv) > 2 and not Path(sys.argv[2]).is_file()
                                else ""))
        events(sys.argv[2], sys.argv[3:] == ["--steps"])
    elif sys.argv[1:2] == ["--replay"]:
        if len(sys.argv) != 3 or not Path(sys.argv[2]).is_file():
            raise SystemExit("usage: policy_sim.py --replay REPORT.md (a bench_engine report of a uniform workload)"
                             + (f": no file {sys.argv[2]}" if len(sys.argv) == 3 else ""))
        replay(sys.argv[2])
    else:
        reports = {"--recorded": recorded, "--mixed": mixed, "--traces": traces, "--calibration": calibration,
                   "--deep": deep}
        reports.get(sys.argv[1] if sys.argv[1:] else "", main)()
