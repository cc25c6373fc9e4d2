"""From the options to a loaded pair: which drafter (--spec-type, --drafter, --lookup), which files (-m/-md,
--pair, -hf, the default pair for this machine), and load_pair with the options' settings."""
from __future__ import annotations

import sys

import click

from .. import bounds, interrupt
from ..config import MTP_DRAFTERS, LoadConfig
from ..kinds import COMBINATIONS, KINDS, SPEC_TYPES
from .options import warn


# llama.cpp's --spec-type names -> llamaspec's drafter kinds (a comma-separated pair: lookup first, as llama.cpp
# tries its n-gram drafters before the model ones)
_SPEC_PAIRS = COMBINATIONS
_SPEC_ELSEWHERE = ("draft-dspark", "ngram-map-k", "ngram-map-k4v", "ngram-mod",
                   "ngram-cache")


def spec_type_drafter(value: str) -> str | None:
    """--spec-type draft-mtp -> "mtp"; "ngram-simple,draft-mtp" -> "lookup+mtp"; "none" -> None (no drafting)."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in SPEC_TYPES]
    if unknown:
        also = " (a llama.cpp drafter llamaspec does not have)" if unknown[0] in _SPEC_ELSEWHERE else ""
        raise click.BadParameter(f"{unknown[0]!r}{also}; choose from {', '.join(SPEC_TYPES)}", param_hint="--spec-type")
    kinds = sorted({SPEC_TYPES[n] for n in names if SPEC_TYPES[n]}, key=lambda k: k != "lookup")
    if not kinds:
        return None
    if len(kinds) == 1:
        return kinds[0]
    if tuple(kinds) not in _SPEC_PAIRS:
        raise click.BadParameter(f"{value!r}: one drafter, or ngram-simple with one other", param_hint="--spec-type")
    return _SPEC_PAIRS[tuple(kinds)]


def chosen_drafter(opts: dict) -> tuple[str | None, bool]:
    """(drafter kind or None for the default, plain decoding asked for) from --lookup/--lookup-only, --drafter and
    --spec-type; they must agree."""
    given = {}
    for flag, kind in (("--lookup/--lookup-only", opts.get("drafter")), ("--drafter", opts.get("drafter_kind"))):
        if kind is not None:
            given[flag] = kind
    plain = False
    if opts.get("spec_type") is not None:
        kind = spec_type_drafter(opts["spec_type"])
        if kind is None:
            plain = True
        else:
            given["--spec-type"] = kind
    if len(set(given.values())) > 1:
        raise click.UsageError(" and ".join(f"{flag} {kind}" for flag, kind in given.items()) + " disagree")
    return next(iter(given.values()), None), plain


DEFAULT_PAIR = "default"


def default_pair_for_this_machine() -> str:
    """The models.toml pair offered when no model is given, from the free memory of the largest NVIDIA GPU (when
    this llama.cpp build can use it)."""
    from .. import sysinfo
    from ..backend import supports_gpu_offload
    from ..hub.registry import default_pair_name

    gpus = sysinfo.nvidia_gpus() if supports_gpu_offload() else []
    return default_pair_name(max((g.free_mib / 1024 for g in gpus), default=None))


def resolve_model_paths(opts: dict, use_default_pair: bool = False) -> tuple[str, str | None, dict]:
    """(target path, draft path or None, defaults from the registry entry). With no model given, the registry's
    `default` pair when use_default_pair (the registry asks before downloading), else a usage error."""
    defaults: dict = {}
    target, draft = opts.get("model"), opts.get("model_draft")
    pair_name = opts.get("pair_name")
    if opts.get("hf_repo") or opts.get("hf_repo_draft"):
        return resolve_hf_paths(opts)
    if pair_name and target:
        raise click.UsageError("give either --pair or -m/--model, not both")
    if draft and not target and not pair_name:
        raise click.UsageError("-md/--model-draft needs a target: add -m TARGET.gguf")
    if not target and not pair_name and use_default_pair:
        pair_name = default_pair_for_this_machine()
    if pair_name:
        try:
            from ..hub.registry import resolve_pair
        except ImportError:
            raise click.UsageError("no model registry in this install: give -m TARGET.gguf [-md DRAFT.gguf]")
        confirm = None
        if on_terminal():   # the question, with what the pair needs against what this machine has, is the CLI's
            def confirm(_question, name=pair_name):
                question, fits = download_question(name)
                return click.confirm(question, default=fits, err=True)
        target, draft, defaults = resolve_pair(pair_name, assume_yes=opts.get("assume_yes", False), confirm=confirm)
    if not target:
        raise click.UsageError("no model: give -m TARGET.gguf [-md DRAFT.gguf] or --pair NAME")
    drafter, plain = chosen_drafter(opts)
    if drafter and KINDS[drafter].draft_file == "model" and not draft and opts.get("spec_type") and not opts.get("no_draft"):
        raise click.UsageError(f"--spec-type {opts['spec_type']} needs a draft model: add -md DRAFT.gguf")
    if opts.get("no_draft") or plain:
        draft = None
        defaults = {k: v for k, v in defaults.items() if k != "drafter"}   # plain decoding: nothing drafts
    elif drafter in MTP_DRAFTERS and not opts.get("model_draft") and defaults.get("drafter") not in MTP_DRAFTERS:
        draft = None          # the target's head drafts: a --pair entry's draft model is not loaded (an MTP
                              # entry's draft is its head file, kept)
    return str(target), (str(draft) if draft else None), defaults


def hf_refs(opts: dict):
    """(target ModelRef, draft ModelRef or None, drafter kind or None) of -hf / -hfd; -m and -md are then local
    files or, with -hfd, the draft repo's file."""
    from ..hub.hf_repo import resolve_hf
    from ..hub.registry import ModelRef

    if opts.get("pair_name"):
        raise click.UsageError("give either --pair or -hf/-hfd, not both")
    if opts.get("hf_repo") and opts.get("model"):
        raise click.UsageError("give either -m or -hf for the target, not both")
    if not opts.get("hf_repo") and not opts.get("model"):
        raise click.UsageError("-hfd/--spec-draft-hf needs a target: add -hf REPO or -m TARGET.gguf")
    drafter, _ = chosen_drafter(opts)
    draft_file = opts.get("model_draft") if opts.get("hf_repo_draft") else None
    target, draft, kind = resolve_hf(opts.get("hf_repo"), opts.get("hf_repo_draft"), drafter,
                                     target_file=opts.get("hf_file"), draft_file=draft_file)
    if target is None:
        target = ModelRef(path=str(opts["model"]))
    if draft is None and opts.get("model_draft") and not opts.get("hf_repo_draft"):
        draft = ModelRef(path=str(opts["model_draft"]))
    return target, draft, kind


def resolve_hf_paths(opts: dict) -> tuple[str, str | None, dict]:
    """-hf / -hfd as local paths, downloading into the Hugging Face cache (after asking, on a terminal)."""
    from ..hub.hf_repo import fetch_refs

    target, draft, kind = hf_refs(opts)
    if opts.get("no_draft") or chosen_drafter(opts)[1]:
        draft, kind = None, None
    target_path, draft_path = fetch_refs([target, draft], opts.get("assume_yes", False), confirm_on_terminal())
    defaults = {"drafter": kind} if kind and not chosen_drafter(opts)[0] else {}
    return str(target_path), (str(draft_path) if draft_path else None), defaults


def on_terminal() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def confirm_on_terminal():
    """A yes/no question for the library to ask through (None without a terminal: the library then says how to
    go on instead of asking)."""
    if not on_terminal():
        return None
    return lambda question: click.confirm(question, default=True, err=True)


def download_question(pair_name: str) -> tuple[str, bool]:
    """The question asked before a named pair's files are downloaded (their size, the GPU memory the pair was
    chosen for, what this machine has) and its default: yes only when the pair fits this machine's GPU, or needs
    none."""
    from .. import sysinfo
    from ..backend import supports_gpu_offload
    from ..hub.download import downloaded
    from ..hub.registry import VRAM_FREE_SHARE, get_pair

    entry = get_pair(pair_name)
    missing = [ref for ref, path in zip(entry.models, downloaded(entry)) if path is None]
    size_gb = sum(ref.size_gb or 0 for ref in missing)
    files = " and ".join(ref.file for ref in missing) + (f" ({size_gb:.1f} GB)" if size_gb else "")
    gpus = sysinfo.nvidia_gpus() if supports_gpu_offload() else []
    gpu = max(gpus, key=lambda g: g.free_mib, default=None)
    if gpu is not None:
        has = f"this machine has {gpu.name} with {gpu.free_mib / 1024:.1f} GiB free"
    elif sysinfo.nvidia_gpu_signs():
        has = "this llama-cpp-python build cannot use this machine's GPU (`llamaspec doctor` says how to fix it)"
    else:
        has = "this machine has no GPU"
    if not entry.vram_gb:
        return f"Pair {entry.name!r} needs {files} from Hugging Face (it runs on the CPU). Download now?", True
    fits = gpu is not None and entry.vram_gb * VRAM_FREE_SHARE <= gpu.free_mib / 1024
    advice = "" if fits else (" On the CPU it would be very slow; without --pair, llamaspec picks a pair for "
                              "this machine.")
    return (f"Pair {entry.name!r} needs {files} from Hugging Face and a GPU with {entry.vram_gb:g} GB; {has}."
            f"{advice} Download now?"), fits


def warn_before_load(target: str, draft: str | None, n_gpu_layers: int, draft_n_gpu_layers: int | None) -> None:
    """GPU layers asked for on a CPU-only build; models on a Windows drive under WSL2."""
    from .. import sysinfo
    from ..backend import supports_gpu_offload

    asked_gpu = n_gpu_layers != 0 or (draft_n_gpu_layers or 0) != 0
    signs = sysinfo.nvidia_gpu_signs() if asked_gpu and not supports_gpu_offload() else []
    if signs:
        warn(f"this machine has an NVIDIA GPU ({', '.join(signs)}) but this llama-cpp-python build is CPU-only: "
             f"everything runs on the CPU. Install a CUDA build: {sysinfo.CUDA_REINSTALL}")
    elif n_gpu_layers > 0 and not supports_gpu_offload():
        warn("this llama-cpp-python build cannot use a GPU; running on the CPU "
             "(`llamaspec doctor` shows how to install a CUDA build)")
    for path in (target, draft):
        if path and sysinfo.on_windows_drive(path) and sysinfo.is_wsl():
            warn(f"{path} is on a Windows drive; under WSL2 it loads very slowly. "
                 "Copy it into the Linux file system (e.g. ~/models)")


def parse_devices(value: str | None) -> tuple[str, ...] | None:
    """--device CUDA0,CUDA1 -> ("CUDA0", "CUDA1"); "none" -> () (CPU only); unset -> None (all devices)."""
    if value is None:
        return None
    if value.strip().lower() == "none":
        return ()
    return tuple(v.strip() for v in value.split(",") if v.strip())


def load_pair_from_options(opts: dict, use_default_pair: bool = False, log_loads: bool = False):
    """Load the pair the options describe (warns and continues on CPU when GPU layers were asked for but the
    installed llama.cpp cannot offload), with a line per model on a terminal (loadline.py; `log_loads`: elsewhere
    too)."""
    import contextlib

    from ..backend import watch_loads
    from ..loading import load_pair
    from .loadline import load_line

    template = read_chat_template(opts.get("chat_template_file"))   # a bad file fails before the long load
    target, draft, defaults = resolve_model_paths(opts, use_default_pair)
    n_gpu_layers = opts["n_gpu_layers"]
    warn_before_load(target, draft, n_gpu_layers, opts.get("draft_n_gpu_layers"))
    tensor_split = None
    if opts.get("tensor_split"):
        try:
            tensor_split = bounds.check_tensor_split(float(x) for x in opts["tensor_split"].split(","))
        except ValueError as e:   # not numbers, or not shares (InvalidParameterError is a ValueError)
            shown = opts["tensor_split"][:60]
            raise click.BadParameter(str(e) if "tensor_split" in str(e) else f"not a list of numbers: {shown!r}",
                                     param_hint="--tensor-split")
    config = LoadConfig().replace(**defaults).replace(
        n_gpu_layers=n_gpu_layers, draft_n_gpu_layers=opts.get("draft_n_gpu_layers"), n_ctx=opts.get("n_ctx"),
        n_batch=opts["n_batch"], n_ubatch=opts.get("n_ubatch"), n_threads=opts.get("n_threads"),
        draft_n_threads=opts.get("draft_n_threads"),
        flash_attn=opts["flash_attn"], cache_type_k=opts["cache_type_k"], cache_type_v=opts["cache_type_v"],
        main_gpu=opts["main_gpu"], draft_main_gpu=opts.get("draft_main_gpu"), split_mode=opts["split_mode"],
        tensor_split=tensor_split, rpc_servers=opts.get("rpc_servers"), devices=parse_devices(opts.get("devices")),
        draft_device=opts.get("draft_device"), cache_ram=opts.get("cache_ram"),
        no_repack=True if opts.get("no_repack") else None,
        use_mmap=False if opts.get("no_mmap") else None, use_mlock=True if opts.get("mlock") else None,
        policy=opts.get("policy"), draft_max=opts.get("draft_max"), draft_min=opts.get("draft_min"),
        draft_p_min=opts.get("draft_p_min"), drafter=chosen_drafter(opts)[0], verbose=opts.get("verbose", False))
    line = load_line(log_loads)
    # a Ctrl-C / SIGTERM anywhere in the load is a flag llama.cpp's callbacks read, raised once load_pair returns:
    # arriving while llama.cpp calls back into Python (its log, while devices are listed), it would be lost
    with watch_loads(line) if line is not None else contextlib.nullcontext(), interrupt.signals_stop():
        pair = load_pair(target, draft, config=config)
    if template is not None:   # every prompt of this pair (run, chat, the server) is rendered with it
        pair.target.info.metadata["tokenizer.chat_template"] = template.source
    return pair


def read_chat_template(path: str | None):
    """--chat-template-file as a ChatTemplate (checked: UTF-8, a Jinja template that compiles), or None."""
    if path is None:
        return None
    from ..chat_template import ChatTemplate, ChatTemplateError
    from ..errors import PromptFileError
    from .options import decode_utf8

    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise PromptFileError(f"{path}: cannot read the chat template ({e.strerror or e})") from None
    try:
        return ChatTemplate(decode_utf8(data, path))
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{path}: {e}") from None


