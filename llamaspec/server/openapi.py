"""The server's OpenAPI 3.1 description (served at /openapi.json): its routes and the request bodies exactly as
validation.py accepts them. A body that fits these schemas gets a 2xx, or a 400 only for what a schema cannot
say (a prompt longer than the context, a token id beyond the vocabulary, a template that refuses the messages).

Knows nothing about the app: it reads the limits from validation.py and bounds.py, and the tests hold the two together.
"""
from __future__ import annotations

from .. import __version__
from ..bounds import BOUNDS
from ..config import POLICY_NAMES
from ..shaping import REPEAT_PENALTY_MIN
from .tools import MAX_TOOLS
from .validation import MAX_MESSAGES, MAX_STOP, MAX_TOP_LOGPROBS

REF = "#/components/schemas/"


def _number(row: str, **extra) -> dict:
    """The JSON schema of a number whose range is bounds.py's row (the upper end without what the model knows)."""
    b = BOUNDS[row]
    kind = "integer" if b.integer else "number"
    if b.least_positive:   # the lower end, or at least least_positive
        return {"anyOf": [{"type": kind, "const": b.low},
                          {"type": kind, "minimum": b.least_positive, "maximum": b.upper()}], **extra}
    return {"type": kind, "exclusiveMinimum" if b.low_open else "minimum": b.low,
            "exclusiveMaximum" if b.high_open else "maximum": b.upper(), **extra}


def _nullable(schema: dict) -> dict:
    """null is accepted for every optional field and means 'not given'."""
    return {"anyOf": [schema, {"type": "null"}]}


_TEXT = {"type": "string", "description": "Unicode text: no lone surrogates (\\ud800-\\udfff)."}
_MESSAGE_TEXT = {"type": "string", "description": "Unicode text without lone surrogates or the noncharacters "
                                                  "U+FDD0-U+FDEF, which the server reserves. Special-token text "
                                                  "(like <|im_start|>) stays plain text."}

_SAMPLING = {
    "model": _nullable({"type": "string", "description": "Ignored: the server serves one model."}),
    "max_tokens": _nullable(_number("max_tokens")),
    "max_completion_tokens": _nullable(_number("max_tokens",
                                               description="Wins over max_tokens when both are given.")),
    "temperature": _nullable(_number("temperature")),
    "top_p": _nullable(_number("top_p")),
    "top_k": _nullable(_number("top_k")),
    "min_p": _nullable(_number("min_p")),
    "seed": _nullable(_number("seed")),
    "sampler_order": _nullable({"enum": ["openai", "llama.cpp"], "description":
                                "openai (the default): temperature, then top_k, top_p, min_p; llama.cpp: top_k, "
                                "top_p, min_p on the untempered distribution, temperature last."}),
    "stop": _nullable({"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": MAX_STOP}]}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {
        "include_usage": _nullable({"type": "boolean"})}}),
    # penalties, applied to the target's rows exactly under speculation (llama.cpp's penalties sampler)
    "repeat_penalty": _nullable({"type": "number", "minimum": REPEAT_PENALTY_MIN, "maximum": 10}),
    "repeat_last_n": _nullable({"type": "integer", "minimum": -1, "description": "-1: the whole context."}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "logit_bias": _nullable({"type": "object", "maxProperties": 1024, "description": "Token id (a decimal string, "
                             "below the vocabulary size) -> a number in [-100, 100]."}),
    "n_probs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                          "description": "llama-server's: > 0 returns log-probabilities with this many alternatives."}),
    "grammar": _nullable({"type": "string", "description": "GBNF (llama.cpp's grammar format); the reply follows it."}),
    "json_schema": _nullable({"type": "object", "description": "llama-server's: the reply is JSON valid under "
                                                               "this schema."}),
    "response_format": _nullable({"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                             "strict": _nullable({"type": "boolean"}),
                                                             "schema": {"type": "object"}}}}}]}),
    # accepted, without effect here
    "user": _nullable({"type": "string"}),
    "metadata": _nullable({"type": "object"}),
    "store": _nullable({"type": "boolean"}),
    "service_tier": _nullable({"type": "string"}),
    "parallel_tool_calls": _nullable({"type": "boolean"}),
    "cache_prompt": _nullable({"type": "boolean", "description": "The cache is reused either way."}),
    # fields accepted only with their default value
    "n": _nullable({"const": 1}),
    "best_of": _nullable({"const": 1}),
    "echo": _nullable({"const": False}),
    "suffix": _nullable({"const": ""}),
    "functions": _nullable({"type": "array", "maxItems": 0}),
    "function_call": _nullable({"const": "none"}),
    "mirostat": _nullable({"const": 0}),
}

SCHEMAS = {
    "TextPart": {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": _MESSAGE_TEXT}},
    "Message": {"type": "object", "required": ["role"], "properties": {
        "role": {**_MESSAGE_TEXT, "description": "Any role the chat template accepts; without special-token text."},
        "content": _nullable({"anyOf": [_MESSAGE_TEXT, {"type": "array", "items": {"$ref": REF + "TextPart"}}]})}},
    "Tool": {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"},
            "description": _nullable({"type": "string"}),
            "parameters": {"type": "object", "description": "A JSON schema."}}}}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"], "additionalProperties": False,
                              "properties": {
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": {"$ref": REF + "Message"}},
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                                   "description": "Above 0 needs logprobs: true."}),
        "tools": _nullable({"type": "array", "maxItems": MAX_TOOLS, "items": {"$ref": REF + "Tool"}}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["auto", "none", "required"]}, {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                            "properties": {"name": {"type": "string"}}}}}],
            "description": "'required' needs tools; a named function must be one of the tools."}),
        "chat_template_kwargs": _nullable({"type": "object", "description": "Extra variables for the chat template "
                                                                           "(identifiers)."}),
        **_SAMPLING}},
    "CompletionRequest": {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 5}),
        "prompt": {"anyOf": [
            {**_TEXT, "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
             "description": "Token ids, each below the model's vocabulary size."},
            {"type": "array", "minItems": 1, "maxItems": 1, "description": "A batch of one prompt.",
             "items": {"anyOf": [{**_TEXT, "minLength": 1},
                                 {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]}}]},
        **_SAMPLING}},
    "PolicyUpdate": {"type": "object", "additionalProperties": False, "properties": {
        "policy": _nullable({"enum": list(POLICY_NAMES)}),
        "draft_max": _nullable(_number("draft_max",
                                       description="At most the server's batch size (-b) less one.")),
        "draft_min": _nullable(_number("draft_min")),
        "draft_p_min": _nullable(_number("draft_p_min"))}},
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
}

_ERRORS = {
    "400": "Invalid request (the field at fault is in error.param)", "401": "Missing or wrong API key",
    "403": "Host or Origin not allowed, or admin routes off", "408": "The body did not arrive in time",
    "413": "Body larger than the limit", "415": "Body not sent as application/json",
    "429": "Queue full (Retry-After)", "503": "Shutting down",
}


def _errors(*codes: str) -> dict:
    return {c: {"description": _ERRORS[c], "content": {"application/json": {"schema": {"$ref": REF + "Error"}}}}
            for c in codes}


def _post(summary: str, schema: str, streams: bool = True) -> dict:
    ok = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string", "description": "Chunks as server-sent events, then "
                                                                               "'data: [DONE]'."}}
    return {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF + schema}}}},
        "responses": {"200": {"description": "OK", "content": ok},
                      **_errors("400", "401", "403", "408", "413", "415", "429", "503")}}


def _get(summary: str, media_type: str = "application/json", public: bool = False) -> dict:
    op = {"summary": summary, "responses": {"200": {"description": "OK", "content": {media_type: {}}},
                                            **_errors("401", "403")}}
    if public:
        op["security"] = []
    return op


def openapi_description(max_body_bytes: int) -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "llamaspec serve", "version": __version__,
                 "description": f"OpenAI-compatible endpoint over a speculative pair. Bodies: application/json, at "
                                f"most {max_body_bytes} bytes."},
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "--api-key (admin routes: --admin-key)"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {"post": _post("Chat completion", "ChatCompletionRequest")},
            "/v1/completions": {"post": _post("Text completion", "CompletionRequest")},
            "/v1/models": {"get": _get("The served model")},
            "/v1/models/{model}": {"get": {**_get("One model"), "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
            "/health": {"get": _get("Liveness and queue depth", public=True)},
            "/metrics": {"get": _get("Prometheus metrics", "text/plain")},
            "/openapi.json": {"get": _get("This description", public=True)},
            "/admin/config": {"get": _get("Draft policy and its settings"),
                              "patch": _post("Change the draft policy", "PolicyUpdate", streams=False)},
        },
    }
