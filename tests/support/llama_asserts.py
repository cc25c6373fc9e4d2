"""The architecture lists of llamaspec/gguf/graph_archs.py, derived from a llama.cpp source tree, so a test can tell
when a newer llama.cpp changes them.

From src/models/*.cpp: the graph builders whose top level asserts `n_embd_head == hparams.n_embd_head_k()` (or
`_v()`: key and value heads of one size; lfm2's loader asserts the same of its attention blocks) or
`n_embd_head == n_rot` (the rotary dimension is the whole head), and the loaders that make the query projection
`{n_embd, n_embd}`; src/llama-model.cpp maps each architecture to its class and src/llama-arch.cpp gives its name. `python tests/support/llama_asserts.py [SRC]` prints the lists.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path


def find_llama_src() -> Path | None:
    """llama.cpp's src/ folder: $LLAMASPEC_LLAMA_SRC, else the tree benchmarks/build-llama-tools.sh unpacks for the
    installed llama-cpp-python; None when it is not there."""
    env = os.environ.get("LLAMASPEC_LLAMA_SRC")
    if env:
        src = Path(env).expanduser()
    else:
        try:
            version = importlib.metadata.version("llama-cpp-python")
        except importlib.metadata.PackageNotFoundError:
            return None
        src = (Path.home() / ".cache" / "llamaspec" / "llama-tools" / "src" / f"llama_cpp_python-{version}" / "vendor"
               / "llama.cpp" / "src")
    return src if (src / "llama-model.cpp").is_file() else None


def _top_level(text: str, start: int) -> str:
    """The text of a function body at brace depth 1 (nested blocks left out), from just after its '{'."""
    depth, i, out = 1, start, []
    while depth and i < len(text):
        c = text[i]
        depth += (c == "{") - (c == "}")
        if depth == 1:
            out.append(c)
        i += 1
    return "".join(out)


def graph_asserts(src: Path) -> tuple[frozenset, frozenset, frozenset]:
    """(archs asserting key head == value head, archs asserting head == rotary dimension, archs whose query
    projection is {n_embd, n_embd}), each as a set of llama.cpp architecture names."""
    names = dict(re.findall(r'\{\s*(LLM_ARCH_[A-Z0-9_]+),\s*"([^"]+)"\s*\}', (src / "llama-arch.cpp").read_text()))
    model = (src / "llama-model.cpp").read_text()
    classes = dict(re.findall(r"case (LLM_ARCH_[A-Z0-9_]+):\s*return new (llama_model_[a-z0-9_]+)\(", model))
    graph: dict[str, list[set]] = {}
    query_n_embd, kv_equal_in_loader = set(), set()
    for path in (src / "models").glob("*.cpp"):
        text = path.read_text()
        for m in re.finditer(r"(llama_model_[a-z0-9_]+)::graph(?:<[^>]*>)?::graph\([^)]*\)[^{]*\{", text):
            body = _top_level(text, m.end())
            found = set()
            if re.search(r"n_embd_head\s*=\s*hparams\.n_embd_head_[kv]\(\)", body):
                if re.search(r"GGML_ASSERT\(n_embd_head == hparams\.n_embd_head_[kv]\(\)\)", body):
                    found.add("k==v")
                if "GGML_ASSERT(n_embd_head == n_rot)" in body:
                    found.add("rot")
            graph.setdefault(m.group(1), []).append(found)
        for m in re.finditer(r"void (llama_model_[a-z0-9_]+)::load_arch_tensors\(", text):
            body = text[m.end():text.find("\n}", m.end())]
            if re.search(r'create_tensor_qkv\(layer, i, n_embd, n_embd,|LLM_TENSOR_ATTN_Q, *"weight", i\), *\{n_embd, '
                         r"n_embd\}", body):
                query_n_embd.add(m.group(1))
            if "GGML_ASSERT(n_embd_v_gqa == n_embd_k_gqa)" in body:
                kv_equal_in_loader.add(m.group(1))
    k_eq_v, rot, query = set(), set(), set()
    for arch, cls in classes.items():
        if arch not in names:
            continue
        asserted = set.intersection(*graph[cls]) if graph.get(cls) else set()  # by every graph the class builds
        if "k==v" in asserted or cls in kv_equal_in_loader:
            k_eq_v.add(names[arch])
        if "rot" in asserted:
            rot.add(names[arch])
        if cls in query_n_embd:
            query.add(names[arch])
    return frozenset(k_eq_v), frozenset(rot), frozenset(query)


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else find_llama_src()
    for label, archs in zip(("HEAD_K_EQ_V_ARCHS", "HEAD_IS_ROT_ARCHS", "QUERY_IS_N_EMBD_ARCHS"), graph_asserts(root)):
        print(label, " ".join(sorted(archs)))
