"""The `auto` policy's tuning constants, in one place: each line says what raising it trades."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import InvalidParameterError


@dataclass(frozen=True)
class AutoTuning:
    """How `auto` explores and how far it trusts what it measured. The defaults hold on the simulator's machines
    (tests/support/policy_sim.py) and on the measured pairs (benchmarks/results/auto-policy-notes.md)."""

    # -- exploring ------------------------------------------------------------------------------------------
    k_start: int = 3                    # the measuring draft's length: longer measures more sizes, risks more
    probe_every: int = 4                # plain steps before the first probe: sooner finds a better draft, pays more
    max_probe_interval: int = 128       # the longest back-off between failed probes: longer wastes less, recovers later
    recheck_every: int = 1024           # plain steps between re-measures where no draft can pay
    min_gain: float = 1.2               # a perfect draft must beat plain by this to try at all: higher is safer, slower
    loss_budget: float = 0.01           # share of the time exploring may lose against plain decoding
    credit_steps: int = 16              # the most plain passes of credit saved up: more allows bolder exploring
    initial_credit_steps: int = 2       # credit at the first plain pass, for learning the costs
    horizon: int = 16                   # steps in which a change of k must repay its cold passes
    new_text_probe: float = 0.5         # a new request's shadow probes, while accepted, are taken at once (no credit
                                        # asked) where one costs at most this many plain passes: higher asks a new
                                        # text sooner after a poor one, pays more where drafts stay useless
    # -- estimating -----------------------------------------------------------------------------------------
    decay: float = 0.95                 # per-step weight of the past: lower follows changes faster, noisier
    stale_decay: float = 0.995          # decay of acceptance at positions not drafted: lower forgets them faster
    idle_decay: float = 0.98            # decay of acceptance's weight per plain step: lower trusts a probe after a
                                        # pause more (acceptance changes between requests)
    request_fade: float = 0.5           # weight kept of acceptance seen before a new request: lower follows a change of
                                        # text at once, trusts the first judgements of each request more
    surprise_llr: float = 5.0           # a new request's first judgements this unlikely (log-likelihood ratio) under
                                        # the estimate it began with let go of the requests before: lower follows a
                                        # change of text sooner, forgets more on a chance run (0: never)
    surprise_fade: float = 0.1          # weight kept, then, of position 1's judgements in the requests before
    prior: float = 0.6                  # acceptance assumed before any draft is judged
    prior_weight: float = 0.5           # how firmly position 1 leans on the prior (low: a useless draft shows at once)
    chain_weight: float = 2.0           # how firmly position j leans on j - 1 (high: one rejection does not cut k)
    plain_samples: int = 3              # plain passes before t_verify(1) is trusted (and calibrated costs' weight)
    sure_gain: float = 2.0              # x min_gain: a gain this large needs no further plain passes to trust
    refresh_every: int = 8              # drafted steps between plain passes that re-measure t_verify(1)
    recent: int = 9                     # samples kept of cold-pass excess and of shadow-probe costs (medians)
    # -- judging probes -------------------------------------------------------------------------------------
    accept_enough: float = 0.5          # a shadow probe counts as accepted at this chance; measuring starts there
    doubt_seen: float = 12.0            # judgements of position 1 (faded per judgement, not by idle steps) after which
                                        # an accepted shadow probe where plain was fastest is asked once more before any
                                        # draft: lower guards a useless draft sooner, delays a good one after bad luck
    cold_matters: float = 0.1           # switch cost over t_verify(1) above which a cold "no draft pays" is re-measured
    cold_refresh: float = 0.05          # switch cost over t_verify(1) above which no refresh pass is taken
    tail_seen: float = 6.0              # judgements (faded) of the position past k below which a drafting step drafts
                                        # one token more, unverified, that the target's next token judges where all k
                                        # were accepted (a tail probe): higher asks more often, a drafted token each
                                        # time; 0 never (one-token drafts then never judge position 2 again)
    tail_gap: float = 0.05              # ... while position k + 1's estimate is this far under position k's: lower asks
                                        # where k + 1 is near k already (and k is best on its costs), more tokens

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise InvalidParameterError(f"{f.name} must be a number >= 0, got {value!r}", param=f.name)
        for name in ("k_start", "probe_every", "max_probe_interval", "recheck_every", "credit_steps", "horizon",
                     "plain_samples", "refresh_every", "recent"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}", param=name)
        if self.min_gain < 1.0:
            raise InvalidParameterError(f"min_gain must be >= 1, got {self.min_gain!r}", param="min_gain")
        for name in ("loss_budget", "prior"):
            if not getattr(self, name) < 1.0:
                raise InvalidParameterError(f"{name} must be in [0, 1), got {getattr(self, name)!r}", param=name)
        if self.surprise_fade > 1.0:
            raise InvalidParameterError(f"surprise_fade must be in [0, 1], got {self.surprise_fade!r}",
                                        param="surprise_fade")
        for name in ("decay", "stale_decay", "idle_decay", "request_fade"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise InvalidParameterError(f"{name} must be in (0, 1], got {getattr(self, name)!r}", param=name)
