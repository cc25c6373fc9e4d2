"""`-hf REPO[:QUANT]`: which GGUF file of a Hugging Face repo to use, and the sidecar heads beside it, picked the way
llama.cpp picks them (common/download.cpp: find_best_model, find_best_sibling).

- The model: the first file whose name holds QUANT followed by '.' or '-' (case-insensitive); without a QUANT,
  Q4_K_M, then Q8_0, then the first model file. Files named mmproj, imatrix, mtp-, eagle3-, dflash- or dspark-
  are not models.
- A sidecar (`mtp-`, `eagle3-`, `dflash-` in its name): among the repo's files holding the prefix, one in the
  deepest folder shared with the model, then one whose name holds `-QUANT.`, then the one whose quant's bit count
  (Q8_0 -> 8) is closest to QUANT's (or the model's).

The repo's file list comes from the hub's tree API through huggingface_hub, or from the local cache when offline.
This module knows nothing of models.toml or of loading; it returns ModelRefs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import RegistryError
from ..kinds import KINDS
from .download import _hub_errors, check_reachable, hf_cache_dir, hub_endpoint, hub_offline

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
# drafter kind -> the file name part that marks its sidecar in a repo, in llama.cpp's order of preference when the
# kind is not asked for (dspark- is llama.cpp's too; llamaspec has no DSpark drafter)
SIDECAR_PREFIXES = {kind: KINDS[kind].sidecar for kind in ("mtp", "dflash", "eagle3")}
_NOT_MODELS = ("mmproj", "imatrix", *SIDECAR_PREFIXES.values(), "dspark-")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
# the hub's own rule (huggingface_hub's validate_repo_id): letters, digits, '-', '_', '.'; neither part starts or
# ends with '-' or '.'; no '--' or '..'; a name of at most 96 characters
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_REPO = re.compile(f"{_REPO_PART}/{_REPO_PART}")
MAX_REPO_NAME = 96


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int | None = None


@dataclass(frozen=True)
class HfChoice:
    """What `-hf REPO[:QUANT]` names: the model file (None when the repo has only sidecars) and the sidecars found,
    by drafter kind."""

    repo: str
    model: object | None               # ModelRef
    sidecars: dict = field(default_factory=dict)   # kind -> ModelRef


def split_repo_tag(spec: str) -> tuple[str, str]:
    """"owner/name:Q4_K_M" -> ("owner/name", "Q4_K_M"); no tag -> ""."""
    repo, _, tag = spec.partition(":")
    shown = spec if len(spec) <= 120 else spec[:100] + "..."
    if not _REPO.fullmatch(repo) or ":" in tag:
        raise RegistryError(f"{shown!r} is not a Hugging Face repo: expected OWNER/NAME[:QUANT] (letters, digits, "
                            "'-', '_', '.'; neither part starting or ending with '-' or '.'), e.g. "
                            "ggml-org/Qwen3.6-27B-GGUF:Q4_K_M")
    if "--" in repo or ".." in repo:
        raise RegistryError(f"{shown!r} is not a Hugging Face repo: a repo id holds no '--' or '..'")
    name = repo.split("/")[1]
    if len(name) > MAX_REPO_NAME:
        raise RegistryError(f"{shown!r} is not a Hugging Face repo: its name has {len(name)} characters, the hub "
                            f"allows {MAX_REPO_NAME}")
    return repo, tag


def split_info(path: str) -> tuple[str, str, int, int]:
    """(prefix, QUANT tag upper-cased, part index, part count) of a GGUF file name, as llama.cpp reads it."""
    prefix = path[:-len(".gguf")] if path.lower().endswith(".gguf") else path
    index = count = 1
    match = _SPLIT.match(prefix)
    if match:
        prefix, index, count = match[1], int(match[2]), int(match[3])
    tag = _TAG.search(prefix)
    return prefix, (tag[1].upper() if tag else ""), index, count


def quant_bits(name: str) -> int:
    """Q4_0 -> 4, F16 -> 16, Q8_K_M -> 8; 0 when the name has no quant."""
    digits = re.search(r"\d+", name)
    return int(digits[0]) if digits else 0


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(word in name for word in _NOT_MODELS)


def best_model(files: list[RepoFile], tag: str) -> RepoFile | None:
    for quant in ([tag] if tag else list(DEFAULT_QUANTS)):
        pattern = re.compile(re.escape(quant) + r"[.-]", re.IGNORECASE)
        for f in files:
            if is_model_file(f.path) and pattern.search(f.path) and split_info(f.path)[2] == 1:
                return f
    if not tag:
        return next((f for f in files if is_model_file(f.path) and split_info(f.path)[2] == 1), None)
    return None


def best_sibling(files: list[RepoFile], model: str, keyword: str, tag: str = "") -> RepoFile | None:
    """The sidecar holding `keyword` that best matches the model file (or, without one, the QUANT tag)."""
    model_bits = quant_bits(tag) if tag else quant_bits(split_info(model)[1])
    model_dirs = model.split("/")[:-1]
    best, best_key = None, None
    for f in files:
        if not f.path.endswith(".gguf") or keyword not in f.path:
            continue
        dirs = f.path.split("/")[:-1]
        if dirs != model_dirs[:len(dirs)]:
            continue   # llama.cpp: the sidecar's folder is the model's or one above it
        exact = bool(tag) and f"-{tag.upper()}." in f.path.upper()
        key = (len(dirs), exact, -abs(quant_bits(split_info(f.path)[1]) - model_bits))
        if best_key is None or key > best_key:
            best, best_key = f, key
    return best


def list_gguf_files(repo: str, revision: str | None = None) -> list[RepoFile]:
    """The repo's .gguf files: from the hub, or (offline) from the local cache."""
    if not hub_offline():
        from huggingface_hub import HfApi, constants

        from .registry import ModelRef

        check_reachable(f"list the files of {repo}")
        constants.HF_HUB_OFFLINE = False   # read once at import by huggingface_hub: follow the environment now
        with _hub_errors(ModelRef(repo=repo, file="(file list)", revision=revision)):
            tree = HfApi(endpoint=hub_endpoint()).list_repo_tree(repo, revision=revision, recursive=True)
            return [RepoFile(item.path, getattr(item, "size", None)) for item in tree
                    if getattr(item, "path", "").endswith(".gguf") and hasattr(item, "size")]
    snapshots = hf_cache_dir() / ("models--" + repo.replace("/", "--")) / "snapshots"
    found = sorted({str(p.relative_to(snap)) for snap in snapshots.glob("*") for p in snap.rglob("*.gguf")})
    if not found:
        raise RegistryError(f"{repo} is not in the local cache ({hf_cache_dir()}) and HF_HUB_OFFLINE is set; unset "
                            "it to look the repo up")
    return [RepoFile(path) for path in found]


def choose(spec: str, sidecars: tuple[str, ...] = (), file: str | None = None,
           files: list[RepoFile] | None = None) -> HfChoice:
    """The model file of `-hf REPO[:QUANT]` (or the given `file`, llama.cpp's --hf-file) and the sidecars of the
    drafter kinds asked for."""
    from .registry import ModelRef

    repo, tag = split_repo_tag(spec)
    files = list_gguf_files(repo) if files is None else files
    if file is not None:
        model = next((f for f in files if f.path == file), None)
        if model is None:
            raise RegistryError(f"file {file} not found in {repo}{_listing(files)}")
    else:
        model = best_model(files, tag)
    found = {}
    for kind in sidecars:
        sibling = best_sibling(files, model.path if model else "", SIDECAR_PREFIXES[kind], tag)
        if sibling is not None:
            found[kind] = ModelRef(repo=repo, file=sibling.path, size_gb=_gb(sibling.size))
    if model is None and not found:
        want = f"{tag} model file" if tag else "GGUF model file"
        raise RegistryError(f"{repo} has no {want}{_listing(files)}")
    if model is not None and split_info(model.path)[3] > 1:
        raise RegistryError(f"{repo}: {model.path} is one part of a split GGUF; llamaspec reads single-file GGUFs, "
                            f"pick another quant ({repo}:QUANT)")
    ref = ModelRef(repo=repo, file=model.path, size_gb=_gb(model.size)) if model is not None else None
    return HfChoice(repo, ref, found)


def _gb(size: int | None) -> float | None:
    return round(size / 1e9, 2) if size else None


def _listing(files: list[RepoFile]) -> str:
    names = [f.path for f in files if f.path.endswith(".gguf")]
    if not names:
        return " (it has no .gguf files)"
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f" (it has {shown})"


def resolve_hf(target_spec: str | None, draft_spec: str | None, drafter: str | None = None,
               target_file: str | None = None, draft_file: str | None = None):
    """(target ModelRef or None, draft ModelRef or None, drafter kind or None) for -hf / -hfd, as llama.cpp's
    common/arg.cpp resolves them: a draft repo without a file named (-md) yields its sidecar when it ships one (of
    the kind asked for, or without one: mtp-, then dflash-, then eagle3-) and the kind with it, else its model
    file; the target repo's sidecar of the asked kind is the draft when no draft repo is given."""
    wanted = _sidecar_kinds(drafter)
    target = choose(target_spec, wanted if draft_spec is None else (), file=target_file) if target_spec else None
    draft, kind = None, drafter
    if draft_spec is not None:
        found = choose(draft_spec, () if draft_file else (wanted or tuple(SIDECAR_PREFIXES)), file=draft_file)
        if found.sidecars:
            sidecar_kind, draft = next(iter(found.sidecars.items()))
            kind = drafter or sidecar_kind
        elif found.model is None:
            raise RegistryError(f"{found.repo} has no model file and no {'/'.join(wanted) or 'draft'} sidecar")
        else:
            draft = found.model
    elif target is not None and target.sidecars:
        draft = next(iter(target.sidecars.values()))
    if target is not None and target.model is None:
        raise RegistryError(f"{target.repo} has only sidecar files, no model to load as the target")
    return (target.model if target else None), draft, kind


def _sidecar_kinds(drafter: str | None) -> tuple[str, ...]:
    """The sidecar kinds a drafter kind can use ("lookup+mtp" -> mtp)."""
    if drafter is None:
        return ()
    return tuple(kind for kind in SIDECAR_PREFIXES if kind in drafter.split("+"))


def fetch_refs(refs, assume_yes: bool = False, confirm=None) -> list:
    """Local paths of the ModelRefs (None stays None), downloading what is not cached: at once (assume_yes), after
    confirm(question) says yes, or not at all (a RegistryError says how)."""
    from .download import cached_path, fetch

    missing = [ref for ref in refs if ref is not None and cached_path(ref) is None]
    if missing and not assume_yes:
        files = " and ".join(f"{ref.file} from {ref.repo}" + (f" ({ref.size_gb:g} GB)" if ref.size_gb else "")
                             for ref in missing)
        if confirm is None:
            raise RegistryError(f"{files} not downloaded yet; pass --yes to download now")
        if not confirm(f"Download {files} from Hugging Face?"):
            raise RegistryError("download declined")
    return [fetch(ref) if ref is not None else None for ref in refs]
