import json
import os
import threading

import pytest

from cluster.store.disk_tier import DiskStore
from cluster.store.events import BlockEvent
from tests.store.blocks import B, NS, chain, checkpoint


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        self.t += 1.0
        return self.t


def store(tmp_path, budget=1 << 30, **kw):
    events = []
    s = DiskStore(tmp_path / "node", budget=budget, listener=events.append, clock=kw.pop("clock", Clock()), **kw)
    return s, events


def test_publish_layout_and_read_back(tmp_path):
    s, events = store(tmp_path)
    blocks = chain(3)
    assert s.write_many(blocks) == {"written": 3, "deduped": 0, "dropped": 0}
    for ns, key, data in blocks:
        path = s.path(ns, key)
        assert path == tmp_path / "node" / "blocks" / ns.hex() / key.hex()[:2] / f"{key.hex()}.blk"
        assert path.read_bytes() == data
    assert [bytes(d) for d in s.read_many(NS, [k for _, k, _ in blocks])] == [d for _, _, d in blocks]
    assert [(e.event, e.tier, e.key, e.tokens) for e in events] == [("stored", "disk", k, B) for _, k, _ in blocks]
    assert events[1].parent == blocks[0][1] and events[0].parent == NS and events[0].nbytes == len(blocks[0][2])
    assert not list((tmp_path / "node" / "blocks").rglob("*.tmp"))


def test_writing_the_same_block_twice_costs_nothing(tmp_path):
    s, events = store(tmp_path)
    blocks = chain(2)
    s.write_many(blocks)
    mtime = s.path(*blocks[0][:2]).stat().st_mtime_ns
    assert s.write_many(blocks) == {"written": 0, "deduped": 2, "dropped": 0}
    assert s.path(*blocks[0][:2]).stat().st_mtime_ns == mtime and len(events) == 2


def test_budget_never_exceeded_and_lru_by_access(tmp_path):
    blocks = chain(10)
    size = len(blocks[0][2])
    s, events = store(tmp_path, budget=4 * size)
    s.write_many(blocks[:4])
    s.read_many(NS, [blocks[0][1]])  # a read is a use: block 0 is now the most recent
    s.write_many(blocks[4:6])
    kept = [k for _, k, _ in blocks if k in s.index]
    assert kept == [blocks[0][1], blocks[3][1], blocks[4][1], blocks[5][1]]
    assert [e.key for e in events if e.event == "evicted"] == [blocks[1][1], blocks[2][1]]
    assert s.index.bytes <= s.budget and not s.path(*blocks[1][:2]).exists()
    assert s.stats()["evictions"] == 2


def test_pins_hold_blocks_under_a_reader_and_budget_is_exceeded_by_at_most_one(tmp_path):
    blocks = chain(6)
    size = len(blocks[0][2])
    s, _ = store(tmp_path, budget=2 * size)
    s.write_many(blocks[:2])
    keys = [k for _, k, _ in blocks[:2]]
    located = s.open_read(NS, keys)  # a restore pins them
    assert all(located)
    s.write_many(blocks[2:3])  # nothing evictable: allowed to overshoot by this one block
    s.write_many(blocks[3:4])  # block 2 is evictable: it makes room for block 3
    assert [k for _, k, _ in blocks if k in s.index] == keys + [blocks[3][1]]
    assert all(os.path.exists(p) for p, _ in located) and s.index.bytes == s.budget + size
    s.open_read(NS, [blocks[3][1]])  # now everything is pinned and the tier is one block over
    assert s.write_many(blocks[4:5]) == {"written": 0, "deduped": 0, "dropped": 1}
    assert s.index.bytes <= s.budget + size
    s.close_read(NS, keys, keys, [])
    s.write_many(blocks[5:6])  # unpinned again: evicts back under budget
    assert s.index.bytes <= s.budget + size and blocks[5][1] in s.index


def test_concurrent_readers_never_lose_a_block(tmp_path):
    blocks = chain(8, payload=1024)
    size = len(blocks[0][2])
    s, _ = store(tmp_path, budget=4 * size, clock=__import__("time").time)
    s.write_many(blocks[:4])
    hot = [k for _, k, _ in blocks[:2]]
    failures = []

    def reader():
        for _ in range(200):
            got = s.read_many(NS, hot)
            if any(g is None for g in got):
                failures.append(got)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(200):  # the writer keeps forcing evictions meanwhile
        s.write_many(chain(1, salt=100 + i, payload=1024))
    for t in threads:
        t.join()
    assert not failures


def corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) - 100]
    elif how == "flip":
        data[-50] ^= 0x01
    elif how == "header":
        data[40] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how,reason", [("truncate", "truncated"), ("flip", "payload"), ("header", "header")])
def test_bad_blocks_are_quarantined_with_their_reason(tmp_path, how, reason):
    s, events = store(tmp_path)
    blocks = chain(2)
    s.write_many(blocks)
    corrupt(s.path(*blocks[1][:2]), how)
    got = s.read_many(NS, [k for _, k, _ in blocks])
    assert got[0] is not None and got[1] is None
    assert blocks[1][1] not in s.index and not s.path(*blocks[1][:2]).exists()
    q = list((tmp_path / "node" / "quarantine" / reason).iterdir())
    assert len(q) == 1 and q[0].name.endswith(blocks[1][1].hex() + ".blk")
    log = [json.loads(line) for line in (tmp_path / "node" / "quarantine" / "log.jsonl").read_text().splitlines()]
    assert log[0]["reason"] == reason and log[0]["key"] == blocks[1][1].hex()
    assert s.stats()["quarantined"][reason] == 1 and events[-1].event == "evicted"


def test_foreign_namespace_and_wrong_id_are_quarantined(tmp_path):
    s, _ = store(tmp_path)
    ours, theirs = chain(2), chain(2, ns=b"x" * 32)
    s.write_many(ours)
    s.path(*ours[0][:2]).write_bytes(theirs[0][2])  # another model's block under our name
    s.path(*ours[1][:2]).write_bytes(ours[0][2])  # our block 0 under block 1's name
    assert s.read_many(NS, [k for _, k, _ in ours]) == [None, None]
    assert s.stats()["quarantined"]["namespace"] == 1 and s.stats()["quarantined"]["id"] == 1


def test_refuses_to_store_a_block_that_does_not_verify(tmp_path):
    s, _ = store(tmp_path)
    ns, key, data = chain(1)[0]
    assert s.write_many([(ns, key, data[:-1])])["dropped"] == 1
    assert s.write_many([(ns, chain(1, salt=9)[0][1], data)])["dropped"] == 1  # right bytes, wrong name
    assert len(s.index) == 0


def test_recovery_rebuilds_the_index_and_cleans_up(tmp_path):
    s, _ = store(tmp_path)
    blocks = chain(5)
    cp = checkpoint(blocks, 2)
    s.write_many(blocks + [cp])
    shard = s.path(*blocks[0][:2]).parent
    (shard / f".{blocks[0][1].hex()}.123.0.tmp").write_bytes(b"partial")
    corrupt(s.path(*blocks[3][:2]), "header")
    corrupt(s.path(*blocks[4][:2]), "truncate")
    again = DiskStore(tmp_path / "node", budget=1 << 30)
    r = again.recovery
    assert (r["blocks"], r["quarantined"], r["temp_removed"]) == (4, 2, 1)
    assert set(again.index.entries) == {blocks[0][1], blocks[1][1], blocks[2][1], cp[1]}
    assert again.stats()["quarantined"]["header"] == 1 and again.stats()["quarantined"]["truncated"] == 1
    assert again.read_many(NS, [blocks[2][1], cp[1]])[1] is not None
    assert again.index.get(cp[1]).kind == "state" and again.index.get(blocks[1][1]).parent == blocks[0][1]


def test_recovery_keeps_lru_order_across_restarts(tmp_path):
    s, _ = store(tmp_path, clock=__import__("time").time)
    blocks = chain(3)
    s.write_many(blocks)
    os.utime(s.path(*blocks[0][:2]), (2e9, 2e9))
    os.utime(s.path(*blocks[1][:2]), (1e9, 1e9))
    os.utime(s.path(*blocks[2][:2]), (1.5e9, 1.5e9))
    again = DiskStore(tmp_path / "node", budget=1 << 30)
    assert [e.key for e in again.index.evict(budget=0)] == [blocks[1][1], blocks[2][1], blocks[0][1]]


def test_event_fields():
    e = BlockEvent("stored", "disk", NS, b"k" * 32, NS, 16, 100)
    assert (e.event, e.tier, e.nbytes) == ("stored", "disk", 100)
