"""Request parsing: a JSON body -> a GenerationRequest (or a policy update), every check naming the field at fault.

Cheap and bounded: nothing here renders a template or tokenizes (the worker does, off the event loop). The limits
(MAX_MESSAGES, MAX_STOP, and bounds.py's numeric ranges) are the ones the OpenAPI description in openapi.py publishes.
Knows nothing about models, HTTP or the worker.
"""
from __future__ import annotations

import dataclasses

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..bounds import BOUNDS
from ..config import POLICY_NAMES, POLICY_SETTINGS
from ..sampling import OPENAI, SAMPLER_ORDERS
from ..shaping import REPEAT_PENALTY_MIN
from .apierror import invalid
from .tools import parse_tool_choice, parse_tools, tool_fields

MAX_MESSAGES = 2048   # OpenAI's own limit; also bounds the chat template's work
MAX_STOP = 16
POLICY_FIELDS = POLICY_SETTINGS   # what PATCH /admin/config sets: DraftSettings' own names
# lone surrogates cannot be encoded as UTF-8; U+FDD0..U+FDEF are noncharacters, which mark message text inside the
# rendered chat prompt (prompt.py)
_SURROGATE = re.compile("[\ud800-\udfff]")
_NONCHARACTER = re.compile("[\ufdd0-\ufdef]")


@dataclass
class GenerationRequest:
    prompt: str | list[int] | list[dict]   # completion text, token ids, or chat messages ({role, content} strings)
    prompt_field: str                       # "messages" or "prompt", for error messages
    max_tokens: int                         # 0: up to the context
    sampling: dict                          # temperature, top_p, top_k, min_p, seed, sampler_order
    stop: list[str]
    stream: bool
    include_usage: bool
    template_vars: dict = dataclasses.field(default_factory=dict)   # chat_template_kwargs (e.g. enable_thinking)
    extras: "Extras" = None                 # structured output, tools, penalties, logprobs

    def __post_init__(self):
        if self.extras is None:
            self.extras = Extras()

    @property
    def chat(self) -> bool:
        return self.prompt_field == "messages"


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    # an int of any size is finite (math.isfinite would overflow converting 10**400 to a float)
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))


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


def refuse_lone_surrogates(value, param: str = "") -> None:
    """A 400 naming where a lone surrogate lies in a JSON value (its strings and object keys): such text cannot be
    encoded for the tokenizer, a grammar or a chat template. One C-speed pass when there is none (nearly always)."""
    if not _SURROGATE.search(json.dumps(value, ensure_ascii=False)):
        return
    stack = [(value, param)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            check_text(where, item)
        elif isinstance(item, dict):
            for key, inner in item.items():
                check_text(where or "body", key)   # the key itself cannot be shown as a field name
                stack.append((inner, f"{where}.{key[:60]}" if where else key[:60]))
        elif isinstance(item, list):
            stack.extend((inner, f"{where}[{i}]") for i, inner in enumerate(item))


def _optional(body: dict, name: str, check: Callable[[Any], bool], expected: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise invalid(name, f"'{name}' must be {expected}, got {_shown(value)}")
    return value


def _bounded(body: dict, name: str, row: str | None = None, default=None, known: dict | None = None):
    """An optional number within its row of bounds.py (the CLI's and the library's range too)."""
    value = body.get(name)
    if value is None:
        return default
    problem = BOUNDS[row or name].problem(value, known)
    if problem is not None:
        raise invalid(name, f"'{name}' {problem}"[:300])
    return value


# Fields llamaspec does not implement: accepted when they ask for the default behaviour, else 400. mirostat adapts
# to the surprise of what was sampled, a per-request state speculation would have to replay; n, best_of and echo
# would need several sequences or the prompt's own logits.
DEFAULT_ONLY = {
    "n": lambda v: is_int(v) and v == 1,
    "best_of": lambda v: is_int(v) and v == 1,
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "mirostat": lambda v: is_int(v) and v == 0,
}
# Accepted and without effect here: bookkeeping fields of OpenAI's API, and llama-server's cache switch (the cache is
# always reused where the prompt allows; the output is the same either way).
IGNORED = ("model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "cache_prompt")
COMMON_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                 "sampler_order", "stop", "stream", "stream_options", "repeat_penalty", "repeat_last_n",
                 "presence_penalty", "frequency_penalty", "logit_bias", "grammar", "json_schema", "response_format",
                 "n_probs", *DEFAULT_ONLY, *IGNORED)
CHAT_FIELDS = ("messages", "logprobs", "top_logprobs", "tools", "tool_choice", "chat_template_kwargs",
               *COMMON_FIELDS)
COMPLETION_FIELDS = ("prompt", "logprobs", *COMMON_FIELDS)
MAX_TOP_LOGPROBS = 20   # OpenAI's limit


@dataclass
class Extras:
    """What a request asks beyond plain sampling (each checked for type and range here; grammars and schemas are
    compiled by the worker, which owns the model)."""
    penalties: dict = field(default_factory=dict)   # shaping.Penalties' fields
    logit_bias: dict = field(default_factory=dict)  # token id -> bias
    top_logprobs: int | None = None                 # None: no log-probabilities
    grammar: str | None = None                      # GBNF
    json_schema: dict | None = None                 # the schema the reply must satisfy (json_object: an object)
    schema_param: str = "response_format"           # the field that gave it (json_schema or response_format)
    tools: list = field(default_factory=list)       # OpenAI function tools
    tool_choice: str | dict = "auto"                # auto, none, required, or {"type": "function", "function": ...}


def _refuse_unknown(body: dict, known: tuple[str, ...]) -> None:
    for name in body:
        if name not in known:
            raise invalid(name, f"unknown field '{name[:60]}': this server does not implement it (see /openapi.json)",
                          code="unsupported_parameter")
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
    _optional(body, "model", lambda v: isinstance(v, str), "a string")
    limits = [_bounded(body, name, "max_tokens") for name in ("max_completion_tokens", "max_tokens")]
    max_tokens = next((n for n in limits if n is not None), None)  # the newer name wins when both are given
    sampling = {"temperature": float(_bounded(body, "temperature", default=1.0)),
                "top_p": float(_bounded(body, "top_p", default=1.0)),
                "top_k": _bounded(body, "top_k", default=0),
                "min_p": float(_bounded(body, "min_p", default=0.0)),
                "seed": _bounded(body, "seed"),
                "sampler_order": _optional(body, "sampler_order", lambda v: v in SAMPLER_ORDERS,
                                           f"one of {', '.join(map(json.dumps, SAMPLER_ORDERS))}", OPENAI)}
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = _optional(options, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
    _optional(body, "cache_prompt", lambda v: isinstance(v, bool), "true or false")
    return GenerationRequest(prompt, prompt_field, max_tokens or 0, sampling, _parse_stop(body), stream,
                             include_usage, extras=parse_extras(body, prompt_field == "messages"))


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
    _refuse_unknown(body, CHAT_FIELDS)
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
        tools = tool_fields(i, m)
        refuse_lone_surrogates(tools, f"messages[{i}]")   # arguments decoded from their JSON string too
        plain.append({"role": role, "content": _message_text(i, m.get("content")), **tools})
    req = dataclasses.replace(_parse_common(body, plain, "messages"),
                              template_vars=parse_template_kwargs(body.get("chat_template_kwargs")))
    refuse_lone_surrogates(body)   # wherever else text enters: tools, grammar, schema, logit_bias keys
    return req


def parse_template_kwargs(value) -> dict:
    """chat_template_kwargs (llama.cpp's and vLLM's name): extra variables for the chat template, e.g.
    {"enable_thinking": false}; names are identifiers, values are JSON scalars."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object", code="invalid_type")
    for name, item in value.items():
        if not name.isidentifier() or name in ("messages", "tools", "add_generation_prompt", "bos_token",
                                               "eos_token"):
            raise invalid("chat_template_kwargs", f"'chat_template_kwargs' cannot set {name!r}")
        if not (item is None or isinstance(item, (bool, str)) or is_int(item) or is_number(item)):
            raise invalid(f"chat_template_kwargs.{name}", "must be a string, number, boolean or null")
    return dict(value)


def parse_completion(body: dict) -> GenerationRequest:
    _refuse_unknown(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        req = _parse_common(body, [int(t) for t in prompt], "prompt")
    elif not isinstance(prompt, str) or not prompt:
        code = "missing_required_parameter" if prompt is None else "invalid_type"
        raise invalid("prompt", "'prompt' must be a non-empty string (or a list of token ids); batches of several "
                                "prompts are not supported", code=code)
    else:
        req = _parse_common(body, check_text("prompt", prompt), "prompt")
    refuse_lone_surrogates(body)
    return req


def parse_policy_update(body: dict, current: dict, n_batch: int | None = None) -> dict:
    """Merge an admin update into the current policy settings: each value within its row of bounds.py (a draft
    no longer than one batch of `n_batch` verifies); how they combine is make_policy's check."""
    unknown = sorted(set(body) - set(POLICY_FIELDS))
    if unknown:
        raise invalid(unknown[0], f"unknown setting '{unknown[0]}'; settable: {', '.join(POLICY_FIELDS)}")
    if "policy" in body and body["policy"] not in POLICY_NAMES:   # null too: it would silently mean "auto"
        raise invalid("policy", f"'policy' must be one of {', '.join(POLICY_NAMES)}, got {_shown(body['policy'])}")
    known = {"n_batch": n_batch} if n_batch else None
    for name in ("draft_max", "draft_min", "draft_p_min"):
        _bounded(body, name, known=known)
    merged = {**current, **body}
    low, high = merged.get("draft_min"), merged.get("draft_max")
    if low is not None and high is not None and low > high:
        name = "draft_min" if "draft_min" in body else "draft_max"
        raise invalid(name, f"'draft_min' ({low}) must not exceed 'draft_max' ({high})")
    return merged


def parse_extras(body: dict, chat: bool) -> Extras:
    """Penalties, logit bias, log-probabilities, grammar / JSON output and tools, each checked for type and range."""
    extras = Extras()
    for name, key, check, expected in (
            ("repeat_penalty", "repeat", lambda v: is_number(v) and REPEAT_PENALTY_MIN <= v <= 10,
             f"a number in [{REPEAT_PENALTY_MIN:g}, 10]"),
            ("frequency_penalty", "frequency", lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
            ("presence_penalty", "presence", lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
            ("repeat_last_n", "last_n", lambda v: is_int(v) and v >= -1, "an integer >= -1 (-1: the whole context)")):
        value = _optional(body, name, check, expected)
        if value is not None:
            extras.penalties[key] = value
    bias = _optional(body, "logit_bias", lambda v: isinstance(v, dict) and len(v) <= 1024,
                     "an object of at most 1024 token ids to numbers", {})
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) < 10 and is_number(value) and -100 <= value <= 100):
            raise invalid("logit_bias", f"'logit_bias' maps token ids to numbers in [-100, 100]; got "
                                        f"{_shown(key)}: {_shown(value)}")
        extras.logit_bias[int(key)] = float(value)
    extras.top_logprobs = _parse_logprobs(body, chat)
    extras.grammar = _optional(body, "grammar", lambda v: isinstance(v, str) and v.strip(), "GBNF text")
    extras.json_schema = _parse_response_format(body)
    if body.get("json_schema") is not None:
        extras.schema_param = "json_schema"
    if extras.grammar is not None and extras.json_schema is not None:
        raise invalid("grammar", "give either 'grammar' or a JSON 'response_format' / 'json_schema', not both")
    if chat:
        extras.tools = parse_tools(body.get("tools"))
        extras.tool_choice = parse_tool_choice(body.get("tool_choice"), extras.tools)
        if extras.tool_choice not in ("auto", "none") and (extras.grammar is not None or extras.json_schema is not None):
            raise invalid("tool_choice", "a forced tool call cannot be combined with 'grammar' or 'response_format'")
    return extras


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    """None for no log-probabilities, else how many of each row's best to list too. Chat: logprobs (bool) with
    top_logprobs (0..20); completions: logprobs (an integer 0..5, OpenAI's legacy form). llama-server's n_probs > 0
    asks for them as well."""
    n_probs = _optional(body, "n_probs", lambda v: is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                        f"an integer in [0, {MAX_TOP_LOGPROBS}]", 0)
    if chat:
        wanted = _optional(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
        top = _optional(body, "top_logprobs", lambda v: is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                        f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top is not None and not wanted and top > 0:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        if wanted:
            return max(top or 0, n_probs)
    else:
        top = _optional(body, "logprobs", lambda v: is_int(v) and 0 <= v <= 5, "an integer in [0, 5]")
        if top is not None:
            return max(top, n_probs)
    return n_probs or None


def _parse_response_format(body: dict) -> dict | None:
    """None for free text, else the JSON schema the reply must satisfy (json_object: {"type": "object"})."""
    schema = _optional(body, "json_schema", lambda v: isinstance(v, dict), "a JSON schema object")
    fmt = _optional(body, "response_format", lambda v: isinstance(v, dict) and isinstance(v.get("type"), str),
                    "an object with a 'type'")
    if fmt is None or fmt["type"] == "text":
        return schema
    if schema is not None:
        raise invalid("json_schema", "give either 'json_schema' or a JSON 'response_format', not both")
    if fmt["type"] == "json_object":
        return fmt.get("schema") if isinstance(fmt.get("schema"), dict) else {"type": "object"}
    if fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format", "'response_format.json_schema' must be an object with a 'schema' object")
        return spec.get("schema", {})
    raise invalid("response_format", f"'response_format.type' must be text, json_object or json_schema, got "
                                     f"{_shown(fmt['type'])}")
