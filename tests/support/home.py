"""The user's folders during the tests: temp folders. Importing this module (conftest does, first) records where
the real ones are and passes on, through the variables the tests read, what the tests need from the real home:
the real test models, llama.cpp's tools and source (benchmarks/build-llama-tools.sh), the vocab cache."""
from __future__ import annotations

import os
from pathlib import Path

from .llama_asserts import find_llama_src

# The variables that say where a program writes for its user (platformdirs reads the XDG ones on Linux, HOME on
# macOS, the AppData ones on Windows); each points into a temp folder during the tests.
HOME_VARS = {"HOME": ".", "USERPROFILE": ".", "XDG_DATA_HOME": ".local/share", "XDG_CONFIG_HOME": ".config",
             "XDG_CACHE_HOME": ".cache", "XDG_STATE_HOME": ".local/state", "APPDATA": "AppData/Roaming",
             "LOCALAPPDATA": "AppData/Local", "HF_HOME": ".cache/huggingface"}
# llamaspec's and Hugging Face's own overrides of those folders: unset, so that they follow HOME_VARS
UNSET_VARS = ("LLAMASPEC_CONFIG_DIR", "LLAMASPEC_CHAT_DIR", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")


def _real_user_dirs() -> dict[str, Path]:
    import platformdirs

    return {"data": Path(platformdirs.user_data_dir("llamaspec")), "config": Path(platformdirs.user_config_dir(
        "llamaspec")), "home": Path.home()}


REAL = _real_user_dirs()   # where llamaspec would write for the user running the tests


def locate_shared_resources() -> None:
    """Set the variables through which the tests find what lives in the real home, before HOME moves."""
    home = Path.home()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache")
    if os.environ.get("LLAMASPEC_TEST_MODELS"):
        os.environ["LLAMASPEC_TEST_MODELS"] = str(Path(os.environ["LLAMASPEC_TEST_MODELS"]).expanduser())
    os.environ.setdefault("LLAMASPEC_LLAMA_TOOLS", str(home / ".cache" / "llamaspec" / "llama-tools" / "bin"))
    os.environ.setdefault("LLAMASPEC_VOCAB_DIR", str(cache / "llamaspec" / "vocab"))   # read, and filled once
    if not os.environ.get("LLAMASPEC_LLAMA_SRC"):
        src = find_llama_src()
        if src is not None:
            os.environ["LLAMASPEC_LLAMA_SRC"] = str(src)


def point_home_at(home: Path, setenv, delenv) -> None:
    """Make `home` the user's home for everything that asks: setenv(var, value) / delenv(var) change the
    environment (os.environ's, or a monkeypatch's)."""
    for var, sub in HOME_VARS.items():
        path = (home / sub).resolve()
        path.mkdir(parents=True, exist_ok=True)
        setenv(var, str(path))
    for var in UNSET_VARS:
        delenv(var)
