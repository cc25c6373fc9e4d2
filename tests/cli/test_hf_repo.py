"""`-hf REPO[:QUANT]` / `-hfd` (the file for a quant and the sidecar heads, as llama.cpp picks them) and GGUF headers
read over HTTP with range requests (`llamaspec check -hf ...` / `--pair` without downloading the files).

The hub is tests/support/hf_standin.py: a real HTTP server on 127.0.0.1 serving GGUF files these tests write, with the
hub's tree API and byte ranges; it counts the body bytes it sends, which is how "only a prefix was read" is checked.
"""
from __future__ import annotations

import re
import time

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFWriter

from support.gguf_factory import write_out
from support.hf_standin import HubStandin, isolate_hub
from llamaspec.errors import RegistryError
from llamaspec.gguf.reader import read_model_info
from llamaspec.hub import download, hf_repo, remote
from llamaspec.hub.hf_repo import RepoFile, best_model, best_sibling, choose, resolve_hf

GGML = "ggml-org/Qwen3.8-27B-GGUF"
GGML_FILES = ["Qwen3.8-27B-Q4_K_M.gguf", "Qwen3.8-27B-Q8_0.gguf", "mtp-Qwen3.8-27B-Q8_0.gguf",
              "mtp-Qwen3.8-27B-Q4_0.gguf", "mmproj-Qwen3.8-27B-F16.gguf", "README.md"]


@pytest.fixture(autouse=True)
def isolated_hub(tmp_path, monkeypatch):
    isolate_hub(tmp_path, monkeypatch)


def files(*names) -> list[RepoFile]:
    return [RepoFile(n, 1) for n in names]


# ---------------------------------------------------------------------------------------------------------------
# Picking files like llama.cpp (common/download.cpp)
# ---------------------------------------------------------------------------------------------------------------

def test_quant_tag_picks_its_file_and_no_tag_prefers_q4_k_m_then_q8_0():
    listing = files(*GGML_FILES)
    assert best_model(listing, "Q8_0").path == "Qwen3.8-27B-Q8_0.gguf"
    assert best_model(listing, "q4_k_m").path == "Qwen3.8-27B-Q4_K_M.gguf"   # case-insensitive
    assert best_model(listing, "").path == "Qwen3.8-27B-Q4_K_M.gguf"
    assert best_model(files("A-Q8_0.gguf", "A-Q6_K.gguf"), "").path == "A-Q8_0.gguf"
    assert best_model(files("A-Q6_K.gguf", "A-Q5_K_M.gguf"), "").path == "A-Q6_K.gguf"   # the first model file
    assert best_model(listing, "IQ2_XS") is None


def test_sidecars_and_projectors_are_never_the_model():
    assert best_model(files("mtp-A-Q4_K_M.gguf", "mmproj-A-Q4_K_M.gguf", "A-imatrix.gguf"), "") is None
    assert best_model(files("mtp-A-Q4_K_M.gguf", "A-Q4_K_M.gguf"), "").path == "A-Q4_K_M.gguf"


def test_split_model_is_picked_by_its_first_part_and_then_refused():
    listing = files("A-Q4_K_M-00002-of-00002.gguf", "A-Q4_K_M-00001-of-00002.gguf")
    assert best_model(listing, "Q4_K_M").path == "A-Q4_K_M-00001-of-00002.gguf"
    with pytest.raises(RegistryError, match="split GGUF"):
        choose("o/a:Q4_K_M", files=listing)


def test_mtp_sidecar_follows_the_quant_bits_or_the_exact_tag():
    listing = files(*GGML_FILES)
    # Q4_K_M -> 4 bits: the Q4_0 head (llama.cpp: closest quantization); Q8_0: the exact tag
    assert best_sibling(listing, "Qwen3.8-27B-Q4_K_M.gguf", "mtp-", "Q4_K_M").path == "mtp-Qwen3.8-27B-Q4_0.gguf"
    assert best_sibling(listing, "Qwen3.8-27B-Q8_0.gguf", "mtp-", "Q8_0").path == "mtp-Qwen3.8-27B-Q8_0.gguf"
    assert best_sibling(listing, "Qwen3.8-27B-Q8_0.gguf", "mtp-").path == "mtp-Qwen3.8-27B-Q8_0.gguf"
    assert best_sibling(listing, "Qwen3.8-27B-Q8_0.gguf", "eagle3-") is None


def test_sidecar_in_a_deeper_folder_than_the_model_is_not_its_sidecar():
    listing = files("Q4/A-Q4_K_M.gguf", "mtp-A-Q8_0.gguf", "Q4/mtp-A-Q4_0.gguf", "other/mtp-A-Q4_0.gguf")
    assert best_sibling(listing, "Q4/A-Q4_K_M.gguf", "mtp-").path == "Q4/mtp-A-Q4_0.gguf"     # deepest shared
    assert best_sibling(listing, "A-Q4_K_M.gguf", "mtp-").path == "mtp-A-Q8_0.gguf"          # never deeper


def test_draft_repo_with_an_mtp_sidecar_drafts_with_it_and_selects_mtp():
    listing = {GGML: files(*GGML_FILES), "z-lab/D": files("dflash-D-Q4_K_M.gguf", "eagle3-D-Q8_0.gguf")}
    with _listing(listing):
        target, draft, kind = resolve_hf(f"{GGML}:Q4_K_M", f"{GGML}:Q8_0")
        assert (target.file, draft.file, kind) == ("Qwen3.8-27B-Q4_K_M.gguf", "mtp-Qwen3.8-27B-Q8_0.gguf", "mtp")
        # no tag: the draft repo's default model is Q4_K_M, so its 4-bit head
        assert resolve_hf(GGML, GGML)[1].file == "mtp-Qwen3.8-27B-Q4_0.gguf"
        # dflash outranks eagle3 when nothing is asked for; an asked kind picks its own sidecar
        assert resolve_hf(GGML, "z-lab/D")[1:] == (resolve_hf(GGML, "z-lab/D")[1], "dflash")
        assert resolve_hf(GGML, "z-lab/D", drafter="eagle3")[1].file == "eagle3-D-Q8_0.gguf"
        # the target repo's sidecar of the asked kind, when no draft repo is given; none without a kind
        assert resolve_hf(f"{GGML}:Q8_0", None, drafter="mtp")[1].file == "mtp-Qwen3.8-27B-Q8_0.gguf"
        assert resolve_hf(GGML, None)[1] is None
        # a file named with -md (llama.cpp: hf_file of the draft repo) turns the sidecar search off
        assert resolve_hf(GGML, GGML, draft_file="Qwen3.8-27B-Q8_0.gguf")[1:] == (
            resolve_hf(GGML, GGML, draft_file="Qwen3.8-27B-Q8_0.gguf")[1], None)


def test_repo_spec_that_is_not_owner_name_is_one_clear_error():
    for bad in ("qwen", "a/b/c", "a/b:Q4:Q8", ""):
        with pytest.raises(RegistryError, match="OWNER/NAME"):
            hf_repo.split_repo_tag(bad)


@pytest.mark.parametrize("bad, fragment", [("owner/repo.-", "OWNER/NAME"), ("owner/-repo", "OWNER/NAME"),
                                           ("o/" + "a" * 97, "its name has 97 characters, the hub allows 96"),
                                           ("o/a--b", "no '--' or '..'"), ("o..p/a", "no '--' or '..'")])
def test_repo_id_the_hub_would_refuse_is_one_line_before_any_request(bad, fragment):
    with pytest.raises(RegistryError, match=re.escape(fragment)):
        hf_repo.split_repo_tag(bad)
    assert hf_repo.split_repo_tag("o/" + "a" * 96) == ("o/" + "a" * 96, "")
    assert hf_repo.split_repo_tag("unsloth/Qwen3.6-27B_GGUF:Q8_0") == ("unsloth/Qwen3.6-27B_GGUF", "Q8_0")


def test_repo_id_the_hub_would_refuse_is_one_line_on_the_command_line():
    from llamaspec.cli import main

    for bad in ("owner/repo.-", "o/" + "b" * 120):
        result = CliRunner().invoke(main, ["run", "-hf", bad, "hello"])
        assert result.exit_code == 1 and "Traceback" not in result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "is not a Hugging Face repo" in lines[0]


class _listing:
    """choose() over fixed file lists instead of the hub's tree API (the API itself is tested below)."""

    def __init__(self, listing):
        self.listing, self.saved = listing, hf_repo.list_gguf_files

    def __enter__(self):
        hf_repo.list_gguf_files = lambda repo, revision=None: self.listing[repo]

    def __exit__(self, *exc):
        hf_repo.list_gguf_files = self.saved


# ---------------------------------------------------------------------------------------------------------------
# Over HTTP: the tree API, headers read by range, downloads of the picked files
# ---------------------------------------------------------------------------------------------------------------

def write_model(path, n_tokens: int = 20_000, n_embd: int = 64, n_layer: int = 2, n_ctx_train: int = 32768):
    """A llama-shaped GGUF (tokenizer of n_tokens, f32 weights): a header of ~n_tokens * 14 bytes, then about
    n_tokens * n_embd * 8 bytes of weights."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(2 * n_embd)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(n_tokens)])
    writer.add_tensor("token_embd.weight", np.zeros((n_tokens, n_embd), np.float32))
    writer.add_tensor("output.weight", np.zeros((n_tokens, n_embd), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    for i in range(n_layer):
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd // 2, n_embd)),
                            ("attn_v", (n_embd // 2, n_embd)), ("attn_output", (n_embd, n_embd)),
                            ("ffn_gate", (2 * n_embd, n_embd)), ("ffn_up", (2 * n_embd, n_embd)),
                            ("ffn_down", (n_embd, 2 * n_embd))):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.zeros(shape, np.float32))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
    write_out(writer)
    return path


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("hf-repo")
    return {"Big-Q4_K_M.gguf": write_model(folder / "big.gguf").read_bytes(),
            "Big-Q8_0.gguf": write_model(folder / "big8.gguf", n_embd=32).read_bytes(),
            "Small-Q8_0.gguf": write_model(folder / "small.gguf", n_embd=32, n_layer=1).read_bytes(),
            "notes.gguf": b"<html>not a model</html>" * 50}


@pytest.fixture
def hub(repo_files, monkeypatch):
    with HubStandin({"o/big": dict(repo_files), "o/small": {"Small-Q8_0.gguf": repo_files["Small-Q8_0.gguf"]}}) as s:
        monkeypatch.setenv("HF_ENDPOINT", s.url)
        yield s


def check_cli(*args):
    from llamaspec.cli import main

    return CliRunner().invoke(main, ["check", *args])


def header_bytes(data: bytes) -> int:
    info = read_model_info_bytes(data)
    return info.data_offset


def read_model_info_bytes(data: bytes):
    from pathlib import Path

    from llamaspec.gguf.reader import parse_header

    return parse_header(data, Path("x.gguf"), len(data))


def test_tree_api_lists_the_repo_and_the_quant_picks_the_file(hub):
    assert [f.path for f in hf_repo.list_gguf_files("o/big")] == ["Big-Q4_K_M.gguf", "Big-Q8_0.gguf",
                                                                 "Small-Q8_0.gguf", "notes.gguf"]
    assert choose("o/big:Q8_0").model.file == "Big-Q8_0.gguf"
    assert choose("o/big").model.file == "Big-Q4_K_M.gguf"
    with pytest.raises(RegistryError, match="no IQ1_S model file.*Big-Q4_K_M.gguf"):
        choose("o/big:IQ1_S")
    with pytest.raises(RegistryError, match="not found"):
        choose("o/nothing")


def test_remote_header_is_the_local_header_and_reads_only_a_prefix(hub, repo_files, monkeypatch):
    monkeypatch.setattr(remote, "FIRST_READ", 4096)   # so that the header takes several growing reads
    ref = choose("o/big:Q4_K_M").model
    info = remote.read_remote_header(ref)
    data = repo_files["Big-Q4_K_M.gguf"]
    local = read_model_info_bytes(data)
    assert info.metadata == local.metadata and info.tensors == local.tensors and info.tokens == local.tokens
    assert info.file_size == len(data)
    header = header_bytes(data)
    sent = hub.sent["Big-Q4_K_M.gguf"]
    assert header <= sent < 2 * header + 4096 < len(data) / 4
    ranges = [r.range for r in hub.gets("Big-Q4_K_M.gguf")]
    assert len(ranges) >= 3 and all(r and r.startswith("bytes=") and not r.endswith("-") for r in ranges)
    assert not (download.hf_cache_dir() / "models--o--big").exists()   # nothing was downloaded


def test_check_hf_plans_the_pair_without_downloading_it(hub, repo_files):
    result = check_cli("-hf", "o/big:Q4_K_M", "-hfd", "o/small", "--vram", "1")
    assert result.exit_code == 0, result.output
    assert "=> compatible" in result.output
    assert "largest context with both models fully on the GPU:" in result.output
    total = sum(len(v) for v in repo_files.values())
    assert sum(hub.sent.values()) < total / 4
    assert not (download.hf_cache_dir() / "models--o--big").exists()


def test_check_says_which_context_fits_fully_and_that_more_does_not(hub):
    fits = check_cli("-hf", "o/big:Q4_K_M", "--vram", "0.5", "-c", "4096")
    assert fits.exit_code == 0, fits.output
    line = next(l for l in fits.output.splitlines() if "largest context" in l)
    n_ctx = int(line.rsplit("-c ", 1)[1].rstrip(")"))
    assert 4096 <= n_ctx <= 32768 and n_ctx % 256 == 0
    over = check_cli("-hf", "o/big:Q4_K_M", "--vram", "0.5", "-c", str(n_ctx + 256))
    same = check_cli("-hf", "o/big:Q4_K_M", "--vram", "0.5", "-c", str(n_ctx))
    if n_ctx < 32768:
        assert "does not fit" in over.output
    assert "fits fully offloaded" in same.output


def test_check_pair_reads_headers_from_the_hub_not_the_files(hub, repo_files):
    from llamaspec.hub import registry

    path = registry.user_models_path()
    path.parent.mkdir(parents=True)
    path.write_text('[pairs.remote]\ntarget = { repo = "o/big", file = "Big-Q8_0.gguf" }\n'
                    'draft = { repo = "o/small", file = "Small-Q8_0.gguf" }\n')
    result = check_cli("--pair", "remote", "--vram", "24")
    assert result.exit_code == 0, result.output
    assert "o/big/Big-Q8_0.gguf" in result.output and "=> compatible" in result.output
    assert hub.sent["Big-Q8_0.gguf"] < len(repo_files["Big-Q8_0.gguf"]) / 4


def test_not_a_gguf_on_the_hub_is_one_line(hub):
    result = check_cli("-hf", "o/big", "-hff", "notes.gguf")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "not a GGUF file" in result.stderr.strip().splitlines()[-1]


def test_offline_and_not_cached_says_so(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = check_cli("-hf", "o/big:Q4_K_M")
    assert result.exit_code == 1
    assert "HF_HUB_OFFLINE" in result.stderr


def test_hf_download_goes_to_the_cache_and_then_works_offline(hub, monkeypatch):
    from llamaspec.cli.pair_choice import resolve_model_paths

    target, draft, defaults = resolve_model_paths({"hf_repo": "o/big:Q8_0", "hf_repo_draft": "o/small",
                                                   "assume_yes": True})
    assert target.endswith("Big-Q8_0.gguf") and "models--o--big" in target
    assert draft.endswith("Small-Q8_0.gguf") and defaults == {}
    assert read_model_info(target).file_size == len(hub.repos["o/big"]["Big-Q8_0.gguf"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = resolve_model_paths({"hf_repo": "o/big:Q8_0", "hf_repo_draft": "o/small"})
    assert again[:2] == (target, draft)


def test_hf_without_yes_or_terminal_says_how_and_downloads_nothing(hub):
    from llamaspec.cli.pair_choice import resolve_model_paths

    with pytest.raises(RegistryError, match="--yes"):
        resolve_model_paths({"hf_repo": "o/big:Q8_0"})
    assert hub.sent == {}


# ---------------------------------------------------------------------------------------------------------------
# An unreachable hub (isolate_hub points HF_ENDPOINT at a closed loopback port): one line at once, no retries
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["run", "-hf", "o/big", "hello"], ["check", "-hf", "o/big:Q8_0"],
                                     ["run", "-m", "local.gguf", "-hfd", "o/small", "hello"]])
def test_unreachable_hub_ends_at_the_first_failure_in_one_line(command):
    from llamaspec.cli import main

    started = time.monotonic()
    result = CliRunner().invoke(main, command)
    elapsed = time.monotonic() - started
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr            # no retry lines
    assert lines[0].startswith("error: cannot reach http://127.0.0.1:9 to ")
    assert "use a local file (-m FILE.gguf), or set HF_HUB_OFFLINE=1" in lines[0]
    assert elapsed < 5   # huggingface_hub's own retries took 27 s


def test_a_cached_file_is_used_when_the_hub_cannot_be_reached(hub, monkeypatch):
    from llamaspec.hub.registry import ModelRef

    ref = ModelRef(repo="o/small", file="Small-Q8_0.gguf")
    path = download.fetch(ref)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    started = time.monotonic()
    assert download.fetch(ref) == path
    assert time.monotonic() - started < 5
    with pytest.raises(RegistryError, match="cannot reach http://127.0.0.1:9 to download Small-Q8_0.gguf from o/big"):
        download.fetch(ModelRef(repo="o/big", file="Small-Q8_0.gguf"))
