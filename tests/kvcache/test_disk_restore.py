"""Restores through the disk tier: exact, verified, and a bad file is a miss that still answers right."""

import threading

import pytest

from cluster.store.hashing import chain_ids
from tests.kvcache.conftest import prompt_of

B = 32


def flush(h):
    assert h.pc.tiers.disk.flush(30)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-swa", "tiny-hybrid"])
def test_restart_restores_exactly_from_disk(disk_harness, tmp_path, name):
    first = disk_harness(name, node_dir=tmp_path / "n")
    prompt = prompt_of(260)
    first.warm(prompt, max_tokens=20)
    flush(first)
    again = disk_harness(name, node_dir=tmp_path / "n")  # a new process: empty RAM, same disk
    assert again.store.recovery["blocks"] == len(first.store.index)
    warm, cold = again.warm(prompt), again.cold(prompt)
    assert warm.cached >= 192
    again.assert_same(warm, cold)
    assert again.pc.tiers.disk.counters["disk_hits"] > 0 and again.pc.tiers.stats()["ram"]["blocks"] > 0  # promoted


def test_ram_evictions_are_served_from_disk(disk_harness):
    h = disk_harness("tiny-dense", ram_bytes=300_000)  # ~2 blocks of RAM
    prompt = prompt_of(300)
    h.warm(prompt, max_tokens=2)
    flush(h)
    assert h.pc.tiers.ram.evictions > 0
    warm, cold = h.warm(prompt), h.cold(prompt)
    assert warm.cached == h.hit_after(300, 300, 301)  # 288; 256 on the canonical schedule
    h.assert_same(warm, cold)


def test_a_full_spill_queue_drops_the_oldest_and_ram_eviction_spills_it_again(disk_harness):
    h = disk_harness("tiny-dense", queue=1 << 20)  # ~4 blocks of queue
    disk = h.pc.tiers.disk
    gate, real_write = threading.Event(), disk.link.write
    disk.link.write = lambda ns, items: (gate.wait(), real_write(ns, items))[1]  # a stalled disk
    prompt = prompt_of(40 * B)
    h.warm(prompt, max_tokens=1)  # generation does not wait for the disk
    ids = chain_ids(h.pc.namespace, prompt, B)[: h.kept_after(len(prompt), len(prompt)) // B]  # what it kept
    gate.set()
    flush(h)
    dropped = disk.counters["dropped_spills"]
    assert dropped > 0 and disk.counters["spilled"] + dropped == len(ids)
    missing = [k for k in ids if k not in h.store.index]
    first = ids.index(missing[0])  # the blocks after the batch in flight: the oldest pending went first
    assert len(missing) == dropped and first >= 1 and missing == ids[first:first + dropped]
    disk.queue_bytes = 64 << 20  # the disk caught up: room to queue again
    h.pc.tiers.ram.budget = 2  # evict everything from RAM: the missing blocks spill on the way out
    h.pc.tiers.ram.put(b"x" * 32, b"yy")
    flush(h)
    assert all(k in h.store.index for k in ids)


# Where each damage is caught: recovery reads every header at start; only a read checks the payload.
@pytest.mark.parametrize("how,reason,caught_at", [
    ("truncate", "truncated", "recovery"), ("flip", "payload", "read"), ("header", "header", "recovery"),
    ("foreign", "namespace", "recovery"), ("swap", "id", "recovery")])
def test_corrupt_file_is_quarantined_and_the_answer_is_still_right(disk_harness, tmp_path, how, reason, caught_at):
    h = disk_harness("tiny-swa", node_dir=tmp_path / "n")
    prompt = prompt_of(250)
    h.warm(prompt, max_tokens=2)
    flush(h)
    ids = chain_ids(h.pc.namespace, prompt, B)
    path = h.store.path(h.pc.namespace, ids[3])
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[:-10]
    elif how == "flip":
        data[-100] ^= 4
    elif how == "header":
        data[60] ^= 4
    elif how == "foreign":
        other = disk_harness("tiny-dense", node_dir=tmp_path / "other")
        other.warm(prompt, max_tokens=2)
        flush(other)
        data = other.store.path(other.pc.namespace, chain_ids(other.pc.namespace, prompt, B)[3]).read_bytes()
    elif how == "swap":
        data = h.store.path(h.pc.namespace, ids[2]).read_bytes()
    path.write_bytes(bytes(data))
    fresh = disk_harness("tiny-swa", node_dir=tmp_path / "n")  # empty RAM: the restore must read the disk
    assert fresh.store.recovery["quarantined"] == (1 if caught_at == "recovery" else 0)
    warm, cold = fresh.warm(prompt), fresh.cold(prompt)
    assert warm.cached == fresh.resume_point(3 * B)  # the blocks before the bad one
    fresh.assert_same(warm, cold)
    assert fresh.store.stats()["quarantined"][reason] == 1
    assert [p.name for p in (tmp_path / "n" / "quarantine" / reason).iterdir()] == [
        f"{fresh.pc.namespace.hex()[:16]}-{ids[3].hex()}.blk"]
    flush(fresh)  # the recomputed block replaced the bad one
    assert fresh.store.index.get(ids[3]) is not None and fresh.store.read_many(fresh.pc.namespace, [ids[3]])[0] is not None


def test_tier_events_carry_the_block_identity(disk_harness):
    events = []
    h = disk_harness("tiny-dense", ram_bytes=300_000, events=events)
    prompt = prompt_of(160)
    h.warm(prompt, max_tokens=1)
    flush(h)
    ids = chain_ids(h.pc.namespace, prompt, B)
    k = h.kept_after(160, 160) // B  # 5 blocks; 4 on the canonical schedule
    stored_disk = [e for e in events if e.event == "stored" and e.tier == "disk"]
    stored_ram = [e for e in events if e.event == "stored" and e.tier == "ram"]
    assert [e.key for e in stored_ram][:k] == ids[:k] and {e.key for e in stored_disk} >= set(ids[:k])
    first = next(e for e in stored_ram if e.key == ids[1])
    assert (first.namespace, first.parent, first.tokens) == (h.pc.namespace, ids[0], B) and first.nbytes > 0
    assert any(e.event == "evicted" and e.tier == "ram" for e in events)
