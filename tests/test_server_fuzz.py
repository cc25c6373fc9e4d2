"""A bounded fuzz of every numeric request field and admin setting against a real `serve` (tiny models, loopback):
each value is answered with a 2xx or an OpenAI 4xx error naming the field, never a 5xx, a traceback in the log,
a dead process or a memory jump (PATCH /admin/config with draft_max 2^70 or 10^9 once meant a 500 or 16 GB)."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import ADMIN_KEY, API_KEY, start_server  # noqa: E402

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


@pytest.mark.slow
def test_numeric_request_fields_get_an_answer_or_a_4xx(server):
    rss_before = server.rss_kib()
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
    assert server.proc.poll() is None
    assert server.rss_kib() - rss_before < RSS_GROWTH_LIMIT_KIB
    assert "Traceback" not in server.stderr()


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
