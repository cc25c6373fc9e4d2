"""Benchmark one loaded pair: the same prompts decoded plainly and in each speculation mode, in one run.

Plain decoding is the pair with FixedPolicy(0), so one load serves every mode. Repeats are the outer loop, then
prompts, then modes (plain, k=1, ..., auto, plain, k=1, ...): each prompt is prefilled once and the modes after the
first reuse its KV cache, so the comparison is of decoding speed (tokens / seconds after the prompt), and a load
that comes and goes falls on every mode of a repeat alike. Tok/s is the median over repeats, a speedup the median of
each repeat's ratio to plain, and a mode is called faster or slower only beyond plain's own spread over the repeats
(`compare`). Each mode keeps one policy object for the whole run at one temperature, as a chat session would; a
sweep over temperatures repeats the run at each, with speedups against plain decoding at the same temperature.
Returns dataclasses; printing is the caller's business.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from ..chat_template import ChatTemplate
from ..errors import InvalidParameterError
from ..policy import POLICY_NAMES, AutoPolicy, Costs, DraftPolicy, FixedPolicy, make_policy
from ..stats import GenerationStats

WARMUP_TOKENS = 8
# the costs the H100's random-weight 27B MTP file measured at load (seconds; results/h100-auto-suite-uniform-mtp-
# greedy-at-1dfe9ae.md): target passes of 1-4 tokens, a drafted token, cold passes' excess. Benchmarks that run
# `auto` without a model start it from these, so that it reasons as it did there.
H100_MTP27B_COSTS = Costs(verify={1: 0.0118, 2: 0.0128, 3: 0.0152, 4: 0.0181}, draft=0.00126, excess=[0.0073] * 4)


@dataclass(frozen=True)
class Mode:
    name: str           # "plain", "k=3", "auto", ...
    policy: str         # "plain" or a policy name
    draft_max: int | None   # fixed draft length, or an adaptive policy's maximum (None: the policy's default)

    def make_policy(self, draft_p_min: float | None = None) -> DraftPolicy:
        if self.policy == "plain":
            return FixedPolicy(0)
        return make_policy(self.policy, draft_max=self.draft_max, draft_p_min=draft_p_min)


PLAIN = Mode("plain", "plain", 0)


def fixed_mode(k: int) -> Mode:
    return Mode(f"k={k}", "fixed", k)


def policy_mode(name: str, draft_max: int | None = None) -> Mode:
    if name not in POLICY_NAMES or name == "fixed":
        raise InvalidParameterError(f"unknown policy {name!r} to compare; choose from auto, confidence, threshold "
                                    "(fixed draft lengths go in --k)")
    return Mode(name, name, draft_max)


def parse_k_list(text: str) -> list[int]:
    """'1,2,3,5,8' -> [1, 2, 3, 5, 8]."""
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidParameterError(f"--k takes draft lengths like 1,2,3,5,8; got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise InvalidParameterError(f"--k takes draft lengths >= 1 like 1,2,3,5,8; got {text!r}")
    return list(dict.fromkeys(ks))


def parse_temperature_list(text: str) -> list[float]:
    """'0,0.5,0.8,1.0' -> [0.0, 0.5, 0.8, 1.0]."""
    try:
        temps = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidParameterError(f"--temps takes temperatures like 0,0.5,0.8,1.0; got {text!r}") from None
    if not temps or any(not math.isfinite(t) or t < 0 for t in temps):
        raise InvalidParameterError(f"--temps takes temperatures >= 0 like 0,0.5,0.8,1.0; got {text!r}")
    return list(dict.fromkeys(temps))


def parse_policy_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        policy_mode(name)  # validates
    if not names:
        raise InvalidParameterError("--policies needs at least one of auto, confidence, threshold")
    return list(dict.fromkeys(names))


@dataclass
class ModeResult:
    mode: str
    policy: str
    draft_len: int | None          # fixed k, or the adaptive policy's maximum
    temperature: float = 0.0
    prompts: int = 0               # prompts measured (in each repeat)
    repeats: int = 0               # rounds over the prompts measured
    tokens: int = 0                # over every repeat
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    decode_seconds: float = 0.0    # generation time after the prompt was processed
    prefill_seconds: float = 0.0
    same_output: int | None = 0    # prompts whose text equals plain decoding's (None when sampling)
    speedup: float | None = None   # median over repeats of tok/s / plain's tok/s in the same repeat
    speedups: list[float] = field(default_factory=list)            # that ratio in each repeat
    repeat_tokens_per_second: list[float] = field(default_factory=list)
    verdict: str | None = None     # against plain: "faster", "slower", "same" (within noise) or None (unknown)

    def add(self, stats: GenerationStats) -> None:
        self.tokens += stats.tokens_generated
        self.target_passes += stats.target_passes
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.decode_seconds += stats.decode_time
        self.prefill_seconds += stats.time_prefill

    @property
    def tokens_per_second(self) -> float:
        """The median over repeats (over everything measured when there are none)."""
        if self.repeat_tokens_per_second:
            return statistics.median(self.repeat_tokens_per_second)
        return self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_second_min(self) -> float:
        return min(self.repeat_tokens_per_second, default=self.tokens_per_second)

    @property
    def tokens_per_second_max(self) -> float:
        return max(self.repeat_tokens_per_second, default=self.tokens_per_second)

    @property
    def spread(self) -> float | None:
        """(max - min) / median of tok/s over repeats: how much the same mode differs from itself (None with
        fewer than two repeats)."""
        if len(self.repeat_tokens_per_second) < 2 or not self.tokens_per_second:
            return None
        return (self.tokens_per_second_max - self.tokens_per_second_min) / self.tokens_per_second

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass (1.0 for plain decoding)."""
        return self.tokens / self.target_passes if self.target_passes else 0.0

    @property
    def mean_draft_len(self) -> float:
        return self.drafted / self.target_passes if self.target_passes else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("tokens_per_second", "tokens_per_second_min", "tokens_per_second_max", "spread",
                     "acceptance_rate", "mean_accepted_length", "mean_draft_len"):
            d[name] = getattr(self, name)
        return d


@dataclass(frozen=True)
class Verdict:
    """Whether speculation pays at one temperature: the fastest mode that beats plain beyond the noise (None when
    none does), and how the auto policy fared."""

    temperature: float
    repeats: int
    noise: float | None            # the relative difference taken as noise (None: one repeat, unknown)
    best: ModeResult | None        # the fastest mode judged faster than plain
    auto: ModeResult | None        # the auto policy's row, when it ran
    auto_matches_best: bool = False   # auto's speedup is within the noise of the best's

    @property
    def pays(self) -> bool | None:
        return None if self.noise is None else self.best is not None

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "repeats": self.repeats, "noise": self.noise, "pays": self.pays,
                "best_mode": self.best.mode if self.best else None,
                "best_speedup": self.best.speedup if self.best else None,
                "auto_speedup": self.auto.speedup if self.auto else None, "auto_matches_best": self.auto_matches_best}


@dataclass
class BenchReport:
    results: list[ModeResult]
    n_prompts: int
    max_tokens: int
    sampler: dict
    warmup_seconds: float = 0.0
    outputs: dict[str, list[str]] = field(default_factory=dict, repr=False)   # mode -> text per prompt
    repeats: int = 1               # asked for
    interrupted: bool = False      # stopped by Ctrl-C: the results hold what was measured until then

    @property
    def plain(self) -> ModeResult | None:
        return next((r for r in self.results if r.policy == "plain"), None)

    @property
    def temperatures(self) -> list[float]:
        return list(dict.fromkeys(r.temperature for r in self.results))

    def verdicts(self) -> list[Verdict]:
        """One per temperature measured."""
        return [judge([r for r in self.results if r.temperature == t]) for t in self.temperatures]

    def to_dict(self) -> dict:
        return {"n_prompts": self.n_prompts, "max_tokens": self.max_tokens, "sampler": dict(self.sampler),
                "temperatures": self.temperatures, "warmup_seconds": self.warmup_seconds, "repeats": self.repeats,
                "interrupted": self.interrupted, "results": [r.to_dict() for r in self.results],
                "verdicts": [v.to_dict() for v in self.verdicts()]}


def prepare_prompts(pair, prompts: Sequence[str], chat: bool = True) -> list[list[int]]:
    """Token ids of each prompt, as a user message in the target's chat template (chat) or as raw text."""
    if not chat:
        return [pair.tokenize(p) for p in prompts]
    template = ChatTemplate.from_model_info(pair.target.info)
    out = []
    for prompt in prompts:
        rendered = template.render([{"role": "user", "content": prompt}])
        out.append(pair.tokenize(rendered, add_special=template.add_special_for(rendered)))
    return out


def default_modes(pair, draft_max: int | None = None) -> list[Mode]:
    """Plain, a fixed draft length and the auto policy, each within the pair's reach unless given: on a target whose
    rollback is bounded by recurrent-state snapshots, the snapshots its load kept (engine.snapshot_bound; a user's
    load of the same pair gives `auto` that reach, loading.snapshot_reach)."""
    from ..engine import snapshot_bound

    if not pair.speculative:
        return [PLAIN]
    reach = snapshot_bound(pair)
    return [PLAIN, fixed_mode(draft_max or min(4, reach or 4)), policy_mode("auto", reach)]


# ---------------------------------------------------------------------------------------------------------------
# Noise: a mode is faster (slower) than plain only when its median speedup over the repeats lies beyond plain's own
# spread over the same repeats (at least MIN_NOISE) and every repeat's speedup is on the same side of 1. A speedup
# is a ratio within one repeat (the modes of a repeat run interleaved, prompt by prompt), so a load that comes and
# goes between repeats moves both sides of it.
# ---------------------------------------------------------------------------------------------------------------
MIN_NOISE = 0.03


def noise_of(plain: ModeResult) -> float | None:
    """The relative difference taken as noise: plain's spread over repeats, at least MIN_NOISE; None with one."""
    return None if plain.spread is None else max(MIN_NOISE, plain.spread)


def compare(result: ModeResult, noise: float | None) -> str | None:
    """"faster", "slower" or "same" (within noise) against plain; None when the noise is unknown."""
    if noise is None or result.speedup is None or not result.speedups:
        return None
    if result.speedup > 1 + noise and min(result.speedups) > 1:
        return "faster"
    if result.speedup < 1 / (1 + noise) and max(result.speedups) < 1:
        return "slower"
    return "same"


def judge(results: Sequence[ModeResult]) -> Verdict:
    """The verdict over the modes run at one temperature (plain among them)."""
    plain = next(r for r in results if r.policy == "plain")
    noise = noise_of(plain)
    faster = [r for r in results if r.policy != "plain" and r.verdict == "faster"]
    best = max(faster, key=lambda r: r.speedup, default=None)
    auto = next((r for r in results if r.policy == "auto"), None)
    matches = bool(best is not None and auto is not None and auto.verdict == "faster"
                   and auto.speedup * (1 + noise) >= best.speedup)
    return Verdict(plain.temperature, plain.repeats, noise, best, auto, matches)


def run_bench(pair, prompts: Sequence[Sequence[int]], modes: Sequence[Mode], *, max_tokens: int = 128,
              sampler: dict | None = None, warmup: bool = True, draft_p_min: float | None = None,
              progress: Callable[[int], None] | None = None,
              temperatures: Sequence[float] | None = None, repeats: int = 3) -> BenchReport:
    """Decode every prompt in every mode (plain first, added when missing), `repeats` times, at sampler's
    temperature or at each of `temperatures`; speedups are against plain at the same temperature.

    The order is repeat, then prompt, then mode (plain, k=1, ..., auto, plain, k=1, ...), so background load falls
    on every mode alike. A Ctrl-C ends the run with what was measured (`report.interrupted`): a prompt that not
    every mode finished in the last repeat is left out."""
    sampler = dict(sampler or {})
    modes = [PLAIN] + [m for m in modes if m.policy != "plain"]
    if len(modes) > 1 and not pair.speculative:
        raise InvalidParameterError("nothing to compare: the benchmark needs a draft model (-md), --lookup-only or "
                                    "the target's MTP head (--spec-type draft-mtp)")
    if not prompts:
        raise InvalidParameterError("no prompts to benchmark")
    if repeats < 1:
        raise InvalidParameterError(f"repeats must be at least 1, got {repeats}", param="repeats")
    temps = list(temperatures) if temperatures else [sampler.get("temperature") or 0.0]

    # 1. warm-up: page the weights in, start the threads, size the buffers (not measured)
    t0 = time.perf_counter()
    if warmup:
        for mode in modes[:2]:
            pair.set_policy(mode.make_policy(draft_p_min))
            pair.generate(list(prompts[0]), max_tokens=min(WARMUP_TOKENS, max_tokens),
                          **{**sampler, "temperature": temps[0]})
    warmup_seconds = time.perf_counter() - t0

    # 2. every prompt in every mode, interleaved, `repeats` times; one policy object per mode for the whole run at
    # one temperature. runs[t][repeat][mode] = [(stats, text) per prompt]
    runs: dict[float, list[dict[str, list]]] = {}
    interrupted = False
    try:
        for temperature in temps:
            at_t = {**sampler, "temperature": temperature}
            policies = {m.name: m.make_policy(draft_p_min) for m in modes}
            runs[temperature] = []
            for _ in range(repeats):
                this_repeat = {m.name: [] for m in modes}
                runs[temperature].append(this_repeat)
                for prompt in prompts:
                    for mode in modes:
                        pair.set_policy(policies[mode.name])
                        completion = pair.generate(list(prompt), max_tokens=max_tokens, **at_t)
                        this_repeat[mode.name].append((completion.stats, completion.text))
                        if progress is not None:
                            progress(1)
    except KeyboardInterrupt:
        interrupted = True

    # 3. per mode: totals, tok/s in each repeat, speedups against plain in the same repeat
    results: list[ModeResult] = []
    outputs: dict[str, list[str]] = {}
    for temperature, rounds in runs.items():
        if rounds:   # a prompt not every mode finished (the last repeat, interrupted) has nothing to compare with
            done = min(len(samples) for samples in rounds[-1].values())
            rounds[-1] = {name: samples[:done] for name, samples in rounds[-1].items()}
            rounds = [r for r in rounds if any(r.values())]
        if not rounds:
            continue
        by_mode = {}
        for mode in modes:
            policy = mode.make_policy(draft_p_min)
            r = ModeResult(mode.name, mode.policy, mode.draft_max if mode.draft_max is not None else policy.draft_max, temperature,
                           prompts=max(len(rnd[mode.name]) for rnd in rounds), repeats=len(rounds))
            for rnd in rounds:
                stats = [s for s, _ in rnd[mode.name]]
                for s in stats:
                    r.add(s)
                seconds = sum(s.decode_time for s in stats)
                r.repeat_tokens_per_second.append(sum(s.tokens_generated for s in stats) / seconds if seconds else 0.0)
            by_mode[mode.name] = r
        plain = by_mode[PLAIN.name]
        noise = noise_of(plain)
        first = rounds[0]
        for mode in modes:
            r = by_mode[mode.name]
            r.speedups = [tps / base if base else math.nan
                          for tps, base in zip(r.repeat_tokens_per_second, plain.repeat_tokens_per_second)]
            finite = [x for x in r.speedups if not math.isnan(x)]
            r.speedup = statistics.median(finite) if finite else None
            r.verdict = compare(r, noise) if r is not plain else None
            texts = [text for _, text in first[mode.name]]
            r.same_output = (sum(a == b for a, (_, b) in zip(texts, first[PLAIN.name])) if not temperature else None)
            outputs[mode.name if len(temps) == 1 else f"{mode.name} T={temperature:g}"] = texts
        results += [by_mode[m.name] for m in modes]
    if len(temps) > 1:
        sampler.pop("temperature", None)
    return BenchReport(results, len(prompts), max_tokens, sampler, warmup_seconds, outputs, repeats, interrupted)


def plot_report(report: BenchReport, path: str) -> None:
    """Speedup and acceptance against draft length (fixed k as lines, adaptive policies as labelled points), or
    against temperature when the report sweeps several (a line per mode). Needs matplotlib (ImportError
    otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    if len(report.temperatures) > 1:
        _plot_against_temperature(report, ax_speed, ax_acc)
    else:
        _plot_against_draft_length(report, ax_speed, ax_acc)
    ax_speed.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for ax in (ax_speed, ax_acc):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_against_draft_length(report: BenchReport, ax_speed, ax_acc) -> None:
    fixed = sorted((r for r in report.results if r.policy == "fixed"), key=lambda r: r.draft_len or 0)
    adaptive = [r for r in report.results if r.policy not in ("fixed", "plain")]
    plain_x = [0] if report.plain else []
    ax_speed.plot(plain_x + [r.draft_len for r in fixed], [1.0] * len(plain_x) + [r.speedup or 0 for r in fixed],
                  marker="o", color="C0", label="fixed k")
    ax_acc.plot([r.draft_len for r in fixed], [r.acceptance_rate or 0 for r in fixed], marker="o", color="C0",
                label="fixed k")
    for i, r in enumerate(adaptive, start=1):
        style = {"marker": "s", "color": f"C{i}", "label": r.mode}
        ax_speed.scatter([r.mean_draft_len], [r.speedup or 0], **style)
        ax_acc.scatter([r.mean_draft_len], [r.acceptance_rate or 0], **style)
    ax_speed.set(xlabel="draft length (mean for policies)", ylabel="speedup vs plain", title="Speedup")
    ax_acc.set(xlabel="draft length (mean for policies)", ylabel="acceptance rate", title="Acceptance", ylim=(0, 1))


def _plot_against_temperature(report: BenchReport, ax_speed, ax_acc) -> None:
    modes = list(dict.fromkeys(r.mode for r in report.results if r.policy != "plain"))
    for i, mode in enumerate(modes):
        rows = sorted((r for r in report.results if r.mode == mode), key=lambda r: r.temperature)
        temps = [r.temperature for r in rows]
        style = {"marker": "o", "color": f"C{i}", "label": mode}
        ax_speed.plot(temps, [r.speedup or 0 for r in rows], **style)
        ax_acc.plot(temps, [r.acceptance_rate or 0 for r in rows], **style)
    ax_speed.set(xlabel="temperature", ylabel="speedup vs plain (same temperature)", title="Speedup")
    ax_acc.set(xlabel="temperature", ylabel="acceptance rate", title="Acceptance", ylim=(0, 1))


def auto_state(policy: AutoPolicy) -> str:
    """One line of what an AutoPolicy has measured: the costs it decides by, relative to one plain pass."""
    gain = policy.perfect_draft_gain()
    v1, t_draft = policy.verify_time(1), policy.t_draft
    if gain is None or not t_draft:
        return "costs not measured"
    points = ", ".join(f"v({n})={policy.verify_time(n) / v1:.2f}" for n in policy.model.sizes)
    acceptance = ", ".join(f"{a:.2f}" for a in policy.accept.estimates()[1:6])
    cold = f"; a cold pass {policy.switch_cost / v1:.2f} plain passes slower"
    speeds = policy.model.speeds(policy.accept.estimates(), min(policy.draft_max, 6), False)
    predicted = ", ".join(f"k={k} {tps:.1f}" for k, tps in speeds)
    start, per_token = policy.model.draft_line()
    step = f", a drafting step's own cost {start / v1:.3f}" if start else ""
    return (f"t_verify(1) {1000 * v1:.1f} ms, draft/target cost per token {per_token / v1:.2f}{step}, {points}{cold}; "
            f"perfect-draft gain {gain:.2f}; acceptance by position {acceptance}; the tok/s it predicts from these "
            f"(draft and verification only) {predicted}")
