"""What the convert/ scripts share: finding llamaspec from a source checkout, one-line errors, sizes."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

try:
    import llamaspec  # noqa: F401
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import click

from llamaspec.errors import LlamaspecError

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def one_line_errors(func):
    """LlamaspecError, OSError and Ctrl-C become one line on stderr and a non-zero exit."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except LlamaspecError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except ImportError as e:  # llama-cpp-python missing: its message says how to install it
            click.echo(f"error: {str(e).splitlines()[0]}", err=True)
            sys.exit(1)
        except OSError as e:
            click.echo(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted; nothing was written", err=True)
            sys.exit(130)

    return wrapper


def megabytes(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:,.1f} MB"


def show_progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()
