"""OpenAI function tools: request checking, the tool-call syntax of each chat-template family, the grammar that
forces a call (tool_choice `required` or a named function), and parsing calls back out of the reply (whole or
streamed).

Families, told apart by the chat template's text:
- `hermes` (Qwen 2.5 / 3 / 3.5+, Hermes, and the default): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
  one block per call.
- `llama3` (Llama 3.1 / 3.2 / 3.3): a JSON object `{"name": ..., "parameters": {...}}` as the whole reply, optionally
  after `<|python_tag|>`; several separated by `;`.
- `gemma` (Gemma 3, which has no tool tokens; Google's documented convention): a fenced block
  ```` ```tool_code\nname(arg=value, ...)\n``` ````, or a JSON object as for llama3.

Knows nothing about models or HTTP: text in, calls out; JSON schemas in, schemas out (the worker compiles them).
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from .apierror import invalid

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


# -- request fields --------------------------------------------------------------------------------------------
def parse_tools(tools) -> list[dict]:
    """The `tools` list, each {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"'tools' must be a list of at most {MAX_TOOLS} function tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise invalid(f"tools[{i}]", "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}} "
                                         "with a name of letters, digits, '_', '.' or '-' (at most 64)")
        if not isinstance(fn.get("parameters", {}), dict) or not isinstance(fn.get("description", ""), str):
            raise invalid(f"tools[{i}]", "a tool's 'parameters' must be a JSON schema object and its 'description' "
                                         "a string")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if k in fn}})
    return out


def parse_tool_choice(choice, tools: list[dict]):
    """"auto" (the default with tools), "none", "required", or {"name": ...} for one named function."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise invalid("tool_choice", "'tool_choice' is 'required' but no 'tools' were given")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or "
                                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid("tool_choice", f"'tool_choice' names the function {name[:64]!r}, which is not in 'tools'")
    return {"name": name}


def tool_fields(index: int, message: dict) -> dict:
    """A message's tool fields as chat templates expect them: an assistant's `tool_calls` (arguments as objects,
    as Transformers passes them) and a tool result's `tool_call_id` / `name`."""
    out = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise invalid(f"messages[{index}].tool_calls", "'tool_calls' must be a list")
        parsed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise invalid(f"messages[{index}].tool_calls[{j}]",
                              "each tool call needs a 'function' with a 'name' and 'arguments' (a JSON string)")
            arguments = fn.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    raise invalid(f"messages[{index}].tool_calls[{j}].function.arguments",
                                  "'arguments' must be a JSON object encoded as a string") from None
            parsed.append({"id": str(call.get("id", "")), "type": "function",
                           "function": {"name": fn["name"], "arguments": arguments}})
        out["tool_calls"] = parsed
    for name in ("tool_call_id", "name"):
        if isinstance(message.get(name), str):
            out[name] = message[name]
    return out


# -- syntax per family -------------------------------------------------------------------------------------------
def family_of(template_source: str) -> str:
    if "<|python_tag|>" in template_source or "<|eom_id|>" in template_source:
        return "llama3"
    if "<start_of_turn>" in template_source:
        return "gemma"
    return "hermes"


def forced_call_schema(tools: list[dict], choice, family: str) -> dict:
    """The JSON schema of one call to the chosen tool (or any tool, for 'required')."""
    key = "arguments" if family == "hermes" else "parameters"
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice["name"]]
    variants = [{"type": "object", "properties": {"name": {"const": fn["name"]},
                                                   key: fn.get("parameters") or {"type": "object"}},
                 "required": ["name", key], "additionalProperties": False} for fn in chosen]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def forced_call_gbnf(call_gbnf: str, family: str) -> str:
    """Wrap the GBNF of one call's JSON (its root renamed) in the family's tool-call syntax."""
    body = re.sub(r"^root\s*::=", "call ::=", call_gbnf, count=1, flags=re.M)
    if family == "hermes":
        return body + '\nroot ::= "<tool_call>\\n" call "\\n</tool_call>"\n'
    return body + "\nroot ::= call\n"


@dataclass
class ToolCall:
    name: str
    arguments: str   # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def to_dict(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_GEMMA = re.compile(r"```tool_code\s*(.*?)\s*```", re.S)


def _json_call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _python_call(text: str) -> ToolCall | None:
    """name(a=1, b="x") with literal arguments (Gemma's tool_code)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, family: str) -> tuple[str, list[ToolCall]]:
    """(the reply's text outside tool calls, the calls). Text that only looks like a call stays text."""
    if family == "hermes" or "<tool_call>" in text:
        calls = [c for c in (_json_call(m) for m in _HERMES.findall(text)) if c is not None]
        if calls:
            return _HERMES.sub("", text).strip(), calls
    if family == "gemma":
        calls = [c for c in (_python_call(m) for m in _GEMMA.findall(text)) if c is not None]
        if calls:
            return _GEMMA.sub("", text).strip(), calls
    stripped = text.strip().removeprefix("<|python_tag|>").strip()
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while stripped.startswith("{", pos):   # JSON calls as the whole reply, separated by ';' (Llama 3)
        try:
            obj, pos = decoder.raw_decode(stripped, pos)
        except ValueError:
            return text, []
        call = _json_call(json.dumps(obj))
        if call is None:
            return text, []
        calls.append(call)
        while pos < len(stripped) and stripped[pos] in " \t\r\n;":
            pos += 1
    if calls and pos == len(stripped):
        return "", calls
    return text, []


_OPENING = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*[,}]')


class ToolStream:
    """Splits a streamed reply into content to send at once and a tail held back because it may be a tool call;
    `finish` parses what was held. A Hermes-style call is announced as soon as its name is complete (`announce`:
    its id and name, the arguments still to come), so a reply that opens with a call has its first delta after a
    few tokens, as llama-server streams it; its arguments follow whole when the call ends (`finish`)."""

    def __init__(self, family: str):
        self.family, self.text, self.sent = family, "", 0
        self.marker = "<tool_call>" if family == "hermes" else "```tool_code" if family == "gemma" else None
        self.opened: list[ToolCall] = []   # announced calls, in order; their arguments are set by finish
        self._scan = 0                     # where the next call's opening may start

    def announce(self) -> list[tuple[int, ToolCall]]:
        """(index, call) of the calls whose name became complete since the last call (Hermes syntax only)."""
        new = []
        while self.family == "hermes":
            found = _OPENING.search(self.text, self._scan)
            if found is None:
                break
            self._scan = found.end()
            new.append((len(self.opened), ToolCall(found.group(1), "")))
            self.opened.append(new[-1][1])
        return new

    def push(self, piece: str) -> str:
        self.text += piece
        start = self._hold_from()
        out, self.sent = self.text[self.sent:start], max(self.sent, start)
        return out

    def _hold_from(self) -> int:
        lead = self.text.lstrip()
        if self.sent == 0 and (lead.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(lead)):
            return 0   # a JSON call (or Llama's python tag) may be the whole reply: hold it all
        if self.marker is None:
            return len(self.text)
        at = self.text.find(self.marker, self.sent)
        if at >= 0:
            return at
        for n in range(min(len(self.marker) - 1, len(self.text) - self.sent), 0, -1):   # a marker's beginning
            if self.marker.startswith(self.text[-n:]):
                return len(self.text) - n
        return len(self.text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls). The announced calls come first, in order, with their arguments (a
        call announced but never closed or not JSON keeps empty arguments: the client's parse then fails, as the
        model's call did), then the calls not announced."""
        if self.opened:
            blocks = [_json_call(b) for b in _HERMES.findall(self.text)]
            for call, got in zip(self.opened, blocks):
                call.arguments = got.arguments if got is not None and got.name == call.name else ""
            calls = self.opened + [c for c in blocks[len(self.opened):] if c is not None]
            rest = _HERMES.sub("", self.text)
            cut = rest.find(self.marker)   # a call cut short: announced, not content
            content = (rest if cut < 0 else rest[:cut]).strip()
            return content[self.sent:] if content.startswith(self.text[:self.sent]) else "", calls
        content, calls = parse_tool_calls(self.text, self.family)
        if not calls:
            return self.text[self.sent:], []
        return content[self.sent:] if content.startswith(self.text[:self.sent]) else "", calls
