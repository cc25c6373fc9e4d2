"""An OpenAI-compatible HTTP endpoint over one Pair (Starlette on uvicorn): the routes, the Service behind them,
and the code that binds a socket and runs uvicorn.

A request is read (JSON only, within a size and a time limit), validated (validation.py), queued for the one
worker thread that owns the Pair (worker.py; beyond `max_queue` waiting: 429), and answered as JSON or server-sent
events (formats.py). A client that goes away cancels its job. guard.py checks Host and Origin before any route.

Knows nothing about decoding or tokenizing: the worker does both; this module never touches the Pair's engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import sys
import threading
import time
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..chat_template import ChatTemplate
from ..errors import InvalidParameterError, LlamaspecError
from ..reasoning import template_kwargs
from .apierror import APIError, invalid
from .formats import EventStream, Gone, ResponseFormat, error_for, next_event, wait_disconnect
from .guard import CountRequests, Guard, cors_options
from .metrics import CONTENT_TYPE, ServerMetrics
from .openapi import openapi_description
from .tools import family_of
from .validation import GenerationRequest, parse_chat, parse_completion, parse_policy_update
from .worker import Job, Worker


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    api_key: str | None = None
    admin_key: str | None = None      # None: the api key guards admin routes too; neither: admin is off
    max_queue: int = 16               # requests allowed to wait while one generates (while `parallel` do)
    parallel: int = 1                 # requests generated together (slots.py); 1: one at a time (worker.py)
    max_body_bytes: int = 4 << 20
    read_timeout: float = 30.0        # seconds for a request's headers, and again for its body
    bound_host: str = "127.0.0.1"     # the --host, accepted in Host headers along with IPs and localhost names
    allowed_hosts: tuple[str, ...] = ()   # more Host names ('*': any)
    cors_origins: tuple[str, ...] = ()    # browser origins allowed to call ('*': any)
    reasoning: str = "auto"           # thinking on/off for every chat request (enable_thinking); auto: the template's;
                                      # a request's chat_template_kwargs.enable_thinking overrides it

    def __post_init__(self):
        check_keys(self.api_key, self.admin_key)


def check_keys(api_key: str | None, admin_key: str | None) -> None:
    """Refuse an empty key (a script passing an unset variable): it would open admin routes to 'Bearer '."""
    for flag, key in (("--api-key", api_key), ("--admin-key", admin_key)):
        if key is not None and not key.strip():
            raise InvalidParameterError(f"{flag} is empty; give a key, or leave the option out for no key",
                                        param=flag.lstrip("-").replace("-", "_"))


class _ClientGone(Exception):
    """The client hung up while its request was being read."""


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
        self.parallel_note: str | None = None   # why --parallel fell back to one request at a time
        self.worker = self._make_worker(pair, config)
        self.stopping = False

    def _make_worker(self, pair, config: ServerConfig) -> Worker:
        worker = Worker(pair, self.metrics, config.max_queue, self.template, template_kwargs(config.reasoning),
                        parallel=config.parallel)
        self.parallel_note = worker.parallel_note   # why --parallel fell back to one request at a time
        return worker

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
        """The body as a JSON object: application/json only (415), within max_body_bytes (413) and read_timeout
        (408); a client that hangs up meanwhile raises _ClientGone."""
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, f"the body must be JSON sent as 'Content-Type: application/json' (got "
                                f"'{media_type[:60] or 'none'}')", code="unsupported_media_type")
        limit = self.config.max_body_bytes
        too_big = APIError(413, f"request body larger than {limit} bytes", code="request_too_large",
                           headers={"Connection": "close"})
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            data = await asyncio.wait_for(read(), self.config.read_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.config.read_timeout:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise _ClientGone() from None
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the body is not valid JSON ({str(e)[:100]})", code="invalid_json")
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        return body

    # -- generation ---------------------------------------------------------------------------------------------
    async def generate(self, request: Request, req: GenerationRequest, fmt: ResponseFormat) -> Response:
        """Queue the request, wait for its turn, answer with JSON or an event stream; a client that leaves (while
        waiting or generating) cancels its job."""
        job = Job(req, asyncio.get_running_loop())
        if not self.worker.submit(job):
            if self.stopping:
                raise APIError(503, "the server is shutting down", code="shutting_down", kind="server_error")
            raise APIError(429, f"the server is busy ({self.config.max_queue} requests already waiting); retry "
                                "shortly", code="queue_full", kind="rate_limit_error", headers={"Retry-After": "1"})
        disconnected = asyncio.ensure_future(wait_disconnect(request.receive))
        handed_over = False  # to the event stream, which cleans up itself
        try:
            first = await next_event(job, disconnected)
            if first is None:
                return Gone()
            if first[0] == "error":
                raise error_for(first[1], req.prompt_field)
            if req.stream:
                handed_over = True
                return EventStream(job, fmt, disconnected, lambda: self.worker.cancel(job))
            return await self._collect(job, disconnected, fmt)
        finally:
            if not handed_over:
                disconnected.cancel()
                self.worker.cancel(job)

    @staticmethod
    async def _collect(job: Job, disconnected: asyncio.Task, fmt: ResponseFormat) -> Response:
        texts, thinking = [], []
        logprobs = [] if job.request.extras.top_logprobs is not None else None
        while True:
            event = await next_event(job, disconnected)
            if event is None:
                return Gone()
            kind, value = event
            if kind == "text":
                texts.append(value)
            elif kind == "reasoning":
                thinking.append(value)
            elif kind == "logprobs":
                logprobs.append(value)
            elif kind == "error":
                raise error_for(value, job.request.prompt_field)
            else:
                return JSONResponse(fmt.full("".join(texts), value, "".join(thinking), logprobs))

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        body = await self.read_json(request)
        if self.template is None:
            raise APIError(500, f"this model's chat template is unusable: {self.template_error}",
                           code="chat_template_error", kind="server_error")
        req = parse_chat(body)
        family = family_of(self.template.source) if req.extras.tools and req.extras.tool_choice != "none" else None
        return await self.generate(request, req, ResponseFormat(True, self.config.model_id, family))

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        body = await self.read_json(request)
        return await self.generate(request, parse_completion(body), ResponseFormat(False, self.config.model_id))

    # -- information ------------------------------------------------------------------------------------------
    def model_card(self) -> dict:
        pair = self.pair
        return {"id": self.config.model_id, "object": "model", "created": self.started, "owned_by": "llamaspec",
                "llamaspec": {"target": pair.target.path.name,
                              "draft": pair.draft.path.name if pair.draft is not None else None,
                              "drafter": pair.drafter_kind, "n_ctx": self.worker.n_ctx, **self.policy_view()}}

    def policy_view(self) -> dict:
        return {"policy": self.pair.policy.describe() if self.pair.speculative else None,
                "settings": self.pair.config.drafting.policy_settings()}

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

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_description(self.config.max_body_bytes))

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
        # the pair's settings as loaded (a --pair entry's draft_max too), changed by what the body gives
        drafting, n_batch = self.pair.config.drafting, self.pair.target_ctx.n_batch
        try:
            drafting = dataclasses.replace(drafting, **parse_policy_update(body, drafting.policy_settings(), n_batch))
            await asyncio.wrap_future(self.worker.set_drafting(drafting))
        except InvalidParameterError as e:
            raise invalid(e.param, str(e))
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
        """A stop signal arrived: take no new requests; in-flight ones get `grace` seconds, then are cancelled (a
        prefill too, within a chunk). A second signal cancels them at once."""
        if self.stopping:
            self.worker.cancel_all()
            return
        self.stopping = True
        busy = sum(self.worker.depth)
        if busy and grace > 0:
            print(f"llamaspec serve: stopping; {busy} request(s) in flight get {grace:g} s (Ctrl-C again to cut "
                  "them now)", file=sys.stderr, flush=True)
        self.worker.refuse_new()
        timer = threading.Timer(grace, self.worker.cancel_all)
        timer.daemon = True
        timer.start()

    def stop(self, timeout: float = 10.0) -> bool:
        self.stopping = True
        return self.worker.stop(timeout)


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _client_gone(request: Request, exc: _ClientGone) -> Response:
    print(f"llamaspec serve: {request.method} {request.url.path}: the client hung up during the upload",
          file=sys.stderr, flush=True)
    return Gone()


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
        Route("/openapi.json", service.openapi, methods=["GET"]),
        Route("/admin/config", service.get_config, methods=["GET"]),
        Route("/admin/config", service.patch_config, methods=["PATCH"]),
    ]
    app = Starlette(routes=routes, lifespan=service.lifespan,
                    exception_handlers={APIError: _api_error, _ClientGone: _client_gone, HTTPException: _http_error,
                                        Exception: _internal_error})
    # the last added runs first: count everything, refuse foreign hosts and origins, then answer CORS
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, **cors_options(config.cors_origins))
    app.add_middleware(Guard, bound_host=config.bound_host, allowed_hosts=config.allowed_hosts,
                       cors_origins=config.cors_origins)
    app.add_middleware(CountRequests, metrics=service.metrics)
    app.state.service = service
    return app
