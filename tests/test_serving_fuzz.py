"""Fuzz the endpoints with bodies built from the server's own OpenAPI spec: whatever arrives, the answer
is a 2xx or a 4xx in OpenAI's error shape, never a 500, a hang or a dead worker."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import serving

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40) | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def server(tiny_run):
    with serving(tiny_run, "--max-batch-size", "4") as url:
        yield url


@pytest.fixture(scope="module")
def fields(server):
    spec = httpx.get(server + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    return {path: list(schemas[name]["properties"]) for path, name in
            (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"))}


PLAUSIBLE = {
    "prompt": st.text(max_size=60),
    "max_tokens": st.integers(-3, 40) | st.just(10**9),
    "seed": st.integers(-2**70, 2**70),
    "stop": st.lists(st.text(max_size=70), max_size=6),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]),
                                                "content": st.text(max_size=30)}), max_size=3),
    "stream": st.booleans(),
    "method": st.sampled_from(["ar", "dd2", "refusion", "x"]),
    "fixed_tokens": st.dictionaries(st.integers(-2, 6).map(str), st.integers(-5, 600) | st.text(max_size=5)),
}


def bodies(names: list[str]):
    """Objects over the spec's field names, with plausible values mixed with junk."""
    def value(name):
        return PLAUSIBLE[name] | JSON_VALUES if name in PLAUSIBLE else JSON_VALUES

    return st.lists(st.sampled_from(names), unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: value(k) for k in keys}))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bodies_never_500(server, fields, data):
    path = data.draw(st.sampled_from(sorted(fields)))
    body = data.draw(bodies(fields[path]))
    if "max_tokens" not in body:
        body["max_tokens"] = 4  # keep valid requests short
    # ensure_ascii keeps lone surrogates as \\udXXX escapes: valid JSON that is not valid UTF-8 text
    r = httpx.post(server + path, content=json.dumps(body).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404, 429), (body, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=80) | st.text(max_size=80).map(str.encode))
def test_fuzzed_raw_bytes(server, raw):
    r = httpx.post(server + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code in (200, 400), (raw, r.status_code, r.text)
    if r.status_code == 400:
        assert json.loads(r.text)["error"]["message"]


def test_server_still_healthy_after_fuzzing(server):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    r = httpx.post(server + "/v1/completions", json={"prompt": "And", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
