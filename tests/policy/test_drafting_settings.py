"""The drafting settings have one name each (draft_max, draft_min, draft_p_min) from the flag to the policy, change
at run time only through `Pair.set_drafting`, and size a recurrent target's snapshots in one function
(`loading.snapshot_reach`) without building a policy."""
from __future__ import annotations

from pathlib import Path

import pytest

from llamaspec.config import DRAFTER_KINDS, LoadConfig
from llamaspec.errors import InvalidParameterError
from llamaspec.gguf.info import ModelInfo
from llamaspec.kinds import KINDS, drafter_kind
from llamaspec.policy import AutoPolicy, FixedPolicy, policy_for


def header(arch: str) -> ModelInfo:
    return ModelInfo(Path(f"{arch}.gguf"), 0, 3, {"general.architecture": arch}, (), ())


# -- the snapshot reach ------------------------------------------------------------------------------------------
# (target arch, settings) -> (n_rs_seq, the resolved draft_max); None in the first: the kind's snapshot_k_max.
# The numbers are what load_pair sized before the reach had one function (a policy built to ask its k_max).
REACH = [
    ("qwen35", {}, None, "kind"),                                    # bounded, open: the kind's reach
    ("qwen35", {"policy": "confidence"}, None, "kind"),
    ("qwen35", {"policy": "threshold"}, None, "kind"),
    ("qwen35", {"policy": "fixed"}, 4, None),                        # fixed's own 4, left open in the settings
    ("qwen35", {"draft_max": 7}, 7, 7),                              # a reach asked for is kept
    ("qwen35", {"policy": "fixed", "draft_max": 0}, 1, 0),           # plain still keeps one snapshot
    ("qwen35", {"n_rs_seq": 5}, 5, "kind"),                          # snapshots asked for are kept
    ("llama", {}, 12, None),                                         # no snapshots to pay for: auto's 12
    ("mamba", {"policy": "confidence"}, 8, None),                    # a checkpointing target: confidence's 8
    ("llama", {"n_batch": 8}, 6, None),                              # within the batch: n_ubatch >= n_rs_seq + 2
]


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
@pytest.mark.parametrize("arch, settings, n_rs_seq, draft_max", REACH)
def test_snapshot_reach_sizes_the_target_as_before_for_every_kind(monkeypatch, kind, arch, settings, n_rs_seq,
                                                                  draft_max):
    def no_policy(*args, **kwargs):
        raise AssertionError("the reach is resolved without building a policy")

    monkeypatch.setattr("llamaspec.loading.policy_for", no_policy)
    from llamaspec.loading import snapshot_reach

    reach = KINDS[kind].snapshot_k_max
    config = snapshot_reach(LoadConfig.from_kwargs(drafter=kind, **settings), header(arch), drafter_kind(kind))
    assert config.target.n_rs_seq == (reach if n_rs_seq is None else n_rs_seq)
    assert config.drafting.draft_max == (reach if draft_max == "kind" else draft_max)


def test_each_kinds_open_reach_on_a_snapshot_target():
    from llamaspec.loading import snapshot_reach

    got = {kind: snapshot_reach(LoadConfig(drafter=kind), header("qwen35"), drafter_kind(kind)).target.n_rs_seq
           for kind in DRAFTER_KINDS}
    assert got == {"model": 4, "lookup": 4, "lookup+model": 4, "mtp": 3, "lookup+mtp": 3, "eagle3": 4, "dflash": 6}


def test_a_policy_given_as_an_object_sets_the_reach():
    from llamaspec.loading import snapshot_reach

    config = LoadConfig()   # auto, open: on a snapshot target the kind's 4, unless the policy object says
    assert snapshot_reach(config, header("qwen35"), drafter_kind("model"), FixedPolicy(6)).target.n_rs_seq == 6
    assert snapshot_reach(config, header("qwen35"), drafter_kind("model"), AutoPolicy(9)).target.n_rs_seq == 9
    assert snapshot_reach(config, header("qwen35"), drafter_kind("model"), FixedPolicy(6)).drafting.draft_max is None


def test_an_open_reach_longer_than_the_batch_is_refused():
    from llamaspec.loading import snapshot_reach

    with pytest.raises(InvalidParameterError, match="draft_max"):   # dflash's 6 does not fit a batch of 5
        snapshot_reach(LoadConfig.from_kwargs(drafter="dflash", n_batch=5), header("qwen35"), drafter_kind("dflash"))


# -- one name from the settings to the policy --------------------------------------------------------------------
def test_the_settings_reach_the_policy_under_their_own_names():
    config = LoadConfig(policy="threshold", draft_max=6, draft_min=2, draft_p_min=0.5)
    p = policy_for(config.drafting)
    assert (p.draft_max, p.draft_min, p.draft_p_min) == (6, 2, 0.5)
    with pytest.raises(TypeError, match="k_max"):
        LoadConfig(k_max=3)   # the old inner names are not settings
    for name in ("draft_max", "draft_min", "draft_p_min"):
        assert not hasattr(LoadConfig(), name)   # one place holds them: config.drafting


# -- every change at run time goes through Pair.set_drafting ------------------------------------------------------
def _chat_k(pair, n: int) -> None:
    from llamaspec.cli.chat import ChatSession

    assert ChatSession(pair, None, {"max_tokens": None}).command(f"/k {n}")


def _admin_patch(pair, body: dict) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, create_app

    app = create_app(pair, ServerConfig(model_id="tiny", admin_key="adm"))
    with TestClient(app, base_url="http://localhost") as client:
        r = client.patch("/admin/config", headers={"Authorization": "Bearer adm"}, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["settings"] == pair.config.drafting.policy_settings()


@pytest.mark.parametrize("loaded, body", [
    ("fixed", {"draft_max": 3}),                      # a fixed pair: the draft length alone
    ("auto", {"policy": "fixed", "draft_max": 3}),    # /k is a fixed length: the same change, spelled out
])
def test_chat_k_and_admin_patch_end_in_the_same_drafting(tiny_models, loaded, body):
    from llamaspec import load_pair

    ends = []
    for change in (lambda pair: _chat_k(pair, 3), lambda pair: _admin_patch(pair, body)):
        with load_pair(str(tiny_models["target"]), str(tiny_models["draft"]), n_ctx=256, n_threads=1,
                       policy=loaded, draft_max=5, draft_min=1, warm_up=False) as pair:
            change(pair)
            drafting = pair.config.drafting
            assert drafting.draft_max == 3 and pair.policy.next_draft_len() == 3
            assert type(pair.policy) is type(policy_for(drafting))   # the settings say what the pair runs
            ends.append((drafting, type(pair.policy)))
    assert ends[0] == ends[1] and ends[0][1] is FixedPolicy


def test_an_admin_patch_keeps_the_policy_and_changes_its_length(tiny_models):
    from llamaspec import load_pair

    with load_pair(str(tiny_models["target"]), str(tiny_models["draft"]), n_ctx=256, n_threads=1, policy="auto",
                   warm_up=False) as pair:
        _admin_patch(pair, {"draft_max": 3})
        assert (pair.config.drafting.policy, pair.config.drafting.draft_max) == ("auto", 3)
        assert isinstance(pair.policy, AutoPolicy) and pair.policy.draft_max == 3
