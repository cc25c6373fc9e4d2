"""GGUF headers of files on the Hugging Face hub, read with HTTP range requests, so that `llamaspec check` can
plan a 20 GB pair from the first few MiB of each file.

The first read is FIRST_READ bytes; while the header (metadata, then tensor infos) goes on past what was read, the
next read at least doubles it, up to where the parser says the header goes on. The requests go through
huggingface_hub's HTTP session (its proxies, token and endpoint); its errors become one RegistryError line.
This module knows nothing about models.toml or loading.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import RegistryError
from ..gguf.reader import HeaderIncomplete, ModelInfo, parse_header
from .download import _hub_errors, cached_path, check_reachable, hub_endpoint, hub_offline

FIRST_READ = 2**20
TIMEOUT_S = 60
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def read_header(ref) -> ModelInfo:
    """The header of a ModelRef's file: from the local copy when there is one, else read remotely."""
    from ..gguf.reader import read_model_info
    from .download import _existing_local

    if ref.is_local:   # a models.toml `path`: there is nothing to read remotely
        return read_model_info(_existing_local(ref))
    local = cached_path(ref)
    if local is not None:
        return read_model_info(local)
    if hub_offline():
        raise RegistryError(f"{ref.label} is not in the local cache and HF_HUB_OFFLINE is set; unset it to read its "
                            "header from the hub")
    return read_remote_header(ref)


def read_remote_header(ref) -> ModelInfo:
    """Parse the GGUF header of `ref` (a repo + file) from byte ranges of its resolve URL."""
    from huggingface_hub import hf_hub_url

    check_reachable(f"read the header of {ref.file} from {ref.repo}")
    url = hf_hub_url(ref.repo, ref.file, revision=ref.revision, endpoint=hub_endpoint())
    label = Path(ref.repo) / ref.file
    with _hub_errors(ref):
        prefix, file_size = _read_range(url, 0, FIRST_READ)
        while True:
            try:
                return parse_header(prefix, label, file_size)
            except HeaderIncomplete as e:
                end = min(file_size, max(e.needed, 2 * len(prefix)))
                more, _ = _read_range(url, len(prefix), end)
                if not more:
                    raise RegistryError(f"{ref.label}: the hub sent no bytes after byte {len(prefix)}; run the same "
                                        "command again") from None
                prefix += more


def _read_range(url: str, start: int, end: int) -> tuple[bytes, int]:
    """Bytes [start, end) of the file at `url` and the file's size. Reads at most end - start bytes of the body,
    even from a server that ignores the Range header."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    session = get_session()
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    if hasattr(session, "stream"):   # httpx (huggingface_hub >= 1.0)
        with session.stream("GET", url, headers=headers, timeout=TIMEOUT_S) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            return _take(response, response.iter_bytes(), start, end)
    response = session.get(url, headers=headers, timeout=TIMEOUT_S, stream=True)   # requests
    try:
        if response.status_code >= 400:
            hf_raise_for_status(response)
        return _take(response, response.iter_content(64 * 1024), start, end)
    finally:
        response.close()


def _take(response, chunks, start: int, end: int) -> tuple[bytes, int]:
    match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
    if response.status_code == 206 and match:
        file_size, skip = int(match[3]), 0
    else:   # the whole file from byte 0: skip to `start`, stop at `end`
        file_size, skip = int(response.headers.get("Content-Length", 0) or 0), start
    want = min(end, file_size) - start if file_size else end - start
    out = bytearray()
    for chunk in chunks:
        if skip:
            dropped = min(skip, len(chunk))
            chunk, skip = chunk[dropped:], skip - dropped
        out += chunk
        if len(out) >= want:
            break
    if not file_size:
        raise RegistryError(f"{response.url}: the server did not say how large the file is")
    return bytes(out[:want]), file_size
