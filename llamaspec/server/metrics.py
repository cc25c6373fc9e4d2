"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Three metric kinds (counter, gauge, histogram), each with optional labels, safe to update from any thread.
`ServerMetrics` is the set the server exports; it knows nothing about HTTP or models, only what it is told.
"""
from __future__ import annotations

import abc

import math
import threading
from typing import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: time to first token spans prompt processing (ms to tens of s); per-token latency spans sub-ms to 1 s.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if math.isnan(x):
        return "NaN"
    return repr(int(x)) if float(x).is_integer() and abs(x) < 2**53 else repr(float(x))


class _Metric(abc.ABC):
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Iterable[str] = ()):
        self.name, self.help = name, help_text
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"] + self._samples()

    @abc.abstractmethod
    def _samples(self) -> list[str]:
        """The metric's sample lines in Prometheus text format."""


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help_text, labels=()):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple, float] = {} if self.label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def _samples(self):
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]


class Gauge(_Metric):
    """A value set by the caller, or read from `source` at scrape time ({label values: value})."""

    kind = "gauge"

    def __init__(self, name, help_text, labels=(), source: Callable[[], dict] | None = None):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple, float] = {} if self.label_names or source else {(): 0.0}
        self._source = source

    def set(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def _samples(self):
        if self._source is not None:
            items = sorted((tuple(str(x) for x in k), float(v)) for k, v in self._source().items())
        else:
            with self._lock:
                items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, buckets: Iterable[float], labels=()):
        super().__init__(name, help_text, labels)
        self.bounds = tuple(sorted(buckets)) + (math.inf,)
        self._series: dict[tuple, list] = {}  # labels -> [counts per bucket (not cumulative), sum, count]
        if not self.label_names:
            self._series[()] = [[0] * len(self.bounds), 0.0, 0]

    def observe(self, value: float, **labels) -> None:
        key = self._key(labels)
        index = next(i for i, b in enumerate(self.bounds) if value <= b)
        with self._lock:
            series = self._series.setdefault(key, [[0] * len(self.bounds), 0.0, 0])
            series[0][index] += 1
            series[1] += value
            series[2] += 1

    def count(self, **labels) -> int:
        with self._lock:
            series = self._series.get(self._key(labels))
            return series[2] if series else 0

    def _samples(self):
        lines = []
        with self._lock:
            items = sorted((k, ([*s[0]], s[1], s[2])) for k, s in self._series.items())
        for key, (counts, total, n) in items:
            cumulative = 0
            for bound, c in zip(self.bounds, counts):
                cumulative += c
                le = f'le="{_number(bound)}"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(total)}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {n}")
        return lines


class ServerMetrics:
    """What `llamaspec serve` exports on /metrics.

    `draft_state` is called at scrape time and returns {policy name: current draft length}; `queue_state`
    returns (waiting, running). Both are read without locking the engine: they are plain numbers.
    """

    def __init__(self, draft_state: Callable[[], dict[str, float]], queue_state: Callable[[], tuple[int, int]]):
        p = "llamaspec_"
        self.requests = Counter(p + "requests_total", "HTTP requests by endpoint and status code.",
                                ("endpoint", "status"))
        self.cancelled = Counter(p + "generations_cancelled_total",
                                 "Generations stopped early because the client went away or the server stopped.")
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens processed (including cached ones).")
        self.prompt_tokens_cached = Counter(p + "prompt_tokens_cached_total",
                                            "Prompt tokens reused from the KV cache of an earlier request.")
        self.tokens = Counter(p + "tokens_generated_total", "Tokens generated.")
        self.drafted = Counter(p + "draft_tokens_total", "Tokens proposed by the drafter.")
        self.accepted = Counter(p + "draft_tokens_accepted_total", "Drafted tokens the target accepted.")
        self.passes = Counter(p + "target_passes_total", "Target verification passes.")
        self.acceptance = Gauge(p + "acceptance_rate", "Accepted / drafted tokens since the server started.",
                                source=lambda: {(): self._ratio(self.accepted, self.drafted)})
        self.mean_accepted = Gauge(p + "mean_accepted_length",
                                   "Tokens generated per target pass since the server started.",
                                   source=lambda: {(): self._ratio(self.tokens, self.passes)})
        self.draft_len = Gauge(p + "draft_length", "Draft length the policy will use next, by policy.",
                               ("policy",), source=lambda: {(name,): k for name, k in draft_state().items()})
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for the model.",
                                 source=lambda: {(): queue_state()[0]})
        self.running = Gauge(p + "requests_running", "Requests being generated (0 or 1).",
                             source=lambda: {(): queue_state()[1]})
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Seconds from the start of generation to the first token (prompt processing included).",
                              TTFT_BUCKETS)
        self.token_latency = Histogram(p + "time_per_output_token_seconds",
                                       "Mean seconds per generated token after the first, one observation per "
                                       "request.", TOKEN_LATENCY_BUCKETS)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Seconds a request waited for the model.",
                                    TTFT_BUCKETS)
        self._all = [self.requests, self.cancelled, self.prompt_tokens, self.prompt_tokens_cached, self.tokens,
                     self.drafted, self.accepted, self.passes, self.acceptance, self.mean_accepted, self.draft_len,
                     self.queue_depth, self.running, self.ttft, self.token_latency, self.queue_wait]

    @staticmethod
    def _ratio(num: Counter, den: Counter) -> float:
        d = den.value()
        return num.value() / d if d else 0.0

    def record_generation(self, stats) -> None:
        """Account for one finished (or cancelled) generation's GenerationStats."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prompt_tokens_cached.inc(stats.prompt_tokens_cached)
        self.tokens.inc(stats.tokens_generated)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.passes.inc(stats.target_passes)
        if stats.finish_reason == "cancelled":
            self.cancelled.inc()
        if stats.tokens_generated:
            self.ttft.observe(stats.time_to_first_token)
        if stats.tokens_generated > 1:
            after_first = stats.time_total - stats.time_to_first_token
            self.token_latency.observe(max(after_first, 0.0) / (stats.tokens_generated - 1))

    def render(self) -> str:
        return "\n".join(line for metric in self._all for line in metric.render()) + "\n"
