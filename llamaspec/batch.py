"""Speculative decoding for several sequences at once: one target pass verifies every active sequence's draft.

A `BatchEngine` holds `n_seq` slots over a shared target context (and a shared draft context for a draft model):
each slot is one request with its own history, sampler and seed, draft-length policy, statistics and stop strings,
on its own sequence id (backend/sequences.py). `step()` runs one round for all of them:
1. draft: prompt lookup per slot (free), the draft model (drafters/batched.py) or the target's MTP head
   (drafters/batched_mtp.py: a head sequence per slot, following its slot's rows of the target decodes) for all
   slots together;
2. one target decode: every active slot's [last, d_1..d_k] with all rows, plus a bounded chunk of a joining slot's
   prompt (`prefill_chunk` tokens), so a new request never stalls the others for more than one chunk;
3. each slot accepts with its own rule (modes.py, the same functions as Pair's, reading the rows this decode
   returned) and keeps `len(history) + 1 + n_accepted` tokens on its own sequence.
Draft lengths: a slot alone follows its own policy (a copy of the pair's) as Pair.generate would; with others, the
`auto` slots' lengths are chosen together by the engine's BatchPolicy (policy/batch.py: the expected tokens of all
slots over the shared pass's cost, learnt by its row count, plus the draft rounds; k = 0, plain, for a slot whose
drafts do not pay, with shadow probes now and then), other policies keep their own k. Every length is clamped so
that all runs fit in one batch and, on a recurrent / hybrid target, to its recurrent-state snapshots (n_rs_seq).

Which pairs batch: with no drafter, prompt lookup, a draft model, an MTP head or a lookup+ combination of them
(kinds.py: DrafterKind.batches), an attention target, and a recurrent / hybrid one (Qwen3.5, ...) where llama.cpp
keeps rollback snapshots for it (or with no drafter: nothing is ever rolled back) and an attention draft model.
EAGLE-3 and DFlash drafters follow the target's hidden states one sequence at a time, and a recurrent draft model
would need per-sequence checkpoints: `generate_batch` runs those one prompt after another (`batch_support` says
why). Knows nothing about HTTP; text is decoded as in text.py.
"""
from __future__ import annotations

import codecs
import copy
import functools
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from . import modes
from .drafters import PromptLookupDrafter
from .drafters.base import Draft
from .drafters.batched import DraftJob, SeqDraft, propose_all
from .engine import Completion, shadow_acceptance
from .errors import ContextOverflowError, DecodeError, InvalidParameterError
from .kinds import KINDS
from .policy import AutoPolicy, Hooks
from .policy.batch import BatchPolicy
from .sampling import OPENAI, SamplerConfig, Sampling
from .shaping import Shaper, Shaping
from .stats import GenerationStats, StepTimes
from .text import Piece, StopMatcher

BATCHED_DRAFTERS = ("none",) + tuple(k.name for k in KINDS.values() if k.batches)
DEFAULT_PREFILL_CHUNK = 128


def _source(pair) -> str | None:
    """What drafts for the pair (kinds.SOURCES), None without a drafter."""
    kind = KINDS.get(pair.drafter_kind)
    return kind.source if kind is not None else None


def batch_support(pair) -> str | None:
    """None when `pair` can run several sequences in one pass; otherwise why it cannot."""
    from .backend.sequences import batchable

    if pair.drafter_kind not in BATCHED_DRAFTERS:
        return f"the {pair.drafter_kind} drafter drafts one sequence at a time (batched: {', '.join(BATCHED_DRAFTERS)})"
    why = batchable(pair.target_ctx, pair.speculative)
    draft = pair.draft_ctx.model if pair.draft_ctx is not None and _source(pair) == "draft" else None
    if why is None and draft is not None and (draft.is_recurrent or draft.is_hybrid):
        why = (f"the draft model {draft.path.name} keeps a recurrent state, which llamaspec cannot roll back per "
               "sequence after one-token drafting steps")
    return why


@dataclass
class Slot:
    """One request on one sequence. `pieces`: what the last step emitted for it; `done` once it finished."""

    index: int
    seq: object
    draft: SeqDraft | None
    lookup: PromptLookupDrafter | None
    request_id: object = None
    pieces: list[Piece] = field(default_factory=list)
    done: bool = True
    stats: GenerationStats | None = None
    rows: modes.Rows = field(default_factory=modes.Rows)   # this step's target rows, as the slot's verifier reads them

    def start(self, prompt, common, max_tokens, sampling, shaper, stops, policy, verify) -> None:
        """A request whose first `common` prompt tokens the sequence holds already; the rest but the last (which the
        first verification decodes) are `todo`, decoded a chunk per step."""
        self.prompt, self.max_tokens, self.sampling, self.shaper = prompt, max_tokens, sampling, shaper
        self.policy, self.hooks, self.verify = policy, Hooks(policy), verify
        self.history, self.todo, self.last = list(prompt[:common]), list(prompt[common:-1]), prompt[-1]
        self.decoder, self.matcher = codecs.getincrementaldecoder("utf-8")(errors="replace"), StopMatcher(stops)
        self.pieces, self.done, self.n_out, self.tokens = [], False, 0, []
        self.from_model = False   # this step's draft (or probe) came from the draft model
        self.together = False     # the batch policy chose this step's draft length (policy/batch.py)
        self.t_start = time.perf_counter()

    @property
    def ready(self) -> bool:
        return not self.done and not self.todo


class BatchEngine:
    """`n_seq` slots over shared contexts of the pair's models (n_ctx tokens in all, n_ctx / n_seq per slot)."""

    def __init__(self, pair, n_seq: int, n_ctx: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        from .backend.sequences import shared_like

        why = batch_support(pair)
        if why is not None:
            raise InvalidParameterError(f"cannot decode several sequences at once: {why}", param="parallel")
        self.pair, self.n_seq, self.prefill_chunk = pair, n_seq, max(prefill_chunk, 1)
        target = pair.target_ctx
        # a recurrent target keeps one snapshot per token of the longest draft (rs_snapshots); none without drafts
        self.target = shared_like(target, n_seq, n_ctx, target.options.n_rs_seq if pair.speculative else 0)
        # the longest draft a slot may verify: a rejection must stay within the recurrent state's snapshots
        self.k_cap = self.target.n_rs_seq if self.target.recurrent else self.target.n_batch
        kind = pair.drafter_kind
        self.draft_ctx = self.mtp = None
        try:
            if _source(pair) == "draft":
                self.draft_ctx = shared_like(pair.draft_ctx, n_seq, self.target.n_ctx)
            elif _source(pair) == "mtp":   # the head over the shared target context, a sequence per slot
                from .drafters.batched_mtp import BatchedMTP

                self.mtp = BatchedMTP(self.target, pair.draft_ctx, n_seq)
        except BaseException:
            self.target.close()
            raise
        n_vocab = pair.n_vocab
        self.slots = [Slot(i, seq, SeqDraft(self.draft_ctx.sequences[i], n_vocab) if self.draft_ctx else
                           self.mtp.seqs[i] if self.mtp else None,
                           PromptLookupDrafter(n_vocab=n_vocab) if kind.startswith("lookup") else None)
                      for i, seq in enumerate(self.target.sequences)]
        self._scratch: dict[int, np.ndarray] = {}
        policy = pair.policy
        self.policy = BatchPolicy(policy.tuning if isinstance(policy, AutoPolicy) else None, pair.costs,
                                  free_drafts=_source(pair) == "prompt")
        self.times = StepTimes()

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
    def submit(self, prompt: Sequence[int], max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: Sequence[str] | str | None = None, shaping: Shaping | None = None,
               sampler_order: str = OPENAI, request_id=None) -> Slot | None:
        """Start a request (token ids) in a free slot (the one whose cache shares the longest prefix with it);
        None when every slot is busy. Raises what Pair.generate_tokens raises for a bad request."""
        tokens = self._check(prompt, max_tokens)
        free = [s for s in self.slots if s.done]
        if not free:
            return None
        # a recurrent state cannot go back without a checkpoint (and the engine keeps none): a slot's cache is
        # reused when the prompt extends its whole history (or goes back within its last decode's snapshots);
        # otherwise `reusable` is 0 and the sequence is cleared and the prompt prefilled in full
        slot = max(free, key=lambda s: s.seq.reusable(tokens[:-1]))
        common = slot.seq.reusable(tokens[:-1])
        if not slot.seq.keep(common):
            slot.seq.clear()
            common = 0
        cfg = SamplerConfig(temperature, top_k, top_p, min_p, seed, sampler_order)
        rng = np.random.default_rng(cfg.seed)
        sampling = None if cfg.greedy else Sampling(cfg, rng)
        shaper = Shaper(shaping, self.pair.n_vocab) if shaping is not None and shaping.active else None
        policy = copy.deepcopy(self.pair.policy)
        slot.start(tokens, common, max_tokens, sampling, shaper, [stop] if isinstance(stop, str) else list(stop or []),
                   policy, self._verifier(slot, sampling, shaper))
        slot.request_id = request_id
        slot.stats = GenerationStats(policy=policy.name if self.pair.speculative else "none",
                                     prompt_tokens=len(tokens), prompt_tokens_cached=common, finish_reason="cancelled")
        if self.pair.drafter is not None:
            slot.hooks.attach(self.pair.drafter.draft_cost, self.pair.costs)
        slot.hooks.new_request()
        self.policy.new_request(slot.index)
        if slot.draft is not None:
            slot.draft.begin(tokens[:-1], sampling)
        if slot.lookup is not None:
            slot.lookup.begin(slot.history, sampling, 0.0, False)
        return slot

    def _check(self, prompt, max_tokens) -> list[int]:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
        tokens = self.pair.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise InvalidParameterError("the prompt is empty", param="prompt")
        if len(tokens) >= self.n_ctx_seq:
            raise ContextOverflowError(f"the prompt is {len(tokens)} tokens but a slot holds {self.n_ctx_seq}; "
                                       "shorten the prompt or raise the context size (-c / n_ctx)")
        if max(tokens) >= self.pair.n_vocab or min(tokens) < 0:
            raise InvalidParameterError(f"prompt token ids must be in [0, {self.pair.n_vocab})", param="prompt")
        return tokens

    def _verifier(self, slot: Slot, sampling: Sampling | None, shaper: Shaper | None):
        if shaper is not None:
            return functools.partial(modes.shaped, slot.rows, sampling, shaper, self.pair.target.is_eog)
        if sampling is None:
            return functools.partial(modes.greedy, slot.rows)
        return functools.partial(modes.in_numpy, slot.rows, sampling, functools.partial(self._rows, slot.index))

    def _rows(self, index: int, n: int) -> np.ndarray:
        scratch = self._scratch.get(index)
        if scratch is None or scratch.shape[0] < n:
            scratch = self._scratch[index] = np.zeros((max(n, 9), self.pair.n_vocab), np.float32)
        return scratch

    def cancel(self, slot: Slot) -> None:
        """End a request now (its slot is free at once; its cache stays for a later prompt to reuse)."""
        if not slot.done:
            self._finish(slot, "cancelled")

    def _finish(self, slot: Slot, reason: str) -> None:
        if not slot.done:
            text, stopped = slot.matcher.push(slot.decoder.decode(b"", final=True))
            text += "" if stopped else slot.matcher.flush()
            if text and reason != "stop":
                slot.pieces.append(Piece(text, None, False))
            slot.stats.finish_reason = reason
            slot.stats.time_total = time.perf_counter() - slot.t_start
            slot.stats.end_reply()
            slot.done = True
            slot.todo = []

    # -- one round for every slot -----------------------------------------------------------------------------
    def step(self) -> list[Slot]:
        """Draft, verify, accept for every active slot, and one prefill chunk of a joining one. Returns the slots
        that took part (their `pieces` say what each emitted; `done` whether it finished)."""
        for slot in self.slots:
            slot.pieces = []
        active = [s for s in self.slots if s.ready]
        joining = next((s for s in self.slots if not s.done and s.todo), None)
        t0 = time.perf_counter()
        drafts, probes, rounds = self._draft(active, joining, self._draft_lens(active))
        t1 = time.perf_counter()

        runs = [self.target.Run(s.seq, [s.last] + drafts[s.index].tokens, "all") for s in active]
        if self.target.recurrent and runs:   # one length for all: each recurrent state can then undo its run
            width = max(len(r.tokens) for r in runs)   # (SharedContext.decode); the padding is never accepted
            for r in runs:
                r.tokens += [r.tokens[0]] * (width - len(r.tokens))
        room = self.target.n_batch - sum(len(r.tokens) for r in runs)
        if joining is not None and room > 0:
            chunk = joining.todo[:min(room, self.prefill_chunk if active else room)]
            runs.append(self.target.Run(joining.seq, chunk, "none"))
            joining.todo = joining.todo[len(chunk):]
            joining.history.extend(chunk)
        rows = self.target.decode(runs) if runs else []
        t2 = time.perf_counter()
        if runs and joining is None:   # a prompt chunk's rows cost less than verified ones: not learnt from
            self.policy.record_step(sum(len(r.tokens) for r in runs), t2 - t1, rounds, t1 - t0)
        for slot, slot_rows_ in zip(active, rows):
            slot.rows.rows = slot_rows_
            self._accept(slot, drafts[slot.index], probes.get(slot.index), t1 - t0, t2 - t1)
        if joining is not None and not joining.todo:
            joining.stats.time_prefill = time.perf_counter() - joining.t_start
        self.times.add(t1 - t0, t2 - t1, time.perf_counter() - t0)
        return active + ([joining] if joining is not None and joining not in active else [])

    def _draft_lens(self, active: list[Slot]) -> dict[int, tuple[int, bool]]:
        """Each active slot's draft length, and whether it takes a one-token shadow probe on a plain step. With two
        or more slots, the batch policy chooses for those whose policy is auto (policy/batch.py); alone, or with
        another policy, a slot's own policy chooses, as in Pair.generate. Clamped so that all slots' runs fit in
        one batch and a rejection stays within a recurrent target's snapshots (k_cap)."""
        share = max(self.target.n_batch // max(len(active), 1) - 1, 0)   # every slot's run fits in one batch
        rooms = [s.seq.n_ctx - len(s.history) - 1 for s in active]
        caps = [max(min(room, s.max_tokens - s.n_out - 1, share, self.k_cap), 0) for s, room in zip(active, rooms)]
        ks, together, probes = self.policy.lengths([s.index for s in active], [s.policy for s in active], caps,
                                                   self.target.recurrent)
        lens = {}
        for s, k, room, chosen, probe in zip(active, ks, rooms, together, probes):
            s.together = chosen
            due = probe if chosen else s.hooks.shadow_len() > 0
            lens[s.index] = k, not k and room > 0 and self.pair.speculative and due
        return lens

    def _draft(self, active: list[Slot], joining: Slot | None, lens: dict[int, tuple[int, bool]]):
        """Each active slot's draft (empty on a plain step) and, on a plain step the policy wants judged, a one-token
        shadow probe; lookup first where the pair has it, the draft model for all the rest in one set of decodes
        (with a chunk of the joining slot's prompt riding along); and the draft rounds (0 where one caught up first)."""
        drafts, probes, jobs, behind = {}, {}, [], False
        for s in active:
            k, probe = lens[s.index]
            found = drafts if k else probes
            ran, s.from_model, drafts[s.index] = s.from_model, False, Draft([])   # ran: its drafter ran last step
            if (k or probe) and s.lookup is not None:
                found[s.index] = s.lookup.propose(s.history, s.last, k or 1, s.policy.p_min)
            if (k or probe) and s.draft is not None and not found.get(s.index, Draft([])).tokens:
                jobs.append((s, found, DraftJob(s.draft, s.history, s.last, k or 1, s.policy.p_min)))
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

    def _accept(self, slot: Slot, draft: Draft, probe: Draft | None, draft_seconds: float, verify_seconds: float):
        history, last, drafted = slot.history, slot.last, draft.tokens
        n_accepted, next_token, target_probs = slot.verify(history, last, drafted, draft.probs if drafted else None)
        if not slot.seq.keep(len(history) + 1 + n_accepted):
            raise DecodeError(f"internal: slot {slot.index} could not drop its rejected draft tokens")
        if slot.from_model:
            slot.draft.accepted(n_accepted if drafted else 0)   # a probe's token is never kept
        history.append(last)
        history.extend(drafted[:n_accepted])
        slot.last = next_token
        chance = shadow_acceptance(probe, next_token, target_probs) if probe is not None else None
        slot.stats.shadow_probes += chance is not None
        if slot.together:   # the pass's timings are the batch's (record_step): the slot's policy learns acceptance
            self.policy.slot_step(slot.index, slot.policy, len(drafted), n_accepted, chance)
        else:
            if chance is not None:
                slot.hooks.shadow(chance, draft_seconds)
            slot.policy.update(len(drafted), n_accepted, draft_seconds, verify_seconds)
        slot.stats.record_step(len(drafted), n_accepted, draft_seconds, verify_seconds)
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
            return self._finish(slot, "stop")
        if slot.n_out >= slot.max_tokens:
            self._finish(slot, "length")

    def close(self) -> None:
        if self.draft_ctx is not None:
            self.draft_ctx.close()
        if self.mtp is not None:
            self.mtp.close()
        self.target.close()


def generate_batch(pair, prompts: Sequence[str | Sequence[int]], n_seq: int | None = None,
                   n_ctx: int | None = None, add_special: bool = True, **kwargs) -> list[Completion]:
    """Generate for every prompt, up to `n_seq` (default: all) at once, each as `pair.generate(prompt, **kwargs)`
    would; `kwargs` may be one dict for all or a list of dicts, one per prompt (a seed each, say). Pairs that
    cannot batch (batch_support) run the prompts one after another. n_ctx: the shared context's size (default:
    each sequence gets the pair's n_ctx)."""
    per_prompt = kwargs.pop("requests", None) or [kwargs] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise InvalidParameterError("requests: one dict per prompt", param="requests")
    if not prompts:
        return []
    if batch_support(pair) is not None:
        return [pair.generate(p, add_special=add_special, **kw) for p, kw in zip(prompts, per_prompt)]
    n_seq = min(n_seq or len(prompts), len(prompts))
    engine = pair.batch_engine(n_seq, n_ctx or pair.n_ctx * n_seq)
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
                if slot.done:
                    results[i] = Completion("".join(texts[i]), list(slot.tokens), slot.stats.finish_reason,
                                            slot.stats)
                    del running[i]
    finally:
        for slot in running.values():
            engine.cancel(slot)
    return results
