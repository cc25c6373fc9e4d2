"""The `auto` draft-length policy: the k that maximises tokens(k) / time(k) under the cost model (costs.py), and next
to nothing lost to plain decoding where speculation cannot pay.

One object serves a pair for its lifetime (the server and chat keep theirs): the machine's costs do not change
between requests, so what it measured stays. Its verdict on the machine is a `Phase`:

    START    no step yet: the first is plain (a draft not yet prefilled would delay the first token)
    MEASURE  costs unknown: a measuring draft of k_start (or, with the costs measured at load, a shadow probe:
             only acceptance is unknown), then plain passes enough to trust; where the answer is unclear, two more
    OFF      even a draft that is always right cannot beat plain decoding by min_gain: plain, the draft never
             prefilled, a 2-token draft re-measures every recheck_every steps
    ON       a draft can pay: the best k, or plain with probes now and then, the interval doubling while they fail

and what its next step is for a `Step`: an ordinary one, a PROBE (a short draft that measures), a SHADOW probe (the
drafter proposes one token on a plain step and the token the target emits judges it: the target's pass stays one
token), its result (SHADOWED), or a REFRESH (a plain pass between drafted ones that re-measures t_verify(1)). While
drafting one token with position 2 judged poor on few steps, a tail probe (`_tail_due`) drafts one token more that
the target's next token judges: one-token drafts would otherwise never judge position 2 again.
An accepted shadow probe where the estimates had plain fastest, position 1 judged `doubt_seen` times and no request
yet ended drafting with position 1 at `accept_enough`, is asked once more before any draft (a useless draft agreeing
by chance; `_after_shadow`).
`_decide` is the transition: every change of phase and of k goes through it, but for the plain step's own probes.

Exploring is paid from a credit: every step earns `loss_budget` of its time; a drafted step pays what it lost against
plain decoding (its time and the drafter's estimated catch-up, minus tokens x t_verify(1)) or earns what it gained,
up to `credit_steps` plain passes. Optimistic estimates need a positive credit; a probe needs credit for its cost, or
waits until that cost is at most `loss_budget` of the plain time since the last probe; a new request's shadow probes,
while they are accepted, ask no credit where one costs at most `new_text_probe` plain passes (after a poor request
the credit is spent, and waiting would cost the new text's start).
A change of batch size costs on a GPU (llama.cpp re-captures its CUDA graph), so costs are learnt from warm steps,
what a cold pass costs beyond them is charged to the credit, added to a probe's price and asked back by a change of k
before it is made (`horizon` steps must repay it, or the drafted steps since the new k first looked faster must have
lost it: a small gain that lasts, `_repaid`); without costs from load a new k is kept for three steps (its third
runs warm) before the next decision. A plain step is O(1); the search over k runs after drafted steps only.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import deque
from statistics import median

from .base import Costs, DraftPolicy, check_draft_cost, check_k, check_p
from .costs import Acceptance, CostModel, fastest
from .tuning import AutoTuning


class Phase(enum.Enum):
    START = "start"
    MEASURE = "measure"
    OFF = "off"
    ON = "on"


class Step(enum.Enum):
    ORDINARY = "ordinary"
    PROBE = "probe"          # the current k is a probe
    SHADOW = "shadow"        # the next plain step is a shadow probe
    SHADOWED = "shadowed"    # a shadow probe's result waits for the update that follows it
    REFRESH = "refresh"      # this plain step re-measures t_verify(1) between drafted ones


class AutoPolicy(DraftPolicy):
    """Pick k to maximise expected tokens per second under a measured cost model (see the module's docstring).
    Tuning: an AutoTuning, or its fields as keywords (k_start=3, min_gain=1.2, ...)."""

    name = "auto"

    def __init__(self, draft_max: int = 12, draft_p_min: float = 0.0, tuning: AutoTuning | None = None,
                 **tuning_fields):
        self.draft_max = check_k("draft_max", draft_max, 1)
        self.draft_p_min = check_p("draft_p_min", draft_p_min)
        t = dataclasses.replace(tuning or AutoTuning(), **tuning_fields)
        self.tuning = t = dataclasses.replace(
            t, k_start=min(t.k_start, self.draft_max), max_probe_interval=max(t.max_probe_interval, t.probe_every),
            initial_credit_steps=min(t.initial_credit_steps, t.credit_steps))
        self.model = CostModel(t)
        self.accept = Acceptance(self.draft_max, t)
        self.phase, self.step = Phase.START, Step.ORDINARY
        self._k = 0
        self._shadow_result = 0.0
        self._since_draft = 1 << 30   # plain steps since the last drafted one: how far the drafter is behind
        self._since_probe = 0
        self._since_plain = 0         # drafted steps since the last plain one
        self._probe_interval = t.probe_every
        self._probe_due = 0.0         # plain steps after the last decision when a probe is next considered
        self._credit = 0.0            # seconds exploration may still lose against plain decoding
        self._hold = 0                # drafted steps the current k is kept for before the next decision
        self._warm_checked = False    # a verdict of "no draft pays" from cold costs was measured again warm
        self._shadows = False         # the engine runs shadow probes (attach)
        self._shadow_costs: deque[float] = deque(maxlen=t.recent)
        self._calibrated = False      # started from the costs measured at load
        self._after_prompt = 0        # passes left that run cold because a prompt ran (new_request)
        self._new_text = False        # a new request's shadow probes, while accepted, need no credit (new_text_probe)
        self._tail_asked = False      # this drafting step asked for a tail probe (shadow_len)
        self._tail: tuple | None = None   # its judgement, (chance or None,), until the update after it
        self._owed = (0, 0, 0.0)      # (k, a faster k the horizon refused, what the steps since would have saved at it)
        self._doubted = False         # an accepted shadow probe where the estimates before it had plain fastest
        self._confirming = False      # ... asked again before any draft (a draft agreeing by chance, _after_shadow)
        self._ended_drafting = False  # a request ended drafting, accept_enough at position 1: a good probe is believed

    @property
    def k_start(self) -> int:
        return self.tuning.k_start

    # -- hooks ----------------------------------------------------------------------------------------------
    def attach(self, draft_cost: str = "per_token", costs: Costs | None = None) -> None:
        self.model.per_pass = check_draft_cost(draft_cost) == "per_pass"
        self._shadows = True
        if costs is not None:
            self.calibrate(costs)

    def calibrate(self, costs: Costs) -> None:
        """Start from the costs measured at load (once): acceptance is then the one unknown, and the first decision
        asks it with a shadow probe instead of a measuring draft and the cold passes around it."""
        if not self._calibrated:
            self._calibrated = True
            self.model.calibrate(costs)

    def new_request(self) -> None:
        t = self.tuning
        # a request that ended drafting at a good estimate: drafts paid on this pair (not one that ran on past a lucky
        # probe, drafting while a change back to plain waited to repay its cold passes)
        self._ended_drafting = self._ended_drafting or (self._k > 0 and self.acceptance(1) >= t.accept_enough)
        self.model.new_request()
        self.accept.fade(t.request_fade)   # a new text: what the last one showed weighs less
        if self.phase is Phase.ON and not self._k and self.step is Step.ORDINARY and self._shadows:
            self._since_probe, self._probe_due = 0, 1   # plain: ask the new text with a shadow probe (credit allowing)
            self._new_text = True
        self._after_prompt = 2   # the two passes after a prompt run cold with or without drafts: not charged

    def held(self, tokens: int) -> None:
        self.model.held(tokens)

    def shadow_len(self) -> int:
        if self._k:   # drafting: a tail probe where the position past k is judged too seldom
            self._tail_asked = self._tail_due()
            return int(self._tail_asked)
        return 1 if self.step is Step.SHADOW and self.model.run else 0   # not in a request's first step

    def shadow(self, accepted: float | None, seconds: float) -> None:
        if self._tail_asked:   # a tail probe's judgement (None: a rejection came first), for the update after it
            self._tail = (accepted,)
            return
        self._shadow_costs.append(seconds)
        self._doubted = (accepted >= self.tuning.accept_enough and self.phase is Phase.ON and not self._confirming
                         and not self._ended_drafting and self.accept.seen[1] >= self.tuning.doubt_seen
                         and self._plain_fastest())
        self.accept.record_first(accepted)
        self._credit -= seconds
        self.step, self._shadow_result = Step.SHADOWED, accepted

    # -- estimates (the cost model's, with this policy's acceptance) ----------------------------------------
    @property
    def t_draft(self) -> float | None:
        return self.model.t_draft

    @property
    def switch_cost(self) -> float:
        return self.model.switch_cost

    def verify_time(self, n: int, optimistic: bool = False) -> float | None:
        return self.model.verify_time(n, optimistic)

    def acceptance(self, position: int) -> float:
        return self.accept.estimates()[position]

    def expected_speed(self, k: int, optimistic: bool = False) -> float | None:
        return dict(self.model.speeds(self.accept.estimates(), k, optimistic)).get(k)

    def perfect_draft_gain(self) -> float | None:
        return self.model.perfect_draft_gain(self.draft_max)

    # -- the two questions ----------------------------------------------------------------------------------
    def next_draft_len(self) -> int:
        return self._k

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        tail, self._tail, self._tail_asked = self._tail, None, False
        warm, excess = self.model.record_pass(drafted + 1, verify_seconds)
        if self._after_prompt:
            self._after_prompt -= 1
            excess = 0.0
        if drafted == 0:   # (a tail probe asked where the engine then drafted nothing was a plain step's: dropped)
            self._plain_step(verify_seconds, max(excess, 0.0))
        else:
            self._draft_step(drafted, accepted, draft_seconds, verify_seconds, warm, tail)

    def _tail_due(self) -> bool:
        """Whether this drafting step of k=1 drafts one token more to judge position 2 (the engine drafts it with the
        first, never verifies it; the target's next token judges it where the first is accepted): while position 2 is
        judged less than `tail_seen` times (faded), its estimate is `tail_gap` under position 1's, and k=2 would beat
        k=1 were position 2 as good as position 1. Without it one-token drafts never judge position 2 again. Not at
        other k (there it cost more than it found: auto-policy-notes.md), nor where a draft is one pass (its length
        is the drafter's)."""
        k = self._k
        if k != 1 or self.phase is not Phase.ON or self._hold or self.step is not Step.ORDINARY or \
                not self.position_two_unsure():
            return False
        a = self.accept.estimates()
        a[k + 1] = a[k]
        speeds = dict(self.model.speeds(a, k + 1, False))
        return k + 1 in speeds and speeds[k + 1] > speeds[k]

    def position_two_unsure(self, estimates: list[float] | None = None, tuning: AutoTuning | None = None) -> bool:
        """The acceptance half of a tail probe's question, alone or in a batch (BatchPolicy._tail_due, with its own
        tuning; the cost half, whether two tokens would then pay, is each caller's): position 2 judged fewer than
        `tail_seen` times (faded) and its estimate `tail_gap` under position 1's. Never where a draft is one pass (its
        length is the drafter's) or the longest draft is one token."""
        t = tuning or self.tuning
        if self.draft_max < 2 or self.model.per_pass or self.accept.seen[2] >= t.tail_seen:
            return False
        a = estimates or self.accept.estimates()
        return a[2] <= a[1] - t.tail_gap

    def _plain_step(self, seconds: float, excess: float) -> None:
        """O(1) unless a probe is due: nothing else changed since the last decision. `excess`: what this pass took
        beyond a warm one, the price of the draft before it."""
        t, model = self.tuning, self.model
        self._since_draft, self._since_plain = self._since_draft + 1, 0
        self.accept.wait()
        t_plain = model.size_time(1)
        if self.phase is Phase.START:   # the first plain pass: an allowance for learning the costs
            self.phase, self._credit = Phase.MEASURE, t.initial_credit_steps * t_plain
        self._credit = min(self._credit + t.loss_budget * seconds - excess, t.credit_steps * t_plain)
        if self._k:
            return  # a draft was asked for but did not fit (the request's last token, a full context)
        if self.step is Step.SHADOWED:
            self.step = Step.ORDINARY
            self._after_shadow(self._shadow_result)
            return
        if self.step is Step.REFRESH:  # back to drafting
            self.step = Step.ORDINARY
            self._decide(probe_failed=False)
            return
        if self.phase is Phase.MEASURE and not (self._shadows and model.t_draft is None and self.accept.seen[1]):
            # measure the draft first, then plain passes enough to trust. (A draft measured by shadow probes only,
            # none accepted yet, waits for one on the schedule below.)
            if model.t_draft is None:
                self._k, self.step = t.k_start, Step.PROBE
            elif model.verify[1].samples >= t.plain_samples:
                self._decide(probe_failed=False)
            return
        self._since_probe += 1
        if self._since_probe < self._probe_due:
            return
        # 1 token tells acceptance; 2 measure the draft after its catch-up. A probe is paid from the credit, or
        # waits until it costs at most loss_budget of the plain time since the last one (a drafter far behind
        # makes a probe cost several plain passes); both grow by `earned` a step, so the wait is known. Where the
        # engine runs shadow probes, acceptance is asked with one: no cold target passes.
        shadow = self._shadows and self.phase is not Phase.OFF
        k = min(1 if self.phase is Phase.ON else 2, self.draft_max)
        loss = self._shadow_loss() if shadow else model.probe_loss(k, self._since_draft)
        earned = t.loss_budget * t_plain
        covered = max(self._credit, self._since_probe * earned)
        if self._new_text and shadow and loss <= t.new_text_probe * t_plain:
            covered = loss   # a new text's questions, while they are answered yes: cheap, and waiting costs its start
        if covered >= loss:
            if shadow:
                self.step = Step.SHADOW
            else:
                self._k, self.step = k, Step.PROBE
        else:
            self._probe_due = self._since_probe + max(1.0, (loss - covered) / earned)

    def _after_shadow(self, accepted: float) -> None:
        """Decide after a shadow probe: with the costs unknown, measure them once acceptance looks worth it."""
        t = self.tuning
        self._new_text = self._new_text and accepted >= t.accept_enough
        if self.model.t_draft is None:
            if self.acceptance(1) >= t.accept_enough:
                self._k, self.step = t.k_start, Step.PROBE
                return
            failed = accepted < t.accept_enough
            self._probe_interval = min(self._probe_interval * 2, t.max_probe_interval) if failed \
                else t.probe_every
            self._since_probe, self._probe_due = 0, self._probe_interval
            return
        if self._doubted:
            # plain was fastest before this probe: one accepted token may be a useless draft agreeing by chance
            # (a 4% draft, idle steps having faded what showed it useless, would otherwise draft for 20 steps)
            self._doubted, self._confirming, self.step = False, True, Step.SHADOW
            return
        if self._confirming and accepted < t.accept_enough:
            # not confirmed: plain stays until the next probe (no back-off: one of two accepted is no failure)
            self._confirming, self._since_probe, self._probe_due = False, 0, self._probe_interval
            return
        self._confirming = False
        self._decide(probe_failed=accepted < t.accept_enough)

    def _plain_fastest(self) -> bool:
        """Whether the estimates as they stand put plain decoding ahead of every draft length."""
        _, speeds = self.model.survey(self.accept.estimates(), self.draft_max, False)
        return fastest(speeds) == 0

    def _repaid(self, speeds: dict, best: int, optimistic: bool, drafting: bool) -> bool:
        """Whether a change to `best` repays its cold passes: within `horizon` steps (worth_changing), or by what the
        drafted steps at this k since `best` first looked faster would have saved at it. The second is for a gain too
        small for the horizon that lasts (one-token drafts 2.5% slower than two on an H200, kept for three requests);
        the sum starts again whenever the k or the faster k differs from the last decision's."""
        model, k = self.model, self._k
        if model.worth_changing(speeds, k, best, optimistic):
            return True
        if not drafting or k not in speeds or best not in speeds:
            return False
        at, behind, saved = self._owed
        saved = (saved if (at, behind) == (k, best) else 0.0) + \
            model.step_time(k, optimistic) * (1.0 - speeds[k] / speeds[best])
        self._owed = (k, best, saved)
        return saved >= 2 * model.switch_cost

    def _longest_interval(self) -> int:
        """How far failed probes back off: `max_probe_interval`, or less where a shadow probe costs under half the
        loss budget of the plain steps between them (a drafter far cheaper than the target)."""
        t = self.tuning
        if not self._shadows or not self._shadow_costs:
            return t.max_probe_interval
        steps = self._shadow_loss() / (0.5 * t.loss_budget * self.verify_time(1)) if t.loss_budget else 1e9
        return int(min(max(steps, t.probe_every), t.max_probe_interval))

    def _shadow_loss(self) -> float:
        """Seconds a shadow probe costs: as the recent ones took, else twice a drafted token (the token and its
        catch-up, one batch: on a GPU a batch of many tokens costs a small multiple of one)."""
        costs, n, t_draft = self._shadow_costs, self.tuning.plain_samples, self.t_draft
        estimate = 2.0 * t_draft if t_draft is not None else 0.0
        if self._calibrated and t_draft is not None and len(costs) < n:
            # with the costs measured at load, the first probes are weighed against the estimate (as the cost
            # model's first passes are): one probe that paid once for something (a request's first decode with its
            # sampler chain attached makes llama.cpp reserve its graphs) cannot price the next at hundreds of plain
            # passes
            return median([*costs, *[estimate] * n])
        return median(costs) if costs else estimate

    def _draft_step(self, drafted, accepted, draft_seconds, verify_seconds, warm: bool, tail=None) -> None:
        t, model = self.tuning, self.model
        self._new_text = False
        # After 3+ plain steps the drafter caught up on the missed tokens and the token after them in one batch,
        # which the engine counts as setup: draft_seconds then holds drafted - 1 token decodes. A tail probe's
        # token was drafted in the same step.
        extra = 1 if tail is not None else 0
        counted = 1 if model.per_pass else drafted - 1 + extra if self._since_draft >= 3 else drafted + extra
        model.record_draft(draft_seconds, counted, warm, drafted + extra)
        missed, self._since_draft = self._since_draft, 0
        self._since_plain += 1
        self.accept.record_draft(drafted, accepted, tail[0] if tail is not None else None)
        if model.t_draft is None or 1 not in model.verify:
            return  # keep the draft length until both costs are known
        t_plain = self.verify_time(1)
        seconds = draft_seconds + verify_seconds
        lost = seconds + model.catch_up(missed) - (accepted + 1) * t_plain
        self._credit = min(self._credit + t.loss_budget * seconds - lost, t.credit_steps * t_plain)
        probing = self.step is Step.PROBE
        if probing:
            self.step = Step.ORDINARY
        if self._hold and not probing:  # a new k runs warm on its third step: judge it then
            self._hold -= 1
            return
        if self.phase in (Phase.START, Phase.MEASURE) and model.verify[1].samples < t.plain_samples and not (
                self.perfect_draft_gain() >= t.sure_gain * t.min_gain and verify_seconds >= t_plain):
            # A marginal machine, or a pass over more tokens that took less time than one over a single token
            # (timing noise): the one plain pass may have been an outlier, so measure more before deciding.
            self._k = 0
            return
        self._decide(probing and accepted == 0, drafting=not probing)

    def _decide(self, probe_failed: bool, drafting: bool = False) -> None:
        """The transition: OFF where no draft can pay; else ON with the best k, optimistic while exploring is
        affordable. While `drafting` (not probing), or plain, the current k stays unless the change repays its cold
        passes."""
        t, model = self.tuning, self.model
        optimistic = self._credit > 0
        # (estimates past position k + 2 held to the ones next to the draft: a change to a much longer draft is not
        # taken on what an earlier text showed deep in the draft alone, Acceptance.near)
        gain, speeds = model.survey(self.accept.near(self._k), self.draft_max, optimistic)
        if gain < t.min_gain and not model.draft.samples and not self._warm_checked and \
                model.switch_cost > t.cold_matters * self.verify_time(1):
            # "no draft can pay", from cold passes only, where cold passes cost (a GPU; the first draft of a
            # request can also pay for attaching its sampler): draft k_start for three steps, judge the third
            self._warm_checked, self.phase, self._k, self._hold = True, Phase.MEASURE, t.k_start, 2
            return
        self.phase = Phase.ON if gain >= t.min_gain else Phase.OFF
        on = self.phase is Phase.ON
        if on and self._shadows and not self.accept.seen[1]:
            # no acceptance seen yet (the costs came from calibrate): a shadow probe asks before any draft
            self._k, self.step, self._since_probe, self._probe_due = 0, Step.SHADOW, 0, self._probe_interval
            return
        best = fastest(speeds) if on else 0
        if best != self._k and (drafting or not self._k) and not self._repaid(speeds, best, optimistic, drafting):
            best = self._k   # drafting, or plain after a shadow probe: a change must repay its cold passes
        elif best == self._k:
            self._owed = (0, 0, 0.0)   # no faster k: a lasting gain starts again
        if best and best + 1 != model.last_n and not self._calibrated:   # a size not just run: keep it until it
            self._hold = 2                                                 # runs warm (its costs are unknown)
        if best > 0:
            self._probe_interval = t.probe_every
            # Drafting measures no plain pass, yet every gain is judged against one: where the gain is not
            # obviously large, take a plain pass now and then (often while it has few samples). Not where a lone
            # plain pass runs cold (a GPU): it would cost its change twice and measure no warm pass.
            samples = model.verify[1].samples
            every = t.refresh_every if samples < 4 * t.plain_samples else 16 * t.refresh_every
            if self._since_plain >= every and gain < t.sure_gain * t.min_gain and \
                    model.switch_cost <= t.cold_refresh * self.verify_time(1):
                best, self.step = 0, Step.REFRESH
        elif probe_failed and on and self.accept.seen[1] >= 2:
            # back off while probes fail (after a second try: one rejection says little); one that was accepted:
            # look again soon
            self._probe_interval = min(self._probe_interval * 2, self._longest_interval())
        else:
            self._probe_interval = t.probe_every
        self._since_probe, self._k = 0, best
        self._probe_due = self._probe_interval if on else t.recheck_every
        if not best and on and self._shadows and self.accept.seen[1] < t.plain_samples:
            self._probe_due = 1   # acceptance seen once or twice: ask again with the next shadow probe
