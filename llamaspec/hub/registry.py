"""Named target/draft pairs (models.toml) and their files in the Hugging Face cache.

The shipped models.toml is read first (inside the package when installed, at the repository root in a checkout); a
models.toml in the user's config directory changes its entries field by field and adds new ones. Each model of a
pair is a Hugging Face repo + file, downloaded with huggingface_hub into its normal cache (HF_HOME, HF_HUB_CACHE,
HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE are honoured), or a local path.

The registry knows nothing about loading models: it turns a pair name into two file paths and a few defaults.
"""
from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Callable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..config import CACHE_TYPES, DRAFTER_KINDS, POLICY_NAMES
from ..errors import RegistryError
from ..kinds import NO_DRAFT_FILE
# the download side, also reachable from here (registry.pull, registry.hf_cache_dir, ...)
from .download import (_existing_local, cached_path, downloaded, fetch, hf_cache_dir,  # noqa: F401
                       hub_endpoint, hub_offline, pull, remove)
from .entries import HUB_URL, ModelRef, PairEntry  # noqa: F401  (re-exported)

FILE_NAME = "models.toml"
CONFIG_DIR_ENV = "LLAMASPEC_CONFIG_DIR"
DEFAULT_PAIR = "default"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

# key -> (accepted types, description); bool is not an int here
_PAIR_FIELDS = {
    "note": ((str,), "a string"),
    "vram_gb": ((int, float), "a number"),
    "n_gpu_layers": ((int,), "an integer"),
    "draft_n_gpu_layers": ((int,), "an integer"),
    "n_ctx": ((int,), "an integer"),
    "cache_type_k": ((str,), "a string"),
    "cache_type_v": ((str,), "a string"),
    "draft_max": ((int,), "an integer"),
    "policy": ((str,), "a string"),
    "drafter": ((str,), "a string"),
    "verified": ((bool,), "true or false"),
    "default_for_vram": ((bool,), "true or false"),
}
_MODEL_FIELDS = {
    "repo": ((str,), "a string"),
    "file": ((str,), "a string"),
    "revision": ((str,), "a string"),
    "path": ((str,), "a string"),
    "size_gb": ((int, float), "a number"),
}
_ROLES = ("target", "draft")


# ---------------------------------------------------------------------------------------------------------------
# Reading models.toml
# ---------------------------------------------------------------------------------------------------------------

def shipped_models_path() -> Path:
    here = Path(__file__).resolve().parent.parent   # the llamaspec package
    for candidate in (here / FILE_NAME, here.parent / FILE_NAME):  # wheel, then checkout
        if candidate.is_file():
            return candidate
    raise RegistryError(f"{FILE_NAME} is missing from the llamaspec installation ({here}); reinstall llamaspec")


def user_config_dir() -> Path:
    if os.environ.get(CONFIG_DIR_ENV):
        return Path(os.environ[CONFIG_DIR_ENV]).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("llamaspec"))


def user_models_path() -> Path:
    return user_config_dir() / FILE_NAME


def load_registry() -> dict[str, PairEntry]:
    """All pairs: the shipped ones, changed and extended by the user's models.toml."""
    tables: dict[str, tuple[dict, Path, str]] = {}
    for path in (shipped_models_path(), user_models_path()):
        if path.is_file():
            text, pairs = _read_toml(path)
            for name, table in pairs.items():
                base = tables.get(name)
                tables[name] = (_merge_tables(base[0], table) if base else table, path, text)
    return {name: _parse_pair(name, table, path, text) for name, (table, path, text) in tables.items()}


def get_pair(name: str) -> PairEntry:
    pairs = load_registry()
    if name in pairs:
        return pairs[name]
    close = difflib.get_close_matches(name, list(pairs), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise RegistryError(f"unknown pair {name!r}{hint} (`llamaspec models list` shows them all)")


# a GPU "has" vram_gb when this share of it is free (a 24 GB card driving a desktop keeps ~22.5 GiB free)
VRAM_FREE_SHARE = 0.9


def default_pair_name(free_vram_gib: float | None) -> str:
    """The pair offered when no model is given: the `default_for_vram` pair of the largest vram_gb that the free
    GPU memory holds (at least VRAM_FREE_SHARE of it), else `default` (no GPU, or one too small)."""
    if not free_vram_gib:
        return DEFAULT_PAIR
    fitting = [e for e in load_registry().values()
               if e.default_for_vram and e.vram_gb * VRAM_FREE_SHARE <= free_vram_gib]
    return max(fitting, key=lambda e: e.vram_gb).name if fitting else DEFAULT_PAIR


def _read_toml(path: Path) -> tuple[str, dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RegistryError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"{path}{_toml_error_position(e)}: invalid TOML: {_toml_error_message(e)}") from None
    except RecursionError:   # tomllib parses nested arrays and inline tables recursively
        raise RegistryError(f"{path}: invalid TOML: arrays or inline tables nested too deeply") from None
    unknown = [key for key in data if key != "pairs"]
    if unknown:
        raise RegistryError(f"{path}: unknown top-level key {unknown[0]!r} (pairs go in [pairs.NAME] tables)")
    pairs = data.get("pairs", {})
    if not isinstance(pairs, dict):
        raise RegistryError(f"{path}: 'pairs' must be a table of [pairs.NAME] tables")
    return text, pairs


def _toml_error_position(error) -> str:
    line, col = getattr(error, "lineno", None), getattr(error, "colno", None)
    if line is None:
        match = re.search(r"\(at line (\d+), column (\d+)\)", str(error))
        line, col = (int(match[1]), int(match[2])) if match else (None, None)
    return f", line {line}, column {col}" if line else ""


def _toml_error_message(error) -> str:
    return getattr(error, "msg", None) or re.sub(r"\s*\(at line \d+, column \d+\)", "", str(error))


def _merge_tables(base: dict, override: dict) -> dict:
    """A user entry changes a shipped one field by field; giving a model by path replaces the shipped model, and a
    changed model is no longer the checked one."""
    merged = dict(base)
    for role in _ROLES:
        new_table, new_path = override.get(role), override.get(f"{role}_path")
        if new_path is not None or (isinstance(new_table, dict) and "path" in new_table):
            merged.pop(role, None)
            merged.pop(f"{role}_path", None)
        elif isinstance(new_table, dict) and isinstance(base.get(role), dict):
            override = {**override, role: {**{k: v for k, v in base[role].items() if k != "size_gb"}, **new_table}}
    merged.update(override)
    if "verified" not in override and any(k in override for k in ("target", "draft", "target_path", "draft_path")):
        merged["verified"] = False
    return merged


def _parse_pair(name: str, table, path: Path, text: str) -> PairEntry:
    where = f"{path}{_table_line(text, name)}: pair {name!r}"
    if not _NAME_RE.fullmatch(name) or name.endswith(".gguf"):
        raise RegistryError(f"{where}: a pair name has letters, digits, '.', '_' and '-' only, and is not a file name")
    if not isinstance(table, dict):
        raise RegistryError(f"{where}: must be a table ([pairs.{name}])")
    fields = {}
    for key, value in table.items():
        if key in _PAIR_FIELDS:
            fields[key] = _typed(where, key, value, _PAIR_FIELDS[key])
        elif key not in {*_ROLES, "target_path", "draft_path"}:
            raise RegistryError(f"{where}: {_unknown_key_message(key, value, name)}")
    optional = ("draft",) if fields.get("drafter") in NO_DRAFT_FILE else ()   # e.g. a target with its MTP head
    refs = {role: _parse_model(where, role, table, path.parent, role in optional) for role in _ROLES}
    entry = PairEntry(name=name, **refs, **fields, source=str(path))
    _check_values(where, entry)
    return entry


def _parse_model(where: str, role: str, table: dict, base_dir: Path, optional: bool = False) -> ModelRef | None:
    given, path = table.get(role), table.get(f"{role}_path")
    if given is not None and path is not None:
        raise RegistryError(f"{where}: give either {role} = {{ repo = ..., file = ... }} or {role}_path, not both")
    if path is not None:
        given = {"path": path}
    if given is None and optional:
        return None
    if given is None:
        raise RegistryError(f"{where}: missing {role} (a table {{ repo = \"owner/name\", file = \"x.gguf\" }}) "
                            f"or {role}_path")
    if not isinstance(given, dict):
        raise RegistryError(f"{where}: {role} must be a table {{ repo = \"owner/name\", file = \"x.gguf\" }}")
    fields = {}
    for key, value in given.items():
        if key not in _MODEL_FIELDS:
            raise RegistryError(f"{where}: {role}: {_unknown_key_message(key, value, None, _MODEL_FIELDS)}")
        fields[key] = _typed(f"{where}: {role}", key, value, _MODEL_FIELDS[key])
    ref = ModelRef(**fields)
    if ref.is_local:
        if ref.repo or ref.file:
            raise RegistryError(f"{where}: {role} gives both a path and a repo/file")
        expanded = ref.local_path()
        if not expanded.is_absolute() and "$" not in str(expanded):  # relative to the models.toml it is in
            ref = ModelRef(path=str(base_dir / expanded), size_gb=ref.size_gb)
        return ref
    if not ref.repo or not ref.file:
        raise RegistryError(f"{where}: {role} needs both repo and file")
    if not _REPO_RE.fullmatch(ref.repo):
        raise RegistryError(f"{where}: {role} repo {ref.repo!r} is not of the form owner/name")
    for key in ("file", "revision"):
        problem = inside_repo_problem(getattr(ref, key)) if getattr(ref, key) is not None else None
        if problem:
            raise RegistryError(f"{where}: {role} {key} {getattr(ref, key)!r} {problem}")
    if not ref.file.endswith(".gguf"):
        raise RegistryError(f"{where}: {role} file {ref.file!r} is not a .gguf file")
    if _SPLIT_RE.search(ref.file):
        raise RegistryError(f"{where}: {role} file {ref.file!r} is one part of a split GGUF; pick a single-file quant")
    return ref


def inside_repo_problem(name: str) -> str | None:
    """Why `name` (a file or a revision) is not a plain relative name inside a repository's cache folder, or
    None: it must stay in the Hugging Face cache, whatever models.toml says."""
    if not name or "\\" in name or "\0" in name or name.startswith(("/", "~")) or re.match(r"[A-Za-z]:", name):
        return "must be a relative name inside the repository"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "must not contain '..', '.' or empty path parts (it names a file inside the repository)"
    return None


def _typed(where: str, key: str, value, spec):
    types, description = spec
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        raise RegistryError(f"{where}: {key} must be {description}, got {value!r}")
    return value


def _check_values(where: str, entry: PairEntry) -> None:
    problems = [
        (entry.n_ctx < 16, f"n_ctx must be at least 16, got {entry.n_ctx}"),
        (entry.n_gpu_layers < -1, f"n_gpu_layers must be -1 (all) or more, got {entry.n_gpu_layers}"),
        (entry.draft_n_gpu_layers is not None and entry.draft_n_gpu_layers < -1,
         f"draft_n_gpu_layers must be -1 (all) or more, got {entry.draft_n_gpu_layers}"),
        (entry.draft_max is not None and entry.draft_max < 0, f"draft_max must be 0 or more, got {entry.draft_max}"),
        (entry.vram_gb < 0, f"vram_gb must be 0 or more, got {entry.vram_gb}"),
        (entry.cache_type_k not in CACHE_TYPES, f"cache_type_k must be one of {', '.join(CACHE_TYPES)}"),
        (entry.cache_type_v not in CACHE_TYPES, f"cache_type_v must be one of {', '.join(CACHE_TYPES)}"),
        (entry.policy not in POLICY_NAMES, f"policy must be one of {', '.join(POLICY_NAMES)}, got {entry.policy!r}"),
        (entry.drafter is not None and entry.drafter not in DRAFTER_KINDS,
         f"drafter must be one of {', '.join(DRAFTER_KINDS)}, got {entry.drafter!r}"),
    ]
    for failed, message in problems:
        if failed:
            raise RegistryError(f"{where}: {message}")


def _unknown_key_message(key: str, value, pair_name: str | None, known=None) -> str:
    known = known or {**_PAIR_FIELDS, **dict.fromkeys((*_ROLES, "target_path", "draft_path"))}
    if pair_name is not None and isinstance(value, dict) and not (set(value) & {"repo", "file", "path"}):
        # [pairs.qwen2.5-x] without quotes is the nested table pairs -> qwen2 -> "5-x"
        return (f"unknown key {key!r}: a pair name with a dot must be quoted, "
                f"e.g. [pairs.\"{pair_name}.{key}\"]")
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _table_line(text: str, name: str) -> str:
    pattern = re.compile(r"^\s*\[\s*pairs\s*\.\s*(\"|')?" + re.escape(name) + r"(\"|')?\s*\]")
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return f", line {number}"
    return ""


def resolve_pair(name: str, assume_yes: bool = False,
                 confirm: Callable[[str], bool] | None = None) -> tuple[str, str | None, dict]:
    """(target path, draft path, defaults) of a named pair; downloads the files on first use: at once
    (assume_yes), after `confirm(question)` says yes (the CLI asks on a terminal), or not at all (a RegistryError
    says how). The library never prompts by itself."""
    entry = get_pair(name)
    for ref in entry.models:
        if ref.is_local:
            _existing_local(ref)
    paths = downloaded(entry)
    if None in paths:
        missing = [ref for ref, path in zip(entry.models, paths) if path is None]
        if not assume_yes:
            files = " and ".join(ref.file + (f" ({ref.size_gb:g} GB)" if ref.size_gb else "") for ref in missing)
            if confirm is None:
                raise RegistryError(f"pair {entry.name!r} is not downloaded yet ({files}); run `llamaspec models "
                                    f"pull {entry.name}` or pass --yes to download it now")
            if not confirm(f"Pair {entry.name!r} needs {files} from Hugging Face. Download now?"):
                raise RegistryError(f"download declined; `llamaspec models pull {entry.name}` fetches the files "
                                    "later")
        paths = pull(entry)
    target, draft = paths if len(paths) == 2 else (paths[0], None)
    return str(target), (str(draft) if draft is not None else None), entry.defaults()
