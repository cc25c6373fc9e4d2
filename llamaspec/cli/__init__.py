"""The `llamaspec` command line: click code only. Each command lives in its own module of this package and
registers itself on `main`; engine logic stays in the library."""
from __future__ import annotations

import importlib

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="llamaspec")
def main():
    """Speculative decoding for local GGUF models on llama.cpp: same output, faster."""


# Command modules, in the order `--help` lists them.
COMMAND_MODULES = ["chat", "run", "bench", "check", "doctor", "models", "serve"]
for _name in COMMAND_MODULES:
    importlib.import_module(f".{_name}", __name__)
