"""What answers look like on the wire: OpenAI's error JSON, completion and chunk objects, usage, server-sent
events, and the two responses that follow a job (an event stream, or nothing when the client has left).

Knows nothing about models, validation or the worker's thread: a job is anything with an `events` queue of
(kind, value) pairs and a `request` with `stream`, `include_usage` and `prompt_field`.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Callable

from starlette.responses import JSONResponse, Response

from ..chat_template import ChatTemplateError
from ..errors import ContextOverflowError, InvalidParameterError, LlamaspecError

FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "cancelled": "length"}


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


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def error_for(exc: BaseException, prompt_field: str) -> APIError:
    """The HTTP answer to an error raised while preparing or generating a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), param=prompt_field, code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        return APIError(400, str(exc), param=exc.param or prompt_field, code="invalid_value")
    if isinstance(exc, ChatTemplateError):
        return APIError(400, str(exc), param=getattr(exc, "param", None) or prompt_field, code="chat_template_error")
    if isinstance(exc, LlamaspecError):
        return APIError(500, str(exc), kind="server_error", code="generation_failed")
    return APIError(500, "internal error during generation", kind="server_error")


class ResponseFormat:
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

    def full(self, text: str, stats, reasoning: str = "") -> dict:
        finish = FINISH_REASONS.get(stats.finish_reason, "stop")
        if self.chat:
            message = {"role": "assistant", "content": text, **reasoning_field(reasoning.strip())}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._envelope(self.object, [choice], usage=usage(stats), llamaspec=stats.to_dict())

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False, reasoning: str = "",
              **extra) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            delta.update(reasoning_field(reasoning))
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope(self.chunk_object, [choice], **extra)

    def usage_chunk(self, stats) -> dict:
        return self._envelope(self.chunk_object, [], usage=usage(stats))


def reasoning_field(reasoning: str) -> dict:
    """A thinking model's <think> part, as llama.cpp's and vLLM's servers return it (absent when empty)."""
    return {"reasoning_content": reasoning} if reasoning else {}


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.tokens_generated,
            "total_tokens": stats.prompt_tokens + stats.tokens_generated}


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")


# ---------------------------------------------------------------------------------------------------------------
# Following a job
# ---------------------------------------------------------------------------------------------------------------
async def wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def next_event(job, disconnected: asyncio.Task):
    """The job's next event, or None once the client has gone away."""
    if not job.events.empty():
        return job.events.get_nowait()
    getter = asyncio.ensure_future(job.events.get())
    await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


class Gone(Response):
    """The client disconnected before an answer: send nothing (counted as status 499)."""

    def __init__(self):
        pass

    async def __call__(self, scope, receive, send):
        return None


class EventStream(Response):
    """Server-sent events from a started job; stops (and cancels the job) as soon as the client goes away."""

    media_type = "text/event-stream"

    def __init__(self, job, fmt: ResponseFormat, disconnected: asyncio.Task, on_close: Callable[[], None]):
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
            elif kind == "reasoning":
                await send(self._body(fmt.chunk(None, reasoning=value, **usage_field)))
            elif kind == "done":
                finish = FINISH_REASONS.get(value.finish_reason, "stop")
                await send(self._body(fmt.chunk(None, finish, llamaspec=value.to_dict(), **usage_field)))
                if req.include_usage:
                    await send(self._body(fmt.usage_chunk(value)))
                break
            elif kind == "error":
                await send(self._body(error_for(value, req.prompt_field).body()))
                break
        await send(self._body("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _body(data) -> dict:
        return {"type": "http.response.body", "body": sse(data), "more_body": True}
