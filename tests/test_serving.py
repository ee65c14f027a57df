"""The HTTP server, started for real on a free loopback port, driven by the official `openai` client."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.conftest import serving


@pytest.fixture(scope="module")
def server(tiny_run):
    with serving(tiny_run, "--max-batch-size", "8", "--batch-window-ms", "100") as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_openai_client_round_trip(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="And God said", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 8
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "And God said"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == out.choices[0].text  # same prompt, greedy
    passes = httpx.post(server + "/v1/completions", json={"prompt": "And God said", "max_tokens": 8,
                                                          "temperature": 0}, timeout=60).json()["diffar"]["passes"]
    assert 1 <= passes["target"] <= 8 and passes["batch_size"] >= 1


def test_streaming_equals_non_streaming(client):
    full = client.completions.create(model="tiny", prompt="In the beginning", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="In the beginning", max_tokens=12, temperature=0,
                                            stream=True))
    assert len(chunks) >= 2 and "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "In the beginning"}],
                                               max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chat) == full.choices[0].text


def test_who_wrote_each_token_is_streamed_and_reported(server):
    """Plain AR wrote every token but the pinned ones: each text delta says so of the tokens it completes (an
    extra field OpenAI clients ignore), and the response lists them all, token by token."""
    body = {"prompt": "And he said", "max_tokens": 10, "temperature": 0, "fixed_tokens": {"3": 5}}
    said = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["diffar"]
    assert said["origins"] == ["ar"] * 3 + ["pinned"] + ["ar"] * (len(said["token_ids"]) - 4)
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        extras = [json.loads(line[6:]).get("diffar", {}) for line in r.iter_lines() if line.startswith("data: {")]
    assert [o for d in extras if "token_ids" not in d for o in d.get("origins", [])] == said["origins"]
    assert extras[-1]["origins"] == said["origins"]


def test_stop_sequences(client):
    full = client.completions.create(model="tiny", prompt="And he said", max_tokens=16, temperature=0).choices[0].text
    assert len(full) >= 6
    stop = full[-3:]
    cut = client.completions.create(model="tiny", prompt="And he said", max_tokens=16, temperature=0,
                                    stop=[stop, "never-appears"]).choices[0]
    assert cut.text == full[: full.find(stop)] and cut.finish_reason == "stop"
    longer = full[-6:]  # a plain string of any length (up to 64 characters), not only a list
    cut = client.completions.create(model="tiny", prompt="And he said", max_tokens=16, temperature=0, stop=longer)
    assert cut.choices[0].text == full[: full.find(longer)] and cut.choices[0].finish_reason == "stop"


def test_sampling_extremes_are_served(client):
    """In-range values that once overflowed sampling (a 503 for the whole batch) now sample the argmax."""
    greedy = client.completions.create(model="tiny", prompt="And he said", max_tokens=6, temperature=0)
    for extreme in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 5e-324, "top_p": 9.4e-288}):
        out = client.completions.create(model="tiny", prompt="And he said", max_tokens=6, **extreme)
        assert out.choices[0].text == greedy.choices[0].text


def test_batched_equals_unbatched(server):
    prompts = [f"And the LORD said unto Moses, {w}" for w in
               ("Go", "Speak unto the children", "Stretch out thine hand", "Take", "Behold", "Rise up early", "I",
                "Come")]

    def body(p):
        return {"prompt": p, "max_tokens": 10, "temperature": 0}

    alone = [httpx.post(server + "/v1/completions", json=body(p), timeout=60).json()["choices"][0]["text"]
             for p in prompts]
    batches_before = metric(server, "diffar_batch_size_count")
    sum_before = metric(server, "diffar_batch_size_sum")
    cancelled_before = metric(server, "diffar_cancelled_total")

    async def together():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(server + "/v1/completions", json=body(p)) for p in prompts))

    batched = [r.json()["choices"][0]["text"] for r in asyncio.run(together())]
    assert batched == alone
    batches = metric(server, "diffar_batch_size_count") - batches_before
    rows = metric(server, "diffar_batch_size_sum") - sum_before
    assert rows == len(prompts) and batches < len(prompts)  # they really were decoded together
    assert metric(server, "diffar_cancelled_total") == cancelled_before  # finishing is not cancelling


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": 42}, 400, "prompt"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "   "}, 400, "prompt"),
    ({"prompt": "word " * 400, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "seed": 2 ** 64}, 400, "seed"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "max_tokens": 8, "fixed_tokens": {"1": "a b c", "2": 5}}, 400, "fixed_tokens"),
    ({"prompt": "x", "max_tokens": 8, "fixed_tokens": {"7": "many words here"}}, 400, "fixed_tokens"),
    ({"prompt": "x", "method": "telepathy"}, 400, "method"),
    ({"prompt": "x", "method": "dd2"}, 400, "method"),
    ({"prompt": "x", "model": "gpt-7"}, 404, "model"),
    ({"prompt": "x", "n": 3}, 400, "n"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "best_of": 0}, 400, "best_of"),
    ({"prompt": "x", "domain": "shakespeare"}, 400, "domain"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "steps": 0}, 400, "steps"),
    ({"prompt": "x", "guidance_scale": -2}, 400, "guidance_scale"),
    ({"prompt": "x", "preset": "turbo"}, 400, "preset"),
])
def test_bad_requests_get_openai_shaped_4xx(server, body, status, param):
    r = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_malformed_json_and_wrong_shapes(server):
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server + "/v1/chat/completions", json={"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(server + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    assert httpx.get(server + "/v1/nothing-here").status_code == 404
    assert "error" in httpx.get(server + "/v1/nothing-here").json()


def test_disconnect_mid_stream_cancels_generation(server):
    before = metric(server, "diffar_cancelled_total")
    tokens_before = metric(server, "diffar_generated_tokens_total")
    body = {"prompt": "And", "max_tokens": 300, "temperature": 0, "stream": True, "fixed_tokens": {"299": 5}}
    with httpx.stream("POST", server + "/v1/completions", timeout=60, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token in, hang up (the pin at 299 keeps eos away, so only a cancel ends it early)
    deadline = time.time() + 30
    while metric(server, "diffar_cancelled_total") == before and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, "diffar_cancelled_total") == before + 1
    assert 1 <= metric(server, "diffar_generated_tokens_total") - tokens_before < 300
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_disconnect_while_waiting_cancels_generation(smollm2_checkpoint):
    """A non-streaming client that gives up is cancelled at the engine's next step, not generated for. (SmolLM2:
    slow enough on a CPU that 400 tokens take far longer than the client waits.)"""
    with serving(smollm2_checkpoint) as server:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "fixed_tokens": {"399": 5}}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server + "/v1/completions", json=body, timeout=1.0)
        deadline = time.time() + 60
        while metric(server, "diffar_cancelled_total") == 0 and time.time() < deadline:
            time.sleep(0.1)
        assert metric(server, "diffar_cancelled_total") == 1
        assert metric(server, "diffar_generated_tokens_total") < 400


def test_oversized_body_is_refused_unread(server):
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    t0 = time.perf_counter()
    r = httpx.post(server + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.perf_counter() - t0 < 5
    chunked = httpx.post(server + "/v1/completions", content=iter([b'{"prompt": "x"}']), timeout=30)
    assert chunked.status_code == 411
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_foreign_host_header_and_docs_are_refused(server):
    """A page on another site that rebinds its name to 127.0.0.1 sends its own Host: refused (DNS rebinding)."""
    assert httpx.post(server + "/v1/completions", json={"prompt": "x"}, headers={"host": "evil.example"}).status_code == 400
    assert httpx.get(server + "/docs").status_code == 404  # off unless --docs
    assert httpx.get(server + "/health", headers={"host": "localhost"}).status_code == 200


def test_streamed_text_never_shows_a_stop_string(client):
    full = client.completions.create(model="tiny", prompt="And he said", max_tokens=16, temperature=0).choices[0].text
    stop = full[-3:]
    cut = full[: full.find(stop)]
    chunks = list(client.completions.create(model="tiny", prompt="And he said", max_tokens=16, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_lone_surrogates_are_a_400(server):
    raw = b'{"prompt": "abc \\ud800 def", "max_tokens": 2}'
    r = httpx.post(server + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_full_queue_answers_429_and_loses_nothing(tiny_run):
    with serving(tiny_run, "--max-batch-size", "1", "--max-queue", "2") as url:
        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(url + "/v1/completions",
                                                     json={"prompt": "And", "max_tokens": 30, "temperature": 0})
                                              for _ in range(20)))
        codes = [r.status_code for r in asyncio.run(burst())]
        assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 2
        assert metric(url, 'diffar_requests_total{path="/v1/completions",status="200"}') == codes.count(200)


def test_overload_is_shed_with_retry_after(tiny_run):
    """A burst whose queued work exceeds --max-wait-s at the measured step cost: the excess gets a 429 at once,
    with Retry-After; every admitted request is answered in full."""
    with serving(tiny_run, "--max-batch-size", "4", "--max-wait-s", "0.1") as url:
        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(url + "/v1/completions", json={
                    "prompt": "And", "max_tokens": 250, "temperature": 0, "stop": "never said"}) for _ in range(60)))
        replies = asyncio.run(burst())
    shed = [r for r in replies if r.status_code == 429]
    served = [r for r in replies if r.status_code == 200]
    assert len(shed) + len(served) == 60 and shed and served
    assert all(r.json()["error"]["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1 for r in shed)
    assert all(r.json()["usage"]["completion_tokens"] == 250 for r in served)


def test_api_key_guards_every_route_but_health_and_the_page(tiny_run):
    with serving(tiny_run, "--api-key", "s3cret") as url:
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="And", max_tokens=3).usage.completion_tokens == 3


def test_metrics_in_prometheus_format(server):
    text = httpx.get(server + "/metrics").text
    for name in ("diffar_requests_total", "diffar_errors_total", "diffar_request_latency_seconds_bucket",
                 "diffar_batch_size_bucket", "diffar_generated_tokens_total", "diffar_tokens_per_second"):
        assert name in text


def test_loadtest_1000_concurrent_clients_lose_nothing(tiny_run, tmp_path):
    from tests.conftest import run_cli

    out = tmp_path / "load.json"
    proc = run_cli("loadtest", "--checkpoint", tiny_run, "--concurrency", "1000", "--requests", "1000",
                   "--max-tokens", "2", "--max-batch-size", "64", "--time-limit", "240", "--out", out, timeout=400)
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(out.read_text())
    assert result["concurrency"] == 1000 and result["requests"] == 1000
    assert result["completed"] == 1000 and result["errors"] == 0 and result["lost"] == 0
    assert result["p50_ms"] <= result["p95_ms"] <= result["p99_ms"]
