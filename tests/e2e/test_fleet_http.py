"""End to end: a real 2-node fleet (Redis, Ray, Serve, mlx-lm), driven with the openai client and raw HTTP."""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.local_fleet import LocalFleet, node_name, route_of

pytestmark = pytest.mark.fleet
MODEL = "tiny-dense"
OTHER = "tiny-swa"  # a second model in the same fleet: one deployment each
HELLO = [{"role": "user", "content": "Hello there, fleet!"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with LocalFleet(tmp_path_factory.mktemp("fleet"), nodes=2, models=(MODEL, OTHER),
                    extra=("--assign-timeout", "5"), dashboard=True) as f:
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
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, OTHER]
    assert [m.model_extra["kv_block_tokens"] for m in models] == [64, 64]


def test_one_model_is_retrieved_as_the_sdk_asks(client, http):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.model_extra["kv_block_tokens"]) == (MODEL, "model", 64)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    err = error_of(http.get("/v1/models/" + "x" * 5000), 404)
    assert err["code"] == "model_not_found" and len(err["message"]) < 400  # a huge name is not echoed whole


def test_a_wrong_method_is_405_with_the_methods_the_path_takes(http):
    r = http.get("/v1/chat/completions")
    assert error_of(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"


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
    assert node_name(raw.headers["x-fleet-node"]) in {"node-0", "node-1"}
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
        assert node_name(r.headers["x-fleet-node"]) in {"node-0", "node-1"}
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
        nodes.add(node_name(r.headers["x-fleet-node"]))
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


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_empty_body_is_400_naming_the_model(http, path):
    err = error_of(http.post(path, content=b"", headers={"content-type": "application/json"}), 400)
    assert (err["param"], err["code"]) == ("model", "missing_required_parameter")


def test_a_json_body_sent_as_text_is_400_naming_the_content_type(http):
    body = b'{"model": "tiny-dense", "messages": [{"role": "user", "content": "hi"}]}'
    err = error_of(http.post("/v1/chat/completions", content=body, headers={"content-type": "text/plain"}), 400)
    assert err["code"] == "invalid_content_type" and "Content-Type: application/json" in err["message"]
    err = error_of(http.post("/v1/chat/completions", content=body), 400)  # httpx sends no Content-Type for bytes
    assert (err["code"], err["message"]) == ("invalid_content_type", "The request body must be JSON, sent with "
                                             "Content-Type: application/json (this one was sent without a Content-Type)")


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
    err = error_of(http.get("/v1/nothing-here"), 404)
    assert err == {"message": "Invalid URL (GET /v1/nothing-here)", "type": "invalid_request_error", "param": None,
                   "code": None}


def test_status_lists_nodes_replicas_and_models(fleet, http):
    status = fleet.status()
    assert [n["name"] for n in status["nodes"]] == ["node-0", "node-1"] and all(n["alive"] for n in status["nodes"])
    ids = [n["node_id"] for n in status["nodes"]]
    assert [node_name(i) for i in ids] == ["node-0", "node-1"]  # a unique id per node, the name as its label
    assert sorted((r["model"], r["node_id"]) for r in status["replicas"]) == sorted(
        [(MODEL, ids[0]), (MODEL, ids[1]), (OTHER, ids[0]), (OTHER, ids[1])])
    for r in status["replicas"]:
        assert r["cache"]["enabled"] and r["cache"]["block_tokens"] == 64 and r["cache"]["ram"]["budget"] == 2 << 30
    assert status["models"] == [{"name": MODEL, "replicas": 2, "nodes": ids}, {"name": OTHER, "replicas": 2, "nodes": ids}]
    assert status["replicas_source"] == "leases" and status["redis"]["reachable"]
    assert (status["running"], status["endpoint"], status["base_url"]) == (True, fleet.url, fleet.url + "/v1")
    assert [n["metrics_port"] for n in status["nodes"]] == [n.metrics_port for n in fleet.state().nodes]
    assert http.get("/v1/fleet/status").json()["models"] == status["models"]
    text = fleet.cli("status").stdout
    assert ids[0] in text and ids[1] in text and MODEL in text and "cache " in text
    assert text.count("batching: up to 16 decoding, 8 prefilling") == 4  # every replica batches
    assert all(r["batching"]["batching"] and r["batching"]["decode_concurrency"] == 16 for r in status["replicas"])


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
        health = wait_for_health(http, {MODEL: False, OTHER: True})  # once the frozen replicas' leases expire
        assert health.status_code == 503
        other = http.post("/v1/chat/completions", json={"model": OTHER, "messages": HELLO, "max_tokens": 2})
        assert other.status_code == 200  # the other model is unaffected
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200


def wait_for_health(http, models: dict, timeout_s: float = 20.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        r = http.get("/health", timeout=5)
        if r.json()["models"] == models or time.monotonic() > deadline:
            assert r.json()["models"] == models
            return r
        time.sleep(0.5)


def test_a_long_prompt_is_cold_once_then_cached_wherever_it_is_served_with_identical_text(http):
    prompt = " ".join(["The fleet keeps every prefix it has seen, block by block."] * 40)  # ~500 tokens
    runs = []
    for _ in range(6):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200
        body = r.json()
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r.headers["x-fleet-cached-tokens"] == str(cached)
        runs.append((cached, body["choices"][0]["text"], body["usage"]["prompt_tokens"], route_of(r.headers)))
    assert len({text for _, text, _, _ in runs}) == 1  # identical greedy text, cold, cached or pulled from a peer
    (first, _, n, plan), later = runs[0], runs[1:]
    assert first == 0 and plan["local"] == plan["fetched"] == "0", plan
    for cached, _, _, plan in later:
        assert 0 < cached < n and cached % 64 == 0, (cached, plan)
        assert cached == int(plan["local"]) + int(plan["fetched"]), plan


def bypass_routes(fleet) -> int:
    return (fleet.status().get("fleet") or {}).get("routes", {}).get("bypass", 0)


def test_the_cache_bypass_header_gives_the_cold_answer_and_bad_values_are_400(fleet, http):
    body = {"model": MODEL, "prompt": " ".join(["A cold path to compare against."] * 30), "max_tokens": 10,
            "temperature": 0}
    warm = [http.post("/v1/completions", json=body) for _ in range(2)]
    before = bypass_routes(fleet)
    cold = http.post("/v1/completions", json=body, headers={"x-fleet-cache": "bypass"})
    deadline = time.monotonic() + 15  # gateways publish their counts every 2 s
    while bypass_routes(fleet) != before + 1 and time.monotonic() < deadline:
        time.sleep(1)
    assert bypass_routes(fleet) == before + 1  # status's routes count bypassed requests too
    assert warm[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert route_of(cold.headers) == {"policy": "affinity", "reason": "bypass", "local": "0", "fetched": "0"}
    assert {r.json()["choices"][0]["text"] for r in warm + [cold]} == {cold.json()["choices"][0]["text"]}
    err = error_of(http.post("/v1/completions", json=body, headers={"x-fleet-cache": "sometimes"}), 400)
    assert err["param"] == "x-fleet-cache"


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


# -- the front door: real bytes, off-loop tokenization, what requests mean ---------------------------------
def gateway_rss(fleet) -> int:
    return max(psutil.Process(pid).memory_info().rss for pid in fleet.replica_pids("Gateway"))


def test_a_chunked_body_over_the_limit_is_413_as_soon_as_it_passes(fleet):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (100 << 20)}]}).encode()
    chunks = (body[i:i + 65536] for i in range(0, len(body), 65536))  # no Content-Length: chunked framing
    t0 = time.monotonic()
    r = httpx.post(f"{fleet.url}/v1/chat/completions", content=chunks, timeout=120,
                   headers={"content-type": "application/json"})
    assert time.monotonic() - t0 < 30
    assert error_of(r, 413)["code"] == "request_too_large"
    assert gateway_rss(fleet) < 1 << 30


def content_length(reply: bytes) -> int:
    head = reply.partition(b"\r\n\r\n")[0].decode().lower()
    return next((int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.startswith("content-length:")), 0)


def test_a_declared_oversized_body_is_413_before_it_is_read(fleet):
    import socket

    with socket.create_connection(("127.0.0.1", fleet.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1073741824\r\n\r\n{}")  # 1 GiB promised, 2 bytes sent: no need to wait for more
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < content_length(reply):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413") and json.loads(body)["error"]["code"] == "request_too_large"


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_a_huge_prompt_is_refused_cheaply_and_never_stalls_other_requests(fleet, http):
    small = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * (3 << 20)}]}).encode()

    def trial() -> tuple[float, list[float], list[httpx.Response]]:
        idle = statistics.median(timed(lambda: http.post("/v1/chat/completions", json=small)) for _ in range(7))
        refusals = []

        def send_huge():  # several in a row, so the small requests below overlap them many times
            for _ in range(4):
                refusals.append(httpx.post(f"{fleet.url}/v1/chat/completions", content=huge, timeout=60,
                                           headers={"content-type": "application/json"}))

        worker = threading.Thread(target=send_huge)
        worker.start()
        busy = [timed(lambda: http.post("/v1/chat/completions", json=small))]
        while worker.is_alive():
            busy.append(timed(lambda: http.post("/v1/chat/completions", json=small)))
        worker.join()
        return idle, busy, refusals

    # Typical latency within 2x of idle (15 MB still costs the 2 cores here some CPU to receive and parse),
    # and no request ever waits behind the huge one's tokenization (that took 7.3 s before it moved off the
    # loop). Up to three trials: a stall fails every one, a slow second of this shared VM only one.
    for _ in range(3):
        idle, busy, refusals = trial()
        assert [error_of(r, 400)["code"] for r in refusals] == ["context_length_exceeded"] * 4
        if statistics.median(busy) <= 2 * idle + 0.05 and max(busy) < 1.0:
            break
    assert statistics.median(busy) <= 2 * idle + 0.05, (idle, busy)
    assert max(busy) < 1.0, (idle, busy)


def test_a_long_prompt_that_passes_the_cheap_check_is_tokenized_and_refused(http):
    text = "fleet " * 30_000  # 180k characters: under the cheap bound (213k here), still 30k tokens
    err = error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": text}), 400)
    assert err["code"] == "context_length_exceeded" and " in the prompt, 16 for the completion" in err["message"], err
    assert err["param"] == "prompt"  # the prompt alone does not fit: that is the field to fix, not max_tokens
    assert "characters" not in err["message"]  # tokenized (off the loop), not refused by its length


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"xtc_probability": 0.5}, "xtc_probability"),
])
def test_unsupported_chat_fields_are_refused_by_name(http, extra, param):
    err = error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **extra}), 400)
    assert err["param"] == param and "not supported" in err["message"]


def test_best_of_is_refused_by_name(http):
    err = error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 2}), 400)
    assert err["param"] == "best_of"


def test_distinct_seeds_give_distinct_streams_and_out_of_range_seeds_are_400(client, http):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Seeds", max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text

    texts = {seed: sample(seed) for seed in (0, 1 << 32, 1 << 40)}
    assert len(set(texts.values())) == 3, texts  # once: all three collided
    assert sample(1 << 40) == texts[1 << 40]  # the same seed, the same stream
    err = error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "seed": 1 << 70}), 400)
    assert err["param"] == "seed"


@pytest.mark.parametrize("raw,param,says", [
    (b'{"model": "tiny-dense", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content",
     "surrogate"),
    (b'{"model": "tiny-dense", "messages": [{"role": "user", "content": "hi"}], "temperature": "0.5"}',
     "temperature", "valid number"),
])
def test_error_messages_say_what_is_wrong(http, raw, param, says):
    err = error_of(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and says in err["message"]


def test_a_body_that_is_not_utf8_is_400_with_a_code(http):
    raw = b'{"model": "tiny-dense", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    err = error_of(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json"


def test_health_answers_fast_while_every_replica_is_busy(fleet, http):
    body = {"model": MODEL, "prompt": "busy " * 20, "max_tokens": 100, "temperature": 0}
    with ThreadPoolExecutor(40) as pool:
        load = [pool.submit(httpx.post, f"{fleet.url}/v1/completions", json=body, timeout=300) for _ in range(40)]
        time.sleep(3)  # every replica is at max_ongoing_requests now; more wait in the router
        times = []
        for _ in range(10):
            t0 = time.monotonic()
            r = http.get("/health", timeout=10)
            times.append(time.monotonic() - t0)
            assert r.status_code == 200 and r.json()["status"] == "ok"
        assert max(times) < 1.0, times
        codes = [f.result().status_code for f in load]
        assert set(codes) <= {200, 503} and codes.count(200) >= 32  # beyond the queue: 503 + Retry-After


def test_losing_a_gateway_replica_does_not_stall_the_endpoint(fleet, http):
    pids = fleet.replica_pids("Gateway")
    assert len(pids) == 2  # two by default
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 48, "temperature": 0}
    with ThreadPoolExecutor(12) as pool:  # requests in flight on both gateways when one dies
        flying = [pool.submit(httpx.post, f"{fleet.url}/v1/chat/completions", json=body, timeout=60)
                  for _ in range(12)]
        time.sleep(0.3)
        os.kill(pids[0], signal.SIGKILL)
        in_flight = [f.result() for f in flying]
    times, codes = [], []
    for _ in range(10):
        t0 = time.monotonic()
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2}, timeout=30)
        times.append(time.monotonic() - t0)
        codes.append(r.status_code)
    assert max(times) < 5.0, times  # no stall while Serve notices and replaces the dead replica
    # Requests the dead replica held get Serve's proxy's answer, in OpenAI's format (a 503 to retry: the
    # OpenAI SDK does by itself); every other one is served by the surviving gateway.
    for r in in_flight:
        assert r.status_code in (200, 503), (r.status_code, r.text)
        if r.status_code == 503:
            assert error_of(r, 503)["code"] == "unavailable" and r.headers["retry-after"] == "1"
    assert codes.count(200) >= 9 and set(codes) <= {200, 503}, codes
    deadline = time.monotonic() + 120
    while len(fleet.replica_pids("Gateway")) < 2 and time.monotonic() < deadline:  # Serve replaces it
        time.sleep(1)
    assert len(fleet.replica_pids("Gateway")) == 2


# -- security and visibility -------------------------------------------------------------------------------
def listeners(fleet) -> list[tuple[str, str, int]]:
    out = []
    for p in fleet.processes():
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((p.name(), c.laddr.ip, c.laddr.port))
        except psutil.Error:
            continue
    return out


def test_every_socket_of_the_fleet_listens_on_loopback(fleet):
    found = listeners(fleet)
    # The sweep sees every kind of process (GCS, raylets, dashboard, agents, Serve's proxy and replicas,
    # Redis): Ray workers rename themselves, so they are found as descendants of the tagged processes.
    assert len(found) > 20 and fleet.port in {port for _, _, port in found}
    names = {name for name, _, _ in found}
    assert {"gcs_server", "raylet", "redis-server"} <= names and any("ServeReplica" in n for n in names)
    bad = [x for x in found if not (x[1].startswith("127.") or x[1] in ("::1",) or x[1].startswith("::ffff:127."))]
    assert bad == []


def test_serve_runs_its_direct_grpc_data_plane_in_every_serve_process(fleet):
    """The proxy, the gateways and the replicas start with Ray's throughput-optimized Serve (fleet/ray_env.py)."""
    from cluster.fleet.ray_env import SERVE_ENV

    serve = [p for p in fleet.processes() if any(k in p.name() for k in ("ServeReplica", "ProxyActor"))]
    assert len(serve) >= 5  # the proxy, two gateways, a replica per model
    for p in serve:
        env = p.environ()
        assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, p.name()


def test_no_credential_is_shown_anywhere(fleet, http):
    secret = (fleet.data_dir / "redis" / "password").read_text().strip()
    token = (fleet.data_dir / "ray-token").read_text().strip()
    assert len(secret) > 16 and secret in fleet.state().redis_url  # the fleet's Redis has one
    shown = [fleet.cli("status", "--json").stdout, fleet.cli("status").stdout, http.get("/v1/fleet/status").text,
             fleet.up_output]
    logs = [p.read_text(errors="replace") for p in Path(fleet.state().ray_temp_dir).rglob("*.log")]
    logs += [p.read_text(errors="replace") for p in (fleet.data_dir / "logs").rglob("*.log")]
    for text in shown + logs:
        assert secret not in text and token not in text
    assert "***@127.0.0.1" in shown[0]


def test_files_with_secrets_are_private(fleet):
    for path in (fleet.data_dir / "ray-token", fleet.data_dir / "redis" / "password", fleet.data_dir / "fleet.json"):
        assert path.stat().st_mode & 0o077 == 0, path
    ray_dir = Path(fleet.state().ray_temp_dir)  # Ray opens its own dir to every user: the folder around it is ours
    assert ray_dir.parent.stat().st_mode & 0o777 == 0o700 and (ray_dir / "session_latest").is_dir()


def test_the_dashboard_shows_the_serve_app_and_the_node_stores(fleet):
    state = fleet.state()
    token = (fleet.data_dir / "ray-token").read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=state.dashboard_url, timeout=10, trust_env=False) as dash:
        assert dash.get("/api/serve/applications/").status_code == 401  # token auth is on
        t0 = time.monotonic()
        apps = dash.get("/api/serve/applications/", headers=auth)
        assert time.monotonic() - t0 < 5 and apps.status_code == 200
        deployments = apps.json()["applications"]["mlx-fleet"]["deployments"]
        assert {"Gateway", "model-tiny-dense", "model-tiny-swa"} <= set(deployments)
        actors = dash.get("/logical/actors", headers=auth).json()["data"]["actors"]
        names = {a.get("name") for a in actors.values()}
        ids = [n["node_id"] for n in fleet.status()["nodes"]]
        assert {f"node-store:{i}" for i in ids} <= names


# -- fuzzing the schema --------------------------------------------------------------------------------------
def bounded(case) -> None:
    """Keep generation short (a fixed budget) and send a real model name half the time, so valid bodies
    reach the replicas instead of stopping at 404."""
    body = case.body
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and not isinstance(body.get(field), bool) and body[field] > 8:
            body[field] = 8
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4
    if len(json.dumps(body, default=str)) % 2:
        body["model"] = MODEL


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_get_a_2xx_or_a_correct_4xx(fleet, mode):
    """schemathesis against the gateway's own OpenAPI schema, a fixed budget of examples per mode."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{fleet.url}/openapi.json")
    generation = schemathesis.GenerationMode.POSITIVE if mode == "positive" else schemathesis.GenerationMode.NEGATIVE
    seen: dict[int, int] = {}

    @settings(max_examples=80, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy(generation))
    def check(case):
        bounded(case)
        response = case.call(timeout=60)  # a hang fails here
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:500], case.method, case.path, case.body)
        if response.status_code >= 400:
            err = response.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]

    check()
    assert sum(seen.values()) >= 40, seen
    if mode == "positive":
        assert any(code < 300 for code in seen), seen  # valid bodies do reach the replicas


def scrape(fleet) -> dict[tuple, float]:
    """Every node's Prometheus endpoint: {(node port, name, sorted labels): value}, one entry per series.

    Series stay apart (Ray labels each with the process that records it): the series of a process that
    died (the gateway killed earlier in this module) may vanish between two scrapes, so growth is
    counted per series, never as a difference of sums."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple, float] = {}
    for node in fleet.state().nodes:
        text = httpx.get(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("ray_mlx_fleet_"):
                    out[(node.metrics_port, s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (_, n, lab), v in samples.items() if n == name and all((k, v2) in lab for k, v2 in labels.items()))


def growth(before: dict, now: dict, name: str, **labels) -> float:
    """How much the series matching name and labels grew (a series new since `before` grew from 0)."""
    return sum(v - before.get(key, 0.0) for key, v in now.items()
               if key[1] == name and all((k, v2) in key[2] for k, v2 in labels.items()))


def test_prometheus_shows_the_fleets_metrics_and_they_add_up(fleet, client):
    """After traffic, the nodes' Prometheus endpoints (Ray's metrics agents) carry our metrics, and the
    cached-token counter grew by exactly the cached tokens the clients were told of. On the second model:
    nothing else in this module sends it requests, so nothing else lands in the window."""
    before = scrape(fleet)
    for path in ("/v1/no-such-path-7f3a", "/v1/models/no-such-model-7f3a"):
        assert httpx.get(fleet.url + path, timeout=10).status_code == 404
    system = "You are a careful assistant who answers the metrics test. " * 12
    seen_cached, n = 0, 6
    for i in range(n):
        r = client.chat.completions.create(model=OTHER, max_tokens=3, temperature=0.0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
        seen_cached += r.usage.prompt_tokens_details.cached_tokens
    assert seen_cached > 0
    deadline = time.monotonic() + 60  # replicas export every 5 s, Ray's agents every 10 s
    while True:
        now = scrape(fleet)
        grew = {name: growth(before, now, name, **labels) for name, labels in (
            ("ray_mlx_fleet_tokens_total", {"model": OTHER, "kind": "cached"}),
            ("ray_mlx_fleet_requests_total", {"model": OTHER, "code": "200"}),
            ("ray_mlx_fleet_ttft_seconds_count", {"model": OTHER}),
            ("ray_mlx_fleet_request_seconds_count", {"model": OTHER}),
            ("ray_mlx_fleet_routes_total", {"model": OTHER}),
            ("ray_mlx_fleet_prefix_decisions_total", {"model": OTHER}))}
        if grew["ray_mlx_fleet_tokens_total"] >= seen_cached and grew["ray_mlx_fleet_requests_total"] >= n \
                or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert grew["ray_mlx_fleet_tokens_total"] == seen_cached, grew
    assert grew["ray_mlx_fleet_requests_total"] == n and grew["ray_mlx_fleet_routes_total"] == n, grew
    assert grew["ray_mlx_fleet_ttft_seconds_count"] == n and grew["ray_mlx_fleet_request_seconds_count"] == n, grew
    assert grew["ray_mlx_fleet_prefix_decisions_total"] == n, grew
    names = {name for _, name, _ in now}
    assert {"ray_mlx_fleet_cache_blocks", "ray_mlx_fleet_cache_bytes", "ray_mlx_fleet_replica_sequences",
            "ray_mlx_fleet_replica_queued_tokens"} <= names, sorted(names)
    # counters of events that have not happened are there at 0, not missing
    assert {"ray_mlx_fleet_cache_evictions_total", "ray_mlx_fleet_cache_dropped_spills_total",
            "ray_mlx_fleet_cache_quarantined_total", "ray_mlx_fleet_migration_failures_total",
            "ray_mlx_fleet_redis_errors_total"} <= names, sorted(names)
    # the endpoint label is one of a fixed set, whatever URLs clients ask for
    endpoints = {dict(labels)["endpoint"] for _, name, labels in now if name == "ray_mlx_fleet_requests_total"}
    assert {"other", "/v1/models/{model}", "/v1/chat/completions"} <= endpoints <= {
        "/health", "/v1/models", "/v1/models/{model}", "/v1/chat/completions", "/v1/completions",
        "/v1/fleet/status", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "other"}, endpoints
    ram = total(now, "ray_mlx_fleet_cache_blocks", model=OTHER, tier="ram")
    disk = total(now, "ray_mlx_fleet_cache_blocks", tier="disk")
    assert ram > 0 and disk >= 0
    assert total(now, "ray_mlx_fleet_replica_sequences", model=OTHER, stage="active") == 0  # all done
    assert total(now, "ray_mlx_fleet_tokens_total", model=OTHER, kind="generated") >= 3 * n


def test_mlx_fleet_deploy_updates_the_running_app_from_the_serve_file(fleet, tmp_path):
    """`mlx-fleet deploy` with deploy/serve.yaml (only what points it at this fleet changed) redeploys the app
    through the dashboard, with the fleet's token, waits for every replica and prints where to go."""
    import subprocess
    import sys

    import yaml

    state = fleet.state()
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml").read_text())
    doc["proxy_location"] = "HeadOnly"
    doc["http_options"] = {"host": "127.0.0.1", "port": fleet.port}
    args = doc["applications"][0]["args"]
    args.update(models=[{"name": MODEL, "source": MODEL}, {"name": OTHER, "source": OTHER}],
                redis_url=state.redis_url, data_dir=str(fleet.data_dir), gateway={"replicas": 2})
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(fleet.data_dir / "ray-token")}
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "deploy", str(path), "--address", state.dashboard_url],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replicas running" in r.stdout and f"endpoint:  http://127.0.0.1:{fleet.port}/v1" in r.stdout
    assert f"dashboard: {state.dashboard_url}" in r.stdout
    ok = httpx.post(f"{fleet.url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200
    # without the token the dashboard refuses it, and the message says what happened
    env.pop("RAY_AUTH_MODE")
    env.pop("RAY_AUTH_TOKEN_PATH")
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "deploy", str(path), "--address", state.dashboard_url],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
