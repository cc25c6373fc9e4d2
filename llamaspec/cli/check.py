"""`llamaspec check`: will this pair work, and does it fit, without loading any weights."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import click

from . import main
from ..config import CACHE_TYPES, DEFAULT_CACHE_RAM, FLASH_ATTN_MODES, LoadConfig, ModelConfig
from ..kinds import KINDS
from .options import Bounded, Command, fail, handle_errors, hf_options
from .pair_choice import hf_refs

KV_CHOICES = click.Choice(CACHE_TYPES)
_MODEL = ModelConfig()   # the defaults every option shows


def finite(ctx, param, value: float | None) -> float | None:
    """FloatRange lets nan and inf through (nan compares false with its bounds)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of GiB")
    return value


def gib(n_bytes: int) -> str:
    from ..gguf.memory import GiB, MiB

    return f"{n_bytes / GiB:.2f} GiB" if n_bytes >= GiB else f"{n_bytes / MiB:.0f} MiB"


def default_vram(main_gpu: int) -> tuple[float, str] | None:
    """GiB and where the number came from: free memory of the main GPU per nvidia-smi; None without a GPU."""
    from ..sysinfo import nvidia_gpus

    gpus = nvidia_gpus()
    gpu = next((g for g in gpus if g.index == main_gpu), gpus[0] if gpus else None)
    if gpu is None:
        return None
    return gpu.free_mib / 1024, f"free on GPU {gpu.index} ({gpu.name}) per nvidia-smi"


def print_compatibility(report) -> None:
    width = max(len(f.label) for f in report.fields)
    click.echo("Pair compatibility (the check run at load time):")
    for f in report.fields:
        value = f.target if f.target == f.draft else f"target {f.target} / draft {f.draft}"
        click.echo(f"  {f.label:<{width}}  {'OK      ' if f.ok else 'MISMATCH'}  {value}")
    click.echo("  => compatible" if report.compatible else f"  => NOT compatible: {report.mismatch}")


def describe_mtp_head(mtp) -> str:
    if mtp is None:
        return "none (no nextn block: --spec-type draft-mtp cannot draft with it)"
    return (f"{mtp.n_layers} nextn block(s): weights {gib(mtp.weights)} (in the file; loaded only to draft with "
            f"it), its context's KV cache {gib(mtp.kv_cache)} and compute {gib(mtp.compute)}")


def print_plan(plan, vram_source: str) -> None:
    s = plan.settings
    click.echo(f"Memory plan: context {s.n_ctx}, KV cache {s.type_k}/{s.type_v}, micro-batch {s.n_ubatch}, "
               f"flash attention {'on' if s.flash_attn else 'off'}; GPU {plan.vram_bytes / 2**30:.1f} GiB "
               f"({vram_source})")
    state = any(m.recurrent for m in plan.models)  # a recurrent state column only where there is one
    rows = [("", "weights", "KV cache") + (("state",) if state else ()) + ("compute", "on GPU", "CPU-only RAM")]
    for role, m in (("target", plan.target), ("draft", plan.draft)):
        if m is not None:
            layers = "all" if m.fully_offloaded else f"{max(m.n_gpu_layers, 0)}/{m.n_layer} layers"
            rows.append((f"{role} ({layers})", gib(m.weights), gib(m.kv_cache))
                        + ((gib(m.recurrent + m.checkpoints),) if state else ())
                        + (gib(m.compute), gib(m.gpu_total), gib(m.total)))
    blank = ("",) * (4 if state else 3)
    rows.append(("GPU runtime (estimate)",) + blank + (gib(plan.overhead), ""))
    rows.append(("total",) + blank + (gib(plan.gpu_bytes), gib(plan.ram_bytes_cpu_only)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    if state:
        click.echo(f"  state: recurrent state (F32) with {s.n_rs_seq} rollback snapshots where the arch has them, "
                   f"a device checkpoint where needed, and {s.n_checkpoints} turn checkpoints in host RAM")
    spare = plan.vram_bytes - plan.gpu_bytes
    if plan.fits:
        where = "as asked" if not all(m.fully_offloaded for m in plan.models) else "fully offloaded"
        click.echo(f"  => fits {where}, {gib(spare)} to spare")
        return
    click.echo(f"  => does not fit: needs {gib(plan.gpu_bytes)} of {gib(plan.vram_bytes)}")
    if not plan.suggestions:
        click.echo("  nothing fits on this GPU; run on the CPU (-ngl 0 -ngld 0)")
    for sug in plan.suggestions:
        click.echo(f"  fits with {sug.flags:<30} {gib(sug.gpu_bytes):>10} on the GPU  ({sug.note})")


def print_cpu_plan(plan, mtp_added: int | None) -> None:
    """The plan of a machine without a GPU: every buffer in RAM, against this machine's memory."""
    from .. import sysinfo

    s = plan.settings
    click.echo(f"Memory plan: context {s.n_ctx}, KV cache {s.type_k}/{s.type_v}, micro-batch {s.n_ubatch}; no GPU found: "
               "runs on the CPU (--vram GiB plans for a GPU)")
    state = any(m.recurrent for m in plan.models)  # a recurrent state column only where there is one
    rows = [("", "weights", "KV cache") + (("state",) if state else ()) + ("compute", "RAM")]
    for role, m in (("target", plan.target), ("draft", plan.draft)):
        if m is not None:
            rows.append((role, gib(m.weights), gib(m.kv_cache))
                        + ((gib(m.recurrent + m.checkpoints),) if state else ()) + (gib(m.compute), gib(m.total)))
    if mtp_added is not None:
        rows.append(("drafting with the MTP head",) + ("",) * (len(rows[0]) - 2) + (gib(mtp_added),))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    need = plan.ram_bytes_cpu_only + (mtp_added or 0)
    total, available = sysinfo.total_ram_bytes(), sysinfo.available_ram_bytes()
    if not total:
        click.echo(f"  => runs on the CPU; needs {gib(need)} of RAM (this machine's memory is unknown)")
        return
    has = f"this machine has {gib(total)}" + (f" ({gib(available)} available now)" if available else "")
    if need <= (available or total):
        click.echo(f"  => runs on the CPU; needs {gib(need)} of RAM, {has}")
    elif need <= total:
        click.echo(f"  => runs on the CPU if memory is freed: needs {gib(need)} of RAM, {has}")
    else:
        click.echo(f"  => does not fit: needs {gib(need)} of RAM, {has} (a smaller quant or context: -c, -ctk q8_0)")


def read_headers(target, draft, pair_name, hf_repo, hf_file, hf_repo_draft):
    """The two headers (draft None without one): local files are read, files on the hub are read in part."""
    from ..gguf.reader import read_model_info
    from ..hub.remote import read_header

    if pair_name and (target or hf_repo or hf_repo_draft):
        raise click.UsageError("give either --pair or the models (TARGET, -hf), not both")
    if pair_name:
        from ..hub.registry import get_pair

        refs = get_pair(pair_name).models
    elif hf_repo or hf_repo_draft:
        target_ref, draft_ref, _ = hf_refs({"hf_repo": hf_repo, "hf_file": hf_file, "hf_repo_draft": hf_repo_draft,
                                            "model": target, "model_draft": draft})
        refs = (target_ref,) if draft_ref is None else (target_ref, draft_ref)
    elif target:
        return read_model_info(target), (read_model_info(draft) if draft else None)
    else:
        raise click.UsageError("no model: give TARGET [DRAFT], --pair NAME or -hf REPO[:QUANT]")
    infos = [read_header(ref) for ref in refs]
    return infos[0], (infos[1] if len(infos) > 1 else None)


@main.command(cls=Command)
@click.argument("target", required=False, type=click.Path(dir_okay=False))
@click.argument("draft", required=False, type=click.Path(dir_okay=False))
@click.option("-m", "--model", "model", type=click.Path(dir_okay=False), help="Target GGUF file (or TARGET).")
@click.option("-md", "--model-draft", "--spec-draft-model", "model_draft", type=click.Path(dir_okay=False),
              help="Draft GGUF file (or DRAFT).")
@click.option("--pair", "pair_name", help="A named pair from models.toml instead of TARGET DRAFT.")
@hf_options()[0]
@hf_options()[1]
@hf_options()[2]
@click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=16), default=None,
              show_default=f"{_MODEL.n_ctx}, or the --pair entry's", help="Context size in tokens to plan for.")
@click.option("-b", "--batch-size", "n_batch", type=click.IntRange(min=1), default=None, show_default=str(_MODEL.n_batch),
              help="Tokens per prompt-processing batch (llama_decode call).")
@click.option("-ub", "--ubatch-size", "n_ubatch", type=click.IntRange(min=1), default=None,
              show_default=str(_MODEL.n_ubatch), help="Tokens per physical batch, at most -b (sizes the compute buffers).")
@click.option("-ctk", "--cache-type-k", "cache_type_k", type=KV_CHOICES, default=None,
              show_default=f"{_MODEL.cache_type_k}, or the --pair entry's", help="KV cache type of the keys.")
@click.option("-ctv", "--cache-type-v", "cache_type_v", type=KV_CHOICES, default=None,
              show_default=f"{_MODEL.cache_type_v}, or the --pair entry's", help="KV cache type of the values.")
@click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(FLASH_ATTN_MODES), default=None,
              show_default=_MODEL.flash_attn, help="Flash attention (off: a larger compute buffer).")
@click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=int, default=None,
              show_default=f"{_MODEL.n_gpu_layers}, or the --pair entry's",
              help="Target layers on the GPU (-1 = all).")
@click.option("-ngld", "--n-gpu-layers-draft", "draft_n_gpu_layers", type=int, default=None,
              help="Draft layers on the GPU [default: as -ngl].")
@click.option("-mg", "--main-gpu", "main_gpu", type=click.IntRange(min=0), default=0, show_default=True,
              help="The GPU whose free memory is planned for.")
@click.option("-np", "--parallel", "n_parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Slots (serve --parallel): each keeps its own recurrent state and turn checkpoints.")
@click.option("--vram", type=click.FloatRange(min=0, min_open=True), default=None, callback=finite,
              help="GPU memory in GiB [default: free memory nvidia-smi reports; without a GPU, a plan for this "
                   "machine's RAM].")
@click.option("-cram", "--cache-ram", "cache_ram", type=Bounded("cache_ram"), default=DEFAULT_CACHE_RAM,
              show_default=True, help="Host RAM in MiB for saved slot states, as `serve --cache-ram` (-1: no limit).")
@click.option("--yes", "-y", "assume_yes", is_flag=True, hidden=True)
@handle_errors
def check(target, draft, model, model_draft, pair_name, hf_repo, hf_file, hf_repo_draft, n_ctx, n_batch, n_ubatch,
          cache_type_k, cache_type_v, flash_attn, n_gpu_layers, draft_n_gpu_layers, main_gpu, n_parallel, vram,
          cache_ram, assume_yes):
    """Check that DRAFT can speculate for TARGET and plan their memory, reading only the GGUF headers (of files on
    the hub too: --pair and -hf read the headers with HTTP range requests, without downloading the files)."""
    from ..gguf.compat import compatibility_report
    from ..gguf.memory import Settings, largest_full_context, mtp_head_memory, plan_memory, saved_state_bytes
    from ..gguf.recurrent import describe_rollback
    from ..kinds import drafter_kind, file_source
    from ..loading import sibling_draft, snapshot_reach

    if (target and model) or (draft and model_draft):
        raise click.UsageError("give the models either as TARGET [DRAFT] or as -m/-md, not both")
    target, draft = target or model, draft or model_draft
    target_info, draft_info = read_headers(target, draft, pair_name, hf_repo, hf_file, hf_repo_draft)
    from ..backend.model import check_loads
    from ..gguf.spec_kind import spec_kind

    draft_kind = spec_kind(draft_info) if draft_info is not None else None   # refuses what cannot draft at all

    for info in (target_info, draft_info):   # llama.cpp's own refusals, as `run` meets them (no weights read)
        if info is not None and Path(info.path).is_file():   # a header read from the hub has no file here
            check_loads(info.path)
    # the options given, else a --pair entry's settings, else load_pair's defaults: what loading it would use
    defaults = {}
    if pair_name:
        from ..hub.registry import get_pair

        defaults = get_pair(pair_name).defaults()
    config = LoadConfig().replace(**defaults).replace(
        n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, cache_type_k=cache_type_k, cache_type_v=cache_type_v, flash_attn=flash_attn,
        n_gpu_layers=n_gpu_layers, draft_n_gpu_layers=draft_n_gpu_layers)
    n_ctx, n_gpu_layers = config.target.n_ctx, config.target.n_gpu_layers
    draft_n_gpu_layers = config.draft.n_gpu_layers if config.draft is not None else None
    mtp = mtp_head_memory(target_info, Settings.of(config.target))
    head_file = draft_info if file_source(draft_kind).plan == "head" else None   # its blocks before the head are
    if head_file is not None:          # not there: no model plan, the head's own line (all of its weights)
        mtp = replace(mtp_head_memory(head_file, Settings.of(config.target)), weights=head_file.weights_bytes)
        draft_info = None
    reach = snapshot_reach(config, target_info, drafter_kind(draft_kind or config.drafting.drafter))
    settings = Settings.of(config.target, speculative=draft_info is not None or mtp is not None,
                           n_rs_seq=reach.target.n_rs_seq, n_parallel=n_parallel)
    for role, info in (("target", target_info), ("draft", draft_info or head_file)):
        if info is not None:
            click.echo(f"{role + ':':<8}{info.path} ({info.arch}, {info.n_layer} layers, {gib(info.weights_bytes)}, "
                       f"trained context {info.n_ctx_train})")
            if info is not head_file:     # a head file's context is a plain KV cache
                click.echo(f"{'':<8}rollback: {describe_rollback(info, draft=role == 'draft')}")
            if role == "target":
                head = "in the draft file" if head_file is not None else describe_mtp_head(mtp)
                local = Path(info.path).is_file()
                beside = sibling_draft(info.path, "mtp") if mtp is None and draft_info is None and local else None
                if beside is not None:
                    head = f"none in the file; {Path(beside).name} beside it drafts with --spec-type draft-mtp"
                click.echo(f"{'':<8}MTP head: {head}")
            elif draft_kind is not None:
                click.echo(f"{'':<8}drafts as --spec-type {KINDS[draft_kind].spec_type} (from its header)")
    drafting_file = draft_info or head_file
    report = compatibility_report(target_info, drafting_file) if drafting_file is not None else None
    if report is not None:
        click.echo()
        print_compatibility(report)

    found = (vram, "--vram") if vram is not None else default_vram(main_gpu)
    if found is None:
        click.echo()
        mtp_added = (mtp.kv_cache + mtp.compute + (mtp.weights if head_file is not None else 0)
                     if mtp is not None and draft_info is None else None)
        cpu_plan = plan_memory(target_info, draft_info, settings, 0, 0, 0)
        print_cpu_plan(cpu_plan, mtp_added)
        print_cache_ram(cache_ram, saved_state_bytes(target_info, draft_info, settings, mtp if draft_info is None
                                                     else None), cpu_plan.ram_bytes_cpu_only + (mtp_added or 0))
        _notes(n_ctx, target_info, report, drafting_file)
        return
    vram_gib, source = found
    plan = plan_memory(target_info, draft_info, settings, int(vram_gib * 2**30), n_gpu_layers, draft_n_gpu_layers)
    click.echo()
    print_plan(plan, source)
    if mtp is not None and draft_info is None:
        added = mtp.kv_cache + mtp.compute + (mtp.weights if head_file is not None else 0)
        spare = plan.vram_bytes - plan.gpu_bytes - added
        what = "the head file" if head_file is not None else "the MTP head"
        click.echo(f"  drafting with {what} (--spec-type draft-mtp) adds {gib(added)} "
                   "on the GPU: " + (f"fits, {gib(spare)} to spare" if spare >= 0 else f"{gib(-spare)} short"))
    full = largest_full_context(target_info, draft_info, settings, plan.vram_bytes)
    if full is None:
        click.echo("  no context fits with both models fully on the GPU")
    else:
        click.echo(f"  largest context with both models fully on the GPU: {full} (-c {full})")
    if mtp is not None and draft_info is None and head_file is None:
        click.echo("  largest context fully on the GPU with the MTP head: " + ", ".join(
            f"{kv} KV {'none' if n is None else n}" for kv, n in largest_with_head(target_info, settings, plan)))
    if plan.host_bytes:
        click.echo(f"  host RAM beside the GPU: {gib(plan.host_bytes)} for {s_turns(settings)}")
    host = sum(m.total - m.gpu_total for m in plan.models)   # what stays in RAM, turn checkpoints included
    print_cache_ram(cache_ram, saved_state_bytes(target_info, draft_info, settings,
                                                 mtp if draft_info is None else None), max(host, 0))
    _notes(n_ctx, target_info, report, drafting_file)


def largest_with_head(target_info, settings, plan) -> list[tuple[str, int | None]]:
    """(KV type, largest context) with the MTP head's context too: as asked, and with a q8_0 cache if that is not."""
    from ..gguf.memory import largest_full_context

    kinds = [(f"{settings.type_k}/{settings.type_v}" if settings.type_k != settings.type_v else settings.type_k,
              settings)]
    if (settings.type_k, settings.type_v) != ("q8_0", "q8_0"):
        kinds.append(("q8_0", replace(settings, type_k="q8_0", type_v="q8_0")))
    return [(kv, largest_full_context(target_info, None, s, plan.vram_bytes, with_head=True)) for kv, s in kinds]


def s_turns(settings) -> str:
    """What the host memory holds: the slots' turn checkpoints, the prompt cache."""
    slots = f"{settings.n_parallel} slots x " if settings.n_parallel > 1 else ""
    parts = [f"{slots}{settings.n_checkpoints} turn checkpoints of the recurrent state"]
    if settings.cache_ram:
        parts.append(f"a prompt cache of {gib(settings.cache_ram)}")
    return " and ".join(parts)


def print_cache_ram(cache_ram: int, state_bytes: int, ram_need: int) -> None:
    """The host-memory cache of saved slot states (serve --cache-ram): what one full context's state takes, how
    many fit, and whether the budget fits beside what the models take of this machine's RAM."""
    from .. import sysinfo
    from ..gguf.memory import MiB

    if cache_ram == 0:
        click.echo("  saved slot states: off (--cache-ram 0): a session whose slot another session takes is "
                   "processed again")
        return
    budget = "no limit" if cache_ram < 0 else gib(cache_ram * MiB)
    fit = "" if cache_ram < 0 else f", {cache_ram * MiB // max(state_bytes, 1)} of them fit"
    click.echo(f"  saved slot states (--cache-ram, host RAM, used as sessions take turns on slots): up to {budget}; "
               f"a full context's state is {gib(state_bytes)}{fit}")
    total = sysinfo.total_ram_bytes()
    if total and cache_ram > 0 and ram_need + cache_ram * MiB > total:
        click.echo(f"  note: the models' {gib(ram_need)} of RAM and a full --cache-ram {cache_ram} exceed this "
                   f"machine's {gib(total)}: lower --cache-ram")


def _notes(n_ctx, target_info, report, drafting_file) -> None:
    if n_ctx > target_info.n_ctx_train > 0:
        click.echo(f"note: context {n_ctx} is beyond the target's trained context {target_info.n_ctx_train}")
    if report is not None and not report.compatible:
        fail(f"draft {drafting_file.path} cannot speculate for target {target_info.path}: {report.mismatch}")
