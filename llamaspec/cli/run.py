"""`llamaspec run`: one-shot generation for scripts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import main
from .options import (Command, check_shaping_options, decode_utf8, handle_errors, pair_options, reasoning_option,
                      sampler_kwargs, sampler_options, shaping_from_options, shaping_options, utf8_argument, warn)
from .pair_choice import load_pair_from_options
from .textfile import MAX_TEXT_BYTES, read_at_most, read_text_file, text_limit


def read_prompt(prompt: str | None, prompt_file: str | None, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """PROMPT, the text of -f FILE, or stdin for `-` (either form); all of them UTF-8, a file or stdin of at most
    max_bytes."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt as an argument or with -f FILE, not both")
    if prompt is None and prompt_file is None:
        raise click.UsageError("no prompt: give PROMPT, -f FILE, or - to read stdin")
    if prompt == "-" or prompt_file == "-":
        stream = getattr(sys.stdin, "buffer", None)
        return decode_utf8(read_at_most(stream, max_bytes, "stdin"), "stdin") if stream is not None \
            else sys.stdin.read()
    if prompt is not None:
        return utf8_argument(prompt, "PROMPT")
    return read_text_file(Path(prompt_file), max_bytes, "prompt file")


def chat_tokens(pair, messages: list[dict]) -> list[int]:
    """The conversation rendered with the chat template embedded in the target GGUF, as token ids."""
    from ..chat_template import ChatTemplate

    template = ChatTemplate.from_model_info(pair.target.info)
    rendered = template.render(messages)
    return pair.tokenize(rendered, add_special=template.add_special_for(rendered))


def use_chat_template(pair, raw: bool, use_chat: bool) -> bool:
    """An instruct model (a chat template in the target GGUF) answers the prompt as a user message, as llama-cli
    and ollama run do; --raw continues the text instead; --chat insists on the template."""
    if raw and use_chat:
        raise click.UsageError("give either --raw or --chat/--system, not both")
    return not raw and (use_chat or bool(pair.target.info.chat_template))


@main.command(cls=Command)
@click.argument("prompt", required=False)
@click.option("-p", "--prompt", "prompt_option", default=None, help="The prompt (as PROMPT).")
@click.option("-f", "--file", "prompt_file", type=click.Path(dir_okay=False, allow_dash=True),
              help="Read the prompt from FILE (- = stdin).")
@click.option("--raw", is_flag=True, help="Continue PROMPT as plain text, without the chat template.")
@click.option("--chat", "use_chat", is_flag=True,
              help="Apply the chat template (the default where the target has one).")
@click.option("-sys", "--system", "--system-prompt", "system", default=None, help="System prompt (implies --chat).")
@click.option("--stop", multiple=True, help="Stop at this string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the text and the statistics as JSON.")
@click.option("--stats", "show_stats", is_flag=True, help="Print a statistics line on stderr.")
@pair_options
@sampler_options
@shaping_options
@reasoning_option
@handle_errors
def run(prompt, prompt_option, prompt_file, raw, use_chat, system, stop, as_json, show_stats, reasoning, **opts):
    """Answer PROMPT (or -p PROMPT, -f FILE, - for stdin) and print the text: with the target's chat template
    when it has one (an instruct model), --raw for plain completion.

    Text is UTF-8: a prompt, system prompt or stop string with a byte that is not UTF-8 is an error naming the
    byte and its offset (convert such input first, e.g. with iconv).
    """
    if prompt is not None and prompt_option is not None:
        raise click.UsageError("give the prompt once: PROMPT or -p PROMPT")
    text = read_prompt(prompt if prompt is not None else prompt_option, prompt_file, text_limit(opts.get("n_ctx")))
    system = utf8_argument(system, "--system")
    stop = [utf8_argument(s, "--stop") for s in stop]
    if raw and (use_chat or system is not None):   # before a model loads
        use_chat_template(None, raw, True)
    check_shaping_options(opts)
    pair = load_pair_from_options(opts, use_default_pair=True)
    try:
        shaping = shaping_from_options(opts, pair.target)
        if use_chat_template(pair, raw, use_chat or system is not None):
            from ..conversation import chat_prompt

            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            source, starts_inside = chat_prompt(pair, messages, reasoning)
        else:
            source, starts_inside = text, False
        from ..reasoning import ThinkSplitter

        splitter, pieces, thinking = ThinkSplitter(starts_inside) if source is not text else None, [], []
        for piece in pair.stream(source, stop=list(stop), shaping=shaping, **sampler_kwargs(opts)):
            for part in splitter.feed(piece.text) if splitter else [piece]:
                if getattr(part, "kind", "content") == "reasoning":   # the thinking: on stderr, apart from the answer
                    thinking.append(part.text)
                    if not as_json:
                        click.echo(click.style(part.text, dim=True), nl=False, err=True)
                    continue
                pieces.append(part.text)
                if not as_json:
                    click.echo(part.text, nl=False)
        for part in splitter.flush() if splitter else []:
            (thinking if part.kind == "reasoning" else pieces).append(part.text)
            if not as_json:
                click.echo(part.text, nl=False, err=part.kind == "reasoning")
        stats = pair.last_stats
        if as_json:
            click.echo(json.dumps({"text": "".join(pieces), "reasoning": "".join(thinking).strip() or None,
                                   "finish_reason": stats.finish_reason,
                                   "model": str(pair.target.path),
                                   "draft": str(pair.draft.path) if pair.draft is not None else None,
                                   "drafter": pair.drafter_kind,
                                   "stats": stats.to_dict()}, indent=2))
        else:
            click.echo()
        if stats.finish_reason == "context":
            warn(f"generation stopped: the context ({pair.n_ctx} tokens) is full; raise it with -c")
        if show_stats:
            click.echo(stats.summary(), err=True)
    finally:
        pair.close()
