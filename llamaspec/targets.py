"""Where the sequences live: the two targets behind the engine's contract (slots.py).

- `LoneTarget`: the pair's own contexts, one slot. Everything a single sequence can do: checkpoint rollback and turn
  checkpoints on recurrent and hybrid targets, device-side argmax and sampling, tree verification, every drafter kind
  (EAGLE-3, DFlash, recurrent draft models). A prompt is prefilled whole (stoppable: interrupt.py).
- `SharedTarget`: n_seq sequences over one shared target context (backend/sequences.py) and one shared drafter (a
  draft model: drafters/batched.py; an MTP head, a head sequence per slot: drafters/batched_mtp.py); one decode holds
  every slot's run and a bounded chunk of a joining prompt (`prefill_chunk` tokens), so a new request never stalls
  the others for more than one chunk (alone, a batch per step). Verification reads host rows. Which pairs share a
  pass: `batch_support`.

Both keep a slot's reusable past: a recurrent state's turn checkpoint TURN_TAIL tokens before the end of each prompt
(at its end where the cache held all but its last few tokens), and a host-memory cache of saved slot states
(backend/state_cache.py, the pair's `cache_ram`): `open` saves what a slot holds before a request that keeps less
than half of it, and restores the entry that serves the request further than the slot's own cache; `choose` prefers
the slot that serves a prompt furthest, else an empty or the least recently used one.
"""
from __future__ import annotations

import copy
import time

import numpy as np

from .backend.device_sampling import LazyRows
from .backend.sequences import batchable, shared_like
from .backend.state_cache import StateCache
from .drafters import PromptLookupDrafter, common_prefix_len
from .drafters.base import NO_DRAFT, Draft
from .drafters.batched import DraftJob, SeqDraft, propose_all
from .drafters.batched_mtp import BatchedMTP
from .errors import InvalidParameterError
from .kinds import KINDS, Source, source_of
from .policy import Hooks
from .sampling import SamplerConfig, Sampling, draft_filters, filter_logits
from .slots import Slot

BATCHED_DRAFTERS = ("none",) + tuple(k.name for k in KINDS.values() if k.batches)
DEFAULT_PREFILL_CHUNK = 128
# a free slot is chosen for what its cache shares with a prompt when that is more than this fraction of the prompt
# (llama-server's --slot-prompt-similarity); otherwise an empty slot, else the least recently used one
SLOT_SIMILARITY = 0.1
# A prompt's turn checkpoint (recurrent and hybrid targets): this many tokens before the prompt's end, where a chat
# template's generation prompt begins (`<|im_start|>assistant\n<think>\n`): the next request re-renders the answer
# after `<|im_start|>assistant\n` without the `<think>` that the generation prompt opened, so only a checkpoint
# before it serves that request (llama-server checkpoints 4 tokens before the end for the same reason,
# server-context.cpp). Only that one: a later prompt that leaves this one's answer anywhere restarts there and
# prefills three tokens more than from the prompt's very end, where a second checkpoint would copy the whole state
# on every request and halve how many prompts back the kept ones reach.
TURN_TAIL = 4


def _source(pair) -> Source | None:
    return source_of(pair.drafter_kind)


def batch_support(pair) -> str | None:
    """None when `pair` can run several sequences in one pass; otherwise why it cannot (its requests then take turns
    on the pair's own contexts)."""
    if pair.drafter_kind not in BATCHED_DRAFTERS:
        return f"the {pair.drafter_kind} drafter drafts one sequence at a time (batched: {', '.join(BATCHED_DRAFTERS)})"
    why = batchable(pair.target_ctx, pair.speculative)
    draft = pair.draft_ctx.model if pair.draft_ctx is not None and _source(pair).own_context else None
    if why is None and draft is not None and (draft.is_recurrent or draft.is_hybrid):
        why = (f"the draft model {draft.path.name} keeps a recurrent state, which llamaspec cannot roll back per "
               "sequence after one-token drafting steps")
    return why


def state_cache(pair, drafter):
    """The host-memory cache of saved slot states for a target (backend/state_cache.py), budgeted by the pair's
    `cache_ram` MiB; None when that is 0 or when `drafter` (the pair's, for the pair's own contexts) cannot save its
    own cache beside the target's."""
    budget = pair.config.cache_ram
    if budget == 0 or (drafter is not None and not drafter.saves_state):
        return None
    return StateCache(budget)


def _restored(cache, entry, restore) -> bool:
    """Take `entry` out of `cache` and restore it (`restore(parts) -> bool`), timed."""
    t0 = time.perf_counter()
    cache.take(entry)
    ok = restore(entry.parts)
    cache.restore_seconds += time.perf_counter() - t0
    return ok


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


# -- where the sequences live ------------------------------------------------------------------------------------
def _totals(contexts) -> tuple[float, float, int]:
    """Seconds inside llama_decode, seconds rolling caches back (saves, restores, trims) and tokens replayed, over
    `contexts`."""
    return (sum(c.decode_seconds for c in contexts), sum(c.rollback_seconds for c in contexts),
            sum(c.replayed_tokens for c in contexts))


def _prompt_done(slot: Slot, contexts) -> None:
    """The slot's prompt is processed: its generation's time inside llama.cpp counts from here."""
    decoded, seconds, replayed = _totals(contexts)
    slot.decode_before, slot.rollback_before = decoded, (seconds, replayed)


def _generation_times(slot: Slot, contexts) -> None:
    """The slot's generation's time inside llama.cpp (decodes, rollbacks) and tokens replayed, from `contexts`'
    counters since its prompt was done (_prompt_done); nothing if it ended before."""
    if slot.decode_before is None:
        return
    stats, (decoded, seconds, replayed) = slot.stats, _totals(contexts)
    stats.time_in_decode = decoded - slot.decode_before
    stats.time_rollback = seconds - slot.rollback_before[0]
    stats.tokens_replayed = replayed - slot.rollback_before[1]


class LoneTarget:
    """The pair's own target context and drafter, one slot (see the module docstring)."""

    n_seq = 1
    recurrent = False   # one slot: the batch policy's common width never applies

    def __init__(self, pair):
        self.pair, self.ctx, self.drafter = pair, pair.target_ctx, pair.drafter
        self.n_batch = self.k_cap = self.ctx.n_batch   # longer drafts than the snapshots reach save a checkpoint
        self.slots = [Slot(0, self.ctx)]
        self._scratch = np.zeros((0, pair.n_vocab), np.float32)
        self.cache = state_cache(pair, self.drafter)
        model = self.ctx.model
        self.recurrent_memory = model.is_recurrent or model.is_hybrid   # it keeps turn checkpoints (TURN_TAIL)

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
        if self.cache is not None:
            common = self._swap(tokens[:-1], common)
        if not self.ctx.keep(common):
            self.ctx.clear()   # the memory cannot go back to the common prefix: start over
            common = 0
        return common, self.ctx.n_in_memory

    def _swap(self, prompt: list[int], common: int) -> int:
        """Before a prompt takes the contexts: save their state where the prompt keeps less than half of it, and
        restore the saved state that serves the prompt further than the memory's own (StateCache). Returns the common
        prefix of the prompt and what the contexts now hold."""
        cache, ctx, drafter = self.cache, self.ctx, self.drafter
        own = ctx.reach(common)
        entry, further = cache.best(prompt)
        restore = entry is not None and further > own
        held = ctx.n_in_memory
        if cache.wants(held, 0 if restore else own) and not cache.covers(ctx.tokens[:held]):
            t0 = time.perf_counter()
            parts = [ctx.save_state(), drafter.save_state() if drafter is not None else None]
            if parts[0] is not None:
                cache.put(parts[0].tokens, parts, [t.pos for t in parts[0].turns], not self.recurrent_memory,
                          time.perf_counter() - t0)
        if not restore:
            return common
        if not _restored(cache, entry, lambda parts: ctx.restore_state(parts[0]) and (
                drafter is None or drafter.restore_state(parts[1]))):
            ctx.clear()
            if drafter is not None:
                drafter.reset()
            return 0
        cache.tokens_restored += further
        return common_prefix_len(ctx.tokens, prompt)

    def sampling(self, cfg: SamplerConfig, rng, shaper) -> Sampling | None:
        # shaped rows are numpy's: the target's logits come back, so nothing filters on the device; nor for a tree
        if cfg.greedy:
            return None
        return Sampling(cfg, rng, device=self._device_sampling(
            cfg if shaper is None and self.pair.tree is None else None, rng))

    def _device_sampling(self, cfg: SamplerConfig | None, rng: np.random.Generator) -> bool:
        """Filter on the device (llama.cpp's sampler chains) when every context prefers it and can run it;
        otherwise none does (a drafter reads its rows the way the target does). The target filters by the
        request's settings, a drafter by `draft_filters` (at most DRAFT_TOP_K candidates: exact all the same)."""
        contexts = self.contexts
        wanted = cfg is not None and all(ctx.prefers_device_sampling for ctx in contexts)
        # Every chain's draws follow the request's seed (the draft's too: the same draft draws in every request
        # would bias the output across seeds), or none at all; a chain with unchanged filters stays attached.
        if wanted and all([ctx.set_device_sampler(cfg if ctx is self.ctx else draft_filters(cfg),
                                                  None if cfg.seed is None else int(rng.integers(1, 2**31)))
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
        """The whole prompt at once with a turn checkpoint TURN_TAIL tokens before its end (a later prompt that
        leaves this one's answer, as a chat template that re-renders it, restarts there), and the drafter's start.
        One checkpoint a prompt: one at its very end would save a later prompt three tokens of a prefill it runs
        anyway, for a copy of the whole recurrent state on every request (150 MiB for a 27B hybrid)."""
        # greedy needs argmaxes only: taken on the device where rows are verified; a pair that never drafts copies
        # its one row out instead (measured faster for single rows)
        self.ctx.set_device_argmax(slot.sampling is None and slot.shaper is None and self.drafter is not None)
        tail = len(slot.prompt) - TURN_TAIL - len(slot.history)   # prompt tokens before the tail's checkpoint
        at_tail = self.recurrent_memory and 0 < tail < len(slot.todo)
        if at_tail:
            self.ctx.eval(slot.todo[:tail], logits="none")
            self.ctx.checkpoint(turn=True)
            slot.todo = slot.todo[tail:]   # (the history takes the whole prompt below)
            slot.history.extend(slot.prompt[len(slot.history):len(slot.history) + tail])
        if slot.todo:
            self.ctx.eval(slot.todo, logits="none")
        if not at_tail:   # a prompt the cache held but for its last few tokens: its end
            self.ctx.checkpoint(turn=True)
        slot.history.extend(slot.todo)
        slot.todo, slot.prefilled = [], True
        slot.hooks.new_request()
        slot.hooks.held(len(slot.history))
        if self.drafter is not None:   # a drafter the policy will not use yet catches up when first asked
            self.drafter.begin(slot.history, slot.sampling, slot.policy.draft_p_min,
                               prefill=slot.policy.next_draft_len() > 0)
        # the generation's own decode and rollback time from here: the prompt's checkpoint and any replay of a
        # restored prefix are prompt processing (time_prefill), not a step's overhead (stats.python_overhead)
        _prompt_done(slot, self.contexts)

    def draft(self, active: list[Slot], joining: Slot | None, lens: dict) -> tuple[dict, dict, int]:
        if not active:
            return {}, {}, 0
        slot = active[0]
        k, probe = lens[slot.index]
        p_min = slot.policy.draft_p_min
        if k and probe:   # a tail probe: one token past k, in the same proposal
            draft, probed = self.drafter.propose(slot.history, slot.last, k + 1, p_min).split(k)
        else:
            draft = self.drafter.propose(slot.history, slot.last, k, p_min) if k else NO_DRAFT
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
        _generation_times(slot, self.contexts)

    def fail(self, slot: Slot) -> None:
        self.finish(slot)

    def close(self) -> None:
        pass   # the contexts are the pair's


class SharedTarget:
    """`n_seq` sequences over shared contexts of the pair's models (n_ctx tokens in all, n_ctx / n_seq a sequence)."""

    def __init__(self, pair, n_seq: int, n_ctx: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
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
        self.device_sampling = self.ctx.samples_on_device   # sampled slots' chains (off unless asked for)
        self._chain_seeds: dict[int, int | None] = {}   # slot index -> its chain's seed, until the chain attaches
        self.cache = state_cache(pair, None)
        self._used = [0] * n_seq   # when each slot last took a request (a count of requests)

    @property
    def n_ctx_seq(self) -> int:
        return self.ctx.n_ctx_seq

    def choose(self, free: list[Slot], tokens: list[int]) -> Slot:
        """The free slot whose cache serves the prompt furthest, where that is more than SLOT_SIMILARITY of it and
        no less than the state cache offers; otherwise an empty slot, else the least recently used one (a saved
        state is restored into it)."""
        prompt = tokens[:-1]
        own = {s.index: s.seq.reusable(prompt) for s in free}
        best = max(free, key=lambda s: (own[s.index], -self._used[s.index]))
        offered = self.cache.best(prompt)[1] if self.cache is not None else 0
        if own[best.index] > SLOT_SIMILARITY * len(tokens) and own[best.index] >= offered:
            return best
        return min(free, key=lambda s: (s.seq.n_past > 0, self._used[s.index]))

    def open(self, slot: Slot, tokens: list[int]) -> tuple[int, int]:
        # a recurrent state goes back only within its last decode's snapshots or to a turn checkpoint: `reusable`
        # says how far the slot's cache serves the prompt; without any, the sequence starts over
        common = slot.seq.reusable(tokens[:-1])
        if self.cache is not None:
            common = self._swap(slot, tokens[:-1], common)
        self._used[slot.index] = max(self._used) + 1
        if not slot.seq.keep(common):
            slot.seq.clear()
            common = 0
        return common, common

    def _swap(self, slot: Slot, prompt: list[int], common: int) -> int:
        """Before a prompt takes the slot: save its state where the prompt keeps less than half of it, and restore
        the saved state that serves the prompt further than the slot's own (StateCache). Returns how far the slot
        now serves the prompt."""
        cache, seq, draft = self.cache, slot.seq, slot.draft
        entry, further = cache.best(prompt)
        restore = entry is not None and further > common
        if cache.wants(seq.n_past, 0 if restore else common) and not cache.covers(seq.tokens):
            t0 = time.perf_counter()
            parts = [seq.save(), draft.save_state() if draft is not None else None]
            if parts[0] is not None:
                cache.put(parts[0].tokens, parts, [t.pos for t in parts[0].turns], not self.recurrent,
                          time.perf_counter() - t0)
        if not restore:
            return common
        if not _restored(cache, entry, lambda parts: seq.restore(parts[0]) and (
                draft is None or draft.restore_state(parts[1]))):
            seq.clear()
            if draft is not None:
                draft.restore_state(None)
            return 0
        cache.tokens_restored += further
        return seq.reusable(prompt)

    def sampling(self, cfg: SamplerConfig, rng, shaper) -> Sampling | None:
        # shaped rows are numpy's (the target's logits come back); the drafters' rows are numpy's either way
        return None if cfg.greedy else Sampling(cfg, rng, device=self.device_sampling and shaper is None)

    def policy_for(self, slot: Slot):
        policy = copy.deepcopy(self.pair.policy)
        hooks = Hooks(policy)
        if self.pair.drafter is not None:
            hooks.attach(self.pair.drafter.draft_cost, self.pair.costs)
        return policy, hooks

    def begin(self, slot: Slot) -> None:
        slot.hooks.new_request()
        slot.hooks.held(len(slot.prompt) - 1)   # its last token is the first step's
        # greedy needs argmaxes only: taken on the device for the slot's sequence (as LoneTarget.prefill; the
        # sampler stays for the next greedy request), so a step of greedy slots copies no logits out
        self.ctx.set_seq_argmax(slot.seq.seq_id, slot.verifier.wants == "argmax" and self.pair.speculative)
        if slot.verifier.wants == "dists":   # a chain of the request's filters and seed, attached at its first
            cfg = slot.sampling.config       # verification (decode)
            self._chain_seeds[slot.index] = None if cfg.seed is None else int(slot.sampling.rng.integers(1, 2**31))
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
        """Each active slot's draft (empty on a plain step) and its probe where the policy wants one judged: on a
        plain step a one-token shadow probe, on a drafting one a tail probe (one token past k, drafted with the k:
        `Draft.split`); lookup first where the pair has it, the draft model for all the rest in one set of decodes
        (with a chunk of the joining slot's prompt riding along); and the draft rounds (0 where one caught up first;
        a tail probe's token is a round)."""
        drafts, probes, jobs, behind = {}, {}, [], False
        for s in active:
            k, probe = lens[s.index]
            ran, s.from_model, drafts[s.index] = s.from_model, False, Draft([])   # ran: its drafter ran last step
            if not (k or probe):
                continue
            n = k + 1 if k and probe else k or 1
            found = s.lookup.propose(s.history, s.last, n, s.policy.draft_p_min) if s.lookup is not None else None
            if found is not None and found.tokens or s.draft is None:
                _place(drafts, probes, s.index, k, probe, found or Draft([]))
            else:
                jobs.append((s, k, probe, DraftJob(s.draft, s.history, s.last, n, s.policy.draft_p_min)))
                behind = behind or (k and not ran)
        if self.mtp is not None:   # the head catches up on a joining prompt, or plain steps, as it lags
            drafting = {s.index for s, *_ in jobs}
            idle = [(s.draft, s.history) for s in self.slots if not s.done and s.index not in drafting]
            made = self.mtp.propose_all([j for *_, j in jobs], idle)
        else:
            # the draft reads a joining prompt at the target's pace: a chunk beside running slots, a batch alone
            chunk = self.prefill_chunk if active else self.n_batch
            prefills = [(joining.draft, chunk)] if joining is not None and joining.draft else []
            made = propose_all(self.draft_ctx, [j for *_, j in jobs], prefills) if jobs or prefills else []
        for (s, k, probe, _), draft in zip(jobs, made):
            _place(drafts, probes, s.index, k, probe, draft)
            s.from_model = True
        rounds = max((len(d.tokens) for (_, k, *_), d in zip(jobs, made) if k), default=0)
        return drafts, probes, 0 if behind else rounds   # (a shadow probe's one token is not a round)

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
            n = min(room, self.prefill_chunk if active else room)
            tail = len(joining.prompt) - TURN_TAIL - len(joining.history)   # a chunk ends at the tail's checkpoint
            chunk = joining.todo[:min(n, tail) if self.recurrent and 0 < tail < len(joining.todo) else n]
            if chunk:
                runs.append(Run(joining.seq, chunk, "none"))
        for s in active:   # every attached chain has rows in every decode: a slot's from its first verification
            if s.index in self._chain_seeds:   # to its end (SharedContext.set_seq_sampler)
                self.ctx.set_seq_sampler(s.seq.seq_id, s.sampling.config, self._chain_seeds.pop(s.index))
        t0 = time.perf_counter()
        rows = self.ctx.decode(runs) if runs else []
        if runs and joining is None:   # a prompt chunk's rows cost less than verified ones: not learnt from
            self.engine_policy.record_step(sum(len(r.tokens) for r in runs), time.perf_counter() - t0, rounds,
                                           draft_seconds, sum(len(s.history) for s in active))
        self._rows = {s.index: r for s, r in zip(active, rows)}
        if joining is not None:
            joining.todo = joining.todo[len(chunk):]
            joining.history.extend(chunk)
            if self.recurrent and len(joining.history) == len(joining.prompt) - TURN_TAIL and joining.todo:
                joining.seq.checkpoint_turn()   # where a template's generation prompt begins (TURN_TAIL)
                joining.at_tail = True
            if not joining.todo:   # a turn boundary: a later prompt that leaves this one's answer restarts there
                joining.prefilled = True
                if not joining.at_tail:   # (one checkpoint a prompt: LoneTarget.prefill)
                    joining.seq.checkpoint_turn()
                # the contexts' decode and rollback time from here is the slot's generation's (as LoneTarget.prefill)
                _prompt_done(joining, self.contexts)

    def rows(self, slot: Slot, tokens: list[int], wants: str):
        rows = self._rows[slot.index]
        if wants == "dists":   # the device's rows; where no chain could attach, the logits filtered as numpy does
            if isinstance(rows, np.ndarray):
                cfg = slot.sampling.config
                return LazyRows(lambda i: filter_logits(rows[i], cfg), 0, len(tokens))
            return rows
        rows = rows[:len(tokens)]
        if wants != "argmax" or isinstance(rows, list):   # (a list: the argmax tokens of a greedy sampler's sequence)
            return rows
        return rows.argmax(axis=1)

    def accepted(self, slot: Slot, n_accepted: int) -> None:
        if slot.from_model:
            slot.draft.accepted(n_accepted)

    def finish(self, slot: Slot) -> None:
        """The sequence keeps its history for a later prompt to reuse. The slot's generation shared every pass with
        the others: its time inside llama.cpp is the contexts' while it generated, so `python_overhead` is the share of
        its steps (everyone's drafting, verifying and accepting) spent outside llama.cpp."""
        self._end_chain(slot)
        _generation_times(slot, self.contexts)

    def _end_chain(self, slot: Slot) -> None:
        """A finished slot's sampling chain goes (its sequence has no rows from here on); a greedy one's stays."""
        self._chain_seeds.pop(slot.index, None)
        if self.ctx.seq_sampler(slot.seq.seq_id):
            self.ctx.set_seq_sampler(slot.seq.seq_id, None)

    @property
    def contexts(self) -> tuple:
        head = (self.mtp.ctx,) if self.mtp is not None else ()
        return (self.ctx,) + ((self.draft_ctx,) if self.draft_ctx is not None else ()) + head

    def fail(self, slot: Slot) -> None:
        """A slot that failed mid-step starts over: its sequences may hold a half-done step."""
        self._end_chain(slot)
        slot.seq.clear()
        if slot.draft is not None and hasattr(slot.draft, "seq"):
            slot.draft.seq.clear()

    def close(self) -> None:
        if self.draft_ctx is not None:
            self.draft_ctx.close()
        if self.mtp is not None:
            self.mtp.close()
        self.ctx.close()


def _place(drafts: dict, probes: dict, index: int, k: int, probe: bool, draft: Draft) -> None:
    """A slot's proposal where SharedTarget.draft returns it: its draft, its shadow probe, or both split at k."""
    if k and probe:
        drafts[index], probes[index] = draft.split(k)
    elif k:
        drafts[index] = draft
    else:
        probes[index] = draft
