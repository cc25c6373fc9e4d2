"""One client must never hurt another, on a real `serve --parallel 4` on loopback (tiny models): a request whose
grammar allows no token, whose set-up fails, whose grammar or schema would cost minutes, or whose prompt cannot fit
its slot gets its own error, and the streams running beside it finish exactly as they would alone. Bounded: a few
requests each, every wait under TIME_LIMIT_S."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from support.servers import assert_openai_error, health, post, start_server, wait_until  # noqa: E402

N_SLOTS = 4
N_CTX = 1024            # 256 tokens a slot
TIME_LIMIT_S = 60.0
INNOCENT = [{"prompt": f"Innocent {i} tells a story:", "max_tokens": 120, "temperature": 0, "stream": True}
            for i in range(2)]
NO_TOKEN = "root ::= [\\U0010FFFF-\\U00000000]"   # a range that holds no character: no token is ever allowed
AMBIGUOUS = "root ::= " + " ".join(["[a-z]*"] * 30)


@pytest.fixture(scope="module")
def srv(tiny_models, tmp_path_factory):
    s = start_server(tiny_models, tmp_path_factory.mktemp("srv-iso") / "server.log", "-np", str(N_SLOTS),
                     "-fa", "off", n_ctx=N_CTX)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def alone(tiny_models):
    """Each innocent request's reply when it runs alone (the library, one sequence)."""
    from llamaspec import load_pair

    with load_pair(str(tiny_models["target"]), str(tiny_models["noisy"]), n_ctx=N_CTX, n_threads=1,
                   flash_attn="off") as pair:
        return [pair.generate(b["prompt"], max_tokens=b["max_tokens"]).text for b in INNOCENT]


def streamed_text(url: str, body: dict) -> str:
    with httpx.Client(timeout=TIME_LIMIT_S) as http:
        r = http.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert not any("error" in c for c in chunks), r.text
    return "".join(c["choices"][0]["text"] for c in chunks)


def beside_innocents(srv, alone, hostile):
    """Run `hostile()` while the innocent streams generate; they must end as they do alone. Returns what
    `hostile` returned."""
    with ThreadPoolExecutor(len(INNOCENT)) as pool:
        running = [pool.submit(streamed_text, srv.url, b) for b in INNOCENT]
        wait_until(lambda: health(srv.url)["running"] >= 1, 10, "an innocent stream to start")
        result = hostile()
        assert [f.result(TIME_LIMIT_S) for f in running] == alone
    assert srv.proc.poll() is None
    return result


def test_a_grammar_that_allows_no_token_ends_only_its_own_request(srv, alone):
    r = beside_innocents(srv, alone, lambda: post(srv.url, "/v1/completions",
                                                  {"prompt": "x", "max_tokens": 4, "grammar": NO_TOKEN}))
    assert_openai_error(r, 400, param="grammar")
    assert "allows no token" in r.json()["error"]["message"]


def test_a_streamed_grammar_error_is_an_error_event_for_its_own_stream_only(srv, alone):
    def hostile():
        with httpx.Client(timeout=TIME_LIMIT_S) as http:
            return http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True,
                                                                "grammar": NO_TOKEN}).text
    text = beside_innocents(srv, alone, hostile)
    assert "allows no token" in text and "[DONE]" not in text.split("allows no token")[0]


def test_a_grammar_too_costly_is_refused_in_about_a_second(srv, alone):
    def hostile():
        start = time.monotonic()
        r = post(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 4, "grammar": AMBIGUOUS})
        return r, time.monotonic() - start
    r, seconds = beside_innocents(srv, alone, hostile)
    assert_openai_error(r, 400, param="grammar")
    assert "too ambiguous" in r.json()["error"]["message"]
    assert seconds < 5   # 26.6 s a row mask before, and then every row


@pytest.mark.parametrize("schema,what", [
    ({"type": "string", "pattern": "^" + "[a-z]*" * 30 + "$"}, "too ambiguous"),
    ({"type": "string", "minLength": 100000000}, "minLength"),
    ({"type": "string", "pattern": "^a{100000000}$"}, "pattern"),
], ids=["pattern-ambiguous", "minLength", "pattern-count"])
def test_a_schema_too_costly_is_refused_at_once(srv, schema, what):
    start = time.monotonic()
    r = post(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert_openai_error(r, 400, param="response_format")
    assert what in r.json()["error"]["message"]
    assert time.monotonic() - start < 5   # 39 s and 3.4 GB for minLength 100000000 before


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "description": "a\ud800"}}]}, "tools[0].function.description"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]}]},
     "messages[1].tool_calls[0].function.arguments.a"),
    ({"prompt": "x", "grammar": 'root ::= "\ud800"'}, "grammar"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "pattern": "^\ud800$"}}}}, "response_format.json_schema.schema.pattern"),
    ({"prompt": "x", "logit_bias": {"\ud800": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
], ids=["tool-description", "tool-call-arguments", "grammar", "schema-pattern", "logit-bias-key", "logit-bias-digit"])
def test_text_that_cannot_be_encoded_is_a_400_naming_the_field(srv, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    raw = json.dumps({**body, "max_tokens": 2})   # ensure_ascii: the surrogate travels as \ud800, valid JSON
    assert_openai_error(post(srv.url, path, raw), 400, param=param)
    assert "Traceback" not in srv.stderr()


def test_a_prompt_is_measured_against_its_slot_before_it_is_tokenized(srv):
    """64k words: at least 256 tokens by their bytes alone, more than a slot holds (1024 / 4), though not more than
    the whole context: refused from its byte count, never tokenized whole on the worker all slots share."""
    r = post(srv.url, "/v1/completions", {"prompt": "word " * 64000, "max_tokens": 2})
    assert_openai_error(r, 400, code="context_length_exceeded")
    assert "at least" in r.json()["error"]["message"] and "a slot" in r.json()["error"]["message"]


def test_every_job_that_leaves_the_queue_is_answered_even_when_its_set_up_fails(tiny_models, monkeypatch):
    """A set-up that raises something unforeseen (not a LlamaspecError) answers that job with a 500 and leaves the
    request running beside it alone; it once left the client waiting and ended every other stream."""
    from llamaspec import load_pair
    from llamaspec.server import worker as worker_module
    from llamaspec.server.metrics import ServerMetrics
    from llamaspec.server.validation import parse_completion

    real_shaping = worker_module.request_shaping

    def shaping(req, model, template):
        if req.extras.grammar == "root ::= \"boom\"":
            raise RuntimeError("an unforeseen failure")
        return real_shaping(req, model, template)

    monkeypatch.setattr(worker_module, "request_shaping", shaping)

    async def run(pair) -> tuple[list, list]:
        worker = worker_module.Worker(pair, ServerMetrics(lambda: {}, lambda: (0, 0)), max_queue=2, parallel=2)
        worker.start()
        try:
            loop = asyncio.get_running_loop()
            innocent = worker_module.Job(parse_completion({"prompt": "Once upon a time", "max_tokens": 40,
                                                           "temperature": 0}), loop)
            failing = worker_module.Job(parse_completion({"prompt": "x", "max_tokens": 4,
                                                          "grammar": "root ::= \"boom\""}), loop)
            assert worker.submit(innocent) and worker.submit(failing)

            async def events_of(job) -> list:
                events = []
                while not events or events[-1][0] not in ("done", "error"):
                    events.append(await asyncio.wait_for(job.events.get(), TIME_LIMIT_S))
                return events
            return await events_of(innocent), await events_of(failing)
        finally:
            assert worker.stop()

    with load_pair(str(tiny_models["target"]), str(tiny_models["noisy"]), n_ctx=512, n_threads=1,
                   flash_attn="off") as pair:
        expected = pair.generate("Once upon a time", max_tokens=40, temperature=0).text
        innocent, failing = asyncio.run(run(pair))

    assert failing[-1][0] == "error" and getattr(failing[-1][1], "status", None) == 500
    assert innocent[-1][0] == "done"
    assert "".join(v for kind, v in innocent if kind == "text") == expected
