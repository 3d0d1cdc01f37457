"""The disk tier end to end: a fleet is stopped and started again, and answers from its disk."""

from __future__ import annotations

import time

import openai
import pytest

from tests.local_fleet import LocalFleet

pytestmark = pytest.mark.fleet
MODEL = "tiny-dense"
SYSTEM = {"role": "system", "content": "You are the fleet's careful assistant. " * 30}


def chat(fleet, messages, max_tokens=24):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                          temperature=0)
    reply = raw.parse()
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens


def wait_for_spills(fleet, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = fleet.status()
        spills = [r["cache"].get("spill", {}) for r in status["replicas"]]
        disk = status["nodes"][0]["disk"]
        if spills and all(s.get("queued") == 0 for s in spills) and disk and disk["blocks"] > 0:
            return status
        time.sleep(0.5)
    raise AssertionError("spills did not reach the disk")


def test_restarted_fleet_answers_the_second_turn_from_disk(tmp_path):
    turn1 = [SYSTEM, {"role": "user", "content": "What do you keep on disk?"}]
    with LocalFleet(tmp_path, nodes=1) as fleet:
        reply1, _, _ = chat(fleet, turn1)
        turn2 = turn1 + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "And after a restart?"}]
        before, _, prompt_tokens = chat(fleet, turn2)
        status = wait_for_spills(fleet)
        disk = status["nodes"][0]["disk"]
        assert disk["bytes"] > 0 and disk["budget"] > disk["bytes"] and disk["degraded"] is None
        for field in ("hits", "misses", "evictions", "quarantined", "dropped_spills"):
            assert field in disk
        assert "disk:" in fleet.cli("status").stdout
        blocks_seen = disk["blocks"]  # a snapshot: `down` may still flush a few more
    assert fleet.processes() == []
    on_disk = list((tmp_path / "node-0" / "blocks").rglob("*.blk"))
    assert len(on_disk) >= blocks_seen > 0 and not list((tmp_path / "node-0" / "blocks").rglob("*.tmp"))

    with LocalFleet(tmp_path, nodes=1) as again:
        disk = wait_for_spills(again)["nodes"][0]["disk"]
        assert disk["recovery"]["blocks"] == len(on_disk) and disk["recovery"]["quarantined"] == 0
        after, cached, n = chat(again, turn2)
        assert after == before  # identical greedy text
        assert n == prompt_tokens and 0 < cached < n and cached % 64 == 0
        # Status asks the node store itself, but falls back to the copy it publishes every few seconds
        # when the store is slow to answer (a busy box): wait for the counters rather than race them.
        deadline = time.monotonic() + 30
        while (hits := again.status()["nodes"][0]["disk"]["hits"]) * 64 < cached and time.monotonic() < deadline:
            time.sleep(1)
        assert hits * 64 >= cached
