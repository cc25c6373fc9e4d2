"""Serving several requests at once (`serve --parallel N`): the worker thread owns a BatchEngine of N slots
(batch.py) and, between two engine steps, admits waiting jobs into free slots, sends each slot's new text to its job,
and frees the slot of a job that finished or was cancelled (a client that left frees its slot before the next
step). A new request's prompt is decoded a bounded chunk per step beside the others' verifications. At most
`max_queue` jobs wait beyond the N running; more get 429, as with one slot.

The same Job / event contract as worker.py: ("start"), ("text" | "reasoning" | "logprobs", ...), ("done", stats) or
("error", exception). Knows nothing about HTTP.
"""
from __future__ import annotations

import collections
import queue
import sys
import traceback
from dataclasses import dataclass

from ..errors import LlamaspecError
from ..kinds import KINDS
from .apierror import APIError
from .worker import _STOP, _WAKE, Job, Worker, reply_emitter


def shrink_own_contexts(pair) -> None:
    """Remake the pair's own target and draft-model contexts with room for one batch (n_ctx = their n_batch),
    freeing the rest of their KV caches, for a pair whose requests all run in a BatchEngine's shared contexts
    (serve --parallel): those then hold the only full-size caches. Call it before the engine is made, so the
    full-size caches are never held twice. The pair still generates alone (within one batch of tokens); its
    policy, measured costs, batch size and settings stay. An MTP head's context, made over the target's, is freed
    first and made again over the target's new one (at its size)."""
    kind = KINDS.get(pair.drafter_kind)
    head = pair.draft_ctx if kind is not None and kind.source == "mtp" else None
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


@dataclass
class _Running:
    job: Job
    slot: object
    emit: object        # reply_emitter for chat replies, else None
    shaping: object
    n_tokens: int = 0   # tokens whose log-probabilities were sent


class SlotWorker(Worker):
    """Runs up to `parallel` jobs together in one BatchEngine; at most `max_queue` wait beyond them."""

    def __init__(self, pair, metrics, max_queue: int, template=None, template_defaults: dict | None = None,
                 parallel: int = 2):
        super().__init__(pair, metrics, max_queue, template, template_defaults)
        self.parallel = parallel
        shrink_own_contexts(pair)   # first: the slots' shared caches are then the only full-size ones
        self.engine = pair.batch_engine(parallel, self.n_ctx)   # the pair's context size, shared by the slots
        # a prompt is measured against the slot it will run in, before it is tokenized whole on this shared thread
        self.tokenizer.n_ctx, self.tokenizer.holder = self.engine.n_ctx_seq, "a slot (n_ctx / --parallel)"
        self._running_jobs: dict[int, _Running] = {}          # slot index -> its job
        self._admissible: collections.deque[Job] = collections.deque()   # taken from the inbox, not yet in a slot

    @property
    def depth(self) -> tuple[int, int]:
        with self._lock:
            return len(self._queued), len(self._running_jobs)

    def submit(self, job: Job) -> bool:
        with self._lock:
            if self._stopping or len(self._queued) + len(self._running_jobs) >= self.max_queue + self.parallel:
                return False
            self._queued[id(job)] = job
        self._inbox.put(job)
        return True

    def cancel_all(self) -> None:
        with self._lock:
            running = [r.job for r in self._running_jobs.values()]
        for job in running:
            job.cancelled.set()
        super().cancel_all()

    # -- the worker thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            items = [self._inbox.get()] if not (self.engine.busy or self._admissible) else []
            while True:   # whatever else arrived meanwhile
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._apply_policies()
            for item in items:
                if item is _STOP:
                    self._end_all()
                    return
                if item is not _WAKE:
                    self._admissible.append(item)
            try:
                self._round()
            except Exception:   # never let one round take the worker down: its requests end with an error
                traceback.print_exc(file=sys.stderr)
                self._end_all(APIError(500, "internal error", kind="server_error"))

    def _round(self) -> None:
        while self._admissible and self.engine.free:
            self._admit(self._admissible.popleft())
        for index, running in list(self._running_jobs.items()):
            if running.job.cancelled.is_set():
                self.engine.cancel(running.slot)
                self._send(running)
        if not self.engine.busy:
            return
        for slot in self.engine.step():
            running = self._running_jobs.get(slot.index)
            if running is not None:
                self._send(running)

    def _admit(self, job: Job) -> None:
        with self._lock:
            if self._queued.pop(id(job), None) is None:
                return   # cancelled while waiting
        req = job.request
        begun = self._begin(job, lambda tokens, shaping: self.engine.submit(
            tokens, max_tokens=req.max_tokens or self.engine.n_ctx_seq, stop=req.stop, shaping=shaping,
            **req.sampling))
        if begun is None:
            return
        slot, shaping = begun
        opens_thinking = req.chat and self.prompt_opens_thinking
        with self._lock:
            self._running_jobs[slot.index] = _Running(job, slot, reply_emitter(job, opens_thinking)
                                                      if req.chat else None, shaping)

    def _send(self, running: _Running) -> None:
        """The slot's new pieces to its job; when the slot is done, the job's end."""
        job, slot, shaping = running.job, running.slot, running.shaping
        for piece in slot.pieces:
            if shaping is not None and shaping.top_logprobs is not None and piece.token is not None:
                job.emit("logprobs", self._logprob_entry(shaping.logprobs[running.n_tokens]))
                running.n_tokens += 1
            if piece.text and running.emit is not None:
                running.emit(piece.text)
            elif piece.text:
                job.emit("text", piece.text)
        slot.pieces = []
        if slot.done:
            if running.emit is not None:
                running.emit(None)
            with self._lock:
                self._running_jobs.pop(slot.index, None)
            self.metrics.record_generation(slot.stats)
            if slot.error is None:
                job.emit("done", slot.stats)
                return
            if not isinstance(slot.error, LlamaspecError):   # a bug: worth its traceback in the log
                traceback.print_exception(slot.error, file=sys.stderr)
            job.emit("error", slot.error)

    def _end_all(self, error: Exception | None = None) -> None:
        """Cut every running job (each ends with what it has, or with `error`); waiting ones were answered by
        cancel_all."""
        with self._lock:
            running = list(self._running_jobs.values())
        for r in running:
            self.engine.cancel(r.slot)
            if error is None:
                self._send(r)
            else:
                with self._lock:
                    self._running_jobs.pop(r.slot.index, None)
                r.job.emit("error", error)
