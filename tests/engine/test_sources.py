"""What drafts, as a type (kinds.Source): each kind's source answers the questions loading, batching, the server and
`check` ask; and the backend's wall: no module outside llamaspec/backend imports llama.cpp."""
import ast
from pathlib import Path

import pytest

import llamaspec
from llamaspec.gguf.hidden_pair import HEAD_TAP_ARCHS, HIDDEN_ARCHS, HiddenDraftInfo
from llamaspec.kinds import (DRAFT_MODEL, HIDDEN_DRAFT_ARCHS, KINDS, MTP_DRAFTERS, NO_DRAFT_FILE, Opens,
                             file_source)

PACKAGE = Path(llamaspec.__file__).parent


@pytest.mark.parametrize("kind, opens, own, shares, free, draft_file, plan, batches", [
    ("lookup", Opens.NOTHING, False, False, True, "none", "none", True),
    ("model", Opens.OWN, True, False, False, "model", "model", True),
    ("lookup+model", Opens.OWN, True, False, False, "model", "model", True),
    ("mtp", Opens.OVER_TARGET, False, True, False, "none", "head", True),
    ("lookup+mtp", Opens.OVER_TARGET, False, True, False, "none", "head", True),
    ("eagle3", Opens.BOUND, False, False, False, "arch", "model", False),
    ("dflash", Opens.BOUND, False, False, False, "arch", "model", False),
])
def test_each_kinds_source_says_how_it_drafts(kind, opens, own, shares, free, draft_file, plan, batches):
    source = KINDS[kind].source
    assert source.opens is opens
    assert (source.own_context, source.shares_target_context, source.free) == (own, shares, free)
    assert source.head == shares   # only an MTP head runs on the target's context
    assert (KINDS[kind].draft_file, source.plan, KINDS[kind].batches) == (draft_file, plan, batches)


def test_the_kind_lists_follow_the_sources():
    assert MTP_DRAFTERS == ("mtp", "lookup+mtp")
    assert HIDDEN_DRAFT_ARCHS == ("eagle3", "dflash") and set(HIDDEN_ARCHS) == set(HIDDEN_DRAFT_ARCHS)
    assert NO_DRAFT_FILE == ("lookup", "mtp", "lookup+mtp")


def test_a_draft_files_source_is_what_check_plans_for_it():
    assert file_source(None) is DRAFT_MODEL and file_source(None).plan == "model"
    assert file_source("mtp").plan == "head" and file_source("eagle3").plan == "model"


class _Target:
    def __init__(self, arch: str, n_layer: int = 8):
        self.arch, self.n_layer = arch, n_layer


def _info(kind: str, **fields) -> HiddenDraftInfo:
    base = dict(kind=kind, target_layers=(1, 2, 3), n_embd=64, target_hidden_size=128, block_size=0,
                mask_token_id=None, causal=True, n_draft_vocab=None, has_token_embd=True, has_output=True,
                is_variant=None)
    return HiddenDraftInfo(**{**base, **fields})


def test_only_a_block_draft_taps_the_last_layers_output_and_only_where_the_target_records_it():
    head_arch = sorted(HEAD_TAP_ARCHS)[0]
    eagle3, dflash = HIDDEN_ARCHS["eagle3"], HIDDEN_ARCHS["dflash"]
    assert dflash.top_tap(_Target(head_arch)) == 8 and dflash.top_tap(_Target("llama")) == 7
    assert eagle3.top_tap(_Target(head_arch)) == 7
    assert eagle3.target_width(_info("eagle3")) == 128 and dflash.target_width(_info("dflash")) == 64
    assert _info("dflash").arch is dflash and eagle3.title == "an EAGLE-3 draft"


def _llama_imports(path: Path) -> list[str]:
    """The imports of llama_cpp or of the backend's native module in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "llama_cpp"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] == "llama_cpp" or module.endswith("backend.native") or \
                    node.level and module == "native" and path.parent.name == "backend":
                found.append("." * node.level + module)
    return found


def test_only_the_backend_imports_llama_cpp():
    outside = {str(p.relative_to(PACKAGE)): _llama_imports(p) for p in PACKAGE.rglob("*.py")
               if "backend" not in p.relative_to(PACKAGE).parts}
    offenders = {name: found for name, found in outside.items() if found}
    # the package's early import (llama.cpp's libraries before numpy's) is the one deliberate exception
    assert offenders == {"__init__.py": ["llama_cpp"]}
