"""The one thread that touches the Pair: it takes jobs in arrival order, turns each prompt into token ids (chat
template and tokenizer run here, off the event loop, at a cost bounded by the context size: prompt.py), generates,
and sends events back to the event loop. At most `max_queue` jobs wait while one runs.

Testable without HTTP: give it a pair, a ServerMetrics and a loop, submit Jobs, read their `events`.
Knows nothing about HTTP or response formats; it speaks GenerationRequest in and (kind, value) events out.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import sys
import threading
import time
import traceback
from typing import Any

from ..chat_template import ChatTemplate
from ..errors import Cancelled, InvalidParameterError, LlamaspecError
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


class Worker:
    """Runs jobs one at a time, in arrival order; at most `max_queue` wait while one runs."""

    def __init__(self, pair, metrics: ServerMetrics, max_queue: int, template: ChatTemplate | None = None,
                 template_defaults: dict | None = None):
        self.pair, self.metrics, self.max_queue, self.template = pair, metrics, max_queue, template
        self.template_defaults = dict(template_defaults or {})   # the server's chat template variables (--reasoning)
        self.n_ctx = pair.n_ctx   # the context size served (the pair's as loaded)
        self.tokenizer = PromptTokenizer(pair.target, self.n_ctx)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued: dict[int, Job] = {}
        self._running: Job | None = None
        self._policies: list[tuple[Any, concurrent.futures.Future]] = []
        self._thread = threading.Thread(target=self._loop, name="llamaspec-worker", daemon=True)
        self._stopping = False

    # -- called from the event loop ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self._lock:
            return len(self._queued), int(self._running is not None)

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full or the worker is stopping."""
        with self._lock:
            busy = len(self._queued) + int(self._running is not None)
            if self._stopping or busy > self.max_queue:
                return False
            self._queued[id(job)] = job
        self._inbox.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """Drop a waiting job at once; a running one stops at its next token, its next tokenizer chunk, or within
        its prefill (interrupt.py). Harmless on a finished job."""
        job.cancelled.set()
        with self._lock:
            self._queued.pop(id(job), None)

    def set_policy(self, policy) -> concurrent.futures.Future:
        """Swap the draft policy between two engine steps; the future resolves once it is in place."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._policies.append((policy, done))
        self._inbox.put(_WAKE)
        return done

    def refuse_new(self) -> None:
        with self._lock:
            self._stopping = True

    def cancel_all(self) -> None:
        """Answer waiting jobs with 503 and stop the running one (it ends with what it has generated)."""
        with self._lock:
            self._stopping = True
            waiting, self._queued = list(self._queued.values()), {}
            if self._running is not None:
                self._running.cancelled.set()
        for job in waiting:
            job.cancelled.set()
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down", kind="server_error"))

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
            item = self._inbox.get()
            self._apply_policies()
            if item is _STOP:
                return
            if item is _WAKE:
                continue
            with self._lock:
                if self._queued.pop(id(item), None) is None:
                    continue  # cancelled while waiting
                self._running = item
            try:
                with cancel_when(item.cancelled):   # a long prefill stops within a graph node or a chunk
                    self._run(item)
            except Exception:  # never let one request take the worker down
                traceback.print_exc(file=sys.stderr)
                item.emit("error", APIError(500, "internal error", kind="server_error"))
            finally:
                with self._lock:
                    self._running = None

    def _apply_policies(self) -> None:
        with self._lock:
            pending, self._policies = self._policies, []
        for policy, done in pending:
            self.pair.set_policy(policy)
            done.set_result(self.pair.policy)

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

    def _begin(self, job: Job, start):
        """A job's set-up: its prompt's tokens and its shaping, given to `start(tokens, shaping)`; a refusal on the
        way (a bad prompt, a stop) is the job's error reply and None is returned. Otherwise (what `start` returned,
        the shaping), and the job's reply has begun."""
        req = job.request
        self.metrics.queue_wait.observe(time.monotonic() - job.submitted)
        try:
            shaping = request_shaping(req, self.pair.target, self.template)
            started = start(self.prompt_tokens(req, job.cancelled), shaping), shaping
        except Cancelled:  # the client left (nobody reads this) or the server is stopping
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down", kind="server_error"))
            return None
        except LlamaspecError as e:
            job.emit("error", e)
            return None
        except Exception:  # noqa: BLE001 - a job that left the queue is always answered; the others go on
            traceback.print_exc(file=sys.stderr)
            job.emit("error", APIError(500, "internal error while preparing the request", kind="server_error"))
            return None
        job.emit("start")
        return started

    def _run(self, job: Job) -> None:
        req = job.request
        begun = self._begin(job, lambda tokens, shaping: self.pair.stream(
            tokens, max_tokens=req.max_tokens or self.pair.n_ctx, stop=req.stop, add_special=False, shaping=shaping,
            **req.sampling))
        if begun is None:
            return
        pieces, shaping = begun
        error, emitted = None, False
        emit = reply_emitter(job, req.chat and self.prompt_opens_thinking)
        n_tokens = 0
        try:
            for piece in pieces:
                if shaping is not None and shaping.top_logprobs is not None and piece.token is not None:
                    job.emit("logprobs", self._logprob_entry(shaping.logprobs[n_tokens]))
                    n_tokens += 1
                if piece.text and req.chat:
                    emit(piece.text)
                elif piece.text:
                    job.emit("text", piece.text)
                emitted = emitted or bool(piece.text)
                self._apply_policies()
                if job.cancelled.is_set():
                    break
            if req.chat:
                emit(None)
        except Cancelled:  # stopped in a prefill or a catch-up: the reply ends as cut ("cancelled")
            if req.chat:
                emit(None)
            if not (req.stream or emitted):
                error = APIError(503, "the server is shutting down", code="shutting_down", kind="server_error")
        except Exception as e:  # a decode failure (or a bug): the engine has rolled its caches back already
            if not isinstance(e, LlamaspecError):
                traceback.print_exc(file=sys.stderr)
            error = e
        finally:
            pieces.close()
        stats = self.pair.last_stats
        self.metrics.record_generation(stats)
        if error is not None:
            job.emit("error", error)
        else:
            job.emit("done", stats)


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
