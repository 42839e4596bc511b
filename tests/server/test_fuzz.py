"""Every POST endpoint fuzzed from the app's own OpenAPI schema, plus malformed bodies, against
the real server on the starter model: never a 500, every refusal in its API family's error shape,
and the server still answers afterwards. Generation is kept cheap by capping the token counts."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localrun.server import errors

from .. import reliability
from .conftest import MODEL, Served

# (path, examples): generation is a few tokens each; the rest is cheap.
ENDPOINTS = [
    ("/v1/chat/completions", 25), ("/v1/completions", 20), ("/v1/embeddings", 20),
    ("/api/chat", 25), ("/api/generate", 20), ("/api/embed", 20), ("/api/embeddings", 15),
    ("/api/show", 15), ("/api/delete", 15),
]
# Model names: the served one mostly, and names that are not installed (nothing real is deleted).
MISSING = ["nope:1b", "smollm2:999m", "", "../etc/passwd", "a" * 300]
ALIASES = [MODEL, MODEL, MODEL, "smollm2", "SMOLLM2:135M"]  # the same installed model


def openapi(served: Served) -> dict[str, Any]:
    """The running app's OpenAPI document (the server does not publish it over HTTP)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HEAD and GET routes share operation ids
        return served.server.config.app.openapi()  # type: ignore[no-any-return]  (the app caches it)


def request_schema(served: Served, path: str) -> dict[str, Any]:
    """The body schema of `path`, standalone: its $refs resolve inside it."""
    doc = openapi(served)
    ops = doc["paths"][path]
    op = ops.get("post") or ops["delete"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = dict(doc["components"]["schemas"][ref.rsplit("/", 1)[1]])
    schema["components"] = doc["components"]
    return schema


any_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


# Fields whose schema says only "string", with the values that matter most likely.
HINTS: dict[str, st.SearchStrategy[Any]] = {
    "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(max_size=8)),
}
# The smallest body each endpoint answers with 200; the fuzzing adds schema-drawn fields to it.
MINIMAL: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"prompt": "Once upon a time"},
    "/v1/embeddings": {"input": "hello"},
    "/api/chat": {"messages": [{"role": "user", "content": "Hi"}]},
    "/api/generate": {"prompt": "Once upon a time"},
    "/api/embed": {"input": "hello"},
    "/api/embeddings": {"prompt": "hello"},
    "/api/show": {},
    "/api/delete": {},
}


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid for a pydantic-generated JSON schema (the subset FastAPI emits), with its
    bounds as likely as anything between them."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(root["components"]["schemas"][name], root))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, root) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        if kind == "integer":
            lo_i = None if lo is None else int(lo) + ("exclusiveMinimum" in schema)
            hi_i = None if hi is None else int(hi) - ("exclusiveMaximum" in schema)
            edges = [v for v in (lo_i, hi_i, 0, 1, -1, 2**31, 2**63) if v is not None
                     and (lo_i is None or v >= lo_i) and (hi_i is None or v <= hi_i)]
            return st.one_of(st.integers(lo_i, hi_i), st.sampled_from(edges))
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=24)
    if kind == "array":
        items = from_schema(schema["items"], root) if schema.get("items") else any_json
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fixed = {k: HINTS.get(k, from_schema(v, root)) for k, v in props.items() if k in required}
        optional = {k: HINTS.get(k, from_schema(v, root)) for k, v in props.items() if k not in required}
        body = st.fixed_dictionaries(fixed, optional=optional)
        if schema.get("additionalProperties"):
            extra = st.dictionaries(st.text(max_size=8), any_json, max_size=2)
            body = st.tuples(extra, body).map(lambda t: {**t[0], **t[1]})
        return body
    return any_json  # {}: any value


def _method(path: str) -> str:
    return "DELETE" if path == "/api/delete" else "POST"


def cheap(body: Any, path: str, draw: Any) -> Any:
    """The drawn body with what makes generation expensive capped: a few tokens, at most two
    choices; the model is mostly the served one, and never an installed one for deletes."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    names = MISSING if path == "/api/delete" else [*ALIASES, *MISSING]
    body["model"] = draw(st.sampled_from(names))
    if path == "/api/delete":
        body.pop("name", None)
    elif "name" in body:
        body["name"] = body["model"]
    body["stream"] = draw(st.booleans())
    if path.startswith("/v1/"):
        body["max_tokens"] = body["max_completion_tokens"] = draw(st.integers(1, 3))
        body["n"] = draw(st.integers(1, 2))
        if not body["stream"]:
            body.pop("stream_options", None)
    else:
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        body["options"] = {**options, "num_predict": draw(st.integers(1, 3))}
        if isinstance(body.get("keep_alive"), (int, float)) and body["keep_alive"] >= 0:
            body["keep_alive"] = "5m"  # an unload after each request would reload the model every time
    return body


def check(path: str, r: Any) -> None:
    """2xx with a well-formed body, or 4xx/503 in the API family's error shape."""
    status = r.status_code
    assert status < 500 or status == 503, f"{path} answered {status}: {r.text[:500]}"
    reliability.inputs("server request")
    if status >= 400:
        assert_error(path, r.json())
        return
    text = r.text
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    assert_error(path, event, mid_stream=True)
    elif "ndjson" in r.headers.get("content-type", ""):
        for line in filter(None, text.splitlines()):
            event = json.loads(line)
            if "error" in event:
                assert_error(path, event, mid_stream=True)
    elif text:  # a delete answers 200 with no body
        json.loads(text)


def assert_error(path: str, body: Any, mid_stream: bool = False) -> None:
    """The error shape of the path's family; an error inside a stream must not be the server's fault."""
    assert isinstance(body, dict) and "error" in body, body
    if errors.is_openai_path(path):
        err = body["error"]
        assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), body
        assert isinstance(err["message"], str) and err["message"], body
        if mid_stream:
            assert err["type"] != "server_error" or err["code"] == "server_busy", body
    else:
        assert isinstance(body["error"], str) and body["error"], body
    text = body["error"]["message"] if errors.is_openai_path(path) else body["error"]
    assert "internal server error" not in text, body


FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                   HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.mark.slow
@pytest.mark.parametrize(("path", "examples"), ENDPOINTS)
def test_bodies_from_the_schema(served: Served, path: str, examples: int) -> None:
    """Bodies generated from the endpoint's request schema (then made cheap): no 500, and every
    refusal is a clear error in the family's shape."""
    schema = request_schema(served, path)
    bodies = from_schema(schema, schema)

    @settings(max_examples=examples, **FUZZ)  # type: ignore[arg-type]
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        body = data.draw(bodies, label="body")
        if isinstance(body, dict) and data.draw(st.booleans(), label="near valid"):
            # A body the endpoint accepts, with one or two of the drawn fields over it.
            picked = data.draw(st.sets(st.sampled_from(sorted(body) or [""]), max_size=2), label="fields")
            body = {**MINIMAL[path], **{k: body[k] for k in picked if k in body}}
        body = cheap(body, path, data.draw)
        with served.http() as http:
            r = http.request(_method(path), path, json=body)
        check(path, r)
        statuses.append(r.status_code)

    statuses: list[int] = []
    run()
    if path != "/api/delete":  # the fuzzing reached the model, not only the validation
        assert any(s < 300 for s in statuses), statuses


def _wrong_types(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """For each top-level property, bodies that give it values of other types."""
    out = []
    for name in schema.get("properties", {}):
        for bad in ({}, [], "x", 1.5, -1, True, 10**30, [{}], {"a": [1]}):
            out.append({"model": MODEL, "stream": False, "max_tokens": 2, "options": {"num_predict": 2}, name: bad})
    return out


RAW = [
    b"", b"not json", b"{", b"[]", b"null", b"123", b'"text"', b"\xff\xfe\x00", b"[" * 5000 + b"]" * 5000,
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "temperature": NaN, "max_tokens": 2}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "temperature": 1e999, "max_tokens": 2}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "seed": ' + b"9" * 400 + b', "max_tokens": 2}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "top_p": -Infinity, "max_tokens": 2}',
    b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,'
    b' "options": {"num_predict": 2, "temperature": ' + b"1" * 400 + b'}, "stream": false}',
    b'{"model": "' + MODEL.encode() + b'", "input": "hi", "dimensions": ' + b"9" * 400 + b"}",
    b'{"model": "' + MODEL.encode() + b'", "keep_alive": "' + b"9" * 400 + b'h", "prompt": "",'
    b' "options": {"num_predict": 2}, "stream": false}',
    b'{"model": "' + MODEL.encode() + b'", "keep_alive": 1e308, "prompt": "", "stream": false}',
    # Unpaired surrogate escapes: valid JSON, but no UTF-8 text (found by this test: they were 500s).
    b'{"model": "\\ud800", "prompt": "hi"}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi \\udc00", "input": ["\\ud800"], "max_tokens": 2,'
    b' "messages": [{"role": "user", "content": "\\ud83d"}], "options": {"num_predict": 2}, "stream": false}',
]


@pytest.mark.slow
def test_malformed_bodies(served: Served) -> None:
    """Non-JSON, non-object, invalid UTF-8, deep nesting, NaN and huge numbers, and each field of
    each endpoint with a value of the wrong type; then a normal request still works."""
    with served.http() as http:
        for path, _ in ENDPOINTS:
            for raw in RAW:
                if path == "/api/delete":  # never the installed model
                    raw = raw.replace(MODEL.encode(), b"nope:1b")
                check(path, http.request(_method(path), path, content=raw,
                                         headers={"content-type": "application/json"}))
            for body in _wrong_types(request_schema(served, path)):
                if path == "/api/delete":
                    body["model"] = "nope:1b"
                check(path, http.request(_method(path), path, json=body))
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] is not None
        assert http.get("/health").json() == {"status": "ok"}
        assert MODEL in {m["id"] for m in http.get("/v1/models").json()["data"]}
    # A keep_alive of 1e308 s once killed the thread that unloads idle models.
    assert served.pool._reaper.is_alive(), "a request's keep_alive stopped the pool's reaper thread"
