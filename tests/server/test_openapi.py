"""The OpenAPI description at /openapi.json, checked against the running server by a bounded property-based run:
requests drawn from its request schemas get a 2xx (or a 400 only for what a schema cannot say), and requests
that break them, or are not JSON at all, get a 4xx JSON error: never a 500, never a dropped connection.

The strategies are built from the served schema itself (a small JSON Schema -> hypothesis translation below), so
the description and the validation cannot drift apart unnoticed. Derandomized and bounded: ~20 s on 2 cores."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.servers import start_server  # noqa: E402

ADMIN_KEY = "admin-key"
RUN = settings(max_examples=40, deadline=None, derandomize=True, database=None,
               suppress_health_check=list(HealthCheck))
# Room to generate stays small; everything else is drawn as the schema allows.
SMALL = {"max_tokens": st.one_of(st.none(), st.integers(1, 3)),
         "max_completion_tokens": st.one_of(st.none(), st.integers(1, 3)),
         "draft_max": st.one_of(st.none(), st.integers(0, 16)), "draft_min": st.one_of(st.none(), st.integers(0, 16))}
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufdd0\ufdd1"), max_size=12)
# any code point, lone surrogates and reserved noncharacters included, most often in short strings
WILD_TEXT = st.text(st.one_of(st.characters(blacklist_categories=()), st.sampled_from("\ud800\udfff\ufdd0")),
                    min_size=1, max_size=6)
ANY_TEXT = st.text(st.characters(blacklist_categories=()), max_size=8)  # lone surrogates included
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                    max_size=3), max_leaves=8)


@pytest.fixture(scope="module")
def srv(tiny_models, tmp_path_factory):
    s = start_server(tiny_models, tmp_path_factory.mktemp("srv-openapi") / "server.log", "--admin-key", ADMIN_KEY,
                     "--max-queue", "4", n_ctx=256)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def spec(srv) -> dict:
    r = httpx.get(f"{srv.url}/openapi.json", timeout=10)
    assert r.status_code == 200
    return r.json()


def from_schema(schema: dict, spec: dict, name: str = "", text: st.SearchStrategy = TEXT) -> st.SearchStrategy:
    """A strategy for values valid under `schema` (the subset of JSON Schema openapi.py uses); strings are drawn
    from `text`, which may break the schema's Unicode rules on purpose."""
    if name in SMALL:
        return SMALL[name]
    if "$ref" in schema:
        return from_schema(spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], spec, name, text)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, spec, name, text) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, spec, name, text) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum", 2**40))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema, allow_nan=False, allow_infinity=False)
    if kind == "string":
        return text.filter(lambda s: len(s) >= schema.get("minLength", 0))
    if kind == "array":
        items = from_schema(schema.get("items", {"type": "null"}), spec, text=text)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
    if kind == "object":
        if schema.get("maxProperties") == 0:
            return st.just({})
        props = schema.get("properties", {})
        required = {k: from_schema(v, spec, k, text) for k, v in props.items() if k in schema.get("required", ())}
        optional = {k: from_schema(v, spec, k, text) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(required, optional=optional)
    raise AssertionError(f"schema construct not covered: {schema}")


def short(body: dict) -> dict:
    """The body with little to generate: without a limit, a request would generate up to the context's end."""
    if "prompt" in body or "messages" in body:
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            return {**body, "max_tokens": 2}
    return body


def body_schema(spec: dict, path: str, method: str = "post") -> dict:
    return spec["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]


def send(srv, path: str, method: str, content: bytes, content_type: str = "application/json") -> httpx.Response:
    headers = {"Content-Type": content_type, "Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, f"{srv.url}{path}", content=content, headers=headers, timeout=60)


def assert_json_error(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


UNSAYABLE = ("grammar", "json_schema", "response_format", "tools", "tool_choice", "top_logprobs", "logit_bias",
             "chat_template_kwargs")
ROUTES = [("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/admin/config", "patch")]


def test_description_covers_every_route_and_resolves(spec):
    assert spec["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}", "/health",
                 "/metrics", "/openapi.json", "/admin/config"):
        assert path in spec["paths"], path
    refs = [part for part in json.dumps(spec).split('"') if part.startswith("#/components/schemas/")]
    assert refs and all(ref.rsplit("/", 1)[1] in spec["components"]["schemas"] for ref in refs)


@pytest.mark.parametrize("path,method", ROUTES, ids=[p for p, _ in ROUTES])
def test_requests_the_schema_allows_are_answered(srv, spec, path, method):
    @RUN
    @given(from_schema(body_schema(spec, path, method), spec).map(short))
    def check(body):
        r = send(srv, path, method.upper(), json.dumps(body).encode())
        if r.status_code == 200:
            if body.get("stream"):
                assert r.text.rstrip().endswith("data: [DONE]")
            return
        # what a schema cannot say: the context's size, the vocabulary's, the policy's own range rules, whether
        # text is a grammar llama.cpp parses (a JSON schema it converts), how fields combine, what a template takes
        error = assert_json_error(r)
        assert r.status_code == 400, r.text
        assert error["code"] in ("context_length_exceeded", "invalid_value", "chat_template_error"), r.text
        if path != "/admin/config":
            assert error["param"].split("[")[0] in ("prompt", "messages", *UNSAYABLE), r.text

    check()


@pytest.mark.parametrize("path,method", ROUTES, ids=[p for p, _ in ROUTES])
def test_requests_that_break_the_schema_get_a_4xx_json_error(srv, spec, path, method):
    schema = body_schema(spec, path, method)
    schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    fields = sorted(schema["properties"])

    broken = st.one_of(
        # the schema's shape, with strings that break its Unicode rules
        from_schema(schema, spec, text=WILD_TEXT).map(lambda b: json.dumps(short(b)).encode()),
        # a valid body with one field replaced by any JSON value
        st.tuples(from_schema(schema, spec).map(short), st.sampled_from(fields), ANY_JSON).map(
            lambda t: json.dumps({**t[0], t[1]: t[2]}).encode()),
        ANY_JSON.map(lambda v: json.dumps(v).encode()),         # any JSON document
        st.binary(max_size=64),                                 # any bytes
    )

    @RUN
    @given(broken, st.sampled_from(["application/json", "application/json", "text/plain"]))
    def check(content, content_type):
        r = send(srv, path, method.upper(), content, content_type)
        if r.status_code == 200:
            return  # the replacement happened to be valid
        assert_json_error(r)

    check()
