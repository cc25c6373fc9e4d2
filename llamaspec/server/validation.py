"""Request parsing: a JSON body -> a GenerationRequest (or a policy update), every check naming the field at fault.

Cheap and bounded: nothing here renders a template or tokenizes (the worker does, off the event loop). The limits
(MAX_MESSAGES, MAX_STOP, the numeric ranges) are the ones the OpenAPI description in openapi.py publishes.
Knows nothing about models, HTTP or the worker.
"""
from __future__ import annotations

import dataclasses

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..config import POLICY_NAMES
from .formats import invalid

MAX_MESSAGES = 2048   # OpenAI's own limit; also bounds the chat template's work
MAX_STOP = 16
POLICY_FIELDS = ("policy", "draft_max", "draft_min", "draft_p_min")
# lone surrogates cannot be encoded as UTF-8; U+FDD0..U+FDEF are noncharacters, which mark message text inside the
# rendered chat prompt (prompt.py)
_SURROGATE = re.compile("[\ud800-\udfff]")
_NONCHARACTER = re.compile("[\ufdd0-\ufdef]")


@dataclass
class GenerationRequest:
    prompt: str | list[int] | list[dict]   # completion text, token ids, or chat messages ({role, content} strings)
    prompt_field: str                       # "messages" or "prompt", for error messages
    max_tokens: int                         # 0: up to the context
    sampling: dict                          # temperature, top_p, top_k, min_p, seed
    stop: list[str]
    stream: bool
    include_usage: bool
    template_vars: dict = dataclasses.field(default_factory=dict)   # chat_template_kwargs (e.g. enable_thinking)

    @property
    def chat(self) -> bool:
        return self.prompt_field == "messages"


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _shown(value) -> str:
    return json.dumps(value)[:80]


def check_text(param: str, text: str, message_text: bool = False) -> str:
    """`text` if it is valid Unicode for the model (and, for message text, free of the reserved noncharacters)."""
    bad = _SURROGATE.search(text)
    if bad:
        raise invalid(param, f"'{param}' contains a lone surrogate (\\u{ord(bad.group()):04x}) at character "
                             f"{bad.start()}: it is not valid Unicode text")
    if message_text and (bad := _NONCHARACTER.search(text)):
        raise invalid(param, f"'{param}' contains the Unicode noncharacter U+{ord(bad.group()):04X}, which this "
                             "server reserves")
    return text


def _optional(body: dict, name: str, check: Callable[[Any], bool], expected: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise invalid(name, f"'{name}' must be {expected}, got {_shown(value)}")
    return value


# OpenAI fields llamaspec does not implement: accepted when they ask for the default behaviour, else 400.
DEFAULT_ONLY = {
    "n": lambda v: is_int(v) and v == 1,
    "best_of": lambda v: is_int(v) and v == 1,
    "presence_penalty": lambda v: is_number(v) and v == 0,
    "frequency_penalty": lambda v: is_number(v) and v == 0,
    "logprobs": lambda v: v is False or (is_int(v) and v == 0),
    "top_logprobs": lambda v: is_int(v) and v == 0,
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
    for name, is_default in DEFAULT_ONLY.items():
        value = body.get(name)
        if value is not None and not is_default(value):
            raise invalid(name, f"'{name}' = {_shown(value)} is not supported by this server",
                          code="unsupported_parameter")


def _parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        return [check_text("stop", s) for s in stop if s]
    raise invalid("stop", f"'stop' must be a string or a list of at most {MAX_STOP} strings")


def _parse_common(body: dict, prompt, prompt_field: str) -> GenerationRequest:
    _reject_unsupported(body)
    _optional(body, "model", lambda v: isinstance(v, str), "a string")
    limits = [_optional(body, name, lambda v: is_int(v) and v >= 1, "an integer >= 1")
              for name in ("max_completion_tokens", "max_tokens")]
    max_tokens = next((n for n in limits if n is not None), None)  # the newer name wins when both are given
    sampling = {
        "temperature": float(_optional(body, "temperature", lambda v: is_number(v) and 0 <= v <= 2,
                                       "a number in [0, 2]", 1.0)),
        "top_p": float(_optional(body, "top_p", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)),
        "top_k": _optional(body, "top_k", lambda v: is_int(v) and v >= 0, "an integer >= 0", 0),
        "min_p": float(_optional(body, "min_p", lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]", 0.0)),
        "seed": _optional(body, "seed", lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    }
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = _optional(options, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
    return GenerationRequest(prompt, prompt_field, max_tokens or 0, sampling, _parse_stop(body), stream,
                             include_usage)


def _message_text(index: int, content) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's content-part form)."""
    param = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return check_text(param, content or "", message_text=True)
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(param, "only text content parts are supported")
            texts.append(check_text(param, part["text"], message_text=True))
        return "".join(texts)
    raise invalid(param, "a message's 'content' must be a string or a list of text parts")


def parse_chat(body: dict) -> GenerationRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        code = "missing_required_parameter" if messages is None else "invalid_type"
        raise invalid("messages", "'messages' must be a non-empty list of {role, content} objects", code=code)
    if len(messages) > MAX_MESSAGES:
        raise invalid("messages", f"'messages' holds {len(messages)} messages; at most {MAX_MESSAGES} are accepted")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}]", "each message must be an object with a string 'role'")
        role = check_text(f"messages[{i}].role", m["role"], message_text=True)
        plain.append({"role": role, "content": _message_text(i, m.get("content"))})
    return dataclasses.replace(_parse_common(body, plain, "messages"),
                               template_vars=parse_template_kwargs(body.get("chat_template_kwargs")))


def parse_template_kwargs(value) -> dict:
    """chat_template_kwargs (llama.cpp's and vLLM's name): extra variables for the chat template, e.g.
    {"enable_thinking": false}; names are identifiers, values are JSON scalars."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object", code="invalid_type")
    for name, item in value.items():
        if not name.isidentifier() or name in ("messages", "add_generation_prompt", "bos_token", "eos_token"):
            raise invalid("chat_template_kwargs", f"'chat_template_kwargs' cannot set {name!r}")
        if not (item is None or isinstance(item, (bool, str)) or is_int(item) or is_number(item)):
            raise invalid(f"chat_template_kwargs.{name}", "must be a string, number, boolean or null")
    return dict(value)


def parse_completion(body: dict) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return _parse_common(body, [int(t) for t in prompt], "prompt")
    if not isinstance(prompt, str) or not prompt:
        code = "missing_required_parameter" if prompt is None else "invalid_type"
        raise invalid("prompt", "'prompt' must be a non-empty string (or a list of token ids); batches of several "
                                "prompts are not supported", code=code)
    return _parse_common(body, check_text("prompt", prompt), "prompt")


def parse_policy_update(body: dict, current: dict) -> dict:
    """Merge an admin update into the current policy settings; types are checked here, ranges by make_policy."""
    unknown = sorted(set(body) - set(POLICY_FIELDS))
    if unknown:
        raise invalid(unknown[0], f"unknown setting '{unknown[0]}'; settable: {', '.join(POLICY_FIELDS)}")
    _optional(body, "policy", lambda v: v in POLICY_NAMES, f"one of {', '.join(POLICY_NAMES)}")
    for name in ("draft_max", "draft_min"):
        _optional(body, name, lambda v: is_int(v) and v >= 0, "an integer >= 0")
    _optional(body, "draft_p_min", is_number, "a number in [0, 1)")
    return {**current, **body}
