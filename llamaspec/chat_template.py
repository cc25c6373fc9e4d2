"""Chat templates: the Jinja template embedded in a GGUF (`tokenizer.chat_template`), rendered the way
llama-cpp-python and Transformers render it, in a sandboxed environment. Knows nothing about models beyond the
template text and the BOS/EOS token strings.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


@dataclass
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self):
        env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from None
        except Exception as e:  # Jinja folds constants while compiling: {{ 9**99999 }} raises here
            raise ChatTemplateError(f"the chat template does not compile: {type(e).__name__}: {e}") from None

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
        try:
            return self._template.render(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt, raise_exception=_raise,
                                         strftime_now=lambda f: datetime.now().strftime(f), **extra)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {e}") from None
        except Exception as e:  # the template's own expressions ({{ 1/0 }}, {{ 9**99999 }}) raise plain errors
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None

    def add_special_for(self, rendered: str) -> bool:
        """Whether tokenizing the rendered prompt should add BOS (not when the template already wrote it)."""
        return not (self.bos_token and rendered.startswith(self.bos_token))
