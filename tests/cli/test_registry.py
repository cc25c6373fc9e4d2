"""The pair registry (models.toml), downloads through the real huggingface_hub client, and `llamaspec models`.

No model hub is reachable here: downloads go to tests/support/hf_standin.py, a local server speaking the hub's file routes,
with HF_ENDPOINT pointing at it; HF_HOME and the user config dir are temp dirs for every test.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFWriter
from support.gguf_factory import write_out
from support.hf_standin import COMMIT, HubStandin, isolate_hub

from llamaspec.hub import download, registry
from llamaspec.errors import IncompatiblePairError, RegistryError

REPO = "llamaspec-test/tiny-GGUF"
TOKENS = [f"tok{i}" for i in range(300)]
TINY_PAIRS = f"""
[pairs.tiny]
target = {{ repo = "{REPO}", file = "tiny-target.gguf" }}
draft = {{ repo = "{REPO}", file = "tiny-draft.gguf" }}
vram_gb = 1
n_ctx = 512
draft_max = 4
policy = "fixed"
note = "Two tiny files from the stand-in hub."

[pairs.tiny-twin]
target = {{ repo = "{REPO}", file = "tiny-twin.gguf" }}
draft = {{ repo = "{REPO}", file = "tiny-draft.gguf" }}
note = "Another target with the same draft."

[pairs.tiny-mismatch]
target = {{ repo = "{REPO}", file = "tiny-target.gguf" }}
draft = {{ repo = "{REPO}", file = "tiny-other-vocab.gguf" }}
note = "A draft with another tokenizer."

[pairs.tiny-junk]
target = {{ repo = "{REPO}", file = "junk.gguf" }}
draft = {{ repo = "{REPO}", file = "tiny-draft.gguf" }}
note = "A target that is not a GGUF file."

[pairs.tiny-missing-file]
target = {{ repo = "{REPO}", file = "no-such-file.gguf" }}
draft = {{ repo = "{REPO}", file = "tiny-draft.gguf" }}
note = "A file the repo does not have."

[pairs.tiny-missing-repo]
target = {{ repo = "llamaspec-test/no-such-repo", file = "tiny-target.gguf" }}
draft = {{ repo = "{REPO}", file = "tiny-draft.gguf" }}
note = "A repo that does not exist."
"""
FAMILIES = (r"qwen2\.5", r"qwen3", r"llama-3", r"gemma-3")


# ---------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """A fresh config dir and HF cache; any download not aimed at a stand-in hub goes to a closed port."""
    isolate_hub(tmp_path, monkeypatch)


def write_gguf(path: Path, tokens=TOKENS, n_floats: int = 65_536) -> Path:
    """A small valid GGUF: a gpt2 tokenizer of `tokens` and one float tensor (256 KB)."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(path.stem)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_tensor("token_embd.weight", np.arange(n_floats, dtype=np.float32))
    write_out(writer)
    return path


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("hub-files")
    files = {name: write_gguf(folder / name).read_bytes()
             for name in ("tiny-target.gguf", "tiny-twin.gguf", "tiny-draft.gguf")}
    other = [f"other{i}" for i in range(300)]
    files["tiny-other-vocab.gguf"] = write_gguf(folder / "tiny-other-vocab.gguf", tokens=other).read_bytes()
    files["junk.gguf"] = b"<html>not a model</html>" * 100
    return files


@pytest.fixture
def hub(tiny_files, monkeypatch):
    with HubStandin({REPO: dict(tiny_files)}) as standin:
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        yield standin


@pytest.fixture
def tiny_pairs():
    write_user_toml(TINY_PAIRS)


def write_user_toml(text: str) -> Path:
    path = registry.user_models_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def models_cli(*args, input=None):
    from llamaspec.cli import main

    return CliRunner().invoke(main, ["models", *args], input=input)


def error_line(result) -> str:
    """The one error line a failed command printed (the hub client may log warnings before it)."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    return last


def shipped_entries() -> dict[str, registry.PairEntry]:
    return {name: e for name, e in registry.load_registry().items() if e.source == str(registry.shipped_models_path())}


# ---------------------------------------------------------------------------------------------------------------
# The shipped models.toml
# ---------------------------------------------------------------------------------------------------------------

def test_shipped_file_parses_into_entries_with_valid_settings():
    pairs = shipped_entries()
    assert {"default", "test"} <= set(pairs)
    for entry in pairs.values():
        assert entry.note, entry.name
        assert entry.policy in registry.POLICY_NAMES
        assert entry.cache_type_k in registry.CACHE_TYPES and entry.cache_type_v in registry.CACHE_TYPES
        for ref in entry.models:
            assert ref.is_local or (re.fullmatch(r"[\w.-]+/[\w.-]+", ref.repo) and ref.file.endswith(".gguf"))


def test_shipped_file_has_ten_checked_pairs_and_24gb_ones_first():
    pairs = [e for e in shipped_entries().values() if not e.target.is_local and e.name != "default"]
    assert sum(e.verified for e in pairs) >= 10
    assert pairs[0].vram_gb == 24
    assert {8, 12, 16, 24} <= {e.vram_gb for e in pairs}


def test_shipped_pair_names_are_unique_ignoring_case():
    text = registry.shipped_models_path().read_text()
    names = [m[2].lower() for m in re.finditer(r'^\[pairs\.("?)([^"\]]+)\1\]', text, re.M)]
    assert len(names) == len(set(names)) == len(shipped_entries())


def test_target_and_draft_of_each_shipped_pair_are_one_family():
    for entry in shipped_entries().values():
        if entry.target.is_local:
            continue
        # a file named after its role (a DFlash draft's) is named after the family in its repo
        families = [{f for f in FAMILIES if re.search(f, ref.file, re.I)} or
                    {f for f in FAMILIES if re.search(f, ref.repo, re.I)} for ref in entry.models]
        assert len(families[0]) == 1 and all(f == families[0] for f in families[1:]), entry.name
        assert len(entry.models) == 2 or entry.drafter in ("mtp", "lookup+mtp", "lookup"), entry.name


def test_each_shipped_entry_cites_the_listing_of_both_repos_or_says_it_is_not_checked():
    text = registry.shipped_models_path().read_text()
    for entry in shipped_entries().values():
        if entry.target.is_local:
            continue
        comments = _comment_block_above(text, entry.name)
        for ref in entry.models:
            cited = f"https://huggingface.co/{ref.repo}" in comments
            assert cited or (not entry.verified and "NOT CHECKED" in comments), (entry.name, ref.repo)
        assert entry.verified == ("NOT CHECKED" not in comments), entry.name


def test_listed_file_sizes_fit_the_stated_gpu_memory():
    for entry in shipped_entries().values():
        sizes = [ref.size_gb for ref in entry.models]
        if entry.vram_gb and None not in sizes:
            assert sum(sizes) + 1.0 <= entry.vram_gb, entry.name  # + ~1 GB of compute buffers


def _comment_block_above(text: str, name: str) -> str:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf'^\[pairs\.("?){re.escape(name)}\1\]', line))
    block = []
    for line in reversed(lines[:start]):
        if not line.startswith("#"):
            break
        block.append(line)
    return "\n".join(block)


# ---------------------------------------------------------------------------------------------------------------
# The user's models.toml
# ---------------------------------------------------------------------------------------------------------------

def test_user_entry_changes_fields_of_a_shipped_pair_and_adds_new_pairs():
    write_user_toml('[pairs."qwen2.5-coder-32b"]\nn_ctx = 32768\n\n'
                    '[pairs.mine]\ntarget_path = "/m/t.gguf"\ndraft_path = "/m/d.gguf"\nnote = "mine"\n')
    pairs = registry.load_registry()
    changed = pairs["qwen2.5-coder-32b"]
    assert changed.n_ctx == 32768
    assert changed.target.repo == "bartowski/Qwen2.5-Coder-32B-Instruct-GGUF" and changed.draft_max == 16
    assert changed.verified and changed.source == str(registry.user_models_path())
    assert pairs["mine"].target.path == "/m/t.gguf" and pairs["mine"].n_ctx == 4096


def test_user_entry_giving_another_file_is_no_longer_marked_checked():
    write_user_toml('[pairs."qwen2.5-coder-32b"]\ntarget = { file = "Qwen2.5-Coder-32B-Instruct-Q5_K_M.gguf" }\n')
    entry = registry.get_pair("qwen2.5-coder-32b")
    assert entry.target.repo == "bartowski/Qwen2.5-Coder-32B-Instruct-GGUF"
    assert entry.target.file == "Qwen2.5-Coder-32B-Instruct-Q5_K_M.gguf" and entry.target.size_gb is None
    assert not entry.verified


def test_user_pair_of_local_files_resolves_without_the_hub(tmp_path):
    target, draft = write_gguf(tmp_path / "t.gguf"), write_gguf(tmp_path / "d.gguf")
    write_user_toml(f'[pairs.local]\ntarget_path = "{target}"\ndraft_path = "{draft}"\nn_ctx = 1024\n'
                    'cache_type_k = "q8_0"\ndraft_max = 3\nnote = "local"\n')
    got_target, got_draft, defaults = registry.resolve_pair("local")
    assert (got_target, got_draft) == (str(target), str(draft))
    assert defaults["n_ctx"] == 1024 and defaults["cache_type_k"] == "q8_0" and defaults["draft_max"] == 3


def test_a_pair_drafting_with_the_targets_mtp_head_names_only_the_target(tmp_path):
    target = write_gguf(tmp_path / "t.gguf")
    write_user_toml(f'[pairs.own]\ntarget_path = "{target}"\ndrafter = "mtp"\ndraft_max = 3\n'
                    f'[pairs.nodraft]\ntarget_path = "{target}"\n')
    with pytest.raises(RegistryError, match="pair 'nodraft': missing draft"):
        registry.get_pair("own")                 # a pair without a draft needs a drafter that needs none
    write_user_toml(f'[pairs.own]\ntarget_path = "{target}"\ndrafter = "mtp"\ndraft_max = 3\n')
    entry = registry.get_pair("own")
    assert entry.draft is None and entry.models == (entry.target,)
    got_target, got_draft, defaults = registry.resolve_pair("own")
    assert (got_target, got_draft) == (str(target), None) and defaults["drafter"] == "mtp"
    assert models_cli("path", "own").stdout.split() == [str(target)]
    write_user_toml(f'[pairs.own]\ntarget_path = "{target}"\ndraft_path = "{target}"\ndrafter = "eagle"\n')
    with pytest.raises(RegistryError, match="drafter must be one of"):
        registry.get_pair("own")


def test_relative_paths_are_relative_to_the_models_toml_that_names_them():
    folder = registry.user_models_path().parent
    folder.mkdir(parents=True)
    write_gguf(folder / "t.gguf"), write_gguf(folder / "d.gguf")
    write_user_toml('[pairs.rel]\ntarget_path = "t.gguf"\ndraft_path = "d.gguf"\n')
    assert registry.resolve_pair("rel")[:2] == (str(folder / "t.gguf"), str(folder / "d.gguf"))


def test_test_pair_points_at_the_test_models_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMASPEC_TEST_MODELS", str(tmp_path))
    write_gguf(tmp_path / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    write_gguf(tmp_path / "qwen2.5-coder-0.5b-instruct.gguf")
    target, draft, _ = registry.resolve_pair("test")
    assert Path(target).parent == tmp_path and Path(draft).parent == tmp_path


def test_test_pair_without_its_variable_names_the_variable(monkeypatch):
    monkeypatch.delenv("LLAMASPEC_TEST_MODELS", raising=False)
    with pytest.raises(RegistryError, match="environment variable LLAMASPEC_TEST_MODELS is not set"):
        registry.resolve_pair("test")


def test_malformed_user_toml_is_reported_with_file_line_and_column():
    path = write_user_toml('[pairs.a]\nnote = "x"\nn_ctx = = 5\n')
    with pytest.raises(RegistryError) as error:
        registry.load_registry()
    assert str(error.value).startswith(f"{path}, line 3, column ")
    assert "invalid TOML" in str(error.value)


def test_wrong_type_is_reported_with_the_line_of_its_pair():
    path = write_user_toml('# mine\n\n[pairs.a]\ntarget_path = "/t.gguf"\ndraft_path = "/d.gguf"\nn_ctx = "big"\n')
    with pytest.raises(RegistryError, match=re.escape(f"{path}, line 3: pair 'a': n_ctx must be an integer")):
        registry.load_registry()


def test_misspelt_key_gets_a_suggestion():
    write_user_toml('[pairs.a]\ntarget_path = "/t.gguf"\ndraft_path = "/d.gguf"\nn_gpu_layer = 10\n')
    with pytest.raises(RegistryError, match="unknown key 'n_gpu_layer' \\(did you mean 'n_gpu_layers'\\?\\)"):
        registry.load_registry()


def test_unquoted_pair_name_with_a_dot_gets_a_hint():
    write_user_toml('[pairs.qwen2.5-mine]\ntarget_path = "/t.gguf"\ndraft_path = "/d.gguf"\n')
    with pytest.raises(RegistryError, match=re.escape('must be quoted, e.g. [pairs."qwen2.5-mine"]')):
        registry.load_registry()


@pytest.mark.parametrize("table, message", [
    ('target = { repo = "a/b", file = "x.gguf" }', "missing draft"),
    ('target = { repo = "ab", file = "x.gguf" }\ndraft_path = "/d.gguf"', "not of the form owner/name"),
    ('target = { repo = "a/b", file = "x.bin" }\ndraft_path = "/d.gguf"', "is not a .gguf file"),
    ('target = { repo = "a/b", file = "x-00001-of-00003.gguf" }\ndraft_path = "/d.gguf"', "split GGUF"),
    ('target_path = "/t.gguf"\ndraft_path = "/d.gguf"\npolicy = "greedy"', "policy must be one of"),
    ('target_path = "/t.gguf"\ndraft_path = "/d.gguf"\ncache_type_v = "q3"', "cache_type_v must be one of"),
    ('target_path = "/t.gguf"\ndraft_path = "/d.gguf"\nn_gpu_layers = true', "n_gpu_layers must be an integer"),
])
def test_invalid_entries_are_refused_with_the_reason(table, message):
    write_user_toml(f"[pairs.bad]\n{table}\n")
    with pytest.raises(RegistryError, match=re.escape(message)):
        registry.load_registry()


def test_unknown_pair_name_suggests_close_names():
    with pytest.raises(RegistryError, match="unknown pair 'qwen25-coder-32b'; did you mean 'qwen2.5-coder-32b'"):
        registry.resolve_pair("qwen25-coder-32b")


def test_defaults_carry_the_entry_settings():
    assert registry.get_pair("qwen2.5-coder-32b").defaults() == {
        "n_ctx": 8192, "n_gpu_layers": -1, "draft_n_gpu_layers": -1, "cache_type_k": "q8_0",
        "cache_type_v": "q8_0", "draft_max": 16, "policy": "auto"}


# ---------------------------------------------------------------------------------------------------------------
# Downloads through huggingface_hub, against the stand-in hub
# ---------------------------------------------------------------------------------------------------------------

def test_pull_puts_both_files_in_the_hf_cache_layout(hub, tiny_pairs, tiny_files):
    result = models_cli("pull", "tiny")
    assert result.exit_code == 0, result.output
    target, draft = (Path(line) for line in result.stdout.split())
    snapshot = Path(registry.hf_cache_dir()) / "models--llamaspec-test--tiny-GGUF" / "snapshots" / COMMIT
    assert (target, draft) == (snapshot / "tiny-target.gguf", snapshot / "tiny-draft.gguf")
    assert target.read_bytes() == tiny_files["tiny-target.gguf"]
    assert target.resolve().parent.name == "blobs"


def test_resolve_pair_with_yes_downloads_on_first_use_then_works_offline(hub, tiny_pairs, monkeypatch):
    target, draft, defaults = registry.resolve_pair("tiny", assume_yes=True)
    assert Path(target).name == "tiny-target.gguf" and Path(draft).is_file()
    assert defaults["draft_max"] == 4 and defaults["policy"] == "fixed" and defaults["n_ctx"] == 512
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n_requests = len(hub.requests)
    assert registry.resolve_pair("tiny")[:2] == (target, draft)
    assert len(hub.requests) == n_requests


def test_resolve_pair_without_terminal_or_yes_says_how_to_download(hub, tiny_pairs):
    with pytest.raises(RegistryError, match=re.escape("run `llamaspec models pull tiny` or pass --yes")):
        registry.resolve_pair("tiny")
    assert hub.requests == []


def test_resolve_pair_asks_through_its_confirm_callback_and_no_downloads_nothing(hub, tiny_pairs):
    asked = []
    with pytest.raises(RegistryError, match="download declined"):
        registry.resolve_pair("tiny", confirm=lambda q: asked.append(q) or False)
    assert hub.requests == [] and "Download now?" in asked[0]
    target, _, _ = registry.resolve_pair("tiny", confirm=lambda q: True)
    assert Path(target).is_file()


def test_dropped_connection_resumes_with_a_range_request(hub, tiny_pairs, tiny_files, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 16_384)  # yield before the cut
    hub.cut(REPO, "tiny-target.gguf", after_bytes=100_000)
    result = models_cli("pull", "tiny")
    assert result.exit_code == 0, result.output
    first, second = hub.gets("tiny-target.gguf")
    assert first.range is None
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", second.range)[1])
    assert 0 < resumed_at <= 100_000
    assert Path(result.stdout.split()[0]).read_bytes() == tiny_files["tiny-target.gguf"]


def test_interrupted_pull_is_one_line_and_the_next_pull_completes(hub, tiny_pairs, tiny_files):
    hub.cut(REPO, "tiny-target.gguf", after_bytes=100_000)
    hub.fail(REPO, "tiny-target.gguf", status=503)  # the retry after the cut fails
    line = error_line(models_cli("pull", "tiny"))
    assert "tiny-target.gguf" in line and "HTTP 503" in line and "again" in line
    result = models_cli("pull", "tiny")
    assert result.exit_code == 0, result.output
    assert Path(result.stdout.split()[0]).read_bytes() == tiny_files["tiny-target.gguf"]


def test_missing_file_in_repo_is_one_line(hub, tiny_pairs):
    line = error_line(models_cli("pull", "tiny-missing-file"))
    assert line == f"error: file no-such-file.gguf not found in repository {REPO}"


def test_missing_repo_is_one_line(hub, tiny_pairs):
    line = error_line(models_cli("pull", "tiny-missing-repo"))
    assert line.startswith("error: repository llamaspec-test/no-such-repo not found at http://127.0.0.1:")


def test_offline_with_nothing_cached_is_one_line(hub, tiny_pairs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = error_line(models_cli("pull", "tiny"))
    assert "is not in the local cache" in line and "HF_HUB_OFFLINE is set" in line
    assert hub.requests == []


def test_unreachable_hub_is_one_line(tiny_pairs):
    line = error_line(models_cli("pull", "tiny"))  # HF_ENDPOINT is a closed port
    assert line.startswith("error: cannot reach http://127.0.0.1:9 to download tiny-target.gguf")


def test_not_enough_disk_space_is_refused_before_downloading(hub, tiny_pairs, monkeypatch):
    monkeypatch.setattr(download, "_free_bytes", lambda path: 1_000_000)
    line = error_line(models_cli("pull", "tiny"))
    assert "not enough disk space for llamaspec-test/tiny-GGUF/tiny-target.gguf" in line
    assert hub.gets("tiny-target.gguf") == []


def test_downloaded_file_that_is_not_gguf_is_reported(hub, tiny_pairs):
    line = error_line(models_cli("pull", "tiny-junk"))
    assert "junk.gguf: not a GGUF file" in line


def test_pull_refuses_a_draft_with_another_tokenizer(hub, tiny_pairs):
    with pytest.raises(IncompatiblePairError, match="token 5 differs"):
        registry.pull(registry.get_pair("tiny-mismatch"))


# ---------------------------------------------------------------------------------------------------------------
# `llamaspec models list / show / path / rm`
# ---------------------------------------------------------------------------------------------------------------

def test_list_shows_sizes_memory_and_download_state(hub, tiny_pairs):
    before = models_cli("list")
    assert before.exit_code == 0, before.output
    row = _row(before.stdout, "qwen2.5-coder-32b")
    assert row[1:] == ["24 GB", "Qwen2.5-Coder-32B-Instruct-Q4_K_M", "Qwen2.5-Coder-0.5B-Instruct-Q8_0", "20.4 GB",
                       "not downloaded"]
    assert _row(before.stdout, "qwen3-8b")[0] == "qwen3-8b *"
    assert _row(before.stdout, "tiny")[-1] == "not downloaded"
    assert models_cli("pull", "tiny").exit_code == 0
    after = models_cli("list")
    assert _row(after.stdout, "tiny")[-2:] == ["0.5 MB", "downloaded"]
    assert _row(after.stdout, "tiny-twin")[-1] == "partly downloaded"


def _row(table: str, name: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.split(" ")[0] == name)
    return re.split(r"\s{2,}", line.strip())


def test_show_prints_files_links_and_settings():
    result = models_cli("show", "llama3.1-8b")
    assert result.exit_code == 0, result.output
    assert "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf (4.92 GB)" in result.stdout
    assert ("https://huggingface.co/bartowski/Llama-3.2-1B-Instruct-GGUF/blob/main/Llama-3.2-1B-Instruct-Q4_K_M.gguf"
            in result.stdout)
    assert "n_ctx=8192" in result.stdout and "cache_type_k=q8_0" in result.stdout
    assert "not downloaded" in result.stdout and "checked      yes" in result.stdout


def test_path_prints_local_paths_once_downloaded(hub, tiny_pairs):
    assert "run `llamaspec models pull tiny`" in error_line(models_cli("path", "tiny"))
    pulled = models_cli("pull", "tiny")
    result = models_cli("path", "tiny")
    assert result.exit_code == 0 and result.stdout == pulled.stdout


def test_rm_removes_files_and_keeps_one_another_downloaded_pair_uses(hub, tiny_pairs):
    target, draft = (Path(p) for p in models_cli("pull", "tiny").stdout.split())
    twin = Path(models_cli("pull", "tiny-twin").stdout.split()[0])
    result = models_cli("rm", "tiny")
    assert result.exit_code == 0, result.output
    assert "kept tiny-draft.gguf: pair tiny-twin uses it too" in result.stdout
    assert not target.exists() and not target.is_symlink() and draft.is_file() and twin.is_file()
    blobs = target.parent.parent.parent / "blobs"
    assert sorted(b.name for b in blobs.iterdir()) == sorted(p.resolve().name for p in (draft, twin))
    result = models_cli("rm", "tiny-twin", "--include-shared")
    assert result.stdout.strip() == "removed tiny-twin: 0.5 MB freed"
    assert not twin.exists() and not draft.exists() and not any(blobs.iterdir())


def test_rm_takes_a_file_name_literally_and_never_as_a_pattern(hub, tiny_pairs):
    write_user_toml(TINY_PAIRS + f"""
[pairs.greedy]
target = {{ repo = "{REPO}", file = "*.gguf" }}
draft = {{ repo = "{REPO}", file = "tiny-[dt]*.gguf" }}
""")
    target, draft = (Path(p) for p in models_cli("pull", "tiny").stdout.split())
    result = models_cli("rm", "greedy")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "nothing of greedy to remove"
    assert target.is_file() and draft.is_file()


def test_deeply_nested_models_toml_is_one_line_naming_the_file():
    path = write_user_toml("[pairs.deep]\nnote = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(RegistryError, match="nested too deeply"):
        registry.load_registry()
    for args in (["list"], ["show", "deep"], ["rm", "deep"]):
        line = error_line(models_cli(*args))
        assert str(path) in line and "nested too deeply" in line


def test_unknown_pair_on_the_command_line_is_one_line():
    assert error_line(models_cli("show", "qwen3-32")).startswith("error: unknown pair 'qwen3-32'; did you mean")


@pytest.mark.realmodel
@pytest.mark.slow
def test_engine_loads_the_test_pair_by_name(real_models):
    from llamaspec import load_pair

    with load_pair("test", n_ctx=256, n_gpu_layers=0) as pair:
        assert pair.draft is not None
        assert len(pair.generate("def add(a, b):", max_tokens=4).tokens) == 4


@pytest.mark.parametrize("name", ["../outside.gguf", "/etc/x.gguf", "a/../../x.gguf", "~/x.gguf", "a\\b.gguf",
                                  "./x.gguf", "a//x.gguf"])
def test_a_file_name_leaving_the_cache_is_refused_when_models_toml_is_read(name, tmp_path):
    outside = write_gguf(tmp_path / "outside.gguf")
    write_user_toml(f'[pairs.evil]\ntarget = {{ repo = "a/b", file = {name!r} }}\ndraft_path = "{outside}"\n'
                    .replace("'", '"').replace("\\", "\\\\"))
    with pytest.raises(RegistryError, match=r"pair 'evil': target file .* (must be a relative name|must not contain)"):
        registry.load_registry()
    for args in (["list"], ["show", "evil"], ["path", "evil"], ["rm", "evil"]):
        result = models_cli(*args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
        assert "Traceback" not in result.output
    assert outside.exists()   # `models rm` deleted nothing


def test_a_revision_leaving_the_cache_is_refused():
    write_user_toml('[pairs.evil]\ntarget = { repo = "a/b", file = "t.gguf", revision = "../../x" }\n'
                    'draft = { repo = "a/c", file = "d.gguf" }\n')
    with pytest.raises(RegistryError, match="target revision '../../x' must not contain '..'"):
        registry.load_registry()
