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

Where the sequences live is the target's business, behind one small contract (`LoneTarget`, `SharedTarget`):
- `LoneTarget`: the pair's own contexts, one slot. Everything a single sequence can do: checkpoint rollback and turn
  checkpoints on recurrent and hybrid targets, device-side argmax and sampling, tree verification, every drafter kind
  (EAGLE-3, DFlash, recurrent draft models). A prompt is prefilled whole (stoppable: interrupt.py).
- `SharedTarget`: n_seq sequences over one shared target context (backend/sequences.py) and one shared drafter (a
  draft model: drafters/batched.py; an MTP head, a head sequence per slot: drafters/batched_mtp.py); one decode holds
  every slot's run and a bounded chunk of a joining prompt (`prefill_chunk` tokens), so a new request never stalls
  the others for more than one chunk. Verification reads host rows. Which pairs share a pass: `batch_support`.
Knows nothing about HTTP, chat templates or the server's queue.
"""
from __future__ import annotations

import codecs
import copy
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .drafters import PromptLookupDrafter, common_prefix_len
from .drafters.base import Draft
from .drafters.batched import DraftJob, SeqDraft, propose_all
from .errors import Cancelled, ContextOverflowError, DecodeError, InvalidParameterError
from .kinds import KINDS, Source
from .policy import AutoPolicy, Hooks
from .policy.batch import BatchPolicy
from .sampling import OPENAI, SamplerConfig, Sampling, as_dist
from .shaping import Shaper, Shaping
from .stats import GenerationStats, StepTimes
from .text import Piece, StopMatcher

BATCHED_DRAFTERS = ("none",) + tuple(k.name for k in KINDS.values() if k.batches)
DEFAULT_PREFILL_CHUNK = 128


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats = field(repr=False)


def shadow_acceptance(probe, emitted: int, target_probs) -> float:
    """The chance a shadow probe's token would have been accepted as a draft: greedy (no target_probs), whether it
    is the token the target emitted; sampling, min(1, p(x) / q(x)) with p the target's row the token came from."""
    if not probe.tokens:
        return 0.0   # the drafter stopped short of its confidence bound: a real draft would have been empty too
    x = probe.tokens[0]
    if target_probs is None:
        return float(x == emitted)
    p, q = as_dist(target_probs(0)).prob(x), as_dist(probe.probs[0]).prob(x)
    return min(1.0, p / q) if q > 0 else 0.0


def _source(pair) -> Source | None:
    """What drafts for the pair (kinds.Source), None without a drafter."""
    kind = KINDS.get(pair.drafter_kind)
    return kind.source if kind is not None else None


def batch_support(pair) -> str | None:
    """None when `pair` can run several sequences in one pass; otherwise why it cannot (its requests then take turns
    on the pair's own contexts)."""
    from .backend.sequences import batchable

    if pair.drafter_kind not in BATCHED_DRAFTERS:
        return f"the {pair.drafter_kind} drafter drafts one sequence at a time (batched: {', '.join(BATCHED_DRAFTERS)})"
    why = batchable(pair.target_ctx, pair.speculative)
    draft = pair.draft_ctx.model if pair.draft_ctx is not None and _source(pair).own_context else None
    if why is None and draft is not None and (draft.is_recurrent or draft.is_hybrid):
        why = (f"the draft model {draft.path.name} keeps a recurrent state, which llamaspec cannot roll back per "
               "sequence after one-token drafting steps")
    return why


def shrink_own_contexts(pair) -> None:
    """Remake the pair's own target and draft-model contexts with room for one batch (n_ctx = their n_batch),
    freeing the rest of their KV caches, for a pair whose requests all run in a shared engine's contexts
    (serve --parallel): those then hold the only full-size caches. Call it before the shared engine is made, so the
    full-size caches are never held twice. The pair still generates alone (within one batch of tokens); its
    policy, measured costs, batch size and settings stay. An MTP head's context, made over the target's, is freed
    first and made again over the target's new one (at its size)."""
    head = pair.draft_ctx if pair.speculative and _source(pair).shares_target_context else None
    follow = pair.target_ctx.on_decode   # an MTP drafter follows the target through it
    if head is not None:
        head.release()
    for ctx in (pair.target_ctx, pair.draft_ctx if head is None else None):
        if ctx is not None and ctx.n_ctx > ctx.n_batch:
            ctx.remake(ctx.n_batch)
    if head is not None:
        head.remake_over_target()
    pair.target_ctx.on_decode = follow
    pair.reset()


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
        self.from_model = False   # this step's draft (or probe) came from the draft model (SharedTarget)
        self.together = False     # the batch policy chose this step's draft length (policy/batch.py)
        self.t_start = time.perf_counter()

    @property
    def ready(self) -> bool:
        return not self.done and self.prefilled


# -- where the sequences live ------------------------------------------------------------------------------------
class LoneTarget:
    """The pair's own target context and drafter, one slot (see the module docstring)."""

    n_seq = 1
    recurrent = False   # one slot: the batch policy's common width never applies

    def __init__(self, pair):
        self.pair, self.ctx, self.drafter = pair, pair.target_ctx, pair.drafter
        self.n_batch = self.k_cap = self.ctx.n_batch   # longer drafts than the snapshots reach save a checkpoint
        self.slots = [Slot(0, self.ctx)]
        self._scratch = np.zeros((0, pair.n_vocab), np.float32)

    @property
    def n_ctx_seq(self) -> int:
        return self.ctx.n_ctx

    @property
    def contexts(self) -> tuple:
        return (self.ctx, *(self.drafter.contexts if self.drafter is not None else ()))

    def current(self) -> bool:
        """Whether the pair still has these contexts (a tree or a reload swaps them)."""
        return self.ctx is self.pair.target_ctx and self.drafter is self.pair.drafter

    def choose(self, free: list[Slot], tokens: list[int]) -> Slot:
        return free[0]

    def open(self, slot: Slot, tokens: list[int]) -> tuple[int, int]:
        """Keep what the cache shares with the prompt: (tokens kept, tokens the memory holds of them: a checkpoint
        restore may leave part of the common prefix to decode again, with the next decode)."""
        common = common_prefix_len(self.ctx.tokens, tokens[:-1])
        if not self.ctx.keep(common):
            self.ctx.clear()   # the memory cannot go back to the common prefix: start over
            common = 0
        slot.rollback_before = self._rollback_totals()
        return common, self.ctx.n_in_memory

    def sampling(self, cfg: SamplerConfig, rng, shaper) -> Sampling | None:
        # shaped rows are numpy's: the target's logits come back, so nothing filters on the device; nor for a tree
        if cfg.greedy:
            return None
        return Sampling(cfg, rng, device=self._device_sampling(
            cfg if shaper is None and self.pair.tree is None else None, rng))

    def _device_sampling(self, cfg: SamplerConfig | None, rng: np.random.Generator) -> bool:
        """Filter on the device (llama.cpp's sampler chains) when every context prefers it and can run it;
        otherwise none does: draft and target must filter by one rule, which keeps rejection sampling exact."""
        contexts = self.contexts
        wanted = cfg is not None and all(ctx.prefers_device_sampling for ctx in contexts)
        # Every chain's draws follow the request's seed (the draft's too: the same draft draws in every request
        # would bias the output across seeds), or none at all; a chain with unchanged filters stays attached.
        if wanted and all([ctx.set_device_sampler(cfg, None if cfg.seed is None else int(rng.integers(1, 2**31)))
                           for ctx in contexts]):
            return True
        for ctx in contexts:
            ctx.set_device_sampler(None)
        return False

    def policy_for(self, slot: Slot):
        """The pair's own policy: what it learnt carries over from one request to the next."""
        return self.pair.policy, self.pair.hooks

    def begin(self, slot: Slot) -> None:
        pass

    def scratch(self, n: int) -> np.ndarray:
        """Dense rows for n of the target's filtered distributions (numpy sampling), grown once to the longest."""
        if self._scratch.shape[0] < n:
            self._scratch = np.zeros((max(n, self.pair.policy.draft_max + 1), self.pair.n_vocab), np.float32)
        return self._scratch

    def prefill(self, slot: Slot) -> None:
        """The whole prompt at once, then a turn checkpoint (a later prompt that leaves this one's answer, as a
        chat template that re-renders it, restarts here) and the drafter's start."""
        # greedy needs argmaxes only: taken on the device where rows are verified; a pair that never drafts copies
        # its one row out instead (measured faster for single rows)
        self.ctx.set_device_argmax(slot.sampling is None and slot.shaper is None and self.drafter is not None)
        if slot.todo:
            self.ctx.eval(slot.todo, logits="none")
        self.ctx.checkpoint(turn=True)
        slot.history.extend(slot.todo)
        slot.todo, slot.prefilled = [], True
        slot.hooks.new_request()
        if self.drafter is not None:   # a drafter the policy will not use yet catches up when first asked
            self.drafter.begin(slot.history, slot.sampling, slot.policy.draft_p_min,
                               prefill=slot.policy.next_draft_len() > 0)
        slot.decode_before = self._decode_seconds()

    def draft(self, active: list[Slot], joining: Slot | None, lens: dict) -> tuple[dict, dict, int]:
        if not active:
            return {}, {}, 0
        slot = active[0]
        k, probe = lens[slot.index]
        p_min = slot.policy.draft_p_min
        draft = self.drafter.propose(slot.history, slot.last, k, p_min) if k else Draft([])
        probed = self.drafter.propose(slot.history, slot.last, 1, p_min) if probe else None
        return {slot.index: draft}, ({slot.index: probed} if probed is not None else {}), 0

    def decode(self, active: list[Slot], drafts: dict, joining: Slot | None, draft_seconds: float,
               rounds: int) -> None:
        """Nothing shared to decode: a joining slot's prompt is prefilled, a verification decodes when asked."""
        if joining is not None:
            self.prefill(joining)

    def rows(self, slot: Slot, tokens: list[int], wants: str):
        if wants == "argmax":
            return self.ctx.eval_argmax(tokens, rows="all")
        if wants == "dists":
            return self.ctx.eval_dists(tokens, rows="all")
        return self.ctx.eval(tokens, logits="all")

    def accepted(self, slot: Slot, n_accepted: int) -> None:
        self.drafter.accepted(n_accepted)

    def finish(self, slot: Slot) -> None:
        """Exactly one place restores consistency after the end of a request, early or not (Ctrl-C, a closed
        stream, an error): each cache drops anything past what it recorded, the target holds exactly the history."""
        self.ctx.resync()
        self.ctx.keep(len(slot.history))
        for ctx in self.drafter.contexts if self.drafter is not None else ():
            ctx.resync()
        stats = slot.stats
        stats.time_in_decode = self._decode_seconds() - getattr(slot, "decode_before", self._decode_seconds())
        seconds, replayed = self._rollback_totals()
        stats.time_rollback = seconds - slot.rollback_before[0]
        stats.tokens_replayed = replayed - slot.rollback_before[1]

    def fail(self, slot: Slot) -> None:
        self.finish(slot)

    def _decode_seconds(self) -> float:
        return sum(ctx.decode_seconds for ctx in self.contexts)

    def _rollback_totals(self) -> tuple[float, int]:
        """Seconds spent rolling caches back (saves, restores, trims) and tokens replayed, over all contexts."""
        return sum(c.rollback_seconds for c in self.contexts), sum(c.replayed_tokens for c in self.contexts)

    def close(self) -> None:
        pass   # the contexts are the pair's


class SharedTarget:
    """`n_seq` sequences over shared contexts of the pair's models (n_ctx tokens in all, n_ctx / n_seq a sequence)."""

    def __init__(self, pair, n_seq: int, n_ctx: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        from .backend.sequences import shared_like

        why = batch_support(pair)
        if why is not None:
            raise InvalidParameterError(f"cannot decode several sequences at once: {why}", param="parallel")
        self.pair, self.n_seq, self.prefill_chunk = pair, n_seq, max(prefill_chunk, 1)
        # a recurrent target keeps one snapshot per token of the longest draft (snapshot_reach); none without drafts
        target = pair.target_ctx
        self.ctx = shared_like(target, n_seq, n_ctx, target.options.n_rs_seq if pair.speculative else 0)
        self.recurrent, self.n_batch = self.ctx.recurrent, self.ctx.n_batch
        # the longest draft a slot may verify: a rejection must stay within the recurrent state's snapshots
        self.k_cap = self.ctx.n_rs_seq if self.ctx.recurrent else self.ctx.n_batch
        self.draft_ctx = self.mtp = None
        try:
            if pair.speculative and _source(pair).own_context:
                self.draft_ctx = shared_like(pair.draft_ctx, n_seq, self.ctx.n_ctx)
            elif pair.speculative and _source(pair).shares_target_context:   # the head over the shared target
                # context, a sequence per slot
                from .drafters.batched_mtp import BatchedMTP

                self.mtp = BatchedMTP(self.ctx, pair.draft_ctx, n_seq)
        except BaseException:
            self.ctx.close()
            raise
        n_vocab = pair.n_vocab
        self.slots = [Slot(i, seq, SeqDraft(self.draft_ctx.sequences[i], n_vocab) if self.draft_ctx else
                           self.mtp.seqs[i] if self.mtp else None,
                           PromptLookupDrafter(n_vocab=n_vocab) if pair.drafter_kind.startswith("lookup") else None)
                      for i, seq in enumerate(self.ctx.sequences)]
        self._scratch: dict[int, np.ndarray] = {}
        self._rows: dict[int, np.ndarray] = {}   # this step's rows of each verifying slot

    @property
    def n_ctx_seq(self) -> int:
        return self.ctx.n_ctx_seq

    def choose(self, free: list[Slot], tokens: list[int]) -> Slot:
        """The free slot whose cache shares the longest prefix with the prompt."""
        return max(free, key=lambda s: s.seq.reusable(tokens[:-1]))

    def open(self, slot: Slot, tokens: list[int]) -> tuple[int, int]:
        # a recurrent state goes back only within its last decode's snapshots or to a turn checkpoint: `reusable`
        # says how far the slot's cache serves the prompt; without any, the sequence starts over
        common = slot.seq.reusable(tokens[:-1])
        if not slot.seq.keep(common):
            slot.seq.clear()
            common = 0
        return common, common

    def sampling(self, cfg: SamplerConfig, rng, shaper) -> Sampling | None:
        return None if cfg.greedy else Sampling(cfg, rng)

    def policy_for(self, slot: Slot):
        policy = copy.deepcopy(self.pair.policy)
        hooks = Hooks(policy)
        if self.pair.drafter is not None:
            hooks.attach(self.pair.drafter.draft_cost, self.pair.costs)
        return policy, hooks

    def begin(self, slot: Slot) -> None:
        slot.hooks.new_request()
        if slot.draft is not None:
            slot.draft.begin(slot.prompt[:-1], slot.sampling)
        if slot.lookup is not None:
            slot.lookup.begin(slot.history, slot.sampling, 0.0, False)

    def scratch_for(self, slot: Slot):
        def scratch(n: int) -> np.ndarray:
            rows = self._scratch.get(slot.index)
            if rows is None or rows.shape[0] < n:
                rows = self._scratch[slot.index] = np.zeros((max(n, 9), self.pair.n_vocab), np.float32)
            return rows
        return scratch

    def draft(self, active: list[Slot], joining: Slot | None, lens: dict) -> tuple[dict, dict, int]:
        """Each active slot's draft (empty on a plain step) and, on a plain step the policy wants judged, a one-token
        shadow probe; lookup first where the pair has it, the draft model for all the rest in one set of decodes
        (with a chunk of the joining slot's prompt riding along); and the draft rounds (0 where one caught up first)."""
        drafts, probes, jobs, behind = {}, {}, [], False
        for s in active:
            k, probe = lens[s.index]
            found = drafts if k else probes
            ran, s.from_model, drafts[s.index] = s.from_model, False, Draft([])   # ran: its drafter ran last step
            if (k or probe) and s.lookup is not None:
                found[s.index] = s.lookup.propose(s.history, s.last, k or 1, s.policy.draft_p_min)
            if (k or probe) and s.draft is not None and not found.get(s.index, Draft([])).tokens:
                jobs.append((s, found, DraftJob(s.draft, s.history, s.last, k or 1, s.policy.draft_p_min)))
                behind = behind or (k and not ran)
        if self.mtp is not None:   # the head catches up on a joining prompt, or plain steps, as it lags
            drafting = {s.index for s, *_ in jobs}
            idle = [(s.draft, s.history) for s in self.slots if not s.done and s.index not in drafting]
            made = self.mtp.propose_all([j for *_, j in jobs], idle)
        else:
            prefills = [(joining.draft, self.prefill_chunk)] if joining is not None and joining.draft else []
            made = propose_all(self.draft_ctx, [j for *_, j in jobs], prefills) if jobs or prefills else []
        for (s, found, _), draft in zip(jobs, made):
            found[s.index], s.from_model = draft, True
        rounds = max((len(d.tokens) for (_, found, _), d in zip(jobs, made) if found is drafts), default=0)
        return drafts, probes, 0 if behind else rounds   # (a probe's one token is not a round either)

    def decode(self, active: list[Slot], drafts: dict, joining: Slot | None, draft_seconds: float,
               rounds: int) -> None:
        """One decode: every active slot's [last, d_1..d_k] with all rows, and a chunk of a joining slot's prompt."""
        Run = self.ctx.Run
        runs = [Run(s.seq, [s.last] + drafts[s.index].tokens, "all") for s in active]
        if self.recurrent and runs:   # one length for all: each recurrent state can then undo its run
            width = max(len(r.tokens) for r in runs)   # (SharedContext.decode); the padding is never accepted
            for r in runs:
                r.tokens += [r.tokens[0]] * (width - len(r.tokens))
        room = self.n_batch - sum(len(r.tokens) for r in runs)
        chunk = []
        if joining is not None and room > 0:
            chunk = joining.todo[:min(room, self.prefill_chunk if active else room)]
            if chunk:
                runs.append(Run(joining.seq, chunk, "none"))
        t0 = time.perf_counter()
        rows = self.ctx.decode(runs) if runs else []
        if runs and joining is None:   # a prompt chunk's rows cost less than verified ones: not learnt from
            self.engine_policy.record_step(sum(len(r.tokens) for r in runs), time.perf_counter() - t0, rounds,
                                           draft_seconds)
        self._rows = {s.index: r for s, r in zip(active, rows)}
        if joining is not None:
            joining.todo = joining.todo[len(chunk):]
            joining.history.extend(chunk)
            if not joining.todo:   # a turn boundary: a later prompt that leaves this one's answer restarts here
                joining.prefilled = True
                joining.seq.checkpoint_turn()

    def rows(self, slot: Slot, tokens: list[int], wants: str):
        rows = self._rows[slot.index][:len(tokens)]
        return rows.argmax(axis=1) if wants == "argmax" else rows

    def accepted(self, slot: Slot, n_accepted: int) -> None:
        if slot.from_model:
            slot.draft.accepted(n_accepted)

    def finish(self, slot: Slot) -> None:
        pass   # the sequence keeps its history for a later prompt to reuse

    def fail(self, slot: Slot) -> None:
        """A slot that failed mid-step starts over: its sequences may hold a half-done step."""
        slot.seq.clear()
        if slot.draft is not None and hasattr(slot.draft, "seq"):
            slot.draft.seq.clear()

    def close(self) -> None:
        if self.draft_ctx is not None:
            self.draft_ctx.close()
        if self.mtp is not None:
            self.mtp.close()
        self.ctx.close()


# -- the engine ---------------------------------------------------------------------------------------------------
class Engine:
    """Slots over a target (LoneTarget: the pair's contexts, one slot; SharedTarget: n_seq sequences)."""

    def __init__(self, pair, target):
        self.pair, self.target, self.slots = pair, target, target.slots
        policy = pair.policy
        self.policy = BatchPolicy(policy.tuning if isinstance(policy, AutoPolicy) else None, pair.costs,
                                  free_drafts=pair.speculative and _source(pair).free)
        target.engine_policy = self.policy
        self.times = StepTimes()

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
        for slot in self.slots:
            slot.pieces = []
        active = [s for s in self.slots if s.ready]
        joining = next((s for s in self.slots if not s.done and not s.prefilled), None)
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
        if joining is not None and joining.prefilled:
            joining.stats.time_prefill = time.perf_counter() - joining.t_start
        self.times.add(t1 - t0, t2 - t1, time.perf_counter() - t0)
        return active + ([joining] if joining is not None and joining not in active else [])

    def _draft_lens(self, active: list[Slot]) -> dict[int, tuple[int, bool]]:
        """Each active slot's draft length, and whether it takes a one-token shadow probe on a plain step. With two
        or more slots, the batch policy chooses for those whose policy is auto (policy/batch.py); alone, or with
        another policy, a slot's own policy chooses. Clamped so that all slots' runs fit in one batch and a rejection
        stays within what the target's memory can undo (k_cap)."""
        if len(active) == 1:   # alone: the slot's own policy, within its room, its budget, one batch
            s = active[0]
            room = s.seq.n_ctx - len(s.history) - 1
            k = max(min(s.policy.next_draft_len(), room, s.max_tokens - s.n_out - 1, self.target.n_batch - 1,
                        self.target.k_cap), 0)
            s.together = False
            return {s.index: (k, not k and room > 0 and self.pair.speculative and s.hooks.shadow_len() > 0)}
        share = max(self.target.n_batch // max(len(active), 1) - 1, 0)   # every slot's run fits in one batch
        rooms = [s.seq.n_ctx - len(s.history) - 1 for s in active]
        caps = [max(min(room, s.max_tokens - s.n_out - 1, share, self.target.k_cap), 0)
                for s, room in zip(active, rooms)]
        ks, together, probes = self.policy.lengths([s.index for s in active], [s.policy for s in active], caps,
                                                   self.target.recurrent)
        lens = {}
        for s, k, room, chosen, probe in zip(active, ks, rooms, together, probes):
            s.together = chosen
            due = probe if chosen else s.hooks.shadow_len() > 0
            lens[s.index] = k, not k and room > 0 and self.pair.speculative and due
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
        chance = shadow_acceptance(probe, next_token, target_probs) if probe is not None else None
        slot.stats.shadow_probes += chance is not None
        # the policy learns the cost of drafting itself; a catch-up after a pause is not a per-token cost.
        # Rolling back is part of each phase's cost, so `auto` drafts less where it is expensive.
        verify_seconds, own_seconds = pass_seconds + t1 - t0, draft_seconds + t2 - t1
        if slot.together:   # the pass's timings are the batch's (record_step): the slot's policy learns acceptance
            self.policy.slot_step(slot.index, slot.policy, len(drafted), n_accepted, chance)
        else:
            if chance is not None:
                slot.hooks.shadow(chance, own_seconds)
            setup = draft.setup_seconds if drafted else 0.0
            slot.policy.update(len(drafted), n_accepted, max(draft_seconds - setup, 0.0) + t2 - t1, verify_seconds)
        slot.stats.record_step(len(drafted), n_accepted, own_seconds, verify_seconds)
        for i, token in enumerate(drafted[:n_accepted] + [next_token]):
            self._emit(slot, token, i < n_accepted)
            if slot.done:
                return
        if len(history) + 1 > slot.seq.n_ctx:
            self._finish(slot, "context")

    def _emit(self, slot: Slot, token: int, from_draft: bool) -> None:
        slot.n_out += 1
        slot.stats.tokens_generated = slot.n_out
        if self.pair.target.is_eog(token):
            return self._finish(slot, "stop")
        if not slot.stats.time_to_first_token:
            slot.stats.time_to_first_token = time.perf_counter() - slot.t_start
        text, stopped = slot.matcher.push(slot.decoder.decode(self.pair.target.token_bytes(token)))
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
