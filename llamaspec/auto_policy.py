"""The `auto` draft-length policy: expected tokens per second under a measured cost model (see AutoPolicy)."""
from __future__ import annotations

from bisect import insort
from collections import deque
from statistics import median

from .errors import InvalidParameterError
from .policy import Costs, DraftPolicy, _check_k, _check_p


class _Timing:
    """Seconds per unit (a pass, a drafted token) that one slow sample cannot swing: other processes only ever make a
    step slower, and on a shared machine one step can take many times its usual time. The minimum of the first
    samples, their median once there are 3, then a decayed average of samples clipped to [1/2, 2] x the estimate."""

    __slots__ = ("total", "weight", "samples", "_first")

    def __init__(self):
        self.total = self.weight = 0.0
        self.samples = 0
        self._first: list[float] | None = []

    @property
    def value(self) -> float:
        return self.total / self.weight

    def add(self, per_unit: float, units: float, decay: float) -> None:
        self.samples += 1
        first = self._first
        if first is not None:
            first.append(per_unit)
            self.weight += units
            self.total = (min(first) if len(first) < 3 else sorted(first)[len(first) // 2]) * self.weight
            if len(first) == 3:
                self._first = None
            return
        estimate = self.total / self.weight
        self.total = decay * self.total + min(max(per_unit, 0.5 * estimate), 2.0 * estimate) * units
        self.weight = decay * self.weight + units


class AutoPolicy(DraftPolicy):
    """Pick k to maximise expected tokens per second under a measured cost model, and lose next to nothing to
    plain decoding where speculation cannot pay.

    tokens(k) = 1 + sum_{j<=k} prod_{i<=j} a_i          (a_i: acceptance at draft position i, given i-1 accepted)
    time(k)   = k * t_draft + t_verify(k + 1)            (t_verify(n): one target pass over n tokens)
              = t_draft + t_verify(k + 1)                for a drafter whose whole draft is one pass (DFlash)
    k = argmax tokens(k) / time(k) over 0..k_max; k = 0 is plain decoding.

    One object serves a pair for its lifetime (the server and chat keep theirs): the machine's costs do not change
    between requests, so what it measured stays. How it spends its steps:
    1. The first is plain (a draft not yet prefilled would delay the first token). Where the pair measured its
       costs at load (`calibrate`, from Pair.warm_up on a GPU) only acceptance is unknown: the second step is a
       shadow probe (below). Otherwise the second drafts `k_start` tokens: a plain pass, a short verification and
       the draft's cost per token; where the answer is not clear (or the timings contradict each other) it takes
       two more plain passes before deciding.
    2. Perfect-draft bound: where even a draft that is always right could not beat plain decoding by `min_gain`,
       acceptance is beside the point: it stays plain (the draft is then never prefilled) and re-measures with a
       2-token draft every `recheck_every` steps.
    3. Otherwise it drafts the best k, with a plain pass now and then where the gain is not obviously large (every
       gain is judged against t_verify(1)). When plain wins it probes after `probe_every` plain steps, the
       interval doubling while probes fail, up to `max_probe_interval` or where a probe costs half the loss budget
       of the plain steps between probes (after one or two failures the next comes at once): with a shadow probe
       where the engine runs them (one draft token judged against the token the target emits; the target's pass
       stays one token), else with a 1-token draft. A shadow probe that was accepted, with the costs not measured yet, is followed by the
       measuring draft of step 1.
    Exploring is paid from a credit: every step earns `loss_budget` of its time; a drafted step pays what it lost
    against plain decoding (its time and the drafter's estimated catch-up, minus tokens x t_verify(1)) or earns what
    it gained, up to `credit_steps` plain passes. Optimistic estimates (a verify curve flatter than measured,
    beyond the sizes measured) need a positive credit; a probe needs credit for its cost, or waits until that cost
    is at most `loss_budget` of the plain time since the last probe.
    Changing the batch size costs on a GPU: llama.cpp replays a captured CUDA graph while a context's batch shape
    stays the same, so the first pass at a new size runs uncaptured and the second captures it again (on an H200,
    32B target: a 1-token probe made the two plain passes after it 3.5 and 4.8 ms slower than their 10.4 ms). So a
    step counts as warm only after two steps of its size in a row; costs are learnt from warm steps, and what a
    cold pass costs beyond its warm time (`switch_cost`) is learnt from the cold ones, charged to the credit, added
    to a probe's price, and asked back by a change of k, or by leaving plain decoding, before it is made
    (`horizon` steps must repay it). Without costs from load a new k is kept for three steps (its third runs warm)
    before the next decision, and a "no draft pays" drawn from cold costs alone, where cold passes cost, is
    measured once more warm.
    Timings are robust decayed averages (_Timing); acceptance counts decay too, so the policy follows changes within
    a request. A plain step is O(1); the search over k runs after drafted steps only.
    """

    name = "auto"

    def __init__(self, k_max: int = 12, p_min: float = 0.0, k_start: int = 3, probe_every: int = 4,
                 max_probe_interval: int = 128, recheck_every: int = 1024, min_gain: float = 1.2,
                 loss_budget: float = 0.01, credit_steps: int = 16, initial_credit_steps: int = 2,
                 horizon: int = 16, decay: float = 0.95):
        self.k_max = _check_k("k_max", k_max, 1)
        self.p_min = _check_p("p_min", p_min)
        self.k_start = min(_check_k("k_start", k_start, 1), self.k_max)
        self.probe_every = _check_k("probe_every", probe_every, 1)
        self.max_probe_interval = max(_check_k("max_probe_interval", max_probe_interval, 1), self.probe_every)
        self.recheck_every = _check_k("recheck_every", recheck_every, 1)
        if not isinstance(min_gain, (int, float)) or min_gain < 1.0:
            raise InvalidParameterError(f"min_gain must be >= 1, got {min_gain!r}", param="min_gain")
        self.min_gain = float(min_gain)
        self.loss_budget = _check_p("loss_budget", loss_budget)
        self.credit_steps = _check_k("credit_steps", credit_steps, 1)
        self.initial_credit_steps = min(_check_k("initial_credit_steps", initial_credit_steps), self.credit_steps)
        self.horizon = _check_k("horizon", horizon, 1)
        self.decay = decay
        # acceptance at each draft position: (accepted, tried) counts, all decayed at every drafted step so that
        # what was seen at positions no longer drafted fades; each estimate leans on the position before it
        # (position 1 leans on the prior lightly, so that a useless draft shows at once; later positions on the one
        # before them firmly, so that one rejection at position 2 does not keep drafts at one token)
        self._prior, self._prior_weight, self._chain_weight = 0.6, 0.5, 2.0
        self._stale_decay = 0.995
        self._plain_samples, self._sure_gain, self._refresh_every = 3, 2.0, 8
        self._acc = [0.0] * (self.k_max + 1)
        self._tried = [0.0] * (self.k_max + 1)
        self._verify: dict[int, _Timing] = {}        # batch size -> seconds per warm target pass
        self._cold: dict[int, _Timing] = {}          # ... per cold pass, where no warm one was measured yet
        self._sizes: list[int] = []                  # measured batch sizes (warm or cold), sorted
        self._draft = _Timing()                      # seconds per drafted token, warm steps
        self._draft_cold = _Timing()                 # ... cold steps (a probe's)
        self._excess: deque[float] = deque(maxlen=9)  # what cold passes took beyond the warm time of their size
        self._last_n, self._run = 1, 2               # the last step's batch size, steps of it in a row
        self._k = 0
        self._since_draft = 1 << 30   # plain steps since the last drafted one: how far the drafter is behind
        self._since_probe = 0
        self._since_plain = 0         # drafted steps since the last plain one
        self._refresh = False         # this plain step re-measures t_verify(1) between drafted ones
        self._probe_interval = self.probe_every
        self._probe_due = 0.0         # plain steps after the last decision when a probe is next considered
        self._probing = False         # the current draft length is a probe
        self._credit = 0.0            # seconds exploration may still lose against plain decoding
        self._pays: bool | None = None  # perfect-draft bound >= min_gain (None: costs not measured yet)
        self._started = False
        self._hold = 0                  # drafted steps the current k is kept for before the next decision
        self._warm_checked = False      # a verdict of "no draft pays" from cold costs was measured again warm
        self._shadows = False           # the engine runs shadow probes (enable_shadow_probes)
        self._shadow_now = False        # the next plain step is a shadow probe
        self._shadowed: float | None = None   # a shadow probe's acceptance, for the update that follows it
        self._shadow_costs: deque[float] = deque(maxlen=9)
        self._per_pass = False          # t_draft is per draft pass, not per drafted token (set_draft_cost)
        self._calibrated = False        # started from the costs measured at load (calibrate)
        self._after_prompt = 0          # passes left that run cold because a prompt ran (new_request)

    def new_request(self) -> None:
        self._last_n = self._run = 0
        self._after_prompt = 2   # the two passes after a prompt run cold with or without drafts: not charged

    def calibrate(self, costs: Costs) -> None:
        """Start from the costs measured at load: every batch size's warm pass, a drafted token and the cold
        passes' excess, each as if measured three times (real passes take over as they come). Acceptance is then
        the one unknown: the first decision asks it with a shadow probe, where the engine runs them, instead of a
        measuring draft and the cold passes around it."""
        if self._calibrated:
            return
        self._calibrated = True
        for n, seconds in costs.verify.items():
            if n not in self._verify:
                self._verify[n], self._cold[n] = _Timing(), _Timing()
                insort(self._sizes, n)
            for _ in range(self._plain_samples):
                self._verify[n].add(seconds, 1.0, self.decay)
        if costs.draft is not None:
            for _ in range(self._plain_samples):
                self._draft.add(costs.draft, 1.0, self.decay)
        self._excess.extend(costs.excess[-self._excess.maxlen:])

    def enable_shadow_probes(self) -> None:
        self._shadows = True

    def shadow_len(self) -> int:
        return 1 if self._shadow_now and self._run else 0   # not in a request's first step: its first token waits

    def shadow(self, accepted: float, seconds: float) -> None:
        self._shadow_now = False
        self._shadow_costs.append(seconds)
        d, stale = self.decay, self._stale_decay
        for j in range(1, self.k_max + 1):
            keep = d if j == 1 else stale
            self._acc[j] *= keep
            self._tried[j] *= keep
        self._tried[1] += 1.0
        self._acc[1] += accepted
        self._credit -= seconds
        self._shadowed = accepted

    def set_draft_cost(self, kind: str) -> None:
        if kind not in ("per_token", "per_pass"):
            raise InvalidParameterError(f"draft cost must be 'per_token' or 'per_pass', got {kind!r}")
        self._per_pass = kind == "per_pass"

    def _draft_units(self, k: int) -> int:
        """Draft costs of t_draft that a k-token draft takes."""
        return 1 if self._per_pass and k else k

    # -- estimates ---------------------------------------------------------------------------------------------
    @property
    def t_draft(self) -> float | None:
        """Seconds per drafted token (per draft pass for a "per_pass" drafter), from warm steps where there are."""
        timing = self._draft if self._draft.samples else self._draft_cold
        return timing.value if timing.samples else None

    @property
    def switch_cost(self) -> float:
        """Seconds a cold pass takes beyond a warm one of its size (median of the recent ones; 0 unmeasured)."""
        return max(median(self._excess), 0.0) if self._excess else 0.0

    def _size_time(self, n: int) -> float:
        """A warm pass over n tokens: as measured warm, else a cold one less what a cold pass costs beyond it."""
        warm = self._verify[n]
        if warm.samples:
            return warm.value
        cold = self._cold[n].value
        return max(cold - self.switch_cost, 0.5 * cold)

    def acceptances(self) -> list[float]:
        """Acceptance at each draft position 1..k_max (index 0 unused) given the earlier ones were accepted.
        Each is its counts shrunk toward the estimate before it (acceptance changes slowly along a draft; a
        position never reached takes the one before it). No bonus for rarely reached positions: with one
        (0.2 / sqrt(tries)), drafts agreeing 60-80% of the time kept trying 12 tokens in the simulator and paid the
        cold passes of each change (0.93 of the best fixed k on the H200 rows, 0.97 without)."""
        out, before = [0.0] * (self.k_max + 1), self._prior
        for j in range(1, self.k_max + 1):
            w0 = self._prior_weight if j == 1 else self._chain_weight
            before = (self._acc[j] + w0 * before) / (self._tried[j] + w0)
            out[j] = before
        return out

    def acceptance(self, position: int) -> float:
        return self.acceptances()[position]

    def verify_time(self, n: int, optimistic: bool = False) -> float | None:
        """t_verify(n), seconds for one target pass over n tokens (see _verify_curve)."""
        curve = self._verify_curve(n, optimistic)
        return curve[n] if curve else None

    def _verify_curve(self, n_max: int, optimistic: bool) -> list[float]:
        """[_, t_verify(1), ..., t_verify(n_max)] in one pass; [] before any measurement. Measured sizes give
        their average, lowered where a larger size was measured cheaper (timing noise: a pass over more tokens
        does not cost less); between two of them, the line through both. Beyond the largest, the chord from the
        smallest: a long baseline that timing noise cannot tilt (a concave curve makes it pessimistic);
        `optimistic` takes half the slope of the last two points instead: verify cost usually flattens (a GPU
        verifies 9 tokens for little more than 5), and the only way to learn that is to try a longer draft.
        With one size measured: a 10% cost per extra token above it, proportional below it."""
        xs = self._sizes
        if not xs:
            return []
        ys = [self._size_time(x) for x in xs]
        for i in range(len(ys) - 2, -1, -1):  # a pass over more tokens cannot be cheaper: noise made it look so
            ys[i] = min(ys[i], ys[i + 1])
        out = [0.0] * (n_max + 1)
        if len(xs) == 1:
            x0, y0 = xs[0], ys[0]
            for n in range(1, n_max + 1):
                out[n] = y0 * (1.0 + 0.1 * (n - x0) / x0) if n > x0 else y0 * n / x0
            return out
        slope_low = (ys[1] - ys[0]) / (xs[1] - xs[0])
        a = -2 if optimistic else 0
        slope_high = max((ys[-1] - ys[a]) / (xs[-1] - xs[a]), 0.0) * (0.5 if optimistic else 1.0)
        i, last = 0, len(xs)
        for n in range(1, n_max + 1):
            while i < last and xs[i] < n:
                i += 1
            if i < last and xs[i] == n:
                out[n] = ys[i]
            elif i == 0:
                out[n] = max(ys[0] + slope_low * (n - xs[0]), 1e-9)
            elif i == last:
                out[n] = ys[-1] + slope_high * (n - xs[-1])
            else:
                w = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
                out[n] = ys[i - 1] * (1 - w) + ys[i] * w
        return out

    def _speeds(self, k_max: int, optimistic: bool):
        """(k, expected tokens per second) for k = 0..k_max, as far as the estimates reach, in one pass:
        tokens(k) grows by the chance of accepting all of d_1..d_k."""
        verify = self._verify_curve(k_max + 1, optimistic)
        if not verify:
            return
        yield 0, 1.0 / verify[1]
        t_draft = self.t_draft
        if t_draft is None:
            return
        acceptance = self.acceptances()
        tokens = run = 1.0
        for k in range(1, k_max + 1):
            run *= acceptance[k]
            tokens += run
            yield k, tokens / (self._draft_units(k) * t_draft + verify[k + 1])

    def expected_speed(self, k: int, optimistic: bool = False) -> float | None:
        last = None
        for j, speed in self._speeds(k, optimistic):
            last = speed if j == k else None
        return last

    def _best_k(self, optimistic: bool) -> int:
        """argmax_k expected_speed(k) (ties go to the longer draft)."""
        return max(self._speeds(self.k_max, optimistic), key=lambda ks: (ks[1], ks[0]))[0]

    def perfect_draft_gain(self) -> float | None:
        """Best speed-up over plain decoding if every draft token were accepted: below 1, speculation cannot pay
        on this machine whatever the text, and probing acceptance is pointless."""
        verify, t_draft = self._verify_curve(self.k_max + 1, False), self.t_draft
        if not verify or t_draft is None:
            return None
        return verify[1] * max((k + 1) / (self._draft_units(k) * t_draft + verify[k + 1])
                               for k in range(1, self.k_max + 1))

    def _catch_up(self, missed: int) -> float:
        """Estimated seconds for the drafter to catch up on `missed` tokens in one batch with the next one, which
        the engine reports as setup and the policy never sees: priced like the target's own batches, t_draft x
        v(m + 1) / v(1) on the chord of the measured curve. ModelDrafter restarts on its last 64 tokens when more
        than 128 are missing; up to 2 missed tokens are decoded with the draft and counted in its time."""
        if missed <= 2 or self.t_draft is None or len(self._sizes) < 2:
            return 0.0
        xs = self._sizes
        low, high = self._size_time(xs[0]), self._size_time(xs[-1])
        per_token = max(high - low, 0.0) / (xs[-1] - xs[0]) / low
        return self.t_draft * (1.0 + per_token * (64 if missed > 128 else missed))

    def _worth_changing(self, k: int, new: int, optimistic: bool) -> bool:
        """Whether drafting `new` tokens instead of `k` gains, within `horizon` steps, what its two cold passes cost
        (always, where changes cost nothing measurable)."""
        cost = 2 * self.switch_cost
        if not cost:
            return True
        speeds = dict(self._speeds(max(k, new), optimistic))
        if k not in speeds or new not in speeds:
            return True
        t_step = self._draft_units(new) * self.t_draft + self.verify_time(new + 1, optimistic)
        return (speeds[new] - speeds[k]) * self.horizon * t_step > cost * speeds[k]

    def _probe_loss(self, k: int) -> float:
        """Seconds a k-token probe now loses against plain decoding if nothing is accepted. A probe runs cold: its
        draft and verification as timed at earlier probes, and the two plain passes after it pay the change back."""
        draft = self._draft_cold if self._draft_cold.samples else self._draft
        cold = self._cold.get(k + 1)
        verify = cold.value if cold is not None and cold.samples else self.verify_time(k + 1) + self.switch_cost
        return (self._draft_units(k) * draft.value + verify - self.verify_time(1) + 2 * self.switch_cost
                + self._catch_up(self._since_draft))

    # -- the two questions ----------------------------------------------------------------------------------
    def next_draft_len(self) -> int:
        return self._k

    def update(self, drafted, accepted, draft_seconds, verify_seconds) -> None:
        n = drafted + 1
        warm = n == self._last_n and self._run >= 2   # two steps of this size just before: no re-capture
        self._run = self._run + 1 if n == self._last_n else 1
        self._last_n = n
        if n not in self._verify:
            self._verify[n], self._cold[n] = _Timing(), _Timing()
            insort(self._sizes, n)
        timing, cold = self._verify[n], self._cold[n]
        excess = 0.0
        if warm:   # the first warm pass of a size tells what its cold ones cost beyond it
            if cold.samples and not timing.samples:
                self._excess.append(cold.value - verify_seconds)
            timing.add(verify_seconds, 1.0, self.decay)
        else:
            if timing.samples:
                excess = verify_seconds - timing.value
                self._excess.append(excess)
            cold.add(verify_seconds, 1.0, self.decay)
        if self._after_prompt:
            self._after_prompt -= 1
            excess = 0.0
        if drafted == 0:
            self._plain_step(verify_seconds, max(excess, 0.0))
        else:
            self._draft_step(drafted, accepted, draft_seconds, verify_seconds, warm)

    def _plain_step(self, seconds: float, excess: float) -> None:
        """O(1) unless a probe is due: nothing else changed since the last decision. `excess`: what this pass took
        beyond a warm one, the price of the draft before it."""
        self._since_draft, self._since_plain = self._since_draft + 1, 0
        plain, t_plain = self._verify[1], self._size_time(1)
        if not self._started:  # the first plain pass: an allowance for learning the costs
            self._started, self._credit = True, self.initial_credit_steps * t_plain
        cap = self.credit_steps * t_plain
        self._credit = min(self._credit + self.loss_budget * seconds - excess, cap)
        if self._k:
            return  # a draft was asked for but did not fit (the request's last token, a full context)
        if self._shadowed is not None:
            accepted, self._shadowed = self._shadowed, None
            self._after_shadow(accepted)
            return
        if self._refresh:  # a plain pass taken to re-measure t_verify(1): back to drafting
            self._refresh = False
            self._decide(probe_failed=False)
            return
        if self._pays is None and not (self._shadows and self.t_draft is None and self._tried[1]):
            # undecided: measure the draft first, then plain passes enough to trust. (A draft measured by shadow
            # probes only, none accepted yet, waits for one on the schedule below.)
            if self.t_draft is None:
                self._k, self._probing = self.k_start, True
            elif plain.samples >= self._plain_samples:
                self._decide(probe_failed=False)
            return
        self._since_probe += 1
        if self._since_probe < self._probe_due:
            return
        # 1 token tells acceptance; 2 measure the draft after its catch-up. A probe is paid from the credit, or
        # waits until it costs at most loss_budget of the plain time since the last one (a drafter far behind
        # makes a probe cost several plain passes); both grow by `earned` a step, so the wait is known. Where the
        # engine runs shadow probes, acceptance is asked with one: no cold target passes.
        shadow = self._shadows and self._pays is not False
        k = min(1 if self._pays else 2, self.k_max)
        loss, earned = self._shadow_loss() if shadow else self._probe_loss(k), self.loss_budget * t_plain
        covered = max(self._credit, self._since_probe * earned)
        if covered >= loss:
            if shadow:
                self._shadow_now = True
            else:
                self._k, self._probing = k, True
        else:
            self._probe_due = self._since_probe + max(1.0, (loss - covered) / earned)

    def _after_shadow(self, accepted: float) -> None:
        """Decide after a shadow probe: with the costs unknown, measure them once acceptance looks worth it."""
        if self.t_draft is None:
            if self.acceptance(1) >= 0.5:
                self._k, self._probing = self.k_start, True
                return
            failed = accepted < 0.5
            self._probe_interval = min(self._probe_interval * 2, self.max_probe_interval) if failed \
                else self.probe_every
            self._since_probe, self._probe_due = 0, self._probe_interval
            return
        self._decide(probe_failed=accepted < 0.5)

    def _longest_interval(self) -> int:
        """How far failed probes back off: `max_probe_interval`, or less where a shadow probe costs under half the
        loss budget of the plain steps between them (a drafter far cheaper than the target)."""
        if not self._shadows or not self._shadow_costs:
            return self.max_probe_interval
        steps = self._shadow_loss() / (0.5 * self.loss_budget * self.verify_time(1)) if self.loss_budget else 1e9
        return int(min(max(steps, self.probe_every), self.max_probe_interval))

    def _shadow_loss(self) -> float:
        """Seconds a shadow probe costs: as the recent ones took, else twice a drafted token (the token and its
        catch-up, one batch: on a GPU a batch of many tokens costs a small multiple of one)."""
        if self._shadow_costs:
            return median(self._shadow_costs)
        return 2.0 * self.t_draft if self.t_draft is not None else 0.0

    def _draft_step(self, drafted, accepted, draft_seconds, verify_seconds, warm: bool) -> None:
        d = self.decay
        # After 3+ plain steps the drafter caught up on the missed tokens and the token after them in one batch,
        # which the engine counts as setup: draft_seconds then holds drafted - 1 token decodes.
        counted = 1 if self._per_pass else drafted - 1 if self._since_draft >= 3 else drafted
        if counted > 0:
            (self._draft if warm else self._draft_cold).add(draft_seconds / counted, counted, d)
        missed, self._since_draft = self._since_draft, 0
        self._since_plain += 1
        acc, tried = self._acc, self._tried
        judged = min(drafted, accepted + 1)
        for j in range(1, self.k_max + 1):
            keep = d if j <= judged else self._stale_decay
            acc[j] *= keep
            tried[j] *= keep
        for j in range(1, judged + 1):  # positions after the first rejection were not judged
            tried[j] += 1.0
            acc[j] += 1.0 if j <= accepted else 0.0
        if self.t_draft is None or 1 not in self._verify:
            return  # keep the draft length until both costs are known
        t_plain = self.verify_time(1)
        seconds = draft_seconds + verify_seconds
        lost = seconds + self._catch_up(missed) - (accepted + 1) * t_plain
        self._credit = min(self._credit + self.loss_budget * seconds - lost, self.credit_steps * t_plain)
        probing, self._probing = self._probing, False
        if self._hold and not probing:  # a new k runs warm on its third step: judge it then
            self._hold -= 1
            return
        if self._pays is None and self._verify[1].samples < self._plain_samples and not (
                self.perfect_draft_gain() >= self._sure_gain * self.min_gain and verify_seconds >= t_plain):
            # A marginal machine, or a pass over more tokens that took less time than one over a single token
            # (timing noise): the one plain pass may have been an outlier, so measure more before deciding.
            self._k = 0
            return
        self._decide(probing and accepted == 0, drafting=not probing)

    def _decide(self, probe_failed: bool, drafting: bool = False) -> None:
        """Stay plain where no draft can pay; else the best k, optimistic while exploring is affordable. While
        `drafting` (not probing), or plain, the current k stays unless the change repays its cold passes."""
        gain = self.perfect_draft_gain()
        if gain < self.min_gain and not self._draft.samples and not self._warm_checked and \
                self.switch_cost > 0.1 * self.verify_time(1):
            # "no draft can pay", from cold passes only, where cold passes cost (a GPU; the first draft of a
            # request can also pay for attaching its sampler): draft k_start for three steps, judge the third
            self._warm_checked, self._pays, self._k, self._hold = True, None, self.k_start, 2
            return
        self._pays = gain >= self.min_gain
        if self._pays and self._shadows and not self._tried[1]:
            # no acceptance seen yet (the costs came from calibrate): a shadow probe asks before any draft
            self._k, self._shadow_now, self._since_probe, self._probe_due = 0, True, 0, self._probe_interval
            return
        optimistic = self._credit > 0
        best = self._best_k(optimistic) if self._pays else 0
        if best != self._k and (drafting or not self._k) and not self._worth_changing(self._k, best, optimistic):
            best = self._k   # drafting, or plain after a shadow probe: a change must repay its cold passes
        if best and best + 1 != self._last_n and not self._calibrated:   # a size not just run: keep it until it
            self._hold = 2                                                 # runs warm (its costs are unknown)
        if best > 0:
            self._probe_interval = self.probe_every
            # Drafting measures no plain pass, yet every gain is judged against one: where the gain is not
            # obviously large, take a plain pass now and then (often while it has few samples). Not where a lone
            # plain pass runs cold (a GPU): it would cost its change twice and measure no warm pass.
            samples = self._verify[1].samples
            every = self._refresh_every if samples < 4 * self._plain_samples else 16 * self._refresh_every
            if self._since_plain >= every and gain < self._sure_gain * self.min_gain and \
                    self.switch_cost <= 0.05 * self.verify_time(1):
                best, self._refresh = 0, True
        elif probe_failed and self._pays and self._tried[1] >= 2:
            # back off while probes fail (after a second try: one rejection says little); one that was accepted:
            # look again soon
            self._probe_interval = min(self._probe_interval * 2, self._longest_interval())
        else:
            self._probe_interval = self.probe_every
        self._since_probe, self._k = 0, best
        self._probe_due = self._probe_interval if self._pays else self.recheck_every
        if not best and self._pays and self._shadows and self._tried[1] < self._plain_samples:
            self._probe_due = 1   # acceptance seen once or twice: ask again with the next shadow probe
