"""MTP heads in files of their own (ggml-org's `mtp-<model>-Q8_0.gguf` beside `<model>-Q4_K_M.gguf`), the drafter
kind a draft file selects, and DFlash files of a fork's format: a tiny qwen35 model with an MTP block
(mtp_models.py) split into a trunk and a head-only file."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFWriter

from support.mtp_models import make_mtp_model, split_mtp_head

from llamaspec import load_pair
from llamaspec.errors import InvalidParameterError, UnsupportedModelError
from llamaspec.gguf.reader import read_model_info
from llamaspec.gguf.spec_kind import has_mtp_head, is_mtp_head_file, spec_kind
from llamaspec.kinds import kind_for_file
from llamaspec.policy import FixedPolicy

SETTINGS = dict(no_repack=True, n_ctx=256, n_batch=16, n_threads=2)
PROMPT = [5, 17, 99, 3, 42, 8, 77, 21, 64, 2, 90, 33, 11, 120, 7, 58, 19, 101, 4, 66, 29, 13]
N = 24


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model with the head inside, trunk, head file), the head file named as ggml-org names theirs, in the
    trunk's folder."""
    root = tmp_path_factory.mktemp("mtp-sidecar")
    full = make_mtp_model("qwen35", root / "build", head="agree", trunk_mix=0.1)
    folder = root / "repo"
    folder.mkdir()
    trunk, head = folder / "tiny-Q8_0.gguf", folder / "mtp-tiny-Q8_0.gguf"
    split_mtp_head(full, trunk, head)
    return full, trunk, head


def generate(target, draft=None, drafter="model", k=3):
    try:
        pair = load_pair(str(target), None if draft is None else str(draft), drafter=drafter, **SETTINGS)
    except UnsupportedModelError as e:
        if "cannot drop rejected draft tokens" in str(e):
            pytest.skip(f"speculation on this hybrid target needs bounded rollback: {e}")
        raise
    with pair:
        if pair.drafter is not None:
            pair.set_policy(FixedPolicy(k, 0.0))
        out = pair.generate(PROMPT, max_tokens=N)
        return list(out.tokens), pair.config.drafting.drafter, out.stats


def test_the_tensor_list_decides_what_a_file_is(files):
    full, trunk, head = (read_model_info(p) for p in files)
    assert has_mtp_head(full) and not is_mtp_head_file(full) and spec_kind(full) is None   # a model: drafts as one
    assert not has_mtp_head(trunk) and spec_kind(trunk) is None
    assert is_mtp_head_file(head) and spec_kind(head) == "mtp"


def test_a_header_claiming_a_head_without_its_tensors_has_none(files, tmp_path):
    _, trunk, _ = files
    info = read_model_info(trunk)
    lying = type(info)(info.path, info.file_size, info.version,
                       {**info.metadata, "qwen35.nextn_predict_layers": 1}, info.tensors, info.tokens)
    assert lying.n_layer_nextn == 1 and not has_mtp_head(lying)
    with pytest.raises(UnsupportedModelError, match="no multi-token-prediction"):
        from llamaspec.loading import _check_mtp_header
        _check_mtp_header(lying)


@pytest.mark.parametrize("asked, file_kind, expected", [
    ("model", "mtp", "mtp"), ("mtp", "mtp", "mtp"), ("lookup+model", "mtp", "lookup+mtp"),
    ("lookup+mtp", "mtp", "lookup+mtp"), ("model", "dflash", "dflash"), ("model", "eagle3", "eagle3"),
    ("model", None, "model"), ("lookup+model", None, "lookup+model")])
def test_the_draft_file_selects_the_kind_and_the_asked_kind_only_overrides(asked, file_kind, expected):
    assert kind_for_file(asked, file_kind, "qwen35", "d.gguf") == expected


@pytest.mark.parametrize("asked, file_kind", [("eagle3", "mtp"), ("dflash", "mtp"), ("mtp", "dflash"),
                                              ("mtp", None), ("eagle3", None)])
def test_a_kind_the_file_cannot_draft_as_is_refused_in_one_line(asked, file_kind):
    with pytest.raises(InvalidParameterError) as e:
        kind_for_file(asked, file_kind, "qwen35", "d.gguf")
    assert "\n" not in str(e.value) and "d.gguf" in str(e.value)


@pytest.mark.slow
def test_a_head_file_drafts_like_the_head_inside_the_model(files):
    full, trunk, head = files
    plain, _, _ = generate(trunk)
    inside, kind_inside, stats_inside = generate(full, drafter="mtp")
    sidecar, kind, stats = generate(trunk, head)                 # -md mtp-....gguf, no --spec-type: the file says
    assert kind_inside == kind == "mtp"
    assert sidecar == inside == plain
    assert stats.accepted > 0 and stats.accepted == stats_inside.accepted   # the same head, drafting the same


@pytest.mark.slow
def test_a_head_file_beside_the_target_is_found(files):
    _, trunk, _ = files
    found, kind, stats = generate(trunk, drafter="mtp")          # --spec-type draft-mtp, no -md
    assert kind == "mtp" and stats.accepted > 0


def test_without_a_head_anywhere_mtp_is_a_one_line_error(files, tmp_path):
    _, trunk, _ = files
    alone = tmp_path / "tiny-Q8_0.gguf"
    shutil.copy(trunk, alone)
    with pytest.raises(UnsupportedModelError, match="no mtp-\\*.gguf head file beside it") as e:
        load_pair(str(alone), drafter="mtp", **SETTINGS)
    assert "\n" not in str(e.value)


def _fork_dflash(path, arch):
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_tensor("fc.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize("arch", ["dflash-draft", "qwen35-dflash-draft"])
def test_a_fork_dflash_file_is_refused_naming_what_to_download(files, tmp_path, arch):
    _, trunk, _ = files
    draft = _fork_dflash(tmp_path / "dflash-draft-3.6-q8_0.gguf", arch)
    with pytest.raises(UnsupportedModelError) as e:
        load_pair(str(trunk), str(draft), **SETTINGS)
    message = str(e.value)
    assert "\n" not in message and arch in message and "Qwen3.6-27B-DFlash-Q8_0.gguf" in message

    from llamaspec.cli import main

    result = CliRunner().invoke(main, ["check", str(trunk), str(draft), "--vram", "24"])
    assert result.exit_code != 0 and "Qwen3.6-27B-DFlash-Q8_0.gguf" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("how", [["-md", "HEAD"], ["--spec-type", "draft-mtp"]])
def test_cli_drafts_with_a_head_file_given_or_beside_the_target(files, how):
    import json

    from llamaspec.cli import main

    _, trunk, head = files
    args = ["run", "-m", str(trunk), *[str(head) if a == "HEAD" else a for a in how], "--draft-max", "3",
            "--policy", "fixed", "-c", "256", "-t", "2", "--no-repack", "-n", "12", "--raw", "--json", "x"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["drafter"] == "mtp" and out["draft"] == str(head) and out["stats"]["accepted"] > 0
    check = CliRunner().invoke(main, ["check", str(trunk), str(head), "--vram", "24"])
    assert check.exit_code == 0 and "drafts as --spec-type draft-mtp" in check.output
    # the head file's memory is the head's own (its header counts the trunk's blocks, which are not in it)
    assert "drafting with the head file (--spec-type draft-mtp) adds" in check.output
    assert "vocabulary type" in check.output
    alone = CliRunner().invoke(main, ["check", str(trunk), "--vram", "24"])
    assert alone.exit_code == 0 and f"{head.name} beside it drafts with --spec-type draft-mtp" in alone.output


def test_a_registry_entry_with_a_head_file_keeps_it_when_the_head_drafts():
    from llamaspec.cli.pair_choice import resolve_model_paths
    from unittest import mock

    with mock.patch("llamaspec.hub.registry.resolve_pair",
                    return_value=("/m/Q-Q4_K_M.gguf", "/m/mtp-Q-Q8_0.gguf", {"drafter": "mtp"})):
        _, draft, _ = resolve_model_paths({"pair_name": "p", "spec_type": "draft-mtp"})
    assert draft == "/m/mtp-Q-Q8_0.gguf"
    with mock.patch("llamaspec.hub.registry.resolve_pair",
                    return_value=("/m/Q-Q4_K_M.gguf", "/m/Q-DFlash.gguf", {"drafter": "dflash"})):
        _, draft, _ = resolve_model_paths({"pair_name": "p", "spec_type": "draft-mtp"})
    assert draft is None           # the target's own head drafts: the entry's DFlash draft is not loaded


@pytest.mark.parametrize("arch, tensor, expected", [("dflash", "fc.weight", "dflash"),
                                                    ("eagle3", "fc.weight", "eagle3"),
                                                    ("dflash", "markov_w1.weight", "DSpark")])
def test_the_architecture_names_a_hidden_state_draft(tmp_path, arch, tensor, expected):
    w = GGUFWriter(str(tmp_path / "d.gguf"), arch)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_tensor(tensor, np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    info = read_model_info(tmp_path / "d.gguf")
    if expected == "DSpark":      # llama.cpp's DFlash with a Markov head: no drafter for it here
        with pytest.raises(UnsupportedModelError, match="DSpark"):
            spec_kind(info)
    else:
        assert spec_kind(info) == expected
