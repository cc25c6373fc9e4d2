"""Chat templates are code from the model file: whatever one raises becomes a ChatTemplateError, and a render that
would build a huge value or run for ever is stopped, while real templates render exactly as before."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.llama_asserts import find_llama_src
from llamaspec import chat_template
from llamaspec.chat_template import CHATML, ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Write {{code}} % 100"}]


@pytest.mark.parametrize("source, fragment", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{{ messages[0].content.nope() }}", "has no attribute 'nope'"),
    ("{{ (1).__class__.__mro__ }}", "unsafe"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ raise_exception('no tools here') }}", "refused these messages: no tools here"),
    ("{{" * 3000 + "1" + "}}" * 3000, "does not parse"),
    ("{% for x in %}", "does not parse"),
])
def test_any_error_a_template_makes_is_a_chat_template_error(source, fragment):
    with pytest.raises(ChatTemplateError) as failed:
        ChatTemplate(source).render(MESSAGES)
    assert fragment in str(failed.value) and "\n" not in str(failed.value)


@pytest.mark.parametrize("source, fragment", [
    ("{{ 9**99999 }}", "9 ** 99999"),
    ("{{ 'x' * 10**9 }}", "1,000,000,000 items"),
    ("{{ [0] * 10**8 }}", "100,000,000 items"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "items"),
    ("{{ 'x'|center(999999999) }}", "calls center"),
    ("{{ 'x'.ljust(999999999) }}", "calls ljust"),
    ("{{ '%0999999999d' % 1 }}", "field width"),
    ("{{ '{:>999999999}'.format(1) }}", "field width"),
    ("{{ ('a' * 1000000)|replace('a', 'aaaaaaaaaaaaaaaaaaaa') }}", "20,000,000 items"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "wrote over"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "did not finish"),
])
def test_a_render_that_would_build_a_huge_value_or_run_for_ever_is_stopped(source, fragment):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as stopped:
        ChatTemplate(source).render(MESSAGES)
    assert fragment in str(stopped.value)
    assert time.monotonic() - start < chat_template.MAX_RENDER_SECONDS


def test_small_arithmetic_and_long_conversations_still_render():
    small = ChatTemplate("{{ 2**64 }}|{{ 'ab' * 3 }}|{{ range(5)|sum }}|{{ '{}'.format(1700000000) }}").render(MESSAGES)
    assert small == "18446744073709551616|ababab|10|1700000000"
    conversation = [{"role": "user", "content": "x " * 50_000}] * 40
    assert len(ChatTemplate(CHATML).render(conversation)) > 4_000_000


def test_the_templates_llama_cpp_ships_render_as_with_the_plain_sandbox():
    """The bounds change no output: every template in llama.cpp's models/templates renders as jinja2's own
    ImmutableSandboxedEnvironment renders it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    src = find_llama_src()
    folder = src.parent / "models" / "templates" if src is not None else None
    if folder is None or not folder.is_dir():
        pytest.skip("llama.cpp source not found (benchmarks/build-llama-tools.sh unpacks it)")
    rendered = 0
    for path in sorted(Path(folder).glob("*.jinja")):
        template = ChatTemplate(path.read_text(), "<s>", "</s>")
        plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[
            chat_template._IgnoreGenerationTags, "jinja2.ext.loopcontrols"])
        plain.filters["tojson"] = chat_template._tojson
        reference = plain.from_string(path.read_text())
        kwargs = dict(messages=MESSAGES, bos_token="<s>", eos_token="</s>", add_generation_prompt=True,
                      raise_exception=chat_template._raise, strftime_now=lambda f: "01 Jan 2026")
        try:
            expected = reference.render(**kwargs)
        except Exception:  # noqa: BLE001 - a template that needs what these messages lack (tools, ...)
            continue
        assert template.render(MESSAGES, strftime_now=lambda f: "01 Jan 2026") == expected, path.name
        rendered += 1
    assert rendered > 40
