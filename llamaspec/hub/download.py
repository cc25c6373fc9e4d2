"""Files of named pairs in the Hugging Face cache: where the cache is, what is downloaded, fetching (resumable,
through huggingface_hub) and removing. Every huggingface_hub or network failure becomes one RegistryError line.
It knows nothing of models.toml beyond the ModelRef / PairEntry it is given, and never prompts."""
from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from ..errors import RegistryError
from .entries import HUB_URL, ModelRef, PairEntry

DISK_MARGIN_BYTES = 256 * 2**20   # left free after a download
CONNECT_TIMEOUT_S = 10
_TRUE = ("1", "ON", "YES", "TRUE")
_reached: set[str] = set()        # endpoints that answered in this process

def hf_cache_dir() -> Path:
    """huggingface_hub's cache folder, read from the environment now (not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    return any(os.environ.get(var, "").upper() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", HUB_URL).rstrip("/")


def check_reachable(what: str) -> None:
    """One request to the hub, without huggingface_hub's retries (five, 27 s in all, a log line each): a machine
    that cannot reach it hears so at once, in one RegistryError line saying how to go on without it. Any HTTP
    answer, even an error status, means it is reachable; each endpoint is asked once per process."""
    endpoint = hub_endpoint()
    if endpoint in _reached:
        return
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    constants.HF_HUB_OFFLINE = False   # read once at import by huggingface_hub: this is asked only when online
    try:
        get_session().head(endpoint, timeout=CONNECT_TIMEOUT_S)
    except _transport_errors() as e:
        raise RegistryError(f"cannot reach {endpoint} to {what} ({type(e).__name__}); use a local file "
                            "(-m FILE.gguf), or set HF_HUB_OFFLINE=1 to use a model already in the Hugging Face "
                            "cache") from None
    _reached.add(endpoint)


def cached_path(ref: ModelRef) -> Path | None:
    """Where the model's file is on this machine, or None when it is not there (yet)."""
    if ref.is_local:
        path = ref.local_path()
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref.repo, ref.file, cache_dir=str(hf_cache_dir()), revision=ref.revision)
    return Path(found) if isinstance(found, str) and os.path.isfile(found) else None


def downloaded(entry: PairEntry) -> tuple[Path | None, ...]:
    """Where each of entry.models is on this machine (None: not there yet)."""
    return tuple(cached_path(ref) for ref in entry.models)


def fetch(ref: ModelRef) -> Path:
    """The local file of a model, downloading it into the Hugging Face cache when it is not there."""
    if ref.is_local:
        return _existing_local(ref)
    from huggingface_hub import constants, hf_hub_download

    cache, offline, cached = hf_cache_dir(), hub_offline(), cached_path(ref) is not None
    if not offline:
        try:
            check_reachable(f"download {ref.file} from {ref.repo}")
        except RegistryError:
            if not cached:
                raise
            offline = True   # the copy in the cache, without asking the hub for a newer one
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: follow the environment as it is now
    constants.HF_HUB_OFFLINE = offline
    with _hub_errors(ref):
        if not offline and not cached:
            _check_disk_space(ref, cache)
        path = hf_hub_download(ref.repo, ref.file, revision=ref.revision, cache_dir=str(cache),
                               endpoint=hub_endpoint(), local_files_only=offline)
    return Path(path)


def pull(entry: PairEntry) -> tuple[Path, ...]:
    """Download the files of a pair (if needed), check their GGUF headers and that they share one tokenizer."""
    from ..gguf.compat import check_pair
    from ..gguf.reader import read_model_info

    paths = tuple(fetch(ref) for ref in entry.models)
    infos = [read_model_info(p) for p in paths]
    if len(infos) == 2:
        check_pair(*infos)
    return paths


def remove(ref: ModelRef) -> int:
    """Delete a model's file from the Hugging Face cache (its snapshot links and blob); returns the bytes freed."""
    if ref.is_local:
        return 0
    storage = hf_cache_dir() / ("models--" + ref.repo.replace("/", "--"))
    snapshots = storage / "snapshots"
    # the file by its exact name in each snapshot: a name is never a pattern ("*.gguf" is a file called "*.gguf").
    # The registry refuses file names that leave the repo (registry.inside_repo_problem); never delete outside anyway
    revisions = [folder for folder in snapshots.iterdir() if folder.is_dir()] if snapshots.is_dir() else []
    pointers = [p for p in (folder / ref.file for folder in revisions) if (p.is_symlink() or p.is_file())
                and _inside(p.parent.resolve(), snapshots.resolve())]
    blobs = {p.resolve() for p in pointers if p.is_symlink() and _inside(p.resolve(), (storage / "blobs").resolve())}
    freed = 0
    for pointer in pointers:
        if not pointer.is_symlink():  # a copy where symlinks are not available
            freed += pointer.stat().st_size
        pointer.unlink()
    still_linked = {p.resolve() for p in snapshots.rglob("*") if p.is_symlink()}
    for blob in blobs - still_linked:
        if blob.is_file():
            freed += blob.stat().st_size
            blob.unlink()
    return freed


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _existing_local(ref: ModelRef) -> Path:
    path = ref.local_path()
    if "$" in str(path):
        unset = re.findall(r"\$\{?(\w+)", str(path))
        raise RegistryError(f"{ref.path}: environment variable {unset[0]} is not set")
    if not path.is_file():
        raise RegistryError(f"{path}: no such model file")
    return path


def _check_disk_space(ref: ModelRef, cache: Path) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    size = get_hf_file_metadata(hf_hub_url(ref.repo, ref.file, revision=ref.revision, endpoint=hub_endpoint())).size
    free = _free_bytes(cache)
    if size and free is not None and free < size + DISK_MARGIN_BYTES:
        raise RegistryError(f"not enough disk space for {ref.label}: it needs {_gb(size)}, {_gb(free)} is free in "
                            f"{cache} (free some space, or point HF_HOME at a larger disk)")


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return None


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB"


@contextmanager
def _hub_errors(ref: ModelRef):
    """huggingface_hub's exceptions (and the network's) as one RegistryError line naming the file."""
    from huggingface_hub import utils as hf

    label, endpoint = f"{ref.file} from {ref.repo}", hub_endpoint()
    try:
        yield
    except hf.GatedRepoError:
        raise RegistryError(f"{ref.repo} is gated: accept its license at {HUB_URL}/{ref.repo} and set HF_TOKEN to a "
                            "token of that account") from None
    except hf.RepositoryNotFoundError:
        raise RegistryError(f"repository {ref.repo} not found at {endpoint} (a private repo needs HF_TOKEN)") from None
    except hf.RevisionNotFoundError:
        raise RegistryError(f"revision {ref.revision} not found in repository {ref.repo}") from None
    except hf.LocalEntryNotFoundError:
        raise RegistryError(_not_cached_message(label, endpoint)) from None
    except hf.EntryNotFoundError:
        raise RegistryError(f"file {ref.file} not found in repository {ref.repo}") from None
    except hf.OfflineModeIsEnabled:
        raise RegistryError(_not_cached_message(label, endpoint)) from None
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise RegistryError(f"downloading {label} failed: HTTP {status} from {endpoint}; run the same command again "
                            "to retry") from None
    except _transport_errors() as e:
        raise RegistryError(f"cannot reach {endpoint} to download {label} ({type(e).__name__}); check the network "
                            "and run the same command again") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise RegistryError(f"disk full while downloading {label} into {hf_cache_dir()} (free some space, or "
                                "point HF_HOME at a larger disk)") from None
        if "Consistency check failed" in str(e):
            raise RegistryError(f"the download of {label} was cut short; run the same command again") from None
        raise


def _not_cached_message(label: str, endpoint: str) -> str:
    if hub_offline():
        return f"{label} is not in the local cache ({hf_cache_dir()}) and HF_HUB_OFFLINE is set; unset it to download"
    return f"cannot reach {endpoint} to download {label}, and it is not cached; check the network connection"


def _transport_errors() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                         ("requests", "ConnectionError"), ("requests", "Timeout")):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


# ---------------------------------------------------------------------------------------------------------------
# A pair name -> two files
# ---------------------------------------------------------------------------------------------------------------

