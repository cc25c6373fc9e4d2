"""Per-request statistics, returned as a dataclass; the CLI and the server decide how to print them."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    policy: str = "none"
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0   # prompt tokens already in the KV caches from an earlier request
    tokens_generated: int = 0
    target_passes: int = 0          # verification decodes (one per step; plain decoding = one per token)
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)  # n_accepted -> steps
    draft_lengths: Counter = field(default_factory=Counter)     # tokens drafted -> steps
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0
    time_to_first_token: float = 0.0
    time_in_decode: float = 0.0     # seconds spent inside llama_decode (both models), for the Python overhead
    time_rollback: float = 0.0      # seconds rolling caches back while generating: KV trims, recurrent-state step
    #                                 checkpoints, restores (the prompt's turn checkpoint is in time_prefill)
    tokens_replayed: int = 0        # tokens decoded again after a checkpoint restore (recurrent memories)
    shadow_probes: int = 0          # plain steps on which the drafter proposed a token only to be judged (auto)
    tail_probes: int = 0            # drafting steps on which it proposed one token past the draft, never verified,
    #                                 only to be judged by the token the target emits (auto)
    finish_reason: str | None = None
    # the last step: tokens generated before it, drafted, accepted (a reply may stop inside it: end_reply)
    _last_step: tuple[int, int, int] = field(default=(0, 0, 0), repr=False, compare=False)

    def record_step(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """One draft-verify step: `drafted` proposed, `accepted` kept. Call it before the step's tokens are
        counted in `tokens_generated`."""
        self.target_passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.time_draft += draft_seconds
        self.time_verify += verify_seconds
        if drafted:
            self.accepted_lengths[accepted] += 1
        self.draft_lengths[drafted] += 1
        self._last_step = (self.tokens_generated, drafted, accepted)

    def end_reply(self) -> None:
        """The reply has ended. Where it stopped inside the last step's accepted draft tokens (a stop string, an
        end-of-generation token), the draft tokens past that point were verified for nothing that was sent: the
        step counts as drafting and accepting the `kept` draft tokens the reply holds, so accepted <= generated."""
        before, drafted, accepted = self._last_step
        kept = self.tokens_generated - before
        if not drafted or kept > accepted:
            return
        self.drafted -= drafted - kept
        self.accepted -= accepted - kept
        self.accepted_lengths[accepted] -= 1
        self.accepted_lengths[kept] += 1
        self.draft_lengths[drafted] -= 1
        self.draft_lengths[kept] += 1
        self.accepted_lengths += Counter()   # drop the lengths no step has now
        self.draft_lengths += Counter()
        self._last_step = (self.tokens_generated, kept, kept)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass (accepted draft tokens + the target's own token)."""
        return self.tokens_generated / self.target_passes if self.target_passes else 0.0

    @property
    def time_other(self) -> float:
        return max(0.0, self.time_total - self.time_prefill - self.time_draft - self.time_verify)

    @property
    def decode_time(self) -> float:
        """Generation time: from the end of the prefill to the last token. The first verification decodes the
        prompt's last token with the first draft, so every generated token's work lies in this span."""
        return max(self.time_total - self.time_prefill, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.decode_time if self.tokens_generated else 0.0

    @property
    def python_overhead(self) -> float:
        """Fraction of generation wall time spent outside llama_decode and the cache operations."""
        busy = self.time_total - self.time_prefill
        return max(0.0, 1.0 - (self.time_in_decode + self.time_rollback) / busy) if busy > 0 else 0.0

    @property
    def python_ms_per_step(self) -> float:
        """Milliseconds of Python a target pass: the generation's time outside llama_decode (and its sync) and outside
        the caches' rollback, as `python_overhead` counts it."""
        busy = self.time_total - self.time_prefill - self.time_in_decode - self.time_rollback
        return 1000 * busy / max(self.target_passes, 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["_last_step"]
        d["accepted_lengths"] = {str(k): v for k, v in sorted(self.accepted_lengths.items())}
        d["draft_lengths"] = {str(k): v for k, v in sorted(self.draft_lengths.items())}
        for name in ("acceptance_rate", "mean_accepted_length", "tokens_per_second", "time_other", "python_overhead"):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        line = f"{self.tokens_generated} tokens, {self.tokens_per_second:.1f} tok/s"
        if self.drafted:
            line += (f", acceptance {self.acceptance_rate:.0%}, {self.mean_accepted_length:.2f} tokens/pass"
                     f", policy {self.policy}")
        return line


@dataclass
class StepTimes:
    """Where the engine's steps went, in seconds summed over `steps`: drafting, the target's decode, and all of
    `step()` (the rest: building runs, accepting, emitting text)."""

    steps: int = 0
    draft: float = 0.0
    decode: float = 0.0
    total: float = 0.0

    def add(self, draft: float, decode: float, total: float) -> None:
        self.steps, self.draft, self.decode, self.total = (self.steps + 1, self.draft + draft, self.decode + decode,
                                                           self.total + total)
