"""Text files named on the command line (a prompt, a saved chat), read without trusting their size: only a regular
file, and only as many bytes as a context could use, so /dev/zero, a FIFO or a multi-GB file is one line instead of
a hang or the OOM killer."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from ..errors import PromptFileError
from .options import decode_utf8

# More bytes than any tokenizer puts in one token: a text longer than n_ctx x this cannot fit in the context.
BYTES_PER_TOKEN = 64
MAX_TEXT_BYTES = 64 * 2**20   # where the context is not known yet (a 1M-token context at 64 bytes a token)


def text_limit(n_ctx: int | None) -> int:
    """The most bytes worth reading for a context of n_ctx tokens (None: not known yet)."""
    return MAX_TEXT_BYTES if not n_ctx else min(MAX_TEXT_BYTES, n_ctx * BYTES_PER_TOKEN)


def read_text_file(path: Path, max_bytes: int, what: str = "file") -> str:
    """The UTF-8 text of a regular file of at most max_bytes; PromptFileError (one line) otherwise."""
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused below); no effect on a regular file
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise PromptFileError(f"{path}: no such {what}") from None
    except OSError as e:
        raise PromptFileError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a pipe, socket or device)"
            raise PromptFileError(f"{path}: {kind}; give a text file")
        return decode_utf8(read_at_most(f, max_bytes, str(path)), str(path))


def read_at_most(stream: BinaryIO, max_bytes: int, source: str) -> bytes:
    """All of `stream` (a file, stdin) when it holds at most max_bytes; PromptFileError once it holds more."""
    try:
        data = stream.read(max_bytes + 1)
    except OSError as e:
        raise PromptFileError(f"{source}: cannot read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise PromptFileError(f"{source}: more than {_size(max_bytes)}, more text than the context can hold "
                              f"(at most {BYTES_PER_TOKEN} bytes a token)")
    return data


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.0f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.0f} KiB"
