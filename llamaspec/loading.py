"""Loading a pair: check the two files' headers, load both models with one LoadConfig, make their contexts (the
drafter's as its kinds.Source opens it), and pick the drafter. Everything about placement is llama.cpp's own; this
module only decides what goes where."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from . import bounds
from .config import LoadConfig, ModelConfig
from .drafters import make_drafter
from .engine import Pair
from .errors import InvalidParameterError, ModelFileError, UnsupportedModelError
from .gguf.hidden_pair import check_hidden_pair
from .gguf.compat import check_pair
from .gguf.reader import ModelInfo, read_model_info
from .gguf.recurrent import rollback_kind
from .gguf.spec_kind import has_mtp_head, spec_kind
from .kinds import DrafterKind, Opens, Source, drafter_kind, kind_for_file
from .policy import DEFAULT_DRAFT_MAX, DraftPolicy, policy_for


def snapshot_reach(config: LoadConfig, target_info: ModelInfo, kind: DrafterKind,
                   policy: DraftPolicy | None = None) -> LoadConfig:
    """`config` with how far a speculating target must be able to undo resolved, in this one place:

    1. the longest draft: `draft_max` as set (`policy`, an object given instead of settings: its own draft_max);
       left open on a target whose rollback is bounded by recurrent-state snapshots, the kind's `snapshot_k_max`
       (llama.cpp keeps one snapshot per draft token and pays for all of them on every decode, so an open reach,
       auto's 12, would slow every step, plain ones included); else the policy's default (DEFAULT_DRAFT_MAX);
    2. the target's `n_rs_seq`: as set, else one snapshot per token of that draft, within what the batch allows
       (llama.cpp aborts unless n_ubatch >= n_rs_seq + 2)."""
    drafting, target = config.drafting, config.target
    if policy is not None:
        longest = int(getattr(policy, "draft_max", 0) or 0)
    elif drafting.draft_max is not None:
        longest = drafting.draft_max
    elif drafting.policy != "fixed" and rollback_kind(target_info) == "bounded":
        longest = kind.snapshot_k_max
        config = config.replace(draft_max=longest)
    else:
        longest = DEFAULT_DRAFT_MAX[drafting.policy]
    n_rs_seq = target.n_rs_seq or max(min(max(longest, 1), target.n_batch - 2), 0)
    return config.replace(n_rs_seq=n_rs_seq)


def _is_pair_name(name) -> bool:
    text = str(name)
    return not text.endswith(".gguf") and "/" not in text and "\\" not in text and not Path(text).exists()


def load_pair(target: str, draft: str | None = None, *, config: LoadConfig | None = None,
              policy: str | DraftPolicy | None = None, **settings) -> Pair:
    """Load a target and (optionally) a draft GGUF; the pair is checked from the file headers before any weights
    load. Settings come as a `LoadConfig` (`config=`), as its keyword names (`n_ctx=8192`, `draft_n_gpu_layers=0`,
    `cache_type_k="q8_0"`, ...), or both (keywords win). `no_repack=True` (or LLAMASPEC_NO_REPACK=1) turns off
    llama.cpp's CPU weight repacking. `policy` is a policy name or a DraftPolicy object.

    Placement is llama.cpp's own: `split_mode`/`tensor_split`/`main_gpu` spread the target over local GPUs,
    `rpc_servers` adds llama.cpp rpc-servers as devices for the target, `devices` names the target's devices
    ("CUDA0,CUDA1"), and `draft_device` puts the whole draft on one device. With RPC servers and no draft device,
    the draft stays on the local GPUs: a draft token must not wait on the network."""
    from .backend import Context, Model, devices, env_flag, init_backend

    policy_obj = policy if isinstance(policy, DraftPolicy) else None
    if isinstance(policy, str):
        settings["policy"] = policy
    if settings.get("no_repack") is None and env_flag("LLAMASPEC_NO_REPACK"):
        settings["no_repack"] = True
    config = (config or LoadConfig()).replace(**settings)
    init_backend(config.verbose)
    if draft is None and _is_pair_name(target):
        from .hub.registry import resolve_pair  # a named pair from models.toml, downloaded on first use

        target, draft, defaults = resolve_pair(target, assume_yes=True)
        config = LoadConfig().replace(**defaults).replace(**settings)

    # 1. headers: both files readable, the pair compatible, the placement possible, before any weights load
    target_info = read_model_info(target)
    check_placement(target_info, config.target, devices())
    draft_info: ModelInfo | None = None
    kind = drafter_kind(config.drafting.drafter)
    if draft is None and (kind.draft_file == "arch" or kind.source.head and not has_mtp_head(target_info)):
        draft = sibling_draft(target_info.path, kind.name)   # mtp-/eagle3-/dflash-<model>.gguf beside it, or None
    if draft is not None:
        draft_info = read_model_info(draft)
        file_kind = spec_kind(draft_info)          # the kind the file selects; the drafter setting only overrides
        kind = drafter_kind(kind_for_file(kind.name, file_kind, draft_info.arch, draft_info.path))
        config = config.replace(drafter=kind.name)   # the pair keeps its config as resolved
        check_pair(target_info, draft_info)
        check_hidden_pair(target_info, draft_info)
    elif kind.draft_file == "arch":
        raise InvalidParameterError(f"drafter {kind.name!r} needs {kind.title} GGUF: give it (-md / draft=...) or "
                                    f"put it beside the target as {kind.sidecar}<model>.gguf", param="draft")
    speculative = draft is not None or kind.name != "model"
    if speculative:   # a recurrent state with rollback snapshots gets one per draft token
        config = snapshot_reach(config, target_info, kind, policy_obj)
    if policy_obj is None:
        policy_obj = policy_for(config.drafting, n_batch=config.target.n_batch)
    if kind.source.head:
        _check_mtp_header(target_info if draft_info is None else draft_info)
        config = config.replace(load_mtp=True)   # llama.cpp skips the head's tensors otherwise

    # 2. the target
    target_config = config.target
    target_model = Model(target, target_config, info=target_info)
    try:
        target_ctx = Context(target_model, target_config)
        if not target_ctx.logits_finite():   # one token, once per load: a damaged file gives NaN everywhere
            target_ctx.close()
            raise ModelFileError(f"{target}: the model computes non-finite logits (NaN or infinity); its weights "
                                 "are damaged: download or convert it again")
    except BaseException:
        target_model.close()
        raise
    if not speculative:
        return Pair(target_model, target_ctx, None, policy_obj, config)
    if not target_ctx.rollback.speculative:
        name = target_ctx.rollback.describe()
        target_ctx.close()
        target_model.close()
        raise UnsupportedModelError(
            f"{target}: its memory cannot drop rejected draft tokens (rollback: {name}), so speculative decoding "
            "is not supported with it (run it without a draft)")

    # 3. what drafts: a context of the kind's source (none for prompt lookup), then the drafter
    try:
        draft_ctx = _draft_context(kind.source, target_ctx, draft, draft_info, config)
    except BaseException:
        target_ctx.close()
        target_model.close()
        raise
    drafter = make_drafter(kind.name, target_model, draft_ctx)
    return _ready(Pair(target_model, target_ctx, drafter, policy_obj, config), config)


def _draft_context(source: Source, target_ctx, draft: str | None, draft_info: ModelInfo | None, config: LoadConfig):
    """The context a drafter of this source drafts with, as the source opens it: over the target's (its MTP head,
    the target's or a head file's), a draft model's own on local devices unless told otherwise, one bound to the
    target's hidden states, or none."""
    from .backend import Context, Model, devices

    if source.opens is Opens.OVER_TARGET:
        from .backend.mtp import MTPContext

        if draft is None:
            return MTPContext(target_ctx)
        # a head file of its own: loaded as the draft (placed as one), run over the target's context
        head = Model(draft, config.draft_config().replace(load_mtp=True, n_rs_seq=0), info=draft_info)
        try:
            return MTPContext(target_ctx, head)
        except BaseException:
            head.close()
            raise
    if draft is None or source.opens is Opens.NOTHING:   # drafts from the history: a draft file goes unused
        return None
    draft_config = config.draft_config().replace(n_rs_seq=0)  # drafting decodes single tokens: no snapshots
    draft_devices: Sequence[str] | None = None
    if config.draft_device is not None:
        draft_devices = (config.draft_device,)
    elif config.target.rpc_servers:
        draft_devices = tuple(d.name for d in devices() if d.kind == "gpu" and d.backend != "RPC")
    draft_model = Model(draft, draft_config.replace(devices=draft_devices), info=draft_info)
    try:
        if source.opens is Opens.BOUND:  # reads the target's hidden states, borrows its embeddings / head
            from .backend.hidden import HiddenDraftContext

            return HiddenDraftContext(draft_model, draft_config, target_ctx)
        draft_ctx = Context(draft_model, draft_config)
    except BaseException:
        draft_model.close()
        raise
    if not draft_ctx.rollback.speculative:
        name = draft_ctx.rollback.describe()
        draft_ctx.close()
        draft_model.close()
        raise UnsupportedModelError(f"{draft}: its memory cannot drop rejected draft tokens (rollback: {name}); "
                                    "it cannot serve as a draft model")
    return draft_ctx


def _ready(pair: Pair, config: LoadConfig) -> Pair:
    """Warm the pair up where its target runs on a GPU (config.warm_up None), or as told."""
    warm = config.warm_up if config.warm_up is not None else pair.target_ctx.output_on_gpu
    if warm:
        try:
            pair.warm_up()
        except BaseException:
            pair.close()
            raise
    return pair


def check_placement(info: ModelInfo, config: ModelConfig, found) -> None:
    """The context's KV cache fits in the memory this machine has free (RAM and GPUs together), and main_gpu names
    a GPU that exists (the rows: bounds.py). `found`: the backend's devices."""
    from .gguf.memory import Settings, kv_cache_bytes
    from .sysinfo import available_ram_bytes

    gpus = [d for d in found if d.kind == "gpu"]
    per_token = kv_cache_bytes(info, Settings(n_ctx=1, type_k=config.cache_type_k, type_v=config.cache_type_v))
    memory = (available_ram_bytes() or 0) + sum(d.free for d in gpus)
    known = {"n_gpus": len(gpus)}
    if per_token > 0 and memory > 0:
        known["n_ctx_memory"] = memory // per_token
    bounds.check("n_ctx", config.n_ctx, known)
    bounds.check("main_gpu", config.main_gpu, known)


def sibling_draft(target, kind: str = "mtp") -> str | None:
    """The draft file of a kind that drafts from one (an MTP head, an EAGLE-3 or DFlash draft) beside `target`, named
    as a Hugging Face repo names its sidecars (`mtp-<model>-Q8_0.gguf`, `eagle3-...`, `dflash-...`; a combination
    such as lookup+mtp: its part's), picked as llama.cpp picks a repo's sidecar (hub.hf_repo.best_sibling: the
    exact quant, else the closest). Only names that start with the prefix count: in a folder of models, a model
    whose name merely holds `mtp-` is not a head file. None without one."""
    from .hub.hf_repo import RepoFile, best_sibling
    from .kinds import KINDS

    asked = drafter_kind(kind)
    prefixes = [KINDS[name].sidecar for name in (asked.parts or (asked.name,)) if KINDS[name].sidecar]
    folder, name = Path(target).parent, Path(target).name
    for prefix in prefixes:
        files = [RepoFile(p.name) for p in sorted(folder.glob(f"{prefix}*.gguf")) if p.name != name and p.is_file()]
        found = best_sibling(files, name, prefix)
        if found is not None:
            return str(folder / found.path)
    return None


def _check_mtp_header(info: ModelInfo) -> None:
    """The MTP drafters need a head llama.cpp can run: in the target's file or in a head file of its own. The tensor
    list says whether there is one; a header that claims heads llama.cpp cannot run is refused as well (loading it
    to draft would abort)."""
    has_head = has_mtp_head(info)
    if has_head or info.n_layer_nextn > 0:
        from .backend.mtp import MTP_GRAPH_ARCHS

        if info.arch not in MTP_GRAPH_ARCHS:
            raise UnsupportedModelError(f"{info.path}: llama.cpp has no MTP graph for the {info.arch} architecture")
        if info.n_layer_nextn > 1:
            raise UnsupportedModelError(f"{info.path}: {info.n_layer_nextn} chained MTP heads; llamaspec drafts with "
                                        "a single head only")
    if not has_head:
        raise UnsupportedModelError(f"{info.path}: no multi-token-prediction (MTP) head in this file (no "
                                    f"blk.{info.n_layer - 1}.nextn tensors) and no mtp-*.gguf head file beside it; "
                                    "draft with a model (-md), a head file (-md mtp-<model>.gguf) or --lookup-only")
