"""A bounded fuzz of every numeric request field and admin setting against a real `serve` (tiny models, loopback):
each value is answered with a 2xx or an OpenAI 4xx error naming the field, never a 5xx, a traceback in the log,
a dead process or a memory jump (PATCH /admin/config with draft_max 2^70 or 10^9 once meant a 500 or 16 GB)."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from support.servers import ADMIN_KEY, API_KEY, start_server  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
VALUES = [0, 1, -1, 2, 511, 512, 2**31, 2**63, 2**64, 2**70, 10**9, 10**30, 10**400, 0.5, -0.0, 1e308, 3.5,
          "NaN", "Infinity", "-Infinity", "7", True, None, [], {}]
REQUEST_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                  "repeat_penalty", "frequency_penalty", "presence_penalty", "repeat_last_n", "n_probs",
                  "top_logprobs", "logprobs"]
ADMIN_FIELDS = ["draft_max", "draft_min", "draft_p_min"]
RSS_GROWTH_LIMIT_KIB = 300 * 1024


def body_with(field: str, value, base: dict) -> bytes:
    text = json.dumps({**base, field: "__X__"})
    raw = value if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity") else json.dumps(value)
    return text.replace('"__X__"', raw).encode()


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    s = start_server(tiny_models, tmp_path_factory.mktemp("fuzz") / "server.log", "--api-key", API_KEY,
                     "--admin-key", ADMIN_KEY, n_ctx=256)
    yield s
    s.stop()


def check_answer(r, field: str) -> None:
    assert r.status_code < 500, (field, r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["param"] == field or error["param"] is None and field in error["message"], (field, r.text)
        assert "\n" not in error["message"] and "Traceback" not in r.text


def fuzz_request_fields(server) -> None:
    with httpx.Client(timeout=60) as http:
        for field in REQUEST_FIELDS:
            for value in VALUES:
                for path, base in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 2})):
                    if field in ("max_tokens", "max_completion_tokens") and isinstance(value, int) \
                            and not isinstance(value, bool) and value > 8:
                        base = {**base, "stop": ["\n"]}   # in range but long: let the context end it
                    r = http.post(f"{server.url}{path}", content=body_with(field, value, base), headers=AUTH)
                    check_answer(r, field)


@pytest.mark.slow
def test_numeric_request_fields_get_an_answer_or_a_4xx(server):
    rss_before = server.rss_kib()
    fuzz_request_fields(server)
    assert server.proc.poll() is None
    assert server.rss_kib() - rss_before < RSS_GROWTH_LIMIT_KIB
    assert "Traceback" not in server.stderr()


@pytest.fixture(scope="module")
def parallel_server(tiny_models, tmp_path_factory):
    s = start_server(tiny_models, tmp_path_factory.mktemp("fuzz-np") / "server.log", "--api-key", API_KEY,
                     "-np", "4", "--max-queue", "8", "-fa", "off", n_ctx=1024)
    yield s
    s.stop()


INNOCENT = [{"prompt": f"Innocent {i} writes:", "max_tokens": 48, "temperature": 0, "stream": True}
            for i in range(2)]
FUZZ_TIME_LIMIT_S = 300.0
# what once ended every stream beside it (a grammar that allows no token, a logit made infinite), or held the worker
# for minutes (an ambiguous grammar, a schema converter writing out 10^8 repetitions), or went unanswered
HOSTILE = [("grammar", "root ::= [\\U0010FFFF-\\U00000000]"), ("repeat_penalty", 1e-300),
           ("grammar", "root ::= " + " ".join(["[a-z]*"] * 30)), ("grammar", 'root ::= "\ud800"'),
           ("json_schema", {"type": "string", "minLength": 100000000}), ("logit_bias", {"\u00b2": 1})]


def test_fuzz_beside_innocent_streams_on_parallel_slots(parallel_server, tiny_models):
    """The same fuzz against `serve --parallel 4` while two innocent streams run again and again beside it: every
    fuzzed value is answered with a 2xx or a 4xx naming its field, and every innocent reply is the one the request
    gets alone (greedy), however the fuzz lands in the slots next to it."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from llamaspec import load_pair

    with load_pair(str(tiny_models["target"]), str(tiny_models["noisy"]), n_ctx=1024, n_threads=1,
                   flash_attn="off") as pair:
        alone = [pair.generate(b["prompt"], max_tokens=b["max_tokens"]).text for b in INNOCENT]

    done = threading.Event()

    def innocent(i: int) -> list[str]:
        replies = []
        with httpx.Client(timeout=60) as http:
            while not done.is_set():
                r = http.post(f"{parallel_server.url}/v1/completions", json=INNOCENT[i], headers=AUTH)
                assert r.status_code == 200, r.text
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                replies.append("".join(c["choices"][0]["text"] for c in chunks))
        return replies

    start = time.monotonic()
    with ThreadPoolExecutor(len(INNOCENT)) as pool:
        running = [pool.submit(innocent, i) for i in range(len(INNOCENT))]
        try:
            fuzz_request_fields(parallel_server)
            with httpx.Client(timeout=60) as http:
                for field, value in HOSTILE:
                    r = http.post(f"{parallel_server.url}/v1/completions", headers=AUTH,
                                  content=json.dumps({"prompt": "hi", "max_tokens": 2, field: value}))
                    check_answer(r, field)
        finally:
            done.set()
        replies = [f.result(FUZZ_TIME_LIMIT_S) for f in running]
    assert time.monotonic() - start < FUZZ_TIME_LIMIT_S
    for i, got in enumerate(replies):
        assert got and all(text == alone[i] for text in got), (i, len(got))
    assert parallel_server.proc.poll() is None
    assert "Traceback" not in parallel_server.stderr()


def test_admin_settings_are_bounded(server):
    rss_before = server.rss_kib()
    with httpx.Client(timeout=60) as http:
        for field in ADMIN_FIELDS:
            for value in VALUES:
                r = http.patch(f"{server.url}/admin/config", content=body_with(field, value, {"policy": "auto"}),
                               headers=ADMIN)
                check_answer(r, field)
        for value in (2**70, 10**9):
            r = http.patch(f"{server.url}/admin/config", json={"draft_max": value}, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] == "draft_max", r.text
            assert "a verification must fit in one batch" in r.json()["error"]["message"]
    assert server.rss_kib() - rss_before < RSS_GROWTH_LIMIT_KIB
    assert "Traceback" not in server.stderr()
