"""Property-based fuzzing of every POST route from the app's own OpenAPI document (issue 22).

For each route, bodies come from its request schema (`from_schema`, below), from the same
bodies with one field replaced by arbitrary JSON, and from arbitrary JSON values and bytes.
They all go down one keep-alive connection to a live server with a tiny model. Whatever
arrives: no 5xx, the same connection throughout (none dropped), every 4xx in its API's error
shape, every 2xx stream framed as SSE. Bounded: a fixed number of examples per route,
derandomized, and token budgets capped so each answer takes milliseconds. A share of the
bodies is a valid one with a field or two drawn from the schema, so answers get generated
(streamed, constrained, with tools) and not only refused.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clover.engine import LLM, GenerationSettings
from clover.serving.app import create_app
from clover.serving.options import ServeOptions
from tests.test_server_support import serve_in_thread, write_checkpoint

EXAMPLES = 100  # per route
BUDGETS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_thinking_tokens")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=3),
    max_leaves=8,
)  # fmt: skip


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values of the schema subset `clover.serving.schemas` writes (hypothesis-jsonschema's
    last release no longer runs on current Hypothesis)."""
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if props is None:
            return st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3)
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), max_size=schema.get("maxItems", 3))
    simple = {
        "string": st.text(
            min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 20)
        ),
        "integer": st.integers(0, 64) | st.integers(),  # plausible values as well as any
        "number": st.floats(0, 1) | st.floats(allow_nan=False, allow_infinity=False),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return simple.get(kind, JSON_VALUES)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("fuzz"), 512)
    options = ServeOptions(
        model=str(checkpoint), request_timeout=20, defaults=GenerationSettings(max_tokens=8)
    )
    load = lambda: LLM(str(checkpoint), dtype="float32", progress=False)  # noqa: E731
    with serve_in_thread(options, load) as url:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        conn.connect()
        yield conn, options


def _routes() -> dict[str, dict]:
    doc = create_app(ServeOptions()).openapi()
    routes = {}
    for path, methods in doc["paths"].items():
        body = methods.get("post", {}).get("requestBody")
        if body is not None:
            routes[path] = body["content"]["application/json"]["schema"]
    return routes


ROUTES = _routes()
STATUSES: dict = {}


def _cap(body: object) -> object:
    """Small token budgets and choice counts: the fuzz is about validation, not long answers."""
    if isinstance(body, dict):
        for name in BUDGETS:
            if isinstance(body.get(name), int) and not isinstance(body[name], bool):
                body[name] = min(body[name], 8)
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
            body["n"] = min(body["n"], 2)
        options = body.get("options")  # Ollama's budget
        if isinstance(options, dict) and isinstance(options.get("num_predict"), int):
            options["num_predict"] = max(min(options["num_predict"], 8), -2) or 1
    return body


BASE = {  # a valid body per route, for bodies that differ from one in a field or two
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi"},
    "/api/chat": {"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 4}},
    "/api/generate": {"prompt": "hi", "options": {"num_predict": 4}},
}
NARROW = {"model", "decoder", "draft"}  # random text is never valid there


def near_valid(path: str, schema: dict) -> st.SearchStrategy:
    props = {k: from_schema(v) for k, v in schema["properties"].items() if k not in NARROW}
    keys = st.lists(st.sampled_from(sorted(props)), max_size=2, unique=True)
    extra = keys.flatmap(lambda ks: st.fixed_dictionaries({k: props[k] for k in ks}))
    return extra.map(lambda e: {**BASE[path], **e})


def bodies(path: str, schema: dict) -> st.SearchStrategy:
    valid = from_schema(schema)
    mutated = st.tuples(valid, st.text(max_size=12) | st.sampled_from(sorted(
        schema["properties"])), JSON_VALUES).map(lambda t: {**t[0], t[1]: t[2]})  # fmt: skip
    raw = JSON_VALUES.map(json.dumps) | st.binary(max_size=40)
    near = near_valid(path, schema).map(lambda b: json.dumps(_cap(b)))
    mutants = mutated.map(lambda b: json.dumps(_cap(b)))
    return st.one_of(near, near, near, valid.map(json.dumps), mutants, raw)


def check(conn: http.client.HTTPConnection, path: str, body: str | bytes) -> None:
    if isinstance(body, str) and body.startswith("{"):
        body = json.dumps(_cap(json.loads(body)))
    sock = conn.sock
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
    except Exception:
        conn.close()  # a fresh connection for the next example; this one fails
        conn.connect()
        raise
    STATUSES[path, r.status // 100] = STATUSES.get((path, r.status // 100), 0) + 1
    assert conn.sock is sock and sock is not None, "the connection was dropped"
    assert r.status < 500, (path, body, data[:300])
    text = data.decode()
    assert "Traceback" not in text
    if r.status >= 400:
        error = json.loads(text)
        if path == "/v1/messages":
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        elif path.startswith("/api/"):
            assert set(error) == {"error"} and error["error"], error
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}, error
            assert isinstance(error["error"]["code"], str) and error["error"]["message"]
    elif r.getheader("content-type", "").startswith("application/x-ndjson"):
        lines = [json.loads(x) for x in text.splitlines() if x]
        assert lines and (lines[-1].get("done") or "error" in lines[-1]), text[-200:]
    elif r.getheader("content-type", "").startswith("text/event-stream"):
        assert text.endswith("\n\n") and "data: " in text, text[-200:]
        assert '"error"' not in text or "timeout" not in text
    else:
        json.loads(text)


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_fuzz_route(live, path):
    conn, _ = live

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(bodies(path, ROUTES[path]))
    def run(body):
        check(conn, path, body)

    run()
    assert STATUSES.get((path, 2), 0) >= EXAMPLES // 10, STATUSES  # answers were made too
