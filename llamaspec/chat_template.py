"""Chat templates: the Jinja template embedded in a GGUF (`tokenizer.chat_template`), rendered the way
llama-cpp-python and Transformers render it, in a sandboxed environment. Knows nothing about models beyond the
template text and the BOS/EOS token strings.

A template comes with the model file, so it is untrusted code: whatever it raises becomes a ChatTemplateError, and a
render is bounded: numbers of at most MAX_INT_BITS bits and values of at most MAX_RENDERED_CHARS items from any
operator, call, filter or namespace() assignment, that much output, and MAX_STEPS steps (range() items, operators,
calls) or MAX_RENDER_SECONDS (`_Budget`). What it cannot bound is a loop that does nothing at all per item over a
long sequence; a server should render with a timeout of its own as well.
"""
from __future__ import annotations

import contextvars
import functools
import json
import math
import operator
import re
import time
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from .errors import LlamaspecError
from .gguf.reader import ModelInfo

# Used when a GGUF carries no template: ChatML, which most instruction-tuned GGUFs understand.
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class ChatTemplateError(LlamaspecError):
    """The chat template could not be rendered for these messages."""


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """Pass-through for Hugging Face's {% generation %} tag."""

    tags = {"generation"}

    def parse(self, parser):
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise ChatTemplateError(f"the model's chat template refused these messages: {message}")


MAX_RENDERED_CHARS = 1 << 23  # 8 Mi characters: far more than any context window holds
MAX_INT_BITS = 1 << 12
MAX_STEPS = 1_000_000
MAX_RENDER_SECONDS = 5.0
_SIZED = (str, bytes, list, tuple, dict)
_BIG_NUMBER_TEXT = re.compile(r"\d{7,}")  # a field width or precision in a format string
_WIDTH_TAKERS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "tojson"})


def _broken(what: str) -> ChatTemplateError:
    return ChatTemplateError(f"the chat template {what}; the model file's template is broken")


class _Budget:
    """What one render may still spend; `spend` raises ChatTemplateError once it is gone."""

    def __init__(self):
        self.steps, self.deadline = MAX_STEPS, time.monotonic() + MAX_RENDER_SECONDS

    def spend(self, steps: int = 1) -> None:
        self.steps -= steps
        if self.steps < 0 or time.monotonic() > self.deadline:
            raise _broken(f"did not finish (over {MAX_STEPS:,} steps or {MAX_RENDER_SECONDS:g} s)")


_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _check_operands(op: str, left, right) -> None:
    """Refuse `left op right` before computing it when the result would be a number or sequence no template
    needs: a number of more than MAX_INT_BITS bits, a sequence of more than MAX_RENDERED_CHARS items."""
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "**" and ints and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > MAX_INT_BITS:
        raise _broken(f"computes {left} ** {right}, a number of more than {MAX_INT_BITS} bits")
    if op == "*" and ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise _broken(f"computes a product of more than {MAX_INT_BITS} bits")
    if op == "*" and isinstance(left, _SIZED) != isinstance(right, _SIZED):
        seq, times = (left, right) if isinstance(left, _SIZED) else (right, left)
        if isinstance(times, int):
            _check_size(len(seq) * times)
    if op == "+" and isinstance(left, _SIZED) and isinstance(right, _SIZED):
        _check_size(len(left) + len(right))
    if op == "%" and isinstance(left, str):
        _check_format(left)


def _check_size(n_items: int) -> None:
    if n_items > MAX_RENDERED_CHARS:
        raise _broken(f"builds a value of {n_items:,} items (at most {MAX_RENDERED_CHARS:,})")


def _check_format(text: str) -> None:
    if any(int(n) > MAX_RENDERED_CHARS for n in _BIG_NUMBER_TEXT.findall(text)):
        raise _broken("formats with a field width over the output limit")


def _check_call(name: str, receiver, args: tuple, kwargs: dict) -> None:
    """A call or filter that would build a huge value from small arguments: a width past the output limit
    (center, ljust, indent, ...), a format string with such a width, a replace that multiplies a string."""
    if name in _WIDTH_TAKERS and any(isinstance(a, int) and abs(a) > MAX_RENDERED_CHARS
                                     for a in (*args, *kwargs.values())):
        raise _broken(f"calls {name} with a width over {MAX_RENDERED_CHARS:,}")
    if name in ("format", "format_map") and isinstance(receiver, str):
        _check_format(receiver)
    if name == "replace" and isinstance(receiver, str) and len(args) >= 2 \
            and isinstance(args[0], str) and isinstance(args[1], str):
        count = receiver.count(args[0]) if args[0] else len(receiver) + 1
        _check_size(len(receiver) + count * (len(args[1]) - len(args[0])))


def _bounded_filter(name: str, func):
    """A filter whose arguments are checked (`_check_call`) and whose result is bounded."""
    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _budget.get().spend()
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.Environment,
                                                         jinja2.nodes.EvalContext))]
        if values:
            _check_call(name, values[0], tuple(values[1:]), kwargs)
        result = func(*args, **kwargs)
        if isinstance(result, _SIZED):
            _check_size(len(result))
        return result
    return bounded


class _BoundedNamespace(jinja2.utils.Namespace):
    """namespace(): the only state a template carries across loop iterations, so values stored in it are bounded
    (no doubling a string forty times)."""

    def __setitem__(self, name, value):
        _budget.get().spend()
        if isinstance(value, _SIZED):
            _check_size(len(value))
        super().__setitem__(name, value)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every operator that can build a large value, every call, filter and range()
    checked and charged to the render's budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    _OPERATORS = {"*": operator.mul, "**": operator.pow, "+": operator.add, "%": operator.mod}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.globals["range"] = self._range
        self.globals["namespace"] = _BoundedNamespace
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    @staticmethod
    def _range(*args):
        items = safe_range(*args)
        _budget.get().spend(len(items))
        return items

    def call_binop(self, context, operator_name, left, right):
        _budget.get().spend()
        _check_operands(operator_name, left, right)
        return self._OPERATORS[operator_name](left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _budget.get().spend()
        bound = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        _check_call(getattr(bound, "__name__", "a function"), getattr(bound, "__self__", None), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, _SIZED):
            _check_size(len(result))
        return result


@dataclass
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self):
        env = _BoundedSandbox(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                              extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.source)
        except (jinja2.TemplateError, RecursionError, MemoryError) as e:  # a template nested past the parser's stack
            raise ChatTemplateError(f"the chat template does not parse: {_describe(e)}") from None
        except Exception as e:  # Jinja folds constants while compiling: {{ 9**99999 }} raises here
            raise ChatTemplateError(f"the chat template does not compile: {_describe(e)}") from None

    @classmethod
    def from_model_info(cls, info: ModelInfo) -> "ChatTemplate":
        def token_text(token_id):
            if token_id is None or not (0 <= token_id < len(info.tokens)):
                return ""
            return info.tokens[token_id].decode("utf-8", errors="replace")

        return cls(info.chat_template or CHATML, token_text(info.bos_id), token_text(info.eos_id))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ChatTemplateError("each message needs a string 'role' and a string 'content'")
        token = _budget.set(_Budget())
        try:
            chunks, size = [], 0
            variables = dict(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                             add_generation_prompt=add_generation_prompt, raise_exception=_raise,
                             strftime_now=lambda f: datetime.now().strftime(f))
            for chunk in self._template.generate(**{**variables, **extra}):
                size += len(chunk)
                if size > MAX_RENDERED_CHARS:
                    raise _broken(f"wrote over {MAX_RENDERED_CHARS:,} characters")
                chunks.append(chunk)
                _budget.get().spend()
            return "".join(chunks)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - the template is foreign code: any error it makes is its own
            raise ChatTemplateError(f"the chat template failed to render: {_describe(e)}") from None
        finally:
            _budget.reset(token)

    def add_special_for(self, rendered: str) -> bool:
        """Whether tokenizing the rendered prompt should add BOS (not when the template already wrote it)."""
        return not (self.bos_token and rendered.startswith(self.bos_token))


def _describe(error: Exception) -> str:
    """One line: jinja's own messages as they are, anything else with its type (`ZeroDivisionError: ...`)."""
    text = " ".join(str(error).split()) or "no message"
    return text if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {text}"
