"""Options shared by the commands that load a pair (chat, run, bench, serve), with llama.cpp-style names, and the
one place that turns a user-facing error into one line on stderr and a non-zero exit."""
from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path

import click

from ..config import (CACHE_TYPES, DEFAULT_N_CTX, DRAFTER_KINDS, FLASH_ATTN_MODES, POLICY_NAMES, SPLIT_MODES, LoadConfig,
                      ModelConfig)
from .. import bounds
from ..errors import InvalidParameterError, LlamaspecError
from ..kinds import SPEC_TYPES
from ..sampling import LLAMA_CPP, SAMPLER_ORDERS, parse_samplers

EXIT_ERROR = 1
EXIT_USAGE = 2
_MODEL = ModelConfig()   # the defaults every option shows
_LOAD = LoadConfig()


def fail(message: str, code: int = EXIT_ERROR):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


class GpuLayers(click.ParamType):
    """-ngl N, or llama.cpp's `all` / `auto` (both: every layer, -1)."""

    name = "N|all|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text in ("all", "auto"):
            return -1
        try:
            layers = int(text)
        except ValueError:
            self.fail(f"{value!r} is not a number of layers, all or auto", param, ctx)
        problem = bounds.BOUNDS["n_gpu_layers"].problem(layers)
        if problem is not None:
            self.fail(problem, param, ctx)
        return layers


GPU_LAYERS = GpuLayers()


class Bounded(click.ParamType):
    """A number checked against its row in bounds.py, the same range the library and the server apply."""

    def __init__(self, row: str):
        self.bound = bounds.BOUNDS[row]
        self.name = "integer" if self.bound.integer else "number"

    def convert(self, value, param, ctx):
        number = value
        if isinstance(value, str):
            try:
                number = int(value.strip(), 10) if self.bound.integer else float(value.strip())
            except ValueError:
                self.fail(f"{value[:40]!r} is not {'an integer' if self.bound.integer else 'a number'}", param, ctx)
        problem = self.bound.problem(number)
        if problem is not None:
            self.fail(problem, param, ctx)
        return number


class OneLineUsageError(click.UsageError):
    """A usage error shown as one line (click's default adds the usage text around it)."""

    def show(self, file=None) -> None:
        hint = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"error: {self.format_message()}{hint}", err=True)


# --help sections: option (parameter) name -> section; the rest are listed under "Options"
HELP_SECTIONS = {
    "Model": ("model", "model_draft", "pair_name", "hf_repo", "hf_file", "hf_repo_draft", "no_draft", "assume_yes",
              "chat_template_file", "jinja"),
    "Drafting": ("policy", "draft_max", "draft_min", "draft_p_min", "drafter", "drafter_kind", "spec_type"),
    "Sampling": ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "samplers", "sampler_order",
                 "reasoning", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "grammar",
                 "grammar_file", "json_schema", "json_schema_file"),
    "Placement": ("n_gpu_layers", "draft_n_gpu_layers", "n_ctx", "n_batch", "n_ubatch", "n_threads", "draft_n_threads",
                  "flash_attn", "cache_type_k", "cache_type_v", "n_checkpoints", "main_gpu", "draft_main_gpu", "split_mode",
                  "tensor_split", "rpc_servers", "devices", "draft_device", "no_repack", "no_mmap", "mlock"),
    "Server": ("host", "port", "api_key", "admin_key", "model_id", "max_queue", "cache_ram", "max_body_bytes",
               "shutdown_timeout", "read_timeout", "allowed_hosts", "cors_origins", "access_log"),
}
_SECTION_OF = {name: section for section, names in HELP_SECTIONS.items() for name in names}


class Command(click.Command):
    """A command whose bad flags and values are reported in one line (`@main.command(cls=Command)`), whose
    --help lists its options in sections (model, drafting, sampling, placement, server), and which does not read
    `-sys` as `-s ys`."""

    def parse_args(self, ctx, args):
        try:
            self._refuse_glued_short_options(ctx, args)
            return super().parse_args(ctx, args)
        except OneLineUsageError:
            raise
        except click.UsageError as e:
            raise OneLineUsageError(e.format_message(), ctx) from None

    def _refuse_glued_short_options(self, ctx, args) -> None:
        """click reads an unknown `-sys` as `-s` with the value `ys`; llama.cpp users mean an option `-sys`. A
        single-dash word that is no option of this command, and whose tail after a short option is letters, is
        an unknown option here (`-s42` still works)."""
        params = [p for p in self.get_params(ctx) if isinstance(p, click.Option)]
        names = {name for p in params for name in (*p.opts, *p.secondary_opts)}
        takes_value = {name for p in params if not p.is_flag and not p.count for name in p.opts}
        previous = None
        for arg in args:
            if arg == "--":
                return
            if (previous not in takes_value and arg.startswith("-") and not arg.startswith("--") and len(arg) > 2
                    and arg not in names and arg[:2] in names and arg[2:].isalpha()):
                raise click.NoSuchOption(arg, ctx=ctx)
            previous = arg

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(_SECTION_OF.get(param.name, "Options"), []).append(record)
        for title in (*HELP_SECTIONS, "Options"):
            if title in sections:
                with formatter.section(title):
                    formatter.write_dl(sections[title])


def handle_errors(func):
    """Run a command body; LlamaspecError (and Ctrl-C) become one clear line, unless --debug is given."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        debug = kwargs.pop("debug", False)
        from ..interrupt import exit_on_sigterm

        exit_on_sigterm()   # SIGTERM ends a command through its finally blocks (exit 143), like Ctrl-C (130)
        try:
            return func(*args, **kwargs)
        except LlamaspecError as e:
            if debug:
                traceback.print_exc()
            fail(str(e))
        except click.exceptions.Exit:
            raise
        except click.ClickException as e:
            if debug:
                traceback.print_exc()
            fail(e.format_message(), e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except OSError as e:
            if debug:
                traceback.print_exc()
            fail(f"{e.strerror or e}" + (f": {e.filename}" if getattr(e, "filename", None) else ""))

    return click.option("--debug", is_flag=True, help="Show tracebacks for errors.")(wrapper)


def pair_options(func):
    """-m/-md (or --pair) and the loading and drafting options, as llama.cpp users type them."""
    options = [
        click.option("-m", "--model", "model", type=click.Path(dir_okay=False), help="Target GGUF file."),
        click.option("-md", "--model-draft", "--spec-draft-model", "model_draft", type=click.Path(dir_okay=False),
                     help="Draft GGUF file (same tokenizer as the target), or a sidecar head (mtp-..., with "
                          "--spec-type draft-mtp)."),
        click.option("--pair", "pair_name", help="A named pair from models.toml (see `llamaspec models list`)."),
        *hf_options(),
        click.option("--no-draft", is_flag=True, help="Plain decoding with the target alone."),
        click.option("-ngl", "--n-gpu-layers", "--gpu-layers", "n_gpu_layers", type=GPU_LAYERS,
                     default=_MODEL.n_gpu_layers, show_default=True,
                     help="Target layers on the GPU (-1, all or auto = all)."),
        click.option("-ngld", "--n-gpu-layers-draft", "--spec-draft-ngl", "draft_n_gpu_layers", type=GPU_LAYERS,
                     default=None, help="Draft layers on the GPU (default: as -ngl)."),
        click.option("-c", "--ctx-size", "n_ctx", type=Bounded("n_ctx"), default=None,
                     help=f"Context size in tokens [default: {DEFAULT_N_CTX}, or the --pair entry's]."),
        click.option("-b", "--batch-size", "n_batch", type=Bounded("n_batch"), default=_MODEL.n_batch,
                     show_default=True, help="Tokens per prompt-processing batch."),
        click.option("-ub", "--ubatch-size", "n_ubatch", type=Bounded("n_batch"), default=None,
                     help=f"Tokens per physical batch, at most -b (smaller: smaller compute buffers) "
                          f"[default: {_MODEL.n_ubatch}]."),
        click.option("-t", "--threads", "n_threads", type=Bounded("n_threads"), default=None,
                     help="CPU threads (default: physical cores)."),
        click.option("-td", "--threads-draft", "draft_n_threads", type=Bounded("n_threads"), default=None,
                     help="CPU threads of the draft (default: as -t)."),
        click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(FLASH_ATTN_MODES),
                     default=_MODEL.flash_attn, show_default=True, help="Flash attention."),
        click.option("-ctk", "--cache-type-k", "cache_type_k", default=_MODEL.cache_type_k, show_default=True,
                     type=click.Choice(CACHE_TYPES), help="KV cache type of the keys (q8_0 halves it)."),
        click.option("-ctv", "--cache-type-v", "cache_type_v", default=_MODEL.cache_type_v, show_default=True,
                     type=click.Choice(CACHE_TYPES), help="KV cache type of the values."),
        click.option("-ctxcp", "--ctx-checkpoints", "n_checkpoints", type=Bounded("n_checkpoints"),
                     default=_MODEL.n_checkpoints, show_default=True,
                     help="Turn checkpoints of a hybrid/recurrent target's state a slot keeps in host memory (one "
                          "each prompt end), so a re-rendered conversation restarts there (llama-server's spelling)."),
        click.option("-mg", "--main-gpu", "main_gpu", type=Bounded("main_gpu"), default=_MODEL.main_gpu,
                     show_default=True, help="The GPU that holds the target's output (and the draft)."),
        click.option("-dev-draft", "--main-gpu-draft", "draft_main_gpu", type=Bounded("main_gpu"), default=None,
                     help="Put the draft on this GPU."),
        click.option("-sm", "--split-mode", "split_mode", type=click.Choice(SPLIT_MODES),
                     default=_MODEL.split_mode, show_default=True, help="How the target spreads over GPUs."),
        click.option("-ts", "--tensor-split", "tensor_split", default=None,
                     help="Fractions of the target per GPU, e.g. 3,1."),
        click.option("--rpc", "rpc_servers", default=None,
                     help="llama.cpp rpc-servers host:port,... for the target (RPC build of llama-cpp-python)."),
        click.option("-dev", "--device", "devices", default=None,
                     help="The target's devices, e.g. CUDA0,CUDA1 or none (see `llamaspec doctor`)."),
        click.option("-devd", "--device-draft", "draft_device", default=None,
                     help="Put the whole draft on this device, e.g. CUDA1."),
        click.option("--no-repack", is_flag=True, help="Turn off llama.cpp CPU weight repacking."),
        click.option("--no-mmap", "no_mmap", is_flag=True,
                     help="Read the weights into memory instead of mapping the files (slower to load; the pages "
                          "are not dropped under memory pressure)."),
        click.option("--mlock", is_flag=True, help="Keep the weights in RAM: never swapped out or compressed."),
        click.option("--chat-template-file", "chat_template_file", type=click.Path(dir_okay=False),
                     help="A Jinja chat template to render prompts with instead of the one in the target GGUF."),
        click.option("--jinja", is_flag=True,
                     help="Accepted for llama.cpp command lines: llamaspec always renders the Jinja template."),
        click.option("--policy", type=click.Choice(POLICY_NAMES), default=None,
                     help=f"Draft-length policy [default: {_LOAD.drafting.policy}, or the --pair entry's]."),
        click.option("--draft-max", "--draft", "--spec-draft-n-max", "draft_max", type=Bounded("draft_max"),
                     default=None, help="Draft length (fixed) or its maximum (other policies)."),
        click.option("--draft-min", "--spec-draft-n-min", "draft_min", type=Bounded("draft_min"), default=None,
                     help="Shortest draft worth verifying (shorter ones are dropped)."),
        click.option("--draft-p-min", "--spec-draft-p-min", "draft_p_min", type=Bounded("draft_p_min"), default=None,
                     help="Stop drafting when the draft's top probability falls below this."),
        click.option("--lookup", "drafter", flag_value="lookup+model", default=None,
                     help="Prompt lookup first, then the draft model."),
        click.option("--lookup-only", "drafter", flag_value="lookup",
                     help="Prompt lookup (n-gram) drafting, no draft model."),
        click.option("--drafter", "drafter_kind", type=click.Choice(DRAFTER_KINDS), default=None,
                     help="Where drafts come from: a draft model, prompt lookup, the target's MTP head, or lookup "
                          "first [default: model]; an EAGLE-3 or DFlash draft (-md) picks eagle3 / dflash itself."),
        click.option("--spec-type", "spec_type", default=None, metavar="TYPES",
                     help=f"llama.cpp's names, comma-separated: {', '.join(SPEC_TYPES)} (e.g. draft-mtp)."),
        click.option("--yes", "-y", "assume_yes", is_flag=True, help="Answer yes to download prompts."),
        click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's log."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def hf_options() -> list:
    """-hf / -hff / -hfd: models from a Hugging Face repo, as llama.cpp names them."""
    return [
        click.option("-hf", "-hfr", "--hf-repo", "hf_repo", metavar="REPO[:QUANT]",
                     help="Target from a Hugging Face repo, e.g. ggml-org/Qwen3.6-27B-GGUF:Q4_K_M [QUANT default: "
                          "Q4_K_M, then Q8_0, then the first model file]."),
        click.option("-hff", "--hf-file", "hf_file", metavar="FILE", help="The target's file in the -hf repo."),
        click.option("-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", "hf_repo_draft", metavar="REPO[:QUANT]",
                     help="Draft from a Hugging Face repo: its mtp-/dflash-/eagle3- sidecar when it ships one (and "
                          "the drafter with it), else its model file; -md FILE picks the file."),
    ]


def sampler_options(func=None, *, max_tokens: int | None = 256):
    """--temp, --top-k, ... and -n; `@sampler_options(max_tokens=None)` makes -n default to "until the model
    stops or the context is full"."""
    if func is None:
        return functools.partial(sampler_options, max_tokens=max_tokens)
    options = [
        click.option("-n", "--n-predict", "--predict", "--max-tokens", "-n-predict", "max_tokens",
                     type=Bounded("max_tokens"), default=max_tokens, show_default=max_tokens is not None,
                     help="Tokens to generate" + (" [default: until the context fills]." if max_tokens is None
                                                  else ".")),
        click.option("--temp", "--temperature", "temperature", type=Bounded("temperature"), default=0.0,
                     show_default=True, help="Sampling temperature; 0 = greedy."),
        click.option("--top-k", type=Bounded("top_k"), default=0, show_default=True,
                     help="Keep the k most likely tokens (0 = all)."),
        click.option("--top-p", type=Bounded("top_p"), default=1.0, show_default=True,
                     help="Keep the most likely tokens up to this total probability."),
        click.option("--min-p", type=Bounded("min_p"), default=0.0, show_default=True,
                     help="Drop tokens less likely than this times the most likely one."),
        click.option("-s", "--seed", type=Bounded("seed"), default=None,
                     help="Random seed (sampling is reproducible with one)."),
        click.option("--samplers", default=None, metavar="LIST", callback=_check_sampler_order,
                     help="llama.cpp's sampler order, e.g. top_k;top_p;min_p;temperature (temperature last: the "
                          "default) or temperature;top_k;top_p;min_p; a filter left out is off."),
        click.option("--sampler-order", type=click.Choice(SAMPLER_ORDERS), default=None,
                     callback=_check_sampler_order,
                     help="llama.cpp: top-k/top-p/min-p on the untempered distribution, temperature last "
                          "[default]; openai: temperature first."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def shaping_options(func):
    """llama.cpp's penalties and constrained output (--repeat-penalty, --grammar, -j ...), for run and chat; they
    become a Shaping (`shaping_from_options`) once the target is loaded."""
    options = [
        click.option("--repeat-penalty", type=float, default=1.0, show_default=True,
                     help="Divide the logits of tokens seen in the last --repeat-last-n by this (1 = off)."),
        click.option("--repeat-last-n", type=click.IntRange(min=-1), default=64, show_default=True,
                     help="Tokens the penalties look back over (0 = off, -1 = the whole context)."),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                     help="Subtract this from the logits of tokens seen in the window (0 = off)."),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                     help="Subtract this times the count of each token seen in the window (0 = off)."),
        click.option("--grammar", default=None, metavar="GBNF",
                     help="Constrain the reply to this GBNF grammar (llama.cpp's format)."),
        click.option("--grammar-file", type=click.Path(dir_okay=False), default=None,
                     help="Constrain the reply to the GBNF grammar in FILE."),
        click.option("-j", "--json-schema", "json_schema", default=None, metavar="SCHEMA",
                     help="Constrain the reply to JSON valid under this JSON schema, e.g. '{}' for any object."),
        click.option("-jf", "--json-schema-file", "json_schema_file", type=click.Path(dir_okay=False), default=None,
                     help="Constrain the reply to JSON valid under the JSON schema in FILE."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _read_text(path: str, flag: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise click.BadParameter(f"cannot read {path} ({e.strerror or e})", param_hint=flag) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.BadParameter(f"{path}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})",
                                 param_hint=flag) from None


def check_shaping_options(opts: dict) -> None:
    """Before any model loads: read the grammar / schema files, parse the schema, check the penalties; the result
    (GBNF text or a parsed schema, and the flag it came from) lands in opts["constraint"]."""
    import json

    from ..shaping import Penalties

    given = [(flag, opts.get(name)) for flag, name in (("--grammar", "grammar"), ("--grammar-file", "grammar_file"),
                                                       ("--json-schema", "json_schema"),
                                                       ("--json-schema-file", "json_schema_file"))
             if opts.get(name) is not None]
    if len(given) > 1:
        raise click.UsageError(f"give one of {' and '.join(flag for flag, _ in given)}, not both")
    opts["constraint"] = None
    if given:
        flag, value = given[0]
        text = _read_text(value, flag) if flag.endswith("-file") else value
        if flag.startswith("--json-schema"):
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise click.BadParameter(f"not JSON: {e}", param_hint=flag) from None
            if not isinstance(schema, dict):
                raise click.BadParameter("a JSON schema is an object, e.g. '{\"type\": \"object\"}'",
                                         param_hint=flag)
            opts["constraint"] = ("schema", schema, flag)
        else:
            opts["constraint"] = ("gbnf", text, flag)
    try:
        Penalties(repeat=opts["repeat_penalty"], frequency=opts["frequency_penalty"],
                  presence=opts["presence_penalty"], last_n=opts["repeat_last_n"])
    except InvalidParameterError as e:
        raise click.BadParameter(str(e), param_hint="--" + (e.param or "repeat_penalty").replace("_", "-")) from None


def shaping_from_options(opts: dict, model):
    """The Shaping of --repeat-penalty, --grammar, -j and the like for `model` (the loaded target), or None when
    none is asked for; call check_shaping_options first."""
    from ..shaping import Penalties, Shaping

    grammar = None
    if opts.get("constraint") is not None:
        from ..backend.grammar import Grammar, json_schema_gbnf

        kind, value, flag = opts["constraint"]
        gbnf = json_schema_gbnf(value, flag) if kind == "schema" else value
        grammar = Grammar.compile(model, gbnf, flag)
    penalties = Penalties(repeat=opts["repeat_penalty"], frequency=opts["frequency_penalty"],
                          presence=opts["presence_penalty"], last_n=opts["repeat_last_n"])
    shaping = Shaping(grammar=grammar, penalties=penalties if penalties.active else None)
    return shaping if shaping.active else None


def reasoning_option(func=None, *, help: str = "Thinking (the chat template's enable_thinking); auto: the "
                                                 "template's default."):
    """--reasoning on|off|auto: a thinking model's template switch (enable_thinking), as llama.cpp's -rea."""
    from ..reasoning import REASONING_MODES

    option = click.option("-rea", "--reasoning", "reasoning", type=click.Choice(REASONING_MODES), default="auto",
                          show_default=True, help=help)
    return option(func) if func is not None else option


def _check_sampler_order(ctx, param, value):
    """--samplers as (order, named filters), checked as the flags are parsed (before any model loads), and
    --sampler-order, which must agree with it."""
    if value is None:
        return None
    if param.name == "samplers":
        try:
            value = parse_samplers(value)
        except InvalidParameterError as e:
            raise click.BadParameter(str(e).removeprefix("samplers: "), ctx, param) from None
    order = value[0] if param.name == "samplers" else value
    other = ctx.params.get("sampler_order" if param.name == "samplers" else "samplers")
    other_order = other[0] if isinstance(other, tuple) else other
    if other_order is not None and other_order != order:
        raise click.BadParameter(f"--samplers and --sampler-order disagree (one says {other_order}, the other "
                                 f"{order})", ctx, param)
    return value


def sampler_kwargs(opts: dict) -> dict:
    """The sampling keywords of Pair.stream from the options: llama.cpp's order unless told otherwise, and with
    --samplers the filters it leaves out off (as in llama.cpp)."""
    kwargs = {k: opts[k] for k in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed")}
    chain = opts.get("samplers")
    kwargs["sampler_order"] = chain[0] if chain else opts.get("sampler_order") or LLAMA_CPP
    for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
        if chain and name not in chain[1]:
            kwargs[name] = off
    return kwargs


def not_utf8(text: str) -> str | None:
    """Where `text` stops being UTF-8 ("byte 0xff at offset 3"), or None. Python hands over argv bytes (and
    stdin bytes under a C locale) that are not UTF-8 as lone surrogates U+DC80..U+DCFF, which nothing downstream
    can encode."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        offset = len(text[:e.start].encode("utf-8"))
        code = ord(text[e.start])
        if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's stand-in for the byte code - 0xDC00
            return f"byte 0x{code - 0xDC00:02x} at offset {offset}"
        return f"a lone surrogate U+{code:04X} at offset {offset}"


def utf8_argument(text: str | None, name: str) -> str | None:
    """`text` unchanged, or a usage error naming the first byte that is not UTF-8."""
    problem = not_utf8(text) if text is not None else None
    if problem is not None:
        raise click.BadParameter(f"not valid UTF-8: {problem}", param_hint=name)
    return text


def decode_utf8(data: bytes, source: str) -> str:
    """Input text is UTF-8; anything else is an error naming the first bad byte (never silently replaced)."""
    from ..errors import PromptFileError

    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{source}: not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} "
                              "(convert it first, e.g. with iconv)") from None
