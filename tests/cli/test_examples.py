"""The examples and the README's Python example run as written (on the tiny models) and print what they say."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from support.paths import REPO


def run_script(path_or_code, *args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMASPEC_NO_REPACK": "1"}
    if isinstance(path_or_code, str):
        script = tmp_path / "snippet.py"
        script.write_text(path_or_code, encoding="utf-8")
        path_or_code = script
    done = subprocess.run([sys.executable, str(path_or_code), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


STATS = re.compile(r"^\d+ tokens, [\d.]+ tok/s", re.M)


def test_readme_python_example_prints_the_stats_on_their_own_line(tiny_models, tmp_path):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    code = re.search(r"## Use it from Python\n\n```python\n(.*?)```", readme, re.S)[1]
    code = code.replace('"qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"', repr(str(tiny_models["target"])))
    code = code.replace('"qwen2.5-coder-0.5b-instruct.gguf"', repr(str(tiny_models["draft"])))
    code = code.replace("max_tokens=256", "max_tokens=12").replace("n_ctx=8192", "n_ctx=512")
    lines = run_script(code, tmp_path=tmp_path).splitlines()
    assert STATS.match(lines[-1]) and not STATS.search("\n".join(lines[:-1])), lines


def test_chat_turns_example_uses_pair_chat_and_reuses_the_cache(tiny_models, tmp_path):
    source = (REPO / "examples" / "chat_turns.py").read_text(encoding="utf-8")
    assert "pair.chat(" in source and "ChatTemplate" not in source
    out = run_script(REPO / "examples" / "chat_turns.py", tiny_models["target"], tiny_models["draft"],
                     tmp_path=tmp_path)
    cached = [int(n) for n in re.findall(r"cached prompt tokens: (\d+)", out)]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0
