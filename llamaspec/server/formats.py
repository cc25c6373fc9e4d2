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

from starlette.responses import Response

from ..chat_template import ChatTemplateError
from ..errors import Cancelled, ContextOverflowError, InvalidParameterError, LlamaspecError
from .apierror import APIError
from .timings import timings
from .tools import ToolStream, parse_tool_calls

# "cancelled": the reply was cut (the server is stopping); not OpenAI's, which has no word for it
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "cancelled": "cancelled"}


def error_for(exc: BaseException, prompt_field: str) -> APIError:
    """The HTTP answer to an error raised while preparing or generating a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), param=prompt_field, code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        return APIError(400, str(exc), param=exc.param or prompt_field, code="invalid_value")
    if isinstance(exc, Cancelled):
        return APIError(503, "the server is shutting down", code="shutting_down", kind="server_error")
    if isinstance(exc, ChatTemplateError):
        return APIError(400, str(exc), param=getattr(exc, "param", None) or prompt_field, code="chat_template_error")
    if isinstance(exc, LlamaspecError):
        return APIError(500, str(exc), kind="server_error", code="generation_failed")
    return APIError(500, "internal error during generation", kind="server_error")


class ResponseFormat:
    """Chat and text completions differ only in object names and where the text goes. `tools_family`: the
    tool-call syntax to parse replies with (tools.py), None when the request offers no tools."""

    def __init__(self, chat: bool, model_id: str, tools_family: str | None = None):
        self.chat, self.model, self.tools_family = chat, model_id, tools_family
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def full(self, text: str, stats, reasoning: str = "", logprobs: list | None = None) -> dict:
        finish = FINISH_REASONS.get(stats.finish_reason, "stop")
        if self.chat:
            message = {"role": "assistant", "content": text, **reasoning_field(reasoning.strip())}
            if self.tools_family is not None:
                content, calls = parse_tool_calls(text, self.tools_family)
                if calls:
                    message.update(content=content or None, tool_calls=[c.to_dict() for c in calls])
                    finish = "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        return self._envelope(self.object, [choice], usage=usage(stats), timings=timings(stats),
                              llamaspec=stats.to_dict())

    def logprobs(self, entries: list | None) -> dict | None:
        """OpenAI's logprobs object: chat's {"content": [...]}, or the completions API's legacy columns."""
        if entries is None:
            return None
        if self.chat:
            return {"content": entries}
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False, reasoning: str = "",
              logprobs: list | None = None, tool_calls: list | None = None, **extra) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            delta.update(reasoning_field(reasoning))
            if tool_calls:
                delta["tool_calls"] = tool_calls
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        return self._envelope(self.chunk_object, [choice], **extra)

    def usage_chunk(self, stats) -> dict:
        """The last chunk with stream_options.include_usage; it carries the timings too, as llama-server's does."""
        return self._envelope(self.chunk_object, [], usage=usage(stats), timings=timings(stats))


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
        tools = ToolStream(fmt.tools_family) if fmt.chat and fmt.tools_family is not None else None
        logprobs = [] if req.extras.top_logprobs is not None else None   # entries not sent yet
        while True:
            kind, value = await self.job.events.get()
            if kind == "logprobs":
                logprobs.append(value)
            elif kind == "text":
                text = tools.push(value) if tools is not None else value
                if text or logprobs:
                    await send(self._body(fmt.chunk(text, logprobs=logprobs, **usage_field)))
                    logprobs = [] if logprobs is not None else None
                opened = tools.announce() if tools is not None else ()   # id and name now, arguments at its end
                if opened:
                    await send(self._body(fmt.chunk(None, tool_calls=[c.to_dict(i) for i, c in opened],
                                                    **usage_field)))
            elif kind == "reasoning":
                await send(self._body(fmt.chunk(None, reasoning=value, **usage_field)))
            elif kind == "done":
                finish = FINISH_REASONS.get(value.finish_reason, "stop")
                if tools is not None:
                    text, calls = tools.finish()
                    if text or logprobs:
                        await send(self._body(fmt.chunk(text, logprobs=logprobs, **usage_field)))
                        logprobs = [] if logprobs is not None else None
                    if calls:   # an announced call's arguments, the others whole (OpenAI's clients accumulate)
                        finish = "tool_calls"
                        n = len(tools.opened)
                        deltas = [{"index": i, "function": {"arguments": c.arguments}} for i, c in
                                  enumerate(calls[:n]) if c.arguments] + [c.to_dict(n + i) for i, c in
                                                                          enumerate(calls[n:])]
                        if deltas:
                            await send(self._body(fmt.chunk(None, tool_calls=deltas, **usage_field)))
                await send(self._body(fmt.chunk(None, finish, logprobs=logprobs or None, timings=timings(value),
                                                llamaspec=value.to_dict(), **usage_field)))
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
