"""The one thread that touches the Pair: it takes jobs in arrival order, turns each prompt into token ids (chat
template and tokenizer run here, off the event loop, at a cost bounded by the context size: prompt.py), runs them in
the pair's engine (slots.py) and sends events back to the event loop. `--parallel 1` (the default) is one slot of the
pair's own contexts; N is N slots over shared contexts, one target pass for all of them, a joining prompt decoded a
chunk per step beside the others. Between two engine steps the worker admits waiting jobs into free slots, sends each
slot's new text to its job, and frees the slot of a job that finished or whose client left. Each job is in one state:
waiting (in the queue), prefilling (its slot reads the prompt), generating, done; a cancelled one ends at the next
step, a long prefill of the pair's own context within a graph node or a chunk (interrupt.py). At most `max_queue`
jobs wait beyond the running ones; more get 429.

Testable without HTTP: give it a pair, a ServerMetrics and a loop, submit Jobs, read their `events`.
Knows nothing about HTTP or response formats; it speaks GenerationRequest in and (kind, value) events out.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from ..chat_template import ChatTemplate
from ..errors import Cancelled, InvalidParameterError, LlamaspecError
from ..targets import batch_support, shrink_own_contexts
from ..interrupt import cancel_when
from ..shaping import Penalties, Shaping
from .apierror import APIError
from .metrics import ServerMetrics
from ..reasoning import ThinkSplitter, opens_thinking
from .prompt import PromptTokenizer, chat_segments
from .tools import family_of, forced_call_gbnf, forced_call_schema
from .validation import GenerationRequest


class Job:
    """One request on its way through the worker; events go back to the event loop as (kind, value):
    ("start", None), ("text", str)..., then ("done", GenerationStats) or ("error", exception)."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.monotonic()
        self._loop = loop

    def emit(self, kind: str, value=None) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has stopped: nobody is listening any more
            self.cancelled.set()


_WAKE = object()
_STOP = object()


@dataclass
class _Running:
    """A job in a slot."""

    job: Job
    slot: object
    emit: object        # reply_emitter for chat replies, else None
    shaping: object
    n_tokens: int = 0   # tokens whose log-probabilities were sent
    emitted: bool = False


class Worker:
    """Runs up to `parallel` jobs together in the pair's engine; at most `max_queue` wait beyond them. A pair that
    cannot share a pass (targets.batch_support) serves one at a time; `parallel_note` says why."""

    def __init__(self, pair, metrics: ServerMetrics, max_queue: int, template: ChatTemplate | None = None,
                 template_defaults: dict | None = None, parallel: int = 1):
        self.pair, self.metrics, self.max_queue, self.template = pair, metrics, max_queue, template
        self.template_defaults = dict(template_defaults or {})   # the server's chat template variables (--reasoning)
        self.n_ctx = pair.n_ctx   # the context size served (the pair's as loaded; N slots share it)
        why = batch_support(pair) if parallel > 1 else None
        self.parallel_note = None if why is None else \
            f"--parallel {parallel} unavailable ({why}): serving one request at a time"
        self.parallel = parallel if why is None else 1
        if self.parallel > 1:
            shrink_own_contexts(pair)   # first: the slots' shared caches are then the only full-size ones
        self.engine = pair.engine(self.parallel, self.n_ctx)
        # a prompt is measured against the slot it will run in, before it is tokenized whole on this shared thread
        self.tokenizer = PromptTokenizer(pair.target, self.engine.n_ctx_seq)
        if self.parallel > 1:
            self.tokenizer.holder = "a slot (n_ctx / --parallel)"
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued: dict[int, Job] = {}
        self._running_jobs: dict[int, _Running] = {}                     # slot index -> its job
        self._admissible: collections.deque[Job] = collections.deque()   # taken from the inbox, not yet in a slot
        self._draftings: list[tuple[Any, concurrent.futures.Future]] = []
        self._thread = threading.Thread(target=self._loop, name="llamaspec-worker", daemon=True)
        self._stopping = False

    # -- called from the event loop ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self._lock:
            return len(self._queued), len(self._running_jobs)

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full or the worker is stopping."""
        with self._lock:
            if self._stopping or len(self._queued) + len(self._running_jobs) >= self.max_queue + self.parallel:
                return False
            self._queued[id(job)] = job
        self._inbox.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """Drop a waiting job at once; a running one stops at the next step, or within its prefill. Harmless on a
        finished job."""
        job.cancelled.set()
        with self._lock:
            self._queued.pop(id(job), None)
        self._inbox.put(_WAKE)

    def set_drafting(self, drafting) -> concurrent.futures.Future:
        """Change the pair's drafting settings (Pair.set_drafting) between two engine steps (requests that start from
        then on take the new policy); the future resolves to the policy once it is in place, or to the error that
        refused the settings."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._draftings.append((drafting, done))
        self._inbox.put(_WAKE)
        return done

    def refuse_new(self) -> None:
        with self._lock:
            self._stopping = True

    def cancel_all(self) -> None:
        """Answer waiting jobs with 503 and stop the running ones (each ends with what it has generated)."""
        with self._lock:
            self._stopping = True
            waiting, self._queued = list(self._queued.values()), {}
            running = [r.job for r in self._running_jobs.values()]
        for job in running:
            job.cancelled.set()
        for job in waiting:
            job.cancelled.set()
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down", kind="server_error"))
        self._inbox.put(_WAKE)

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel every job and end the thread; False if it did not end within `timeout`."""
        self.cancel_all()
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the worker thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            items = [self._inbox.get()] if not (self.engine.busy or self._admissible) else []
            while True:   # whatever else arrived meanwhile
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._apply_draftings()
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

    def _apply_draftings(self) -> None:
        with self._lock:
            pending, self._draftings = self._draftings, []
        for drafting, done in pending:
            try:
                self.pair.set_drafting(drafting)
            except Exception as e:   # settings the policy refuses: the caller answers with the error
                done.set_exception(e)
            else:
                done.set_result(self.pair.policy)

    def _round(self) -> None:
        while self._admissible and self.engine.free:
            self._admit(self._admissible.popleft())
        for running in list(self._running_jobs.values()):
            if running.job.cancelled.is_set():
                self.engine.cancel(running.slot)
                self._send(running)
        if not self.engine.busy:
            return
        # a prefill of the pair's own context decodes the whole prompt in one step: it stops when its job does
        joining = next((r for r in self._running_jobs.values() if not r.slot.done and not r.slot.prefilled), None)
        try:
            with cancel_when(joining.job.cancelled if joining is not None else None):
                slots = self.engine.step()
        except Cancelled:   # that prefill stopped (its client left, or the server is stopping)
            self.engine.cancel(joining.slot)
            self._send(joining)
            return
        for slot in slots:
            running = self._running_jobs.get(slot.index)
            if running is not None:
                self._send(running)

    prompt_opens_thinking = False   # the last chat prompt left a <think> block open

    def prompt_tokens(self, req: GenerationRequest, cancelled: threading.Event | None = None) -> list[int]:
        """The request's prompt as token ids; raises LlamaspecError (a template failure, a prompt that cannot fit)
        or Cancelled."""
        if isinstance(req.prompt, str):
            return self.tokenizer.tokenize([(req.prompt, True)], add_special=True, cancelled=cancelled)
        if req.chat:
            template_vars = {**self.template_defaults, **req.template_vars}   # a request's own win
            if req.extras.tools and req.extras.tool_choice != "none":
                template_vars["tools"] = req.extras.tools
            segments, add_bos = chat_segments(self.template, req.prompt, self.tokenizer, template_vars)
            self.prompt_opens_thinking = opens_thinking("".join(text for text, _ in segments))
            return self.tokenizer.tokenize(segments, add_special=add_bos, cancelled=cancelled)
        return req.prompt

    def _logprob_entry(self, x) -> dict:
        """OpenAI's chat form of one token's log-probability: its text, bytes and the best alternatives."""
        def entry(token: int, logprob: float) -> dict:
            data = self.pair.target.token_bytes(token)
            return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}
        return {**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}

    def _admit(self, job: Job) -> None:
        """A job's set-up: its prompt's tokens and its shaping, then a slot; a refusal on the way (a bad prompt, a
        stop, any failure) is the job's error reply: a job that leaves the queue is always answered."""
        with self._lock:
            if self._queued.pop(id(job), None) is None:
                return   # cancelled while waiting
        req = job.request
        self.metrics.queue_wait.observe(time.monotonic() - job.submitted)
        try:
            with cancel_when(job.cancelled):
                shaping = request_shaping(req, self.pair.target, self.template)
                tokens = self.prompt_tokens(req, job.cancelled)
            slot = self.engine.submit(tokens, max_tokens=req.max_tokens or self.engine.n_ctx_seq, stop=req.stop,
                                      shaping=shaping, **req.sampling)
        except Cancelled:  # the client left (nobody reads this) or the server is stopping
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down", kind="server_error"))
            return
        except LlamaspecError as e:
            job.emit("error", e)
            return
        except Exception:  # noqa: BLE001 - a job that left the queue is always answered; the others go on
            traceback.print_exc(file=sys.stderr)
            job.emit("error", APIError(500, "internal error while preparing the request", kind="server_error"))
            return
        job.emit("start")
        opens_thinking = req.chat and self.prompt_opens_thinking
        with self._lock:
            self._running_jobs[slot.index] = _Running(job, slot, reply_emitter(job, opens_thinking)
                                                      if req.chat else None, shaping)

    def _send(self, running: _Running) -> None:
        """The slot's new pieces to its job; when the slot is done, the job's end: its stats, or its error."""
        job, slot, shaping = running.job, running.slot, running.shaping
        for piece in slot.pieces:
            if shaping is not None and shaping.top_logprobs is not None and piece.token is not None:
                job.emit("logprobs", self._logprob_entry(shaping.logprobs[running.n_tokens]))
                running.n_tokens += 1
            if piece.text and running.emit is not None:
                running.emit(piece.text)
            elif piece.text:
                job.emit("text", piece.text)
            running.emitted = running.emitted or bool(piece.text)
        slot.pieces = []
        if not slot.done:
            return
        if running.emit is not None:
            running.emit(None)
        with self._lock:
            self._running_jobs.pop(slot.index, None)
        self.metrics.record_generation(slot.stats)
        if slot.error is not None:
            if not isinstance(slot.error, LlamaspecError):   # a bug: worth its traceback in the log
                traceback.print_exception(slot.error, file=sys.stderr)
            job.emit("error", slot.error)
        elif slot.stats.finish_reason == "cancelled" and not (job.request.stream or running.emitted):
            # stopped before a word (the server is stopping; a client that left reads nothing)
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down", kind="server_error"))
        else:
            job.emit("done", slot.stats)

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


def reply_emitter(job: Job, starts_inside: bool):
    """emit(text) sends a chat reply's text as ("reasoning", str) inside <think>...</think> and ("text", str)
    after it, tags removed; emit(None) sends what a cut tag held back."""
    splitter = ThinkSplitter(starts_inside)

    def emit(text: str | None) -> None:
        for part in (splitter.feed(text) if text is not None else splitter.flush()):
            job.emit("reasoning" if part.kind == "reasoning" else "text", part.text)

    return emit


def request_shaping(req: GenerationRequest, model, template: ChatTemplate | None) -> Shaping | None:
    """The request's grammar (GBNF, a JSON schema, or a forced tool call), penalties, logit bias and
    log-probabilities, as shaping.py applies them; None when it asks for none."""
    from ..backend.grammar import Grammar, json_schema_gbnf   # the server's one use of the backend: grammars

    x = req.extras
    gbnf, param = x.grammar, "grammar"
    if x.json_schema is not None:
        gbnf, param = json_schema_gbnf(x.json_schema, x.schema_param), x.schema_param
    if req.chat and x.tool_choice not in ("auto", "none"):
        family = family_of(template.source if template is not None else "")
        gbnf, param = forced_call_gbnf(json_schema_gbnf(forced_call_schema(x.tools, x.tool_choice, family), "tools"),
                                       family), "tool_choice"
    bad = [t for t in x.logit_bias if t >= model.n_vocab]
    if bad:
        raise InvalidParameterError(f"'logit_bias' names token {bad[0]}, beyond the vocabulary ({model.n_vocab})",
                                    param="logit_bias")
    shaping = Shaping(grammar=Grammar.compile(model, gbnf, param) if gbnf is not None else None,
                      penalties=Penalties(**x.penalties) if x.penalties else None,
                      top_logprobs=x.top_logprobs, logit_bias=dict(x.logit_bias))
    return shaping if shaping.active else None
