"""`llamaspec doctor`: what this machine and this llama-cpp-python build can do, and what to fix."""
from __future__ import annotations

import platform
import sys

import click

from .. import __version__, sysinfo
from .options import Command, handle_errors
from . import main


def check_llama_cpp() -> tuple[bool, bool | None]:
    """Prints the llama-cpp-python lines; returns (importable, can offload to a GPU or None)."""
    try:
        from ..backend import library_version, supports_gpu_offload, system_info
    except ImportError as e:
        click.echo(f"llama-cpp-python: not importable ({e}); install it: pip install llama-cpp-python")
        return False, None
    offload = supports_gpu_offload()
    build = "GPU offload: yes" if offload else "GPU offload: no (CPU-only build)"
    click.echo(f"llama-cpp-python {library_version()}: {build}")
    features = sysinfo.cpu_features(system_info())
    click.echo(f"CPU: {sysinfo.cpu_model()}, {sysinfo.cpu_count()} cores; llama.cpp uses: "
               f"{' '.join(features) or 'no special features'}")
    return True, offload


def check_gpus(offload: bool | None) -> None:
    gpus = sysinfo.nvidia_gpus()
    if gpus:
        for g in gpus:
            click.echo(f"GPU {g.index}: {g.name}, {g.total_mib / 1024:.1f} GiB, {g.free_mib / 1024:.1f} GiB free"
                       + (f" (driver {g.driver})" if g.driver else ""))
    elif sysinfo.has_nvidia_smi():
        click.echo("GPUs: none (nvidia-smi found no usable GPU)")
    else:
        click.echo("GPUs: none found (no nvidia-smi)")
    if offload is False:
        lead = "this build cannot use your GPU" if gpus else "for an NVIDIA GPU"
        click.echo(f"  {lead}; reinstall llama-cpp-python with CUDA:\n    {sysinfo.CUDA_REINSTALL}")


def check_devices(ok: bool) -> None:
    """llama.cpp's own device list: the names --device / --device-draft take, and whether RPC is built in."""
    if not ok:
        return
    from ..backend import devices, supports_rpc

    names = [f"{d.name} ({d.description}, {d.total / 2**30:.1f} GiB)" if d.total else d.name for d in devices()]
    click.echo(f"llama.cpp devices: {', '.join(names) or 'none'}; RPC backend: {'yes' if supports_rpc() else 'no'}")


def check_wsl(model_paths: tuple[str, ...]) -> int:
    """Prints the WSL2 lines; returns how many problems were found."""
    wsl = sysinfo.is_wsl()
    click.echo(f"WSL2: {'yes' if wsl else 'no'}")
    problems = 0
    for path in model_paths:
        if wsl and sysinfo.on_windows_drive(path):
            click.echo(f"  warning: {path} is on a Windows drive: it will load very slowly; copy it to ~/models")
            problems += 1
    if wsl:
        click.echo("  WSL2 pitfalls:")
        for pitfall in sysinfo.WSL_PITFALLS:
            click.echo(f"  - {pitfall}")
    return problems


def check_models(model_paths: tuple[str, ...]) -> int:
    from ..errors import ModelFileError
    from ..gguf.reader import read_model_info
    from ..gguf.recurrent import describe_rollback

    problems = 0
    for path in model_paths:
        try:
            info = read_model_info(path)
        except ModelFileError as e:
            click.echo(f"model: {e}")
            problems += 1
            continue
        click.echo(f"model: {info.path} ({info.arch}, {info.n_layer} layers, {info.weights_bytes / 2**30:.2f} GiB)")
        click.echo(f"  rollback: {describe_rollback(info)}")
    return problems


@main.command(cls=Command)
@click.option("-m", "--model", "models", multiple=True, type=click.Path(dir_okay=False),
              help="Also check a model file (repeatable).")
@click.option("-md", "--model-draft", "drafts", multiple=True, type=click.Path(dir_okay=False),
              help="Also check a draft model file.")
@handle_errors
def doctor(models, drafts):
    """Report the llama-cpp-python build, GPUs, CPU features and WSL2 pitfalls."""
    click.echo(f"llamaspec {__version__}, Python {platform.python_version()}, {platform.platform()}")
    ok, offload = check_llama_cpp()
    check_gpus(offload)
    check_devices(ok)
    ram = sysinfo.total_ram_bytes()
    if ram:
        click.echo(f"RAM: {ram / 2**30:.1f} GiB")
    paths = tuple(models) + tuple(drafts)
    problems = check_wsl(paths) + check_models(paths)
    if not ok or problems:
        sys.exit(1)
