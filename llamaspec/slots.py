"""The engine: N slots, one speculative step for all of them. A single request is a batch of one.

A slot is one request on one sequence of the target's memory: its history, its sampler and seed, its draft-length
policy, its verifier (modes.py), its statistics, its text and stop strings. `Engine.step()` runs one round for every
slot:
1. lengths: a slot alone follows its own policy; with others, the `auto` slots' lengths are chosen together by the
   engine's BatchPolicy (policy/batch.py), other policies keep their own; every length within the slot's room, its
   share of one batch and what its memory can undo;
2. draft: every drafting slot's tokens (or, on a plain step, a one-token shadow probe the policy wants judged);
3. the target's pass: every drafting slot's [last, d_1..d_k] and a joining slot's prompt;
4. each slot, on its own: verify (its mode, over its rows), keep its accepted prefix (the one rollback), tell its
   drafter, learn (its policy), emit text. An error there is that slot's alone: it ends with `error` set, its
   caches repaired, while the others go on.

Where the sequences live is the target's business (targets.py: `LoneTarget`, the pair's own contexts, one slot;
`SharedTarget`, n_seq sequences in one pass), behind the small contract the engine calls: choose/open a slot,
sampling, begin/prefill, draft, decode, rows, accepted, finish/fail, close.
Knows nothing about HTTP, chat templates or the server's queue.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .drafters import PromptLookupDrafter
from .drafters.base import Draft
from .drafters.batched import SeqDraft
from .errors import Cancelled, ContextOverflowError, DecodeError, InvalidParameterError
from .kinds import source_of
from .policy import AutoPolicy
from .policy.batch import BatchPolicy
from .sampling import OPENAI, SamplerConfig, as_dist
from .shaping import Shaper, Shaping
from .stats import GenerationStats, StepTimes
from .text import Piece, StopMatcher



@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats = field(repr=False)


def shadow_acceptance(probe, emitted: int, target_probs, row: int = 0) -> float:
    """The chance a shadow probe's token would have been accepted as a draft: greedy (no target_probs), whether it
    is the token the target emitted; sampling, min(1, p(x) / q(x)) with p the target's row the token came from
    (`row`: 0 on a plain step, k after k accepted drafts for a tail probe)."""
    if not probe.tokens:
        return 0.0   # the drafter stopped short of its confidence bound: a real draft would have been empty too
    x = probe.tokens[0]
    if target_probs is None:
        return float(x == emitted)
    p, q = as_dist(target_probs(row)).prob(x), as_dist(probe.probs[0]).prob(x)
    return min(1.0, p / q) if q > 0 else 0.0


def check_request(pair, prompt, max_tokens, n_ctx: int, add_special: bool = True, holder: str = "the context"
                  ) -> list[int]:
    """The prompt's token ids, or the error a bad request gets: the one check every front-end shares."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidParameterError(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    tokens = pair.tokenize(prompt, add_special) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not tokens:
        raise InvalidParameterError("the prompt is empty", param="prompt")
    if len(tokens) >= n_ctx:
        raise ContextOverflowError(f"the prompt is {len(tokens)} tokens but {holder} holds {n_ctx}; "
                                   "shorten the prompt or raise the context size (-c / n_ctx)")
    if max(tokens) >= pair.n_vocab or min(tokens) < 0:
        raise InvalidParameterError(f"prompt token ids must be in [0, {pair.n_vocab})", param="prompt")
    return tokens


@dataclass
class Slot:
    """One request on one sequence. `pieces`: what the last step emitted for it; `done` once it finished; `error`:
    what ended it, when something went wrong on its own rows (the other slots are untouched)."""

    index: int
    seq: object
    draft: SeqDraft | None = None
    lookup: PromptLookupDrafter | None = None
    request_id: object = None
    pieces: list[Piece] = field(default_factory=list)
    done: bool = True
    stats: GenerationStats | None = None
    error: Exception | None = None

    def start(self, prompt, common, max_tokens, sampling, shaper, stops, policy, hooks, verifier) -> None:
        """A request whose first `common` prompt tokens the sequence holds already; the rest but the last (which the
        first verification decodes) are `todo`, prefilled before the slot drafts."""
        self.prompt, self.max_tokens, self.sampling, self.shaper = prompt, max_tokens, sampling, shaper
        self.policy, self.hooks, self.verifier = policy, hooks, verifier
        self.history, self.todo, self.last = list(prompt[:common]), list(prompt[common:-1]), prompt[-1]
        self.decoder, self.matcher = codecs.getincrementaldecoder("utf-8")(errors="replace"), StopMatcher(stops)
        self.pieces, self.done, self.n_out, self.tokens, self.error = [], False, 0, [], None
        self.prefilled = False    # the prompt is in the caches and the drafter has begun
        self.at_tail = False      # its turn checkpoint was saved TURN_TAIL tokens before its end (SharedTarget)
        self.from_model = False   # this step's draft (or probe) came from the draft model (SharedTarget)
        self.together = False     # the batch policy chose this step's draft length (policy/batch.py)
        # the contexts' decode seconds and (rollback seconds, replayed tokens) when the prompt was done (its targets)
        self.decode_before, self.rollback_before = None, (0.0, 0)
        self.t_start = time.perf_counter()

    @property
    def ready(self) -> bool:
        return not self.done and self.prefilled


# -- the engine ---------------------------------------------------------------------------------------------------
class Engine:
    """Slots over a target (targets.py: LoneTarget, the pair's contexts, one slot; SharedTarget, n_seq sequences)."""

    def __init__(self, pair, target):
        self.pair, self.target, self.slots = pair, target, target.slots
        policy = pair.policy
        self.policy = BatchPolicy(policy.tuning if isinstance(policy, AutoPolicy) else None, pair.costs,
                                  free_drafts=pair.speculative and source_of(pair.drafter_kind).free)
        target.engine_policy = self.policy
        self.times = StepTimes()
        # fixed for the engine's life: another drafter gets another engine (Pair.engine)
        self.speculative = pair.speculative
        self.is_eog, self.token_bytes = pair.target.is_eog, pair.target.token_bytes

    @property
    def n_seq(self) -> int:
        return self.target.n_seq

    @property
    def n_ctx_seq(self) -> int:
        return self.target.n_ctx_seq

    @property
    def free(self) -> int:
        return sum(s.done for s in self.slots)

    @property
    def busy(self) -> bool:
        return any(not s.done for s in self.slots)

    # -- joining and leaving ----------------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: Sequence[str] | str | None = None, shaping: Shaping | None = None,
               sampler_order: str = OPENAI, request_id=None, add_special: bool = True) -> Slot | None:
        """Start a request in a free slot (the one whose cache shares the longest prefix with it); None when every
        slot is busy. Raises for a bad request (check_request, SamplerConfig) before anything changes."""
        holder = "the context" if self.n_seq == 1 else "a slot"
        tokens = check_request(self.pair, prompt, max_tokens, self.n_ctx_seq, add_special, holder)
        cfg = SamplerConfig(temperature, top_k, top_p, min_p, seed, sampler_order)
        free = [s for s in self.slots if s.done]
        if not free:
            return None
        slot = self.target.choose(free, tokens)
        common, cached = self.target.open(slot, tokens)
        rng = np.random.default_rng(cfg.seed)
        shaper = Shaper(shaping, self.pair.n_vocab) if shaping is not None and shaping.active else None
        sampling = self.target.sampling(cfg, rng, shaper)
        scratch = self.target.scratch if self.n_seq == 1 else self.target.scratch_for(slot)
        verifier = self.pair.verifier(sampling, shaper, scratch, own_pass=self.n_seq == 1)
        policy, hooks = self.target.policy_for(slot)
        slot.start(tokens, common, max_tokens, sampling, shaper, [stop] if isinstance(stop, str) else list(stop or []),
                   policy, hooks, verifier)
        slot.request_id = request_id
        slot.stats = GenerationStats(policy=policy.name if self.pair.speculative else "none",
                                     prompt_tokens=len(tokens), prompt_tokens_cached=cached, finish_reason="cancelled")
        self.target.begin(slot)
        self.policy.new_request(slot.index)
        return slot

    def cancel(self, slot: Slot) -> None:
        """End a request now (its slot is free at once; its cache stays for a later prompt to reuse)."""
        if not slot.done:
            self._finish(slot, "cancelled")

    def _finish(self, slot: Slot, reason: str, by_stop_string: bool = False) -> None:
        if slot.done:
            return
        text, stopped = slot.matcher.push(slot.decoder.decode(b"", final=True))
        text += "" if stopped else slot.matcher.flush()
        if text and not by_stop_string:   # release what was held back (partial UTF-8, a possible stop's prefix)
            slot.pieces.append(Piece(text, None, False))
        slot.stats.finish_reason = reason
        slot.done, slot.todo = True, []
        try:
            self.target.finish(slot)
        finally:
            slot.stats.time_total = time.perf_counter() - slot.t_start
            slot.stats.end_reply()   # drafts past where the reply stopped do not count

    def _fail(self, slot: Slot, error: Exception) -> None:
        slot.error, slot.stats.finish_reason = error, "error"
        slot.done, slot.todo = True, []
        try:
            self.target.fail(slot)
        finally:
            slot.stats.time_total = time.perf_counter() - slot.t_start

    # -- one round for every slot -----------------------------------------------------------------------------
    def step(self) -> list[Slot]:
        """Draft, verify, accept for every active slot, and the prefill (a chunk of it, with others) of a joining
        one. Returns the slots that took part (their `pieces` say what each emitted; `done` whether it finished)."""
        active, joining = [], None
        for slot in self.slots:
            slot.pieces = []
            if slot.done:
                continue
            if slot.prefilled:
                active.append(slot)
            elif joining is None:
                joining = slot
        t0 = time.perf_counter()
        drafts, probes, rounds = self.target.draft(active, joining, self._draft_lens(active))
        t1 = time.perf_counter()
        self.target.decode(active, drafts, joining, t1 - t0, rounds)
        t2 = time.perf_counter()
        for slot in active:
            try:
                self._accept(slot, drafts[slot.index], probes.get(slot.index), t1 - t0, t2 - t1)
            except Cancelled:
                raise
            except Exception as error:   # this slot's rows (a grammar, a penalty, a decode of its own): its alone
                self._fail(slot, error)
        t3 = time.perf_counter()
        self.times.add(t1 - t0, t2 - t1, t3 - t0)
        if joining is None:
            return active
        if joining.prefilled:
            joining.stats.time_prefill = t3 - joining.t_start
        return active + [joining]

    def _draft_lens(self, active: list[Slot]) -> dict[int, tuple[int, bool]]:
        """Each active slot's draft length, and whether it takes a probe: on a plain step a one-token shadow probe, on
        a drafting one a tail probe (one token past k, drafted, never verified). With two or more slots, the batch
        policy chooses for those whose policy is auto (policy/batch.py); alone, or with another policy, a slot's own
        policy chooses. Clamped so that all slots' runs fit in one batch and a rejection stays within what the
        target's memory can undo (k_cap)."""
        if len(active) == 1:   # alone: the slot's own policy, within its room, its budget, one batch
            s = active[0]
            room = s.seq.n_ctx - len(s.history) - 1
            asked = s.policy.next_draft_len()
            k = max(min(asked, room, s.max_tokens - s.n_out - 1, self.target.n_batch - 1, self.target.k_cap), 0)
            s.together = False
            # a one-token shadow probe on a plain step, or on a drafting one a tail probe (one token past k)
            fits = k + 1 <= room if k else not asked and room > 0
            return {s.index: (k, fits and self.speculative and s.hooks.shadow_len() > 0)}
        share = max(self.target.n_batch // max(len(active), 1) - 1, 0)   # every slot's run fits in one batch
        rooms = [s.seq.n_ctx - len(s.history) - 1 for s in active]
        caps = [max(min(room, s.max_tokens - s.n_out - 1, share, self.target.k_cap), 0)
                for s, room in zip(active, rooms)]
        ks, together, probes = self.policy.lengths([s.index for s in active], [s.policy for s in active], caps,
                                                   self.target.recurrent)
        lens = {}
        for s, k, room, chosen, probe in zip(active, ks, rooms, together, probes):
            s.together = chosen
            # as alone: a shadow probe on a plain step the policy asked to be plain, a tail probe on a drafting one
            fits = k + 1 <= room if k else room > 0 and (chosen or not s.policy.next_draft_len())
            lens[s.index] = k, fits and self.speculative and (probe if chosen else s.hooks.shadow_len() > 0)
        return lens

    def _accept(self, slot: Slot, draft: Draft, probe: Draft | None, draft_seconds: float, pass_seconds: float):
        """Verify, keep, tell the drafter, learn, emit: one slot's part of the step."""
        history, last, drafted = slot.history, slot.last, draft.tokens
        verifier, draft_probs = slot.verifier, draft.probs if drafted else None
        t0 = time.perf_counter()
        if verifier.own_pass:
            n_accepted, next_token, target_probs = verifier.judge(None, history, [last] + drafted, drafted,
                                                                  draft_probs)
        else:
            tokens = verifier.batch(last, drafted)
            rows = self.target.rows(slot, tokens, verifier.wants)
            n_accepted, next_token, target_probs = verifier.judge(rows, history, tokens, drafted, draft_probs)
        # roll back: keep `last` and the accepted draft tokens (a recurrent memory may restore a checkpoint)
        if not slot.seq.keep(len(history) + 1 + n_accepted):
            raise DecodeError(f"the target's cache could not drop the rejected draft tokens (slot {slot.index})")
        t1 = time.perf_counter()
        if drafted or probe is not None:
            self.target.accepted(slot, n_accepted if drafted else 0)   # a probe's token is never kept
        history.append(last)
        history.extend(drafted[:n_accepted])
        slot.last = next_token
        t2 = time.perf_counter()
        stats, chance = slot.stats, None
        if probe is not None and drafted:   # a tail probe: judged where every draft token before it was accepted
            reached = n_accepted == len(drafted) and bool(probe.tokens)
            chance = shadow_acceptance(probe, next_token, target_probs, n_accepted) if reached else None
            stats.tail_probes += 1
        elif probe is not None:
            chance = shadow_acceptance(probe, next_token, target_probs)
            stats.shadow_probes += 1
        # the policy learns the cost of drafting itself; a catch-up after a pause is not a per-token cost.
        # Rolling back is part of each phase's cost, so `auto` drafts less where it is expensive.
        verify_seconds, own_seconds = pass_seconds + t1 - t0, draft_seconds + t2 - t1
        if slot.together:   # the pass's timings are the batch's (record_step): the slot's policy learns acceptance
            self.policy.slot_step(slot.index, slot.policy, len(drafted), n_accepted, chance, tail=bool(drafted))
        else:
            if probe is not None:   # (a tail probe's chance is None where a rejection came first)
                slot.hooks.shadow(chance, own_seconds)
            setup = draft.setup_seconds if drafted else 0.0
            slot.policy.update(len(drafted), n_accepted, max(draft_seconds - setup, 0.0) + t2 - t1, verify_seconds)
        stats.record_step(len(drafted), n_accepted, own_seconds, verify_seconds)
        for i, token in enumerate(drafted[:n_accepted] + [next_token]):
            self._emit(slot, token, i < n_accepted)
            if slot.done:
                return
        if len(history) + 1 > slot.seq.n_ctx:
            self._finish(slot, "context")

    def _emit(self, slot: Slot, token: int, from_draft: bool) -> None:
        slot.n_out += 1
        stats = slot.stats
        stats.tokens_generated = slot.n_out
        if self.is_eog(token):
            return self._finish(slot, "stop")
        if not stats.time_to_first_token:
            stats.time_to_first_token = time.perf_counter() - slot.t_start
        text, stopped = slot.matcher.push(slot.decoder.decode(self.token_bytes(token)))
        slot.tokens.append(token)
        slot.pieces.append(Piece(text, token, from_draft))
        if stopped:
            return self._finish(slot, "stop", by_stop_string=True)
        if slot.n_out >= slot.max_tokens:
            self._finish(slot, "length")

    # -- front-ends ---------------------------------------------------------------------------------------------
    def pieces(self, slot: Slot) -> Iterator[Piece]:
        """A slot's pieces as the steps make them, until it is done; its error, if it failed, is raised. Closing the
        stream early ends the request (its caches repaired)."""
        try:
            while not slot.done:
                self.step()
                yield from slot.pieces
            if slot.error is not None:
                raise slot.error
        finally:
            self.cancel(slot)

    def close(self) -> None:
        for slot in self.slots:
            if not slot.done:
                self.cancel(slot)
        self.target.close()


def generate_batch(pair, prompts: Sequence[str | Sequence[int]], n_seq: int | None = None,
                   n_ctx: int | None = None, add_special: bool = True, **kwargs) -> list[Completion]:
    """Generate for every prompt, up to `n_seq` (default: all) at once, each as `pair.generate(prompt, **kwargs)`
    would; `kwargs` may be one dict for all or a list of dicts, one per prompt (a seed each, say). Pairs that
    cannot share a pass (batch_support) take turns on the pair's own contexts. n_ctx: the shared context's size
    (default: each sequence gets the pair's n_ctx)."""
    per_prompt = kwargs.pop("requests", None) or [kwargs] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise InvalidParameterError("requests: one dict per prompt", param="requests")
    if not prompts:
        return []
    n_seq = min(n_seq or len(prompts), len(prompts))
    engine = pair.engine(n_seq, n_ctx or pair.n_ctx * n_seq)
    tokens = [pair.tokenize(p, add_special) if isinstance(p, str) else list(p) for p in prompts]
    results: list[Completion | None] = [None] * len(prompts)
    waiting = list(range(len(prompts)))
    texts: dict[int, list[str]] = {}
    running: dict[int, Slot] = {}
    try:
        while waiting or running:
            while waiting and engine.free:
                i = waiting.pop(0)
                running[i] = engine.submit(tokens[i], request_id=i, **per_prompt[i])
                texts[i] = []
            engine.step()
            for i, slot in list(running.items()):
                texts[i] += [p.text for p in slot.pieces]
                if slot.error is not None:
                    raise slot.error
                if slot.done:
                    results[i] = Completion("".join(texts[i]), list(slot.tokens), slot.stats.finish_reason,
                                            slot.stats)
                    del running[i]
    finally:
        for slot in running.values():
            engine.cancel(slot)
    return results
