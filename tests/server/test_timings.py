"""`timings` and the speculation counts on short replies, through a real server (tiny models on loopback): a draft
with the target's weights is always accepted, so a fixed draft length of 4 makes five tokens in one verification.
Alone (-np 1, Pair.generate) and in slots (-np 2, shared contexts: slots.py)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from support.servers import post, start_server  # noqa: E402

PROMPT = "Once upon a time"


@pytest.fixture(scope="module", params=[1, 2], ids=["alone", "slots"])
def server(request, tiny_models, tmp_path_factory):
    srv = start_server(tiny_models, tmp_path_factory.mktemp("srv-timings") / "server.log", "--policy", "fixed",
                       "--draft-max", "4", "-np", str(request.param), draft="draft")
    yield srv
    srv.stop()


def complete(server, **body) -> dict:
    r = post(server.url, "/v1/completions", {"model": "x", "prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_reply_made_in_one_step_reports_that_steps_rate(server):
    got = complete(server, max_tokens=5)
    stats, t = got["llamaspec"], got["timings"]
    assert stats["target_passes"] == 1 and t["predicted_n"] == got["usage"]["completion_tokens"] == 5
    # the span holds the verification that made the five tokens, so the rate is at most five over its time
    assert t["predicted_ms"] >= stats["time_verify"] * 1e3
    assert t["predicted_per_second"] <= 5 / stats["time_verify"]
    assert t["predicted_per_second"] == pytest.approx(5 / (t["predicted_ms"] / 1e3))
    assert t["prompt_ms"] + t["predicted_ms"] == pytest.approx(stats["time_total"] * 1e3)


def test_drafts_accepted_past_a_stop_string_are_not_counted(server):
    first = complete(server, max_tokens=1)["choices"][0]["text"]
    whole = complete(server, max_tokens=5)["choices"][0]["text"]
    assert whole.startswith(first) and len(whole) > len(first) + 1
    stop = whole[len(first)]   # the first character of the second token's text
    assert stop not in first, "pick another prompt: the stop string must first appear in the second token"

    got = complete(server, max_tokens=5, stop=[stop])
    stats, t = got["llamaspec"], got["timings"]
    assert got["choices"][0]["finish_reason"] == "stop" and got["usage"]["completion_tokens"] == 2
    assert stats["accepted"] <= stats["tokens_generated"] == 2 and stats["drafted"] == 2
    assert t["draft_n_accepted"] <= t["predicted_n"] == 2


def test_the_last_streamed_chunk_carries_the_timings_with_include_usage(server):
    r = post(server.url, "/v1/completions", {"model": "x", "prompt": PROMPT, "temperature": 0, "max_tokens": 9,
                                             "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 9
    assert last["timings"]["predicted_n"] == 9 and last["timings"]["predicted_per_second"] > 0
    assert last["timings"]["draft_n_accepted"] <= last["timings"]["draft_n"]
