"""Facts about the machine for `llamaspec doctor`, `check` and `bench`: GPUs (through nvidia-smi), the CPU,
WSL2. Knows nothing about llama.cpp: the caller passes llama.cpp's own system-info line where it is needed."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

NVIDIA_SMI_QUERY = ["--query-gpu=index,name,memory.total,memory.free,driver_version", "--format=csv,noheader,nounits"]
CUDA_REINSTALL = 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'
WINDOWS_DRIVE = re.compile(r"^/mnt/[a-zA-Z](/|$)")


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_mib: int
    free_mib: int
    driver: str = ""


def parse_nvidia_smi(text: str) -> list[GPU]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total,memory.free,driver_version --format=csv,noheader,
    nounits`, e.g. `0, NVIDIA GeForce RTX 4090, 24564, 23012, 550.54`. Unparsable rows are skipped."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            gpus.append(GPU(int(parts[0]), parts[1], int(float(parts[2])), int(float(parts[3])),
                            parts[4] if len(parts) > 4 else ""))
        except ValueError:
            continue
    return gpus


def nvidia_gpus(timeout: float = 10.0) -> list[GPU]:
    """NVIDIA GPUs with their memory; empty when nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_nvidia_smi(out.stdout) if out.returncode == 0 else []


def has_nvidia_smi() -> bool:
    return shutil.which("nvidia-smi") is not None


def nvidia_gpu_signs(dev: Path = Path("/dev")) -> list[str]:
    """What says this machine has an NVIDIA GPU, without asking llama.cpp: nvidia-smi on PATH, /dev/nvidia*
    device nodes (Linux driver), /dev/dxg (WSL2's GPU paravirtualization, present when Windows has a GPU driver)."""
    signs = []
    if shutil.which("nvidia-smi") is not None:
        signs.append("nvidia-smi")
    try:
        if any(p.name[len("nvidia"):].isdigit() for p in dev.glob("nvidia*")):
            signs.append(f"{dev}/nvidia*")
    except OSError:
        pass
    if (dev / "dxg").exists():
        signs.append(f"{dev}/dxg (WSL2)")
    return signs


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_count() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def total_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_ram_bytes() -> int | None:
    """Memory the kernel could give now without swapping (MemAvailable), else the total."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total_ram_bytes()


def cpu_features(llama_system_info: str) -> list[str]:
    """The features llama.cpp reports as on, from `CPU : SSE3 = 1 | AVX = 1 | AVX512 = 0 | ...`."""
    return [name.strip() for name, value in re.findall(r"([A-Za-z0-9_]+)\s*=\s*(\d+)", llama_system_info)
            if value != "0"]


def is_wsl(proc_version: str | None = None) -> bool:
    """Running under Windows Subsystem for Linux (/proc/version names Microsoft's kernel)."""
    if proc_version is None:
        try:
            proc_version = Path("/proc/version").read_text(errors="replace")
        except OSError:
            return False
    return "microsoft" in proc_version.lower()


def on_windows_drive(path: str | os.PathLike) -> bool:
    """A path on a Windows drive mounted into WSL (/mnt/c/...): reads go through a slow 9P file server."""
    text = str(path)
    try:
        text = str(Path(path).expanduser().resolve())
    except OSError:
        pass
    return bool(WINDOWS_DRIVE.match(text))


WSL_PITFALLS = (
    "Models under /mnt/c (any Windows drive) load very slowly: WSL2 reads them through a 9P file server. "
    "Copy them into the Linux file system (e.g. ~/models).",
    "WSL2 limits pinned (page-locked) memory; if a CUDA build fails to allocate host buffers, "
    "set GGML_CUDA_NO_PINNED=1.",
    "WSL2 gets half of the Windows RAM by default; raise it with `memory=` in %UserProfile%\\.wslconfig "
    "when a model does not fit in RAM.",
    "Use the NVIDIA driver installed in Windows; do not install a Linux NVIDIA driver inside WSL2.",
)


def hardware_line(n_threads: int | None = None, gpus: list[GPU] | None = None) -> str:
    """One line: CPU model and cores, threads used, GPUs."""
    gpus = nvidia_gpus() if gpus is None else gpus
    line = f"CPU: {cpu_model()} ({cpu_count()} cores"
    line += f", {n_threads} threads used)" if n_threads else ")"
    if gpus:
        line += "; GPU: " + ", ".join(f"{g.name} ({g.total_mib / 1024:.0f} GiB)" for g in gpus)
    else:
        line += "; GPU: none"
    return line
