"""An OpenAI-compatible HTTP endpoint over one Pair (Starlette on uvicorn).

The Pair is not thread-safe, so one worker thread owns it and generates for one request at a time; the other
requests wait in a bounded queue (beyond it: 429). The HTTP side only parses a request, hands it to the worker,
and formats what comes back: plain JSON or server-sent events in OpenAI's chunk format. A client that goes away
cancels its generation (the engine restores its caches when its generator is closed).

Knows nothing about decoding: everything model-related goes through `Pair.stream`, `Pair.set_policy` and the
GGUF's chat template.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import math
import queue
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..chat_template import ChatTemplate
from ..errors import ContextOverflowError, InvalidParameterError, LlamaspecError
from .metrics import CONTENT_TYPE, ServerMetrics
from ..policy import POLICY_NAMES, make_policy

FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "cancelled": "length"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/admin/config")


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    api_key: str | None = None
    admin_key: str | None = None      # None: the api key guards admin routes too; neither: admin is off
    max_queue: int = 16               # requests allowed to wait while one generates
    max_body_bytes: int = 4 << 20
    policy_settings: dict = field(default_factory=dict)  # policy, draft_max, draft_min, draft_p_min at start


class APIError(Exception):
    """An HTTP error answered with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------------------------------
# Request parsing: JSON body -> GenerationRequest (every check names the offending field)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class GenerationRequest:
    prompt: str | list[int]
    prompt_field: str                 # "messages" or "prompt", for error messages
    add_special: bool
    max_tokens: int
    sampling: dict                    # temperature, top_p, top_k, min_p, seed
    stop: list[str]
    stream: bool
    include_usage: bool


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _optional(body: dict, name: str, check: Callable[[Any], bool], expected: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise _invalid(name, f"'{name}' must be {expected}, got {json.dumps(value)[:80]}")
    return value


# OpenAI fields llamaspec does not implement: accepted when they ask for the default behaviour, else 400.
_DEFAULT_ONLY = {
    "n": lambda v: _is_int(v) and v == 1,
    "best_of": lambda v: _is_int(v) and v == 1,
    "presence_penalty": lambda v: _is_number(v) and v == 0,
    "frequency_penalty": lambda v: _is_number(v) and v == 0,
    "logprobs": lambda v: v is False or (_is_int(v) and v == 0),
    "top_logprobs": lambda v: _is_int(v) and v == 0,
    "echo": lambda v: v is False,
    "logit_bias": lambda v: v == {},
    "suffix": lambda v: v == "",
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "function_call": lambda v: v == "none",
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
}


def _reject_unsupported(body: dict) -> None:
    for name, is_default in _DEFAULT_ONLY.items():
        value = body.get(name)
        if value is not None and not is_default(value):
            raise _invalid(name, f"'{name}' = {json.dumps(value)[:80]} is not supported by this server",
                           code="unsupported_parameter")


def _parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return [s for s in stop if s]
    raise _invalid("stop", "'stop' must be a string or a list of at most 16 strings")


def _parse_common(body: dict, prompt, prompt_field: str, add_special: bool) -> GenerationRequest:
    _reject_unsupported(body)
    _optional(body, "model", lambda v: isinstance(v, str), "a string")
    limits = [_optional(body, name, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
              for name in ("max_completion_tokens", "max_tokens")]
    max_tokens = next((n for n in limits if n is not None), None)  # the newer name wins when both are given
    sampling = {
        "temperature": float(_optional(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2,
                                       "a number in [0, 2]", 1.0)),
        "top_p": float(_optional(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)),
        "top_k": _optional(body, "top_k", lambda v: _is_int(v) and v >= 0, "an integer >= 0", 0),
        "min_p": float(_optional(body, "min_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]", 0.0)),
        "seed": _optional(body, "seed", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    }
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = _optional(options, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
    return GenerationRequest(prompt, prompt_field, add_special, max_tokens or 0, sampling, _parse_stop(body),
                             stream, include_usage)


def _message_text(index: int, content) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's content-part form)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _invalid(f"messages[{index}].content", "only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise _invalid(f"messages[{index}].content", "a message's 'content' must be a string or a list of text parts")


def parse_chat(body: dict, template: ChatTemplate) -> GenerationRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        code = "missing_required_parameter" if messages is None else "invalid_type"
        raise _invalid("messages", "'messages' must be a non-empty list of {role, content} objects", code=code)
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _invalid(f"messages[{i}]", "each message must be an object with a string 'role'")
        plain.append({"role": m["role"], "content": _message_text(i, m.get("content"))})
    try:
        text = template.render(plain)
    except LlamaspecError as e:
        raise _invalid("messages", str(e), code="chat_template_error")
    return _parse_common(body, text, "messages", template.add_special_for(text))


def parse_completion(body: dict) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return _parse_common(body, [int(t) for t in prompt], "prompt", False)
    if not isinstance(prompt, str):
        code = "missing_required_parameter" if prompt is None else "invalid_type"
        raise _invalid("prompt", "'prompt' must be a string (or a list of token ids); batches of several prompts "
                                 "are not supported", code=code)
    return _parse_common(body, prompt, "prompt", True)


def parse_policy_update(body: dict, current: dict) -> dict:
    """Merge an admin update into the current policy settings; types are checked here, ranges by make_policy."""
    unknown = sorted(set(body) - {"policy", "draft_max", "draft_min", "draft_p_min"})
    if unknown:
        raise _invalid(unknown[0], f"unknown setting '{unknown[0]}'; settable: policy, draft_max, draft_min, "
                                   "draft_p_min")
    _optional(body, "policy", lambda v: v in POLICY_NAMES, f"one of {', '.join(POLICY_NAMES)}")
    for name in ("draft_max", "draft_min"):
        _optional(body, name, lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    _optional(body, "draft_p_min", _is_number, "a number in [0, 1)")
    return {**current, **body}


# ---------------------------------------------------------------------------------------------------------------
# The worker: the one thread that touches the Pair
# ---------------------------------------------------------------------------------------------------------------
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

    def __init__(self, pair, metrics: ServerMetrics, max_queue: int):
        self.pair, self.metrics, self.max_queue = pair, metrics, max_queue
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
        """Drop a waiting job at once; a running one stops at its next token. Harmless on a finished job."""
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

    def _run(self, job: Job) -> None:
        req = job.request
        self.metrics.queue_wait.observe(time.monotonic() - job.submitted)
        try:
            pieces = self.pair.stream(req.prompt, max_tokens=req.max_tokens or self.pair.n_ctx, stop=req.stop,
                                      add_special=req.add_special, **req.sampling)
        except LlamaspecError as e:
            job.emit("error", e)
            return
        job.emit("start")
        error = None
        try:
            for piece in pieces:
                if piece.text:
                    job.emit("text", piece.text)
                self._apply_policies()
                if job.cancelled.is_set():
                    break
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


# ---------------------------------------------------------------------------------------------------------------
# Response formats
# ---------------------------------------------------------------------------------------------------------------
class _Format:
    """Chat and text completions differ only in object names and where the text goes."""

    def __init__(self, chat: bool, model_id: str):
        self.chat, self.model = chat, model_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def full(self, text: str, stats) -> dict:
        finish = FINISH_REASONS.get(stats.finish_reason, "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._envelope(self.object, [choice], usage=usage(stats), llamaspec=stats.to_dict())

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False, **extra) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope(self.chunk_object, [choice], **extra)

    def usage_chunk(self, stats) -> dict:
        return self._envelope(self.chunk_object, [], usage=usage(stats))


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.tokens_generated,
            "total_tokens": stats.prompt_tokens + stats.tokens_generated}


def _sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")


def _error_for(exc: BaseException, req: GenerationRequest) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), param=req.prompt_field, code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        first = str(exc).split(" ", 1)[0]
        return APIError(400, str(exc), param=first if first in SAMPLING_FIELDS else req.prompt_field,
                        code="invalid_value")
    if isinstance(exc, LlamaspecError):
        return APIError(500, str(exc), kind="server_error", code="generation_failed")
    return APIError(500, "internal error during generation", kind="server_error")


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _next_event(job: Job, disconnected: asyncio.Task):
    """The job's next event, or None once the client has gone away."""
    if not job.events.empty():
        return job.events.get_nowait()
    getter = asyncio.ensure_future(job.events.get())
    await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


class _Gone(Response):
    """The client disconnected before an answer: send nothing (counted as status 499)."""

    def __init__(self):
        pass

    async def __call__(self, scope, receive, send):
        return None


class _EventStream(Response):
    """Server-sent events from a started job; stops (and cancels the job) as soon as the client goes away."""

    media_type = "text/event-stream"

    def __init__(self, job: Job, fmt: _Format, disconnected: asyncio.Task, on_close: Callable[[], None]):
        self.job, self.fmt, self.disconnected, self.on_close = job, fmt, disconnected, on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        pump = asyncio.ensure_future(self._pump(send))
        try:
            await asyncio.wait({pump, self.disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pump.cancel()
            self.disconnected.cancel()
            self.on_close()
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            if not isinstance(pump.exception(), OSError):  # a write to a closed socket is a disconnect
                raise pump.exception()

    async def _pump(self, send) -> None:
        fmt, req = self.fmt, self.job.request
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        usage_field = {"usage": None} if req.include_usage else {}
        if fmt.chat:  # OpenAI's first chat chunk carries the role
            await send(self._body(fmt.chunk("", first=True, **usage_field)))
        while True:
            kind, value = await self.job.events.get()
            if kind == "text":
                await send(self._body(fmt.chunk(value, **usage_field)))
            elif kind == "done":
                finish = FINISH_REASONS.get(value.finish_reason, "stop")
                await send(self._body(fmt.chunk(None, finish, llamaspec=value.to_dict(), **usage_field)))
                if req.include_usage:
                    await send(self._body(fmt.usage_chunk(value)))
                break
            elif kind == "error":
                await send(self._body(_error_for(value, req).body()))
                break
        await send(self._body("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _body(data) -> dict:
        return {"type": "http.response.body", "body": _sse(data), "more_body": True}


# ---------------------------------------------------------------------------------------------------------------
# The application
# ---------------------------------------------------------------------------------------------------------------
class Service:
    """The pair, its worker, its metrics, and the HTTP handlers."""

    def __init__(self, pair, config: ServerConfig):
        self.pair, self.config = pair, config
        self.started = int(time.time())
        self.template_error: str | None = None
        try:
            self.template = ChatTemplate.from_model_info(pair.target.info)
        except LlamaspecError as e:
            self.template, self.template_error = None, str(e)
        self.metrics = ServerMetrics(self._draft_state, lambda: self.worker.depth)
        self.worker = Worker(pair, self.metrics, config.max_queue)
        self.policy_settings = dict(config.policy_settings)
        self.stopping = False

    def _draft_state(self) -> dict[str, float]:
        if not self.pair.speculative:
            return {"none": 0}
        policy = self.pair.policy
        return {policy.name: policy.next_draft_len()}

    # -- plumbing ----------------------------------------------------------------------------------------------
    def authorize(self, request: Request, admin: bool = False) -> None:
        key = (self.config.admin_key or self.config.api_key) if admin else self.config.api_key
        if admin and key is None:
            raise APIError(403, "admin routes are off: start the server with --admin-key (or --api-key)",
                           code="admin_disabled", kind="permission_error")
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", kind="authentication_error")

    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
        too_big = APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the body is not valid JSON ({str(e)[:100]})", code="invalid_json")
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        return body

    # -- generation ---------------------------------------------------------------------------------------------
    async def generate(self, request: Request, req: GenerationRequest, fmt: _Format) -> Response:
        """Queue the request, wait for its turn, answer with JSON or an event stream; a client that leaves (while
        waiting or generating) cancels its job."""
        job = Job(req, asyncio.get_running_loop())
        if not self.worker.submit(job):
            if self.stopping:
                raise APIError(503, "the server is shutting down", code="shutting_down", kind="server_error")
            raise APIError(429, f"the server is busy ({self.config.max_queue} requests already waiting); retry "
                                "shortly", code="queue_full", kind="rate_limit_error", headers={"Retry-After": "1"})
        disconnected = asyncio.ensure_future(_wait_disconnect(request.receive))
        handed_over = False  # to the event stream, which cleans up itself
        try:
            first = await _next_event(job, disconnected)
            if first is None:
                return _Gone()
            if first[0] == "error":
                raise _error_for(first[1], req)
            if req.stream:
                handed_over = True
                return _EventStream(job, fmt, disconnected, lambda: self.worker.cancel(job))
            return await self._collect(job, disconnected, fmt)
        finally:
            if not handed_over:
                disconnected.cancel()
                self.worker.cancel(job)

    @staticmethod
    async def _collect(job: Job, disconnected: asyncio.Task, fmt: _Format) -> Response:
        texts = []
        while True:
            event = await _next_event(job, disconnected)
            if event is None:
                return _Gone()
            kind, value = event
            if kind == "text":
                texts.append(value)
            elif kind == "error":
                raise _error_for(value, job.request)
            else:
                return JSONResponse(fmt.full("".join(texts), value))

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        body = await self.read_json(request)
        if self.template is None:
            raise APIError(500, f"this model's chat template is unusable: {self.template_error}",
                           code="chat_template_error", kind="server_error")
        return await self.generate(request, parse_chat(body, self.template), _Format(True, self.config.model_id))

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        body = await self.read_json(request)
        return await self.generate(request, parse_completion(body), _Format(False, self.config.model_id))

    # -- information ------------------------------------------------------------------------------------------
    def model_card(self) -> dict:
        pair = self.pair
        return {"id": self.config.model_id, "object": "model", "created": self.started, "owned_by": "llamaspec",
                "llamaspec": {"target": pair.target.path.name,
                              "draft": pair.draft.path.name if pair.draft is not None else None,
                              "drafter": pair.drafter_kind, "n_ctx": pair.n_ctx, **self.policy_view()}}

    def policy_view(self) -> dict:
        return {"policy": self.pair.policy.describe() if self.pair.speculative else None,
                "settings": self.policy_settings}

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        if request.path_params["model"] != self.config.model_id:
            raise APIError(404, f"model '{request.path_params['model']}' is not served here", param="model",
                           code="model_not_found")
        return JSONResponse(self.model_card())

    async def health(self, request: Request) -> Response:
        waiting, running = self.worker.depth
        status = "stopping" if self.stopping else "ok"
        return JSONResponse({"status": status, "queue_depth": waiting, "running": running},
                            status_code=503 if self.stopping else 200)

    async def metrics_text(self, request: Request) -> Response:
        self.authorize(request)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # -- admin ----------------------------------------------------------------------------------------------
    async def get_config(self, request: Request) -> Response:
        self.authorize(request, admin=True)
        return JSONResponse(self.policy_view())

    async def patch_config(self, request: Request) -> Response:
        self.authorize(request, admin=True)
        body = await self.read_json(request)
        if not self.pair.speculative:
            raise APIError(400, "this server runs without a drafter: there is no draft policy to change",
                           code="no_drafter")
        settings = parse_policy_update(body, self.policy_settings)
        try:
            policy = make_policy(settings.get("policy") or "auto", k=settings.get("draft_max"),
                                 k_min=settings.get("draft_min"), p_min=settings.get("draft_p_min"))
        except InvalidParameterError as e:
            raise _invalid(None, str(e))
        await asyncio.wrap_future(self.worker.set_policy(policy))
        self.policy_settings = settings
        return JSONResponse(self.policy_view())

    # -- lifecycle --------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.worker.start()
        try:
            yield
        finally:
            self.stop()

    def begin_shutdown(self, grace: float) -> None:
        """A stop signal arrived: take no new requests; in-flight ones get `grace` seconds, then are cancelled."""
        if self.stopping:
            return
        self.stopping = True
        self.worker.refuse_new()
        timer = threading.Timer(grace, self.worker.cancel_all)
        timer.daemon = True
        timer.start()

    def stop(self, timeout: float = 10.0) -> bool:
        self.stopping = True
        return self.worker.stop(timeout)


class _CountRequests:
    """ASGI middleware: llamaspec_requests_total{endpoint, status}; 499 when the client left before an answer."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 0}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status["code"] = status["code"] or 500
            raise
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
            self.metrics.requests.inc(endpoint=endpoint, status=str(status["code"] or 499))


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=None,
                    kind=kind).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    return APIError(500, "internal server error", kind="server_error").response()


def create_app(pair, config: ServerConfig) -> Starlette:
    """The ASGI app serving `pair`; `app.state.service` is its Service."""
    service = Service(pair, config)
    routes = [
        Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
        Route("/v1/completions", service.completions, methods=["POST"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
        Route("/admin/config", service.get_config, methods=["GET"]),
        Route("/admin/config", service.patch_config, methods=["PATCH"]),
    ]
    app = Starlette(routes=routes, lifespan=service.lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                        Exception: _internal_error})
    app.add_middleware(_CountRequests, metrics=service.metrics)
    app.state.service = service
    return app


# ---------------------------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------------------------
def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port); binding first lets the caller print the real port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that do, and with Nagle on a
    # keep-alive client waits ~40 ms (a delayed ACK) for every response body
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(app: Starlette, sock: socket.socket, shutdown_timeout: float = 10.0, access_log: bool = False,
          on_ready: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get `shutdown_timeout` seconds to finish, then are cancelled
    (streams end with a finish chunk and [DONE]). Returns normally after a signal (the caller exits 0).
    `on_ready` runs once requests are being accepted and the signal handlers are in place."""
    import signal

    import uvicorn

    service: Service = app.state.service

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and not self.should_exit:
                on_ready()

        def handle_exit(self, sig, frame):
            service.begin_shutdown(shutdown_timeout)
            super().handle_exit(sig, frame)

    # uvicorn's own deadline is only a backstop: our cancellation ends requests cleanly before it
    config = uvicorn.Config(app, log_level="info" if access_log else "warning", access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + 5.0, lifespan="on")
    # uvicorn re-raises the signal that stopped it once it has shut down, through the handlers it found: make
    # those no-ops so that a signal ends the process normally.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _Server(config).run(sockets=[sock])
