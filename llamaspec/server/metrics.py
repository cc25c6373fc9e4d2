"""What `llamaspec serve` exports on /metrics, through prometheus_client (the format's reference library).

Each ServerMetrics has its own registry, so several apps in one process do not share counters. Gauges that
describe the present (queue depth, current draft length, acceptance so far) are read at scrape time from
callables. Knows nothing about HTTP or models, only what it is told.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: time to first token spans prompt processing (ms to tens of s); per-token latency spans sub-ms to 1 s.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PREFIX = "llamaspec_"
LLAMACPP_PREFIX = "llamacpp:"


class _Present:
    """Gauges computed at scrape time."""

    def __init__(self, metrics: "ServerMetrics", draft_state, queue_state):
        self.metrics, self.draft_state, self.queue_state = metrics, draft_state, queue_state

    def collect(self):
        m = self.metrics
        waiting, running = self.queue_state()
        yield GaugeMetricFamily(PREFIX + "acceptance_rate", "Accepted / drafted tokens since the server started.",
                                value=_ratio(m.totals["accepted"], m.totals["drafted"]))
        yield GaugeMetricFamily(PREFIX + "mean_accepted_length",
                                "Tokens generated per target pass since the server started.",
                                value=_ratio(m.totals["tokens"], m.totals["passes"]))
        draft = GaugeMetricFamily(PREFIX + "draft_length", "Draft length the policy will use next, by policy.",
                                  labels=["policy"])
        for name, k in sorted(self.draft_state().items()):
            draft.add_metric([name], k)
        yield draft
        yield GaugeMetricFamily(PREFIX + "queue_depth", "Requests waiting for the model.", value=waiting)
        yield GaugeMetricFamily(PREFIX + "requests_running", "Requests being generated (0 or 1).", value=running)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


class ServerMetrics:
    """The server's metrics. `draft_state` returns {policy name: current draft length} and `queue_state`
    (waiting, running); both are called at scrape time without locking the engine: they are plain numbers."""

    def __init__(self, draft_state: Callable[[], dict[str, float]], queue_state: Callable[[], tuple[int, int]]):
        self.registry = r = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code (499: the client left "
                                "before an answer).", ("endpoint", "status"), registry=r)
        self.cancelled = Counter(p + "generations_cancelled",
                                 "Generations stopped early because the client went away or the server stopped.",
                                 registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed (including cached ones).",
                                     registry=r)
        self.prompt_tokens_cached = Counter(p + "prompt_tokens_cached",
                                            "Prompt tokens reused from the KV cache of an earlier request.", registry=r)
        self.tokens = Counter(p + "tokens_generated", "Tokens generated.", registry=r)
        self.drafted = Counter(p + "draft_tokens", "Tokens proposed by the drafter.", registry=r)
        self.accepted = Counter(p + "draft_tokens_accepted", "Drafted tokens the target accepted.", registry=r)
        self.passes = Counter(p + "target_passes", "Target verification passes.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Seconds from the start of generation to the first token (prompt processing included).",
                              buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram(p + "time_per_output_token_seconds",
                                       "Mean seconds per generated token after the prefill, one observation "
                                       "per request.", buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Seconds a request waited for the model.",
                                    buckets=TTFT_BUCKETS, registry=r)
        # llama-server's names (tools/server/server-task.cpp) where the meaning is the same; a "draft" is one
        # verification of drafted tokens, and position i counts the drafts whose first i + 1 tokens were accepted
        cpp = LLAMACPP_PREFIX
        self.cpp_drafted = Counter(cpp + "spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated",
                                   registry=r)
        self.cpp_accepted = Counter(cpp + "spec_decode_num_accepted_tokens",
                                    "Speculative: Total draft tokens accepted by the target model", registry=r)
        self.cpp_drafts = Counter(cpp + "spec_decode_num_drafts",
                                  "Speculative: Total speculative decoding verification steps", registry=r)
        self.cpp_per_pos = Counter(cpp + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position",
                                   ("position",), registry=r)
        self.totals = {"accepted": 0, "drafted": 0, "tokens": 0, "passes": 0}  # for the ratios (one writer)
        r.register(_Present(self, draft_state, queue_state))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def record_generation(self, stats) -> None:
        """Account for one finished (or cancelled) generation's GenerationStats."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prompt_tokens_cached.inc(stats.prompt_tokens_cached)
        self.tokens.inc(stats.tokens_generated)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.passes.inc(stats.target_passes)
        self.cpp_drafted.inc(stats.drafted)
        self.cpp_accepted.inc(stats.accepted)
        self.cpp_drafts.inc(sum(stats.accepted_lengths.values()))
        longest = max((n for n, steps in stats.accepted_lengths.items() if steps), default=0)
        for position in range(longest):
            self.cpp_per_pos.labels(position=str(position)).inc(
                sum(steps for n, steps in stats.accepted_lengths.items() if n > position))
        for name, n in (("accepted", stats.accepted), ("drafted", stats.drafted), ("tokens", stats.tokens_generated),
                        ("passes", stats.target_passes)):
            self.totals[name] += n
        if stats.finish_reason == "cancelled":
            self.cancelled.inc()
        if stats.tokens_generated:
            self.ttft.observe(stats.time_to_first_token)
        if stats.tokens_generated:   # the generation span holds every token's work (timings.py says why)
            self.token_latency.observe(stats.decode_time / stats.tokens_generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)
