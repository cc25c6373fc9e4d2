"""`llamaspec serve --parallel N` on loopback: requests generated together each get the reply they get alone (none
lost or mixed up), a client that leaves frees its slot at once, and the bounded queue still answers 429 beyond it.
Tiny models (conftest's tiny_models), a real server process (support/servers.py)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from support.servers import OpenStream, health, metric, post, start_server, wait_until  # noqa: E402

N_SLOTS = 4
N_REQUESTS = 12
TIME_LIMIT_S = 120.0   # a guard against hangs; the test takes a few seconds
LONG = {"prompt": "Go on and on", "max_tokens": 100000, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    srv = start_server(tiny_models, tmp_path_factory.mktemp("srv-np") / "server.log", "-np", str(N_SLOTS),
                       "--max-queue", "2", "-fa", "off", n_ctx=1024)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def library_pair(tiny_models):
    from llamaspec import load_pair

    with load_pair(str(tiny_models["target"]), str(tiny_models["noisy"]), n_ctx=1024, n_threads=1,
                   flash_attn="off") as pair:   # flash attention off on both sides: see test_batch's SETTINGS
        yield pair


def body(i: int) -> dict:
    return {"prompt": f"Request {i} says:", "max_tokens": 12 + i % 5, "temperature": 0, "stream": i % 3 == 0}


def text_of(r: httpx.Response, stream: bool) -> str:
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["text"]
    import json

    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks)


def test_concurrent_replies_equal_their_alone_replies(server, library_pair):
    assert f"{N_SLOTS} slots" in server.stderr()
    expected = [library_pair.generate(body(i)["prompt"], max_tokens=body(i)["max_tokens"])
                for i in range(N_REQUESTS)]
    start = time.monotonic()
    with ThreadPoolExecutor(N_SLOTS + 2) as pool:   # up to two wait in the queue (--max-queue 2): none refused
        replies = list(pool.map(lambda i: text_of(post(server.url, "/v1/completions", body(i)), body(i)["stream"]),
                                range(N_REQUESTS)))
    assert time.monotonic() - start < TIME_LIMIT_S
    assert replies == [c.text for c in expected]
    assert health(server.url)["running"] == 0


def test_a_client_that_leaves_frees_its_slot_at_once(server):
    streams = [OpenStream(server.url, LONG) for _ in range(2)]
    try:
        assert health(server.url)["running"] == 2
        streams[0].close()
        wait_until(lambda: health(server.url)["running"] == 1, 5, "the cancelled request to free its slot")
        ok = post(server.url, "/v1/completions", {"prompt": "still here", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200   # served beside the long one still running
        assert health(server.url)["running"] == 1
    finally:
        for s in streams:
            s.close()
    wait_until(lambda: health(server.url)["running"] == 0, 5, "every slot to be free")


def test_beyond_the_slots_and_the_queue_answers_429(server):
    streams = [OpenStream(server.url, LONG) for _ in range(N_SLOTS)]
    waiting = []
    pool = ThreadPoolExecutor(2)
    try:
        waiting = [pool.submit(post, server.url, "/v1/completions", {"prompt": "queued", "max_tokens": 2})
                   for _ in range(2)]
        wait_until(lambda: health(server.url)["queue_depth"] == 2, 10, "two requests to queue")
        r = post(server.url, "/v1/completions", {"prompt": "one too many", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        for s in streams:
            s.close()
        assert [f.result(30).status_code for f in waiting] == [200, 200]   # served once slots free
        pool.shutdown()
    assert "Traceback" not in server.stderr()


def test_the_model_card_shows_the_served_context_not_the_shrunk_own_one(server):
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["llamaspec"]
    assert card["n_ctx"] == 1024   # the slots' shared context (the pair's own holds one batch now)


def test_mtp_head_slots_give_each_request_its_alone_reply(tmp_path):
    """serve --parallel with the target's MTP head as a head file (mtp-*.gguf, llama.cpp's -md spelling) on a tiny
    qwen35: the head drafts for the slots together and each concurrent reply is the one the request gets alone."""
    from support.mtp_models import make_mtp_model, split_mtp_head
    from llamaspec import load_pair

    trunk, head = tmp_path / "tiny.gguf", tmp_path / "mtp-tiny.gguf"
    split_mtp_head(make_mtp_model("qwen35", tmp_path, head="agree", trunk_mix=0.1), trunk, head)
    prompts = [[3 + i, 17, 42 + i, 99, 5] for i in range(8)]
    with load_pair(str(trunk), str(head), n_ctx=1024, n_threads=1, flash_attn="off") as pair:
        assert pair.drafter_kind == "mtp"
        expected = [pair.generate(q, max_tokens=16).text for q in prompts]
    srv = start_server({"target": trunk, "head": head}, tmp_path / "server.log", "-np", "4", "-fa", "off",
                       n_ctx=1024, draft="head")
    try:
        assert "drafter mtp" in srv.stderr() and "4 slots" in srv.stderr() and "unavailable" not in srv.stderr()
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: text_of(post(srv.url, "/v1/completions", {
                "prompt": prompts[i], "max_tokens": 16, "temperature": 0, "stream": i % 2 == 0}), i % 2 == 0),
                range(len(prompts))))
        assert time.monotonic() - start < TIME_LIMIT_S
        assert replies == expected
        assert metric(srv.url, "llamaspec_draft_tokens_accepted_total") > 0   # the head's drafts were used
    finally:
        srv.stop()
