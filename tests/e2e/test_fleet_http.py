"""End to end: a real 2-node fleet (Redis, Ray, Serve, mlx-lm), driven with the openai client and raw HTTP."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.local_fleet import LocalFleet

pytestmark = pytest.mark.fleet
MODEL = "tiny-dense"
OTHER = "tiny-swa"  # a second model in the same fleet: one deployment each
HELLO = [{"role": "user", "content": "Hello there, fleet!"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with LocalFleet(tmp_path_factory.mktemp("fleet"), nodes=2, models=(MODEL, OTHER),
                    extra=("--assign-timeout", "5")) as f:
        yield f
    assert f.processes() == [], "mlx-fleet down left processes behind"


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(fleet):
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        yield c


def test_up_prints_endpoint_and_a_curl_that_works(fleet, http):
    assert f"{fleet.url}/v1" in fleet.up_output
    curl = next(line for line in fleet.up_output.splitlines() if "-d '" in line)
    body = json.loads(curl.split("-d '", 1)[1].rstrip("'"))
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_models_endpoint(client):
    assert [m.id for m in client.models.list().data] == [MODEL, OTHER]


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "models": {MODEL: True, OTHER: True}}


def test_the_model_field_routes_between_models(client):
    def greedy(model):
        return client.completions.create(model=model, prompt="Route me", max_tokens=12, temperature=0)

    a, b = greedy(MODEL), greedy(OTHER)
    assert (a.model, b.model) == (MODEL, OTHER)
    assert a.choices[0].text != b.choices[0].text  # different weights, different soup
    assert greedy(OTHER).choices[0].text == b.choices[0].text


def test_chat_completion(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    reply = raw.parse()
    assert raw.headers["x-fleet-node"] in {"node-0", "node-1"}
    assert raw.headers["x-fleet-cached-tokens"] == "0"
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    u = reply.usage
    assert (u.completion_tokens, u.total_tokens) == (12, u.prompt_tokens + 12)
    assert u.prompt_tokens > 5 and u.prompt_tokens_details.cached_tokens == 0


def test_text_completion(client):
    reply = client.completions.create(model=MODEL, prompt="The fleet", max_tokens=6, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text
    assert reply.usage.completion_tokens == 6


def test_greedy_is_deterministic_across_requests(client):
    texts = {client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0).choices[0].message.content
             for _ in range(3)}
    assert len(texts) == 1


def test_streaming_matches_non_streaming_and_reports_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_sse_framing_on_the_wire(http):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-fleet-node"] in {"node-0", "node-1"}
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    for e in events[:-2]:
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_stream_of_text_completion(client):
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_both_nodes_serve_traffic(http):
    nodes = set()
    for _ in range(24):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "spread", "max_tokens": 1})
        assert r.status_code == 200
        nodes.add(r.headers["x-fleet-node"])
        if nodes == {"node-0", "node-1"}:
            break
    assert nodes == {"node-0", "node-1"}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": -5}, "max_tokens"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 10**9}, "max_tokens"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "messages": HELLO, "temperature": 3}, "temperature"),
    ({"model": MODEL, "messages": HELLO, "temperature": -1}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user"}], "top_p": 0}, "top_p"),
    ({"messages": HELLO}, "model"),
])
def test_client_mistakes_are_400(http, body, param):
    assert error_of(http.post("/v1/chat/completions", json=body), 400)["param"] == param


def test_malformed_json_is_400(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "tiny-dense", "messages": [', headers={"content-type": "application/json"})
    assert error_of(r, 400)["code"] == "invalid_json"


def test_unknown_model_is_404(http, client):
    err = error_of(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": HELLO}), 404)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=HELLO)


def test_context_overflow_is_400(http, client):
    err = error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 8190}), 400)
    assert err["code"] == "context_length_exceeded"
    long_prompt = list(range(3, 1003)) * 9  # 9000 tokens > 8192
    err = error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1}), 400)
    assert err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=9000)


def test_out_of_vocabulary_token_is_400(http):
    assert error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 99999]}), 400)["param"] == "prompt"


def test_unknown_route_is_openai_404(http):
    error_of(http.get("/v1/nothing-here"), 404)


def test_status_lists_nodes_replicas_and_models(fleet, http):
    status = fleet.status()
    assert [n["node_id"] for n in status["nodes"]] == ["node-0", "node-1"] and all(n["alive"] for n in status["nodes"])
    assert sorted((r["model"], r["node_id"]) for r in status["replicas"]) == [
        (MODEL, "node-0"), (MODEL, "node-1"), (OTHER, "node-0"), (OTHER, "node-1")]
    for r in status["replicas"]:
        assert r["cache"]["enabled"] and r["cache"]["block_tokens"] == 64 and r["cache"]["ram"]["budget"] == 2 << 30
    assert status["models"] == [{"name": MODEL, "replicas": 2, "nodes": ["node-0", "node-1"]},
                                {"name": OTHER, "replicas": 2, "nodes": ["node-0", "node-1"]}]
    assert http.get("/v1/fleet/status").json()["models"] == status["models"]
    text = fleet.cli("status").stdout
    assert "node-0" in text and "node-1" in text and MODEL in text and "cache " in text


def test_no_live_replica_is_503_with_retry_after(fleet, http):
    """Freeze every replica (a hung Mac): the gateway must answer 503 + Retry-After, not hang or 500."""
    pids = [r["pid"] for r in fleet.status()["replicas"] if r["model"] == MODEL]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2}, timeout=30)
        elapsed = time.monotonic() - t0
        err = error_of(r, 503)
        assert err["code"] == "no_replica_available" and r.headers["retry-after"] == "2"
        assert elapsed < 15
        health = http.get("/health", timeout=30)
        assert health.status_code == 503 and health.json()["models"] == {MODEL: False, OTHER: True}
        other = http.post("/v1/chat/completions", json={"model": OTHER, "messages": HELLO, "max_tokens": 2})
        assert other.status_code == 200  # the other model is unaffected
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200


def test_same_long_prompt_twice_is_served_from_cache_with_identical_text(http):
    prompt = " ".join(["The fleet keeps every prefix it has seen, block by block."] * 40)  # ~500 tokens
    runs: dict[str, list] = {}
    for _ in range(30):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200
        body = r.json()
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r.headers["x-fleet-cached-tokens"] == str(cached)
        runs.setdefault(r.headers["x-fleet-node"], []).append((cached, body["choices"][0]["text"], body["usage"]["prompt_tokens"]))
        if len(runs) == 2 and all(len(v) >= 2 for v in runs.values()):
            break
    texts = {text for v in runs.values() for _, text, _ in v}
    assert len(texts) == 1  # identical greedy text, cached or cold, on either node
    for node, seen in runs.items():
        (first, _, n), (second, _, _) = seen[0], seen[1]
        assert first == 0, node
        assert 0 < second < n and second % 64 == 0, (node, second)


def test_streaming_reports_cached_tokens_in_header_and_usage(http):
    prompt = " ".join(["Streaming answers reuse cached blocks too."] * 40)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    hits = []
    for _ in range(12):
        with http.stream("POST", "/v1/completions", json=body) as r:
            raw = "".join(r.iter_text())
        usage = json.loads(raw.split("\n\n")[-3][6:])["usage"]
        assert r.headers["x-fleet-cached-tokens"] == str(usage["prompt_tokens_details"]["cached_tokens"])
        hits.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert max(hits) > 0
