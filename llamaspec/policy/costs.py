"""What `auto` estimates, kept apart from what it decides: a pure cost model.

    tokens(k) = 1 + sum_{j<=k} prod_{i<=j} a_i          (a_i: acceptance at draft position i, given i-1 accepted)
    time(k)   = t_draft(k) + t_verify(k + 1)             (t_verify(n): one target pass over n tokens)
    t_draft(k) = t_start + k * t_token                   (a line through the draft lengths measured; with one
                                                          measured, k times its time a token)
              = t_draft                                  for a drafter whose whole draft is one pass (DFlash)

`Acceptance` holds the a_i, `CostModel` t_draft and t_verify(n), each learnt from what the engine reports; neither
knows about phases, probes or credit (auto.py), nor about models or tokens.
"""
from __future__ import annotations

import math

from bisect import insort
from collections import deque
from statistics import median

from .base import Costs
from .tuning import AutoTuning

# ModelDrafter's catch-up (drafters/model.py): up to 2 missed tokens are decoded with the draft and counted in its
# time; past 128 missed it restarts on its last 64 tokens
_CATCH_UP_COUNTED, _CATCH_UP_MAX, _CATCH_UP_WINDOW = 2, 128, 64
# the slowest a timing sample counts, over the estimate (Timing)
_SLOWEST = 1.1


class Timing:
    """Seconds per unit (a pass, a drafted token) that one slow sample cannot swing: other processes only ever make a
    step slower, and on a shared machine one step can take many times its usual time; on a GPU a pass counted warm
    can still pay a re-capture. The minimum of the first samples, their median once there are 3, then a decayed
    average of samples clipped to [1/2, 11/10] x the estimate: a faster sample moves it at once, a slower one by at
    most a tenth of its weight, so that one inflated pass of a size not drafted again cannot price it out for good
    (a lasting slow-down still shows, over more samples)."""

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
        self.total = decay * self.total + min(max(per_unit, 0.5 * estimate), _SLOWEST * estimate) * units
        self.weight = decay * self.weight + units


# what a token of context costs a pass is used once its estimate is this many standard errors above 0 (and the depths
# timed spread by more than _DEPTH_SPREAD tokens); warm passes between refits (and one at each new depth)
_DEPTH_SIGNIFICANT, _DEPTH_SPREAD, _DEPTH_REFIT = 3.0, 64, 16


class Depth:
    """What a token of context adds to a target pass, learnt where passes ran at different depths (an agent session's
    turns, 30K tokens and more; on a CPU a few thousand already cost a plain pass a third more): the slope of the
    warm passes' times on the tokens held, pooled within each size (a line through each size's own passes, one slope
    for all: a GPU reads the attention layers' KV cache once a pass, whatever its size), used once it stands
    `_DEPTH_SIGNIFICANT` standard errors above nothing. A size last timed shallower than the context now is priced
    that much dearer: without it, a size not run for a while keeps the price of a shallower context while the size
    running pays for this one, and looks cheaper than it is. The load's passes do not count (a short prompt: an error
    of the load's price of the size running would read as a slope). Refit every `_DEPTH_REFIT` warm passes and at the
    first warm pass of a new depth: the first steps of a deeper request are when a stale price lures."""

    __slots__ = ("now", "fed", "slope", "_sums", "_since", "_fit_at")

    def __init__(self):
        self.now = 0                        # tokens held when the request began
        self.fed: dict[int, int] = {}       # batch size -> the depth of its last timed pass
        self.slope = 0.0                    # seconds a pass, a token of context
        self._sums: dict[int, list] = {}    # batch size -> [passes, sum d, sum t, sum d^2, sum d t, sum t^2], warm
        self._since = 0
        self._fit_at = 0                    # the depth at the last fit

    def warm(self, n: int, seconds: float) -> None:
        d = self.now
        sums = self._sums.get(n)
        if sums is None:
            sums = self._sums[n] = [0.0] * 6
        sums[0] += 1.0
        sums[1] += d
        sums[2] += seconds
        sums[3] += d * d
        sums[4] += d * seconds
        sums[5] += seconds * seconds
        self._since += 1
        if self._since >= _DEPTH_REFIT or abs(d - self._fit_at) >= _DEPTH_SPREAD:
            self.fit()

    def fit(self) -> None:
        self._since, self._fit_at = 0, self.now
        sdd = sdt = stt = count = 0.0
        groups = 0
        for passes, sd, st, s_dd, s_dt, s_tt in self._sums.values():
            sdd += s_dd - sd * sd / passes
            sdt += s_dt - sd * st / passes
            stt += s_tt - st * st / passes
            count += passes
            groups += 1
        dof = count - groups - 1
        if dof < 1 or sdd < count * _DEPTH_SPREAD ** 2:
            self.slope = 0.0
            return
        slope = sdt / sdd
        error = math.sqrt(max(stt - slope * sdt, 0.0) / dof / sdd)
        self.slope = slope if slope > _DEPTH_SIGNIFICANT * error else 0.0

    def extra(self, n: int) -> float:
        """Seconds a pass over n tokens costs now beyond its estimate (timed at another depth)."""
        return self.slope * (self.now - self.fed.get(n, 0))


class Acceptance:
    """Acceptance at each draft position: (accepted, tried) counts, all decayed at every drafted step so that what
    was seen at positions no longer drafted fades. Each estimate leans on the position before it: position 1 on
    the prior lightly (a useless draft shows at once), later ones on the one before them firmly (one rejection at
    position 2 does not keep drafts at one token)."""

    def __init__(self, k_max: int, tuning: AutoTuning):
        self.k_max, self.tuning = k_max, tuning
        self.acc = [0.0] * (k_max + 1)
        self.tried = [0.0] * (k_max + 1)
        self.seen = [0.0] * (k_max + 1)   # tried, without the fading of idle steps: how much was judged at all
        self.idle = 0   # plain steps since the last judgement: what was seen before them fades (idle_decay)
        # this request's own part of position 1's counts (faded alike), and its estimate when the request began: a
        # request whose first judgements that estimate cannot explain lets go of what the requests before showed
        self.req_acc = self.req_tried = 0.0
        self.start_first: float | None = None
        self.surprised = False

    def wait(self) -> None:
        """A plain step (no draft judged): O(1), the fading is applied at the next judgement."""
        self.idle += 1

    def _decay(self, judged: int) -> None:
        d, stale = self.tuning.decay, self.tuning.stale_decay
        if self.idle:   # the evidence fades, and the prior with it (estimates): the next judgements weigh more
            fade = self.tuning.idle_decay ** self.idle
            self.acc = [a * fade for a in self.acc]
            self.tried = [n * fade for n in self.tried]
            self.req_acc *= fade
            self.req_tried *= fade
        self.idle = 0
        acc, tried, seen = self.acc, self.tried, self.seen
        for j in range(1, self.k_max + 1):
            keep = d if j <= judged else stale
            acc[j] *= keep
            tried[j] *= keep
            seen[j] *= keep
        self.req_acc *= d      # position 1 is judged whenever anything is
        self.req_tried *= d

    def fade(self, factor: float) -> None:
        """Weigh what was seen so far by `factor` (a new request): no estimate moves, the next judgements weigh more."""
        self.acc = [a * factor for a in self.acc]
        self.tried = [n * factor for n in self.tried]
        self.req_acc = self.req_tried = 0.0
        self.start_first = self.estimates()[1] if self.seen[1] else None
        self.surprised = False

    def record_draft(self, drafted: int, accepted: int, tail: float | None = None) -> None:
        """`accepted` of `drafted` kept; `tail`: where all were, the chance a token drafted past them and not verified
        (a tail probe) would have been accepted too: position drafted + 1 judged."""
        judged = min(drafted, accepted + 1)   # positions after the first rejection were not judged
        if tail is not None and accepted == drafted < self.k_max:
            judged = drafted + 1
        self._decay(judged)
        for j in range(1, judged + 1):
            self.tried[j] += 1.0
            self.seen[j] += 1.0
            self.acc[j] += 1.0 if j <= accepted else 0.0 if j <= drafted else tail
        self.req_tried += 1.0
        self.req_acc += 1.0 if accepted else 0.0
        self._check_surprise()

    def record_first(self, chance: float) -> None:
        """A shadow probe: position 1 judged, accepted with `chance`."""
        self._decay(1)
        self.tried[1] += 1.0
        self.seen[1] += 1.0
        self.acc[1] += chance
        self.req_tried += 1.0
        self.req_acc += chance
        self._check_surprise()

    def _check_surprise(self) -> None:
        """Once a request: where its judgements of position 1 are this unlikely under the estimate it began with
        (their log-likelihood ratio, own rate against that estimate, above `surprise_llr`: the text changed, say
        from code to prose), position 1's judgements from the requests before keep `surprise_fade` of their weight,
        so that its estimate follows the new text at once. The later positions keep theirs: they are asked only
        while drafts reach them, and what they showed (a code answer's long agreeing runs) holds again when the
        text turns back (faded with them, the edit after the prose climbed slower in the simulator)."""
        t = self.tuning
        n, first = self.req_tried, self.start_first
        if self.surprised or first is None or not t.surprise_llr or n < 2:
            return
        x = self.req_acc
        p, f = min(max(first, 0.02), 0.98), x / n
        llr = (x * math.log(f / p) if x > 0 else 0.0) + ((n - x) * math.log((1 - f) / (1 - p)) if n > x else 0.0)
        if llr <= t.surprise_llr:
            return
        self.surprised = True
        keep = t.surprise_fade
        self.acc[1] = self.req_acc + keep * (self.acc[1] - self.req_acc)
        self.tried[1] = self.req_tried + keep * (self.tried[1] - self.req_tried)

    def estimates(self) -> list[float]:
        """a_1..a_k_max (index 0 unused), each its counts shrunk toward the estimate before it (acceptance changes
        slowly along a draft; a position never reached takes the one before it). No bonus for rarely reached
        positions: exploring long drafts paid the cold passes of each change (results/auto-policy-notes.md)."""
        t = self.tuning
        acc, tried, seen = self.acc, self.tried, self.seen
        out, before, chain = [0.0] * (self.k_max + 1), t.prior, t.chain_weight
        for j in range(1, self.k_max + 1):
            w0 = t.prior_weight if j == 1 else chain
            if seen[j]:   # faded by idle steps as the evidence was: fading alone moves no estimate
                w0 *= tried[j] / seen[j]
            before = (acc[j] + w0 * before) / (tried[j] + w0)
            out[j] = before
        return out

    def near(self, k: int) -> list[float]:
        """The estimates as a k-token draft weighs a change of length: past position k + 2, none above the lowest from
        k + 1 on. A position past the ones after the current draft is judged only when a draft reaches it, so its
        estimate may rest on an earlier text's judgements (a warm-up that agreed deep in the draft) that fading does
        not move; a draft one or two tokens longer still reads them as they are (a code answer's deeper agreement
        after a prose one: held from k + 2 on, its longer drafts came later), a much longer one is taken on what the
        positions next to this one show, and the positions it reaches then judge themselves."""
        out = self.estimates()
        if k + 2 < self.k_max:
            low = min(out[k + 1], out[k + 2])
            for j in range(k + 3, self.k_max + 1):
                low = out[j] = min(out[j], low)
        return out


def expected_tokens(acceptances: list[float], k: int) -> float:
    """tokens(k): the tokens a k-token draft yields per target pass, the target's own token included."""
    tokens = run = 1.0
    for j in range(1, k + 1):
        run *= acceptances[j]
        tokens += run
    return tokens


def fastest(speeds: dict) -> int:
    """The k of the highest speed in {k: tokens(k) / time(k)} (ties go to the longer draft)."""
    best, top = 0, -1.0
    for k, speed in speeds.items():   # (a loop, not max with a key: this runs every drafted step)
        if speed > top or (speed == top and k > best):
            best, top = k, speed
    return best


class CostModel:
    """t_draft and t_verify(n), learnt from warm passes (a pass is warm after two of its size in a row: llama.cpp
    replays a captured CUDA graph while a batch shape stays the same), and what a cold pass costs beyond a warm one
    (`switch_cost`), learnt from the cold ones."""

    def __init__(self, tuning: AutoTuning, per_pass: bool = False):
        self.tuning = tuning
        self.per_pass = per_pass                     # t_draft is per draft pass, not per drafted token
        self.verify: dict[int, Timing] = {}          # batch size -> seconds per warm target pass
        self.cold: dict[int, Timing] = {}            # ... per cold pass, where no warm one was measured yet
        self.sizes: list[int] = []                   # measured batch sizes (warm or cold), sorted
        self.draft = Timing()                        # seconds per drafted token, warm steps
        self.draft_cold = Timing()                   # ... cold steps (a probe's)
        self.drafts: dict[int, Timing] = {}          # draft length -> seconds per warm drafting step of that length
        self._draft_line: tuple | None = None        # (t_start, t_token), until a draft is recorded
        self._lengths_timed = False                  # the load timed two or more draft lengths (calibrate)
        # what the first and the second pass after a change of size took beyond a warm pass of it: two prices, not
        # one (on a GPU the first runs without a graph and the second captures one, 5 and 13 ms on a 27B hybrid)
        self.excess = (deque(maxlen=tuning.recent), deque(maxlen=tuning.recent))
        self._switch: float | None = None            # switch_cost, until excess changes
        self.last_n, self.run = 1, 2                 # the last step's batch size, steps of it in a row
        self._curves: dict = {}                      # (optimistic, warm_only) -> verify_curve, until a pass is recorded
        self._drawn: dict = {}                       # warm_only -> the sizes and times the curves are drawn through
        self._curve_len = 1                          # the longest verify_curve asked for: each is computed that long
        self.depth = Depth()                         # what the context held adds to a pass

    # -- learning -------------------------------------------------------------------------------------------
    def _size(self, n: int) -> None:
        if n not in self.verify:
            self.verify[n], self.cold[n] = Timing(), Timing()
            insort(self.sizes, n)

    def record_pass(self, n: int, seconds: float) -> tuple[bool, float]:
        """A target pass over n tokens took `seconds`: (whether it ran warm, what it took beyond a warm one)."""
        self._curves.clear()
        self._drawn.clear()
        warm = n == self.last_n and self.run >= 2   # two steps of this size just before: no re-capture
        self.run = self.run + 1 if n == self.last_n else 1
        self.last_n = n
        self._size(n)
        timing, cold = self.verify[n], self.cold[n]
        excess = 0.0
        if warm or not timing.samples:   # the depth of the time size_time prices it by
            self.depth.fed[n] = self.depth.now
        if warm:   # the first warm pass of a size tells what its cold ones cost beyond it
            # (as timed: the estimate, which a slow pass moves only a little, lags a deeper request's passes, a
            # third dearer on a CPU; a slow pass of another process's making weighs in the slope's error)
            self.depth.warm(n, seconds)
            if cold.samples and not timing.samples:   # the mean of both kinds of cold pass: a sample of each
                for kept in self.excess:
                    kept.append(cold.value - seconds)
                self._switch = None
            timing.add(seconds, 1.0, self.tuning.decay)
        else:
            if timing.samples:
                excess = seconds - timing.value
                self.excess[self.run - 1].append(excess)   # not warm: the first or the second pass of its size
                self._switch = None
            cold.add(seconds, 1.0, self.tuning.decay)
        return warm, excess

    def record_draft(self, seconds: float, counted: int, warm: bool, drafted: int = 0) -> None:
        """`counted` drafted tokens (draft passes) took `seconds`; a warm step whose time holds all its `drafted`
        tokens (no catch-up) times its draft length too."""
        if counted > 0:
            (self.draft if warm else self.draft_cold).add(seconds / counted, counted, self.tuning.decay)
            self._draft_line = None
        if warm and drafted and drafted == counted and self._lengths_timed:
            self.drafts.setdefault(drafted, Timing()).add(seconds, 1.0, self.tuning.decay)

    def new_request(self) -> None:
        self.last_n = self.run = 0

    def held(self, tokens: int) -> None:
        """The next pass follows `tokens` the target holds (a request's first step; the batch's every pass)."""
        self.depth.now = tokens
        self._curves.clear()
        self._drawn.clear()

    def calibrate(self, costs: Costs) -> None:
        """Start from the costs measured at load, each as if measured `plain_samples` times."""
        samples, decay = self.tuning.plain_samples, self.tuning.decay
        self._curves.clear()
        self._drawn.clear()
        for n, seconds in costs.verify.items():
            self._size(n)
            for _ in range(samples):
                self.verify[n].add(seconds, 1.0, decay)
        if costs.draft is not None:
            for _ in range(samples):
                self.draft.add(costs.draft, 1.0, decay)
        for k, seconds in costs.drafts.items():
            for _ in range(samples):
                self.drafts.setdefault(k, Timing()).add(seconds, 1.0, decay)
        self._lengths_timed = len(costs.drafts) >= 2 and not self.per_pass
        self._draft_line = None
        # a change's first pass, then its second, size by size; the first size swept also paid what a process's first
        # passes pay once (on an H200 232 ms against 4-13 later), and is left out where others were measured
        passes = costs.excess[2:] if len(costs.excess) >= 4 else costs.excess
        for i, kept in enumerate(self.excess):
            kept.extend(passes[i::2][-kept.maxlen:])
        self._switch = None

    # -- estimates ------------------------------------------------------------------------------------------
    @property
    def t_draft(self) -> float | None:
        """Seconds per drafted token (per draft pass for a "per_pass" drafter), from warm steps where there are."""
        timing = self.draft if self.draft.samples else self.draft_cold
        return timing.value if timing.samples else None

    @property
    def switch_cost(self) -> float:
        """Seconds a cold pass takes beyond a warm one of its size, the mean of a change's two (the median of the
        recent first passes and of the recent second ones: 2 x switch_cost is what a change costs; 0 unmeasured)."""
        if self._switch is None:
            prices = [max(median(kept), 0.0) for kept in self.excess if kept]
            self._switch = sum(prices) / len(prices) if prices else 0.0
        return self._switch

    def draft_units(self, k: int) -> int:
        """Draft costs of t_draft that a k-token draft takes."""
        return 1 if self.per_pass and k else k

    def draft_line(self) -> tuple[float, float] | None:
        """(t_start, t_token) of a drafting step, t_draft(k) = t_start + k t_token: the least-squares line through
        the draft lengths measured warm, each at its own estimate (a drafter pays a step's bookkeeping once however
        long the draft: on an H200 the 32B pair's draft took 0.83 ms for one token and 3.25 for five), where it
        rises from t_start >= 0 (else a token's mean time), and where the load timed the lengths (calibrate, on a
        GPU: warm passes, steady times); else, and with fewer than two lengths measured, (0, t_draft): a line through
        a few noisy timings of a shared CPU drew long drafts too cheap in the simulator. None before t_draft is
        known."""
        if self._draft_line is not None:
            return self._draft_line
        t_draft = self.t_draft
        if t_draft is None:
            return None
        line = (0.0, t_draft)
        if self._lengths_timed and len(self.drafts) >= 2:   # every length in it has samples (calibrate, record_draft)
            n = sk = st = skk = skt = 0.0
            for k, timing in self.drafts.items():
                t = timing.total / timing.weight
                n, sk, st, skk, skt = n + 1, sk + k, st + t, skk + k * k, skt + k * t
            slope = (n * skt - sk * st) / (n * skk - sk * sk)
            start = (st - slope * sk) / n
            # noise that tilts the line (a longer draft cheaper, a step below nothing): a token's mean time
            line = (start, slope) if start >= 0.0 and slope > 0.0 else (0.0, st / sk)
        self._draft_line = line
        return line

    def draft_time(self, k: int) -> float:
        """t_draft(k): seconds of a warm drafting step of k tokens (0 for none; t_draft must be known)."""
        if not k:
            return 0.0
        if self.per_pass:
            return self.t_draft
        start, per_token = self.draft_line()
        return start + k * per_token

    def size_time(self, n: int) -> float:
        """A warm pass over n tokens: as measured warm, else a cold one less what a cold pass costs beyond it."""
        warm = self.verify[n]
        extra = self.depth.extra(n) if self.depth.slope else 0.0
        if warm.samples:
            return warm.value + extra
        cold = self.cold[n].value
        return max(cold - self.switch_cost, 0.5 * cold) + extra

    def verify_time(self, n: int, optimistic: bool = False) -> float | None:
        """t_verify(n), seconds for one target pass over n tokens (see verify_curve)."""
        curve = self.verify_curve(n, optimistic)
        return curve[n] if curve else None

    def verify_curve(self, n_max: int, optimistic: bool, warm_only: bool = False) -> list[float]:
        """[_, t_verify(1), ..., t_verify(n_max)] in one pass; [] before any measurement. Measured sizes give
        their average, lowered where a larger size was measured cheaper (timing noise: a pass over more tokens
        does not cost less); between two of them, the line through both. Beyond the largest, the chord from the
        smallest: a long baseline that timing noise cannot tilt (a concave curve makes it pessimistic);
        `optimistic` takes half its slope: verify cost usually flattens, and the only way to learn that is to try a
        longer draft (the last two points' slope, which this was, is the one noise tilts: on a 2-core CPU at 4K
        context sizes 3 and 4 timed alike, and a 13-token pass, 5x a plain one there, was priced as 1.7x). With one
        size measured: a 10% cost per extra token above it, proportional below it. `warm_only`: sizes run only cold
        (a change of size every step) do not count where a warm one was measured: a cold pass less a median switch
        cost can overstate a size no later pass corrects.
        The list may run past n_max (one step's decisions ask it several times: it is kept until the next pass)."""
        key = (optimistic, warm_only)
        kept = self._curves.get(key)
        if kept is not None and len(kept) > n_max:
            return kept
        self._curve_len = n_max = max(n_max, self._curve_len)
        if optimistic:   # optimism changes only the slope past the largest size measured: within it, the same list
            plain = self._curves.get((False, warm_only))
            if plain is not None and len(plain) > n_max and n_max <= self._points(warm_only)[0][-1]:
                self._curves[key] = plain
                return plain
        self._curves[key] = out = self._curve(n_max, optimistic, warm_only)
        return out

    def _points(self, warm_only: bool) -> tuple[list[int], list[float]]:
        """The measured sizes and their times, made non-decreasing (kept until the next pass, as the curves are)."""
        kept = self._drawn.get(warm_only)
        if kept is not None:
            return kept
        xs = self.sizes
        if warm_only:
            xs = [x for x in xs if self.verify[x].samples] or xs
        ys = [self.size_time(x) for x in xs]
        for i in range(len(ys) - 2, -1, -1):  # a pass over more tokens cannot be cheaper: noise made it look so
            if ys[i + 1] < ys[i]:
                ys[i] = ys[i + 1]
        self._drawn[warm_only] = xs, ys
        return xs, ys

    def _curve(self, n_max: int, optimistic: bool, warm_only: bool) -> list[float]:
        xs, ys = self._points(warm_only)
        if not xs:
            return []
        out = [0.0] * (n_max + 1)
        if len(xs) == 1:
            x0, y0 = xs[0], ys[0]
            for n in range(1, n_max + 1):
                out[n] = y0 * (1.0 + 0.1 * (n - x0) / x0) if n > x0 else y0 * n / x0
            return out
        x0, y0, x1, y1 = xs[0], ys[0], xs[-1], ys[-1]
        slope_low = (ys[1] - y0) / (xs[1] - x0)
        slope_high = max((y1 - y0) / (x1 - x0), 0.0) * (0.5 if optimistic else 1.0)
        stop = n_max + 1
        for n in range(1, x0 if x0 < stop else stop):   # below the smallest size measured
            out[n] = max(y0 + slope_low * (n - x0), 1e-9)
        for i in range(1, len(xs)):   # each measured size, and the line to the next one
            xa, xb, ya, yb = xs[i - 1], xs[i], ys[i - 1], ys[i]
            if xa > n_max:
                return out
            out[xa] = ya
            for n in range(xa + 1, xb if xb < stop else stop):
                w = (n - xa) / (xb - xa)
                out[n] = ya * (1 - w) + yb * w
        if x1 <= n_max:
            out[x1] = y1
        for n in range(x1 + 1, n_max + 1):   # beyond the largest
            out[n] = y1 + slope_high * (n - x1)
        return out

    def step_time(self, k: int, optimistic: bool = False) -> float | None:
        """time(k): seconds of a step that drafts k tokens and verifies them."""
        verify, t_draft = self.verify_time(k + 1, optimistic), self.t_draft
        if verify is None or (k and t_draft is None):
            return None
        return self.draft_time(k) + verify

    def speeds(self, acceptances: list[float], k_max: int, optimistic: bool):
        """(k, tokens(k) / time(k)) for k = 0..k_max, as far as the estimates reach, in one pass: tokens(k) grows by
        the chance of accepting all of d_1..d_k."""
        verify = self.verify_curve(k_max + 1, optimistic)
        if not verify:
            return
        yield 0, 1.0 / verify[1]
        t_draft = self.t_draft
        if t_draft is None:
            return
        start, per_token = (t_draft, 0.0) if self.per_pass else self.draft_line()
        tokens = run = 1.0
        for k in range(1, k_max + 1):
            run *= acceptances[k]
            tokens += run
            yield k, tokens / (start + k * per_token + verify[k + 1])

    def survey(self, acceptances: list[float], k_max: int, optimistic: bool) -> tuple[float, dict]:
        """(perfect_draft_gain(k_max), {k: tokens(k) / time(k)} as `speeds` yields them) in one pass: what a
        decision asks of the model every drafting step (both known: a plain pass and a drafted token measured)."""
        plain = self.verify_curve(k_max + 1, False)
        verify = self.verify_curve(k_max + 1, optimistic) if optimistic else plain
        start, per_token = (self.t_draft, 0.0) if self.per_pass else self.draft_line()
        speeds = {0: 1.0 / verify[1]}
        gain = 0.0
        tokens = run = 1.0
        for k in range(1, k_max + 1):
            run *= acceptances[k]
            tokens += run
            draft = start + k * per_token
            speeds[k] = tokens / (draft + verify[k + 1])
            perfect = (k + 1) / (draft + plain[k + 1])
            if perfect > gain:
                gain = perfect
        return plain[1] * gain, speeds

    def best_k(self, acceptances: list[float], k_max: int, optimistic: bool) -> int:
        """argmax_k tokens(k) / time(k) (ties go to the longer draft)."""
        return fastest(dict(self.speeds(acceptances, k_max, optimistic)))

    def perfect_draft_gain(self, k_max: int) -> float | None:
        """Best speed-up over plain decoding if every draft token were accepted: below 1, speculation cannot pay
        on this machine whatever the text, and probing acceptance is pointless."""
        verify, t_draft = self.verify_curve(k_max + 1, False), self.t_draft
        if not verify or t_draft is None:
            return None
        return verify[1] * max((k + 1) / (self.draft_time(k) + verify[k + 1]) for k in range(1, k_max + 1))

    def catch_up(self, missed: int) -> float:
        """Estimated seconds for the drafter to catch up on `missed` tokens in one batch with the next one, which
        the engine reports as setup and the policy never sees: priced like the target's own batches, t_draft x
        v(m + 1) / v(1) on the chord of the measured curve."""
        if missed <= _CATCH_UP_COUNTED or self.t_draft is None or len(self.sizes) < 2:
            return 0.0
        xs = self.sizes
        low, high = self.size_time(xs[0]), self.size_time(xs[-1])
        per_token = max(high - low, 0.0) / (xs[-1] - xs[0]) / low
        return self.t_draft * (1.0 + per_token * (_CATCH_UP_WINDOW if missed > _CATCH_UP_MAX else missed))

    def change_needs(self, new: int, optimistic: bool = False) -> float:
        """The share of the current speed a change to drafting `new` tokens must gain to repay its two cold passes
        within `horizon` steps (0 where changes cost nothing measurable)."""
        cost = 2 * self.switch_cost
        return cost / (self.tuning.horizon * self.step_time(new, optimistic)) if cost else 0.0

    def worth_changing(self, speeds: dict, k: int, new: int, optimistic: bool) -> bool:
        """Whether drafting `new` tokens instead of `k` gains, within `horizon` steps, what its two cold passes cost
        (always, where changes cost nothing measurable); `speeds`: {k: tokens(k) / time(k)} as `speeds` yields them
        with the same optimism, as far as both k and new."""
        needed = self.change_needs(new, optimistic)
        if not needed:
            return True
        if k not in speeds or new not in speeds:
            return True
        return speeds[new] - speeds[k] > needed * speeds[k]

    def probe_loss(self, k: int, missed: int) -> float:
        """Seconds a k-token probe now loses against plain decoding if nothing is accepted, with the drafter
        `missed` tokens behind. A probe runs cold: its draft and verification as timed at earlier probes, and the
        two plain passes after it pay the change back."""
        draft = self.draft_cold if self.draft_cold.samples else self.draft
        cold = self.cold.get(k + 1)
        verify = cold.value if cold is not None and cold.samples else self.verify_time(k + 1) + self.switch_cost
        return (self.draft_units(k) * draft.value + verify - self.verify_time(1) + 2 * self.switch_cost
                + self.catch_up(missed))
