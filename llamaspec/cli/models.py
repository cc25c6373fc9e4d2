"""`llamaspec models`: the named target/draft pairs of models.toml and their files in the Hugging Face cache."""
from __future__ import annotations

from pathlib import Path

import click

from . import main
from .options import Command, handle_errors


@main.group()
def models():
    """List, show, download and remove the named target/draft pairs (models.toml)."""


@models.command("list", cls=Command)
@handle_errors
def list_pairs():
    """Every pair: the GPU memory it is tuned for, its two files, and whether they are downloaded."""
    from ..hub import registry

    rows = [("NAME", "VRAM", "TARGET", "DRAFT", "SIZE", "STATUS")]
    unchecked = False
    for entry in registry.load_registry().values():
        paths = registry.downloaded(entry)
        name = entry.name if entry.verified or entry.target.is_local else entry.name + " *"
        unchecked |= name.endswith("*")
        rows.append((name, f"{entry.vram_gb:g} GB" if entry.vram_gb else "CPU", _model_name(entry.target),
                     _model_name(entry.draft) if entry.draft else f"({entry.drafter})", _total_size(entry, paths),
                     _status(entry, paths)))
    _echo_table(rows)
    if unchecked:
        click.echo("* file names not checked against the repo's listing on the hub")
    click.echo(f"your pairs: {registry.user_models_path()}\ndownloads:  {registry.hf_cache_dir()}")


@models.command(cls=Command)
@click.argument("name")
@handle_errors
def show(name):
    """Everything about pair NAME: files, links, settings, where its files are."""
    from ..hub import registry

    entry = registry.get_pair(name)
    paths = registry.downloaded(entry)
    click.echo(f"{entry.name}: {entry.note}")
    click.echo(f"  gpu memory   {f'{entry.vram_gb:g} GB' if entry.vram_gb else 'none (CPU)'}")
    for role, ref, path in zip(("target", "draft"), entry.models, paths):
        click.echo(f"  {role:<12} {ref.label}" + (f" ({ref.size_gb:g} GB)" if ref.size_gb else ""))
        if ref.url:
            click.echo(f"  {'':<12} {ref.url}")
        click.echo(f"  {'':<12} {path if path else 'not downloaded' if not ref.is_local else 'missing'}")
    settings = {k: v for k, v in entry.defaults().items() if v is not None}
    click.echo("  settings     " + " ".join(f"{k}={v}" for k, v in settings.items()))
    if not entry.target.is_local:
        click.echo(f"  checked      {'yes' if entry.verified else 'no: file names not checked against the hub'}")
    click.echo(f"  defined in   {entry.source}")


@models.command(cls=Command)
@click.argument("name")
@handle_errors
def pull(name):
    """Download both files of pair NAME into the Hugging Face cache (resumes where supported) and check them."""
    from ..hub import registry

    entry = registry.get_pair(name)
    labels = " + ".join(ref.label for ref in entry.models)
    click.echo(f"pulling {name}: {labels} into {registry.hf_cache_dir()}", err=True)
    try:
        paths = registry.pull(entry)
    except KeyboardInterrupt:
        click.echo(f"download interrupted; `llamaspec models pull {name}` continues it", err=True)
        raise
    click.echo("\n".join(str(p) for p in paths))


@models.command(cls=Command)
@click.argument("name")
@handle_errors
def path(name):
    """Print the local paths of pair NAME's target and draft (one a line)."""
    from ..hub import registry
    from ..errors import RegistryError

    entry = registry.get_pair(name)
    paths = registry.downloaded(entry)
    if None in paths:
        missing = " and ".join(ref.label for ref, p in zip(entry.models, paths) if p is None)
        raise RegistryError(f"pair {name!r} is not downloaded ({missing} missing); run `llamaspec models pull {name}`")
    click.echo("\n".join(str(p) for p in paths))


@models.command(cls=Command)
@click.argument("name")
@click.option("--include-shared", is_flag=True, help="Also remove a file another downloaded pair uses.")
@handle_errors
def rm(name, include_shared):
    """Remove pair NAME's files from the Hugging Face cache (a file another downloaded pair uses is kept)."""
    from ..hub import registry

    pairs = registry.load_registry()
    entry = registry.get_pair(name)
    freed = 0
    for ref in entry.models:
        if ref.is_local:
            click.echo(f"kept {ref.label}: a local file, not in the cache")
            continue
        users = [other.name for other in pairs.values() if other.name != name
                 and ref.key in {m.key for m in other.models} and None not in registry.downloaded(other)]
        if users and not include_shared:
            click.echo(f"kept {ref.file}: pair {', '.join(users)} uses it too (--include-shared removes it)")
            continue
        freed += registry.remove(ref)
    click.echo(f"removed {name}: {_size_text(freed)} freed" if freed else f"nothing of {name} to remove")


def _model_name(ref) -> str:
    return Path(ref.file or ref.path).name.removesuffix(".gguf")


def _total_size(entry, paths) -> str:
    sizes = [p.stat().st_size if p else ref.size_gb and ref.size_gb * 1e9 for ref, p in zip(entry.models, paths)]
    return "?" if None in sizes else _size_text(sum(sizes))


def _size_text(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


def _status(entry, paths) -> str:
    if any(ref.is_local for ref in entry.models):
        return "local" if None not in paths else "missing"
    if None not in paths:
        return "downloaded"
    return "not downloaded" if all(p is None for p in paths) else "partly downloaded"


def _echo_table(rows) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
