"""The fleet as one cache (3 nodes): affinity, spreading a hot prefix with migration, Redis loss, node loss."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.fleet.processes import kill_sessions
from tests.local_fleet import LocalFleet, node_name, route_of

pytestmark = pytest.mark.fleet
MODEL = "tiny-dense"
B = 64


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with LocalFleet(tmp_path_factory.mktemp("index"), nodes=3, extra=("--assign-timeout", "30")) as f:
        yield f
    assert f.processes() == []


@pytest.fixture(scope="module")
def http(fleet):
    with httpx.Client(base_url=fleet.url, timeout=120) as c:
        yield c


def route(r: httpx.Response) -> dict:
    return route_of(r.headers)


def chat(http, messages, max_tokens=8):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return r, body["choices"][0]["message"]["content"], body["usage"]


def wait_for_index(fleet, entries: int, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = fleet.status()
        total = sum(sum(per.values()) for per in status["fleet"]["index_entries"].values())
        if total >= entries or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def test_later_turns_of_a_conversation_reach_the_node_holding_it(fleet, http):
    for c in range(3):
        messages = [{"role": "system", "content": f"Conversation {c}: " + "keep every turn in mind. " * 40},
                    {"role": "user", "content": f"First question of conversation {c}?"}]
        r, text, usage = chat(http, messages)
        home = r.headers["x-fleet-node"]
        for turn in range(2):
            time.sleep(1.5)  # the first turn's blocks reach the index
            full_blocks = usage["prompt_tokens"] // B * B
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then {turn}?"}]
            r, text, usage = chat(http, messages)
            assert r.headers["x-fleet-node"] == home, (c, turn, r.headers["x-fleet-route"])
            assert route(r)["reason"] == "hit"
            assert usage["prompt_tokens_details"]["cached_tokens"] >= full_blocks


def test_a_hot_system_prompt_spreads_over_all_nodes_which_pull_it_from_its_holder(fleet, http):
    system = {"role": "system", "content": "You are the fleet's shared assistant. " * 60}
    first, reference, _ = chat(http, [system, {"role": "user", "content": "Same question for everyone?"}],
                               max_tokens=24)
    time.sleep(3)  # spilled to the holder's disk, announced
    fetched_before = fleet.status()["fleet"]["fetched_tokens"]
    bodies = [[system, {"role": "user", "content": f"Question number {i}?"}] for i in range(21)]
    bodies += [[system, {"role": "user", "content": "Same question for everyone?"}]] * 9

    def send(messages):
        return chat(http, messages, max_tokens=24)

    with ThreadPoolExecutor(30) as pool:
        results = list(pool.map(send, bodies))
    served = Counter(r.headers["x-fleet-node"] for r, _, _ in results)
    assert len(served) == 3, served
    assert max(served.values()) / (sum(served.values()) / 3) <= 1.5, served
    routes = [route(r) for r, _, _ in results]
    pulled = [x for x in routes if int(x["fetched"]) > 0]
    assert pulled and all(x["from"] == first.headers["x-fleet-node"] for x in pulled), routes
    kinds = Counter((x["reason"], x["local"], x["fetched"]) for x in routes)
    assert all(int(x["local"]) + int(x["fetched"]) > 0 for x in routes), kinds  # nobody recomputed the shared prefix
    same = [(r.headers["x-fleet-node"], text) for (r, text, _), b in zip(results, bodies) if "Same" in b[1]["content"]]
    assert {text for _, text in same} == {reference}  # identical whichever node answers
    assert len({n for n, _ in same}) >= 2
    # The replicas count the pulled tokens the clients were told about, no more, no fewer.
    told = sum(int(x["fetched"]) for x in routes)
    deadline = time.monotonic() + 15
    while (counted := fleet.status()["fleet"]["fetched_tokens"] - fetched_before) != told and time.monotonic() < deadline:
        time.sleep(1)
    assert counted == told


def test_steady_clients_on_a_hot_prompt_spread_and_the_peers_serve_from_their_own_copies(fleet, http):
    """Issue 27's workload: a hot system prompt warmed by one request, then 6 clients each sending 4 requests
    one after another (a new question each time). Under this light load the bound never binds; the equal
    holders share the conversations by the requests sent them lately, so no node takes the lion's share."""
    system = {"role": "system", "content": "You are the help desk of a fleet of Macs; answer briefly. " * 70}
    warm, _, _ = chat(http, [system, {"role": "user", "content": "Warm-up question?"}])
    time.sleep(3)  # spilled to the holder's disk, announced

    def client(c):
        out = []
        for k in range(4):
            messages = [system, {"role": "user", "content": f"Client {c} asks question {k} about its Mac?"}]
            r, text, usage = chat(http, messages)
            out.append((messages, r, text, usage))
        return out

    with ThreadPoolExecutor(6) as pool:
        results = [x for per in pool.map(client, range(6)) for x in per]
    served = Counter(r.headers["x-fleet-node"] for _, r, _, _ in results)
    assert len(served) == 3 and max(served.values()) / (len(results) / 3) <= 1.5, served
    routes = [(r.headers["x-fleet-node"], route(r)) for _, r, _, _ in results]
    assert all(int(x["local"]) + int(x["fetched"]) > 0 for _, x in routes), routes  # nobody recomputed it
    holder = warm.headers["x-fleet-node"]
    pulls = Counter(n for n, x in routes if int(x["fetched"]) > 0)
    own = Counter(n for n, x in routes if n != holder and int(x["fetched"]) == 0)
    assert sum(own.values()) > sum(pulls.values()), (own, pulls)  # a peer pulls it once or so, then has it
    cold = [http.post("/v1/chat/completions", headers={"x-fleet-cache": "bypass"},
                      json={"model": MODEL, "messages": m, "max_tokens": 8, "temperature": 0})
            for m, _, _, _ in results[::6]]  # four of the 24, over four clients
    assert [c.json()["choices"][0]["message"]["content"] for c in cold] == [t for _, _, t, _ in results[::6]]


def block_file(fleet, node_id: str, messages: list, index: int):
    """The file of block `index` of this chat prompt on a node's disk (tokenized here as the gateway does)."""
    from transformers import AutoTokenizer

    from cluster.store.hashing import chain_ids

    tok = AutoTokenizer.from_pretrained(str(fleet.data_dir / "models" / MODEL))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ns = bytes.fromhex(next(r["cache"]["namespace_hex"] for r in fleet.status()["replicas"]))
    bid = chain_ids(ns, list(prompt), B)[index]
    return fleet.data_dir / node_name(node_id) / "blocks" / ns.hex() / bid.hex()[:2] / f"{bid.hex()}.blk"


def test_a_corrupt_block_on_the_peer_is_refused_and_answers_stay_exact(fleet, http):
    system = {"role": "system", "content": "A document every node will want. " * 60}
    ask = [system, {"role": "user", "content": "What does it say?"}]
    first, reference, usage = chat(http, ask, max_tokens=12)
    holder = first.headers["x-fleet-node"]
    time.sleep(3)  # on the holder's disk, announced
    victim = block_file(fleet, holder, ask, 2)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 8
    victim.write_bytes(bytes(data))
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: chat(http, ask, max_tokens=12), range(12)))
    assert {text for _, text, _ in results} == {reference}  # exact, whoever answered and whatever they pulled
    pulled = [route(r) for r, _, _ in results if route(r).get("from") == holder]
    # Nothing from the bad block on was used: a pull stopped before it, unless the holder had meanwhile put a
    # good copy back (a peer reads its disk only; its RAM copy was intact and spilled again once the bad file
    # was quarantined), in which case that file no longer holds the corrupted bytes.
    past = [x for x in pulled if int(x["fetched"]) > 2 * B]
    assert pulled and (not past or (victim.exists() and victim.read_bytes() != bytes(data))), (pulled, past)
    disk = next(n["disk"] for n in fleet.status()["nodes"] if n["node_id"] == holder)
    assert disk["quarantined"]["payload"] == 1  # refused where it was read: on the holder


def test_losing_redis_mid_run_keeps_serving_and_the_index_is_rebuilt(fleet, http):
    status = wait_for_index(fleet, 1)
    assert sum(sum(p.values()) for p in status["fleet"]["index_entries"].values()) > 0
    messages = [{"role": "system", "content": "Remember this through a Redis restart. " * 40},
                {"role": "user", "content": "Still there?"}]
    chat(http, messages)
    pid = json.loads((fleet.data_dir / "supervisor.json").read_text())["redis"]["pid"]
    os.kill(pid, signal.SIGKILL)
    codes = [http.post("/v1/completions", json={"model": MODEL, "prompt": f"during the outage {i}",
                                                "max_tokens": 2}).status_code for i in range(10)]
    assert codes == [200] * 10
    status = wait_for_index(fleet, 10)  # the supervisor restarted Redis empty; every node re-announced
    assert status["redis"]["restarts"] >= 1 and sum(sum(p.values()) for p in status["fleet"]["index_entries"].values()) >= 10
    deadline = time.monotonic() + 20
    while True:
        r, _, usage = chat(http, messages)
        if route(r)["reason"] == "hit" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert route(r)["reason"] == "hit" and usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_status_shows_the_fleet_numbers(fleet, http):
    status = fleet.status()
    f = status["fleet"]
    assert 0 < f["reuse"] < 1 and set(f["reuse_per_node"]) == {n["node_id"] for n in status["nodes"]}
    assert f["routes"].get("hit", 0) > 0 and f["migrated_blocks"] > 0 and f["migrated_bytes"] > 0
    # Reported, not judged: inside a gateway busy with bursts on a 2-core box it includes event-loop waits
    # (25-50 ms at p50 in CI runs); `mlx-fleet bench lookup` measures the lookup itself.
    assert f["lookup_ms_p50"] is not None and 0 < f["lookup_ms_p50"] <= f["lookup_ms_p99"]
    assert all(v["prefill_tps"] > 0 for v in f["cost_model"].values())
    assert any(v["link_bytes_per_s"] for v in f["cost_model"].values())
    text = fleet.cli("status").stdout
    assert "reuse" in text and "migrated" in text and "lookup p50" in text


def test_a_lost_node_stops_receiving_requests_and_leaves_the_index(fleet, http):
    state = fleet.state()
    lost = state.nodes[2]
    lost_id = next(n["node_id"] for n in fleet.status()["nodes"] if n["name"] == lost.node_id)
    kill_sessions([lost.session_id], signal.SIGKILL)  # the Mac is gone
    time.sleep(8)  # its leases expire (6 s)
    served = Counter()
    for i in range(12):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"after the loss {i}", "max_tokens": 2})
        assert r.status_code == 200
        served[r.headers["x-fleet-node"]] += 1
    assert lost_id not in served
    deadline = time.monotonic() + 30  # the survivors collect its entries
    while True:
        entries = fleet.status()["fleet"]["index_entries"]
        if all(lost_id not in per for per in entries.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(lost_id not in per for per in entries.values())
