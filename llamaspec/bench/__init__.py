"""Benchmark one loaded pair: the same prompts decoded plainly and in each speculation mode, in one run.

Plain decoding is the pair with FixedPolicy(0), so one load serves every mode. Prompts are the outer loop and
modes the inner one: each prompt is prefilled once and the modes after the first reuse its KV cache, so the
comparison is of decoding speed (tokens / seconds after the prompt). Each mode keeps one policy object for the
whole run at one temperature, as a chat session would; a sweep over temperatures repeats the run at each, with
speedups against plain decoding at the same temperature. Returns dataclasses; printing is the caller's business.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from ..chat_template import ChatTemplate
from ..errors import InvalidParameterError
from ..policy import POLICY_NAMES, AutoPolicy, DraftPolicy, FixedPolicy, make_policy
from ..stats import GenerationStats

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Mode:
    name: str           # "plain", "k=3", "auto", ...
    policy: str         # "plain" or a policy name
    k: int | None       # fixed draft length, or an adaptive policy's maximum (None: the policy's default)

    def make_policy(self, p_min: float | None = None) -> DraftPolicy:
        if self.policy == "plain":
            return FixedPolicy(0)
        return make_policy(self.policy, k=self.k, p_min=p_min)


PLAIN = Mode("plain", "plain", 0)


def fixed_mode(k: int) -> Mode:
    return Mode(f"k={k}", "fixed", k)


def policy_mode(name: str, k_max: int | None = None) -> Mode:
    if name not in POLICY_NAMES or name == "fixed":
        raise InvalidParameterError(f"unknown policy {name!r} to compare; choose from auto, confidence, threshold "
                                    "(fixed draft lengths go in --k)")
    return Mode(name, name, k_max)


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
    prompts: int = 0
    tokens: int = 0
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    decode_seconds: float = 0.0    # generation time after the prompt was processed
    prefill_seconds: float = 0.0
    same_output: int | None = 0    # prompts whose text equals plain decoding's (None when sampling)
    speedup: float | None = None   # tokens_per_second / plain's at the same temperature

    def add(self, stats: GenerationStats) -> None:
        self.prompts += 1
        self.tokens += stats.tokens_generated
        self.target_passes += stats.target_passes
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.decode_seconds += stats.decode_time
        self.prefill_seconds += stats.time_prefill

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

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
        for name in ("tokens_per_second", "acceptance_rate", "mean_accepted_length", "mean_draft_len"):
            d[name] = getattr(self, name)
        return d


@dataclass
class BenchReport:
    results: list[ModeResult]
    n_prompts: int
    max_tokens: int
    sampler: dict
    warmup_seconds: float = 0.0
    outputs: dict[str, list[str]] = field(default_factory=dict, repr=False)   # mode -> text per prompt

    @property
    def plain(self) -> ModeResult | None:
        return next((r for r in self.results if r.policy == "plain"), None)

    @property
    def temperatures(self) -> list[float]:
        return list(dict.fromkeys(r.temperature for r in self.results))

    def to_dict(self) -> dict:
        return {"n_prompts": self.n_prompts, "max_tokens": self.max_tokens, "sampler": dict(self.sampler),
                "temperatures": self.temperatures, "warmup_seconds": self.warmup_seconds,
                "results": [r.to_dict() for r in self.results]}


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


def default_modes(pair, k: int | None = None) -> list[Mode]:
    """Plain, a fixed draft length and the auto policy."""
    if not pair.speculative:
        return [PLAIN]
    return [PLAIN, fixed_mode(k or 4), policy_mode("auto")]


def run_bench(pair, prompts: Sequence[Sequence[int]], modes: Sequence[Mode], *, max_tokens: int = 128,
              sampler: dict | None = None, warmup: bool = True, p_min: float | None = None,
              progress: Callable[[int], None] | None = None,
              temperatures: Sequence[float] | None = None) -> BenchReport:
    """Decode every prompt in every mode (plain first, added when missing), at sampler's temperature or at each
    of `temperatures`; speedups are against plain at the same temperature."""
    sampler = dict(sampler or {})
    modes = [PLAIN] + [m for m in modes if m.policy != "plain"]
    if len(modes) > 1 and not pair.speculative:
        raise InvalidParameterError("nothing to compare: the benchmark needs a draft model (-md), --lookup-only or "
                                    "the target's MTP head (--spec-type draft-mtp)")
    if not prompts:
        raise InvalidParameterError("no prompts to benchmark")
    temps = list(temperatures) if temperatures else [sampler.get("temperature") or 0.0]

    # 1. warm-up: page the weights in, start the threads, size the buffers (not measured)
    t0 = time.perf_counter()
    if warmup:
        for mode in modes[:2]:
            pair.set_policy(mode.make_policy(p_min))
            pair.generate(list(prompts[0]), max_tokens=min(WARMUP_TOKENS, max_tokens),
                          **{**sampler, "temperature": temps[0]})
    warmup_seconds = time.perf_counter() - t0

    results: list[ModeResult] = []
    outputs: dict[str, list[str]] = {}
    for temperature in temps:
        at_t = {**sampler, "temperature": temperature}
        # 2. every prompt in every mode; one policy object per mode for the whole run at this temperature
        policies = {m.name: m.make_policy(p_min) for m in modes}
        by_mode = {m.name: ModeResult(m.name, m.policy, m.k if m.k is not None else policies[m.name].k_max,
                                      temperature) for m in modes}
        texts: dict[str, list[str]] = {m.name: [] for m in modes}
        for prompt in prompts:
            for mode in modes:
                pair.set_policy(policies[mode.name])
                completion = pair.generate(list(prompt), max_tokens=max_tokens, **at_t)
                by_mode[mode.name].add(completion.stats)
                texts[mode.name].append(completion.text)
                if progress is not None:
                    progress(1)

        # 3. compare with plain at this temperature
        plain = by_mode[PLAIN.name]
        for mode in modes:
            r = by_mode[mode.name]
            r.speedup = r.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else None
            r.same_output = (sum(a == b for a, b in zip(texts[mode.name], texts[PLAIN.name]))
                             if not temperature else None)
        results += [by_mode[m.name] for m in modes]
        for name, mode_texts in texts.items():
            outputs[name if len(temps) == 1 else f"{name} T={temperature:g}"] = mode_texts
    if len(temps) > 1:
        sampler.pop("temperature", None)
    return BenchReport(results, len(prompts), max_tokens, sampler, warmup_seconds, outputs)


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
    speeds = policy.model.speeds(policy.accept.estimates(), min(policy.k_max, 6), False)
    predicted = ", ".join(f"k={k} {tps:.1f}" for k, tps in speeds)
    return (f"t_verify(1) {1000 * v1:.1f} ms, draft/target cost per token {t_draft / v1:.2f}, {points}{cold}; "
            f"perfect-draft gain {gain:.2f}; acceptance by position {acceptance}; the tok/s it predicts from these "
            f"(draft and verification only) {predicted}")
