"""The replica's view of its node's disk stays true over months: evictions reach it, gaps are
resynced, RAM hits keep the disk copies hot, and a failing store is skipped by the breaker."""

import pytest

from cluster.kvcache.breaker import Breaker
from cluster.kvcache.disk_client import DiskClient
from cluster.kvcache.store_link import LocalLink
from cluster.store.disk_tier import DiskStore
from cluster.store.hashing import chain_ids
from tests.kvcache.conftest import prompt_of
from tests.store.blocks import NS, chain

B = 32


def client_for(store) -> DiskClient:
    return DiskClient(LocalLink(store), NS)


def test_disk_evictions_reach_the_replica_and_the_block_is_spilled_again(tmp_path):
    blocks = chain(6)
    store = DiskStore(tmp_path / "node", budget=3 * len(blocks[0][2]))
    client = client_for(store)
    for _, key, data in blocks[:3]:
        client.put(key, data)
    assert client.flush(10)
    assert client.on_disk == {k for _, k, _ in blocks[:3]}
    store.write_many(blocks[3:5])  # another replica's spills push out the two oldest
    client.sync_events()
    assert client.on_disk == {k for _, k, _ in blocks[2:5]} == set(store.keys(NS))
    client.put(blocks[0][1], blocks[0][2])  # RAM evicts it later: it goes back to the disk
    assert client.flush(10) and blocks[0][1] in store.index
    assert client.stats()["events_applied"] >= 5
    client.close()


def test_a_gap_in_the_events_is_resynced_from_the_store(tmp_path):
    store = DiskStore(tmp_path / "node", budget=1 << 30, events_kept=3)
    client = client_for(store)
    client.sync_events()
    resyncs = client.stats()["resyncs"]
    store.write_many(chain(10))  # 10 events, 3 kept: the client missed some
    client.sync_events()
    assert client.stats()["resyncs"] == resyncs + 1
    assert client.on_disk == set(store.keys(NS))
    store.write_many(chain(2, salt=5))  # back in step: plain events again
    client.sync_events()
    assert client.stats()["resyncs"] == resyncs + 1 and client.on_disk == set(store.keys(NS))
    client.close()


def test_a_hot_prefix_served_only_from_ram_survives_a_disk_squeeze_and_a_restart(disk_harness, tmp_path):
    node = tmp_path / "n"
    probe = disk_harness("tiny-dense", node_dir=tmp_path / "probe")
    probe.warm(prompt_of(96, salt=99), max_tokens=1)
    assert probe.pc.tiers.disk.flush(30)
    block_bytes = max(e.size for e in probe.store.index.entries.values())
    h = disk_harness("tiny-dense", node_dir=node, budget=8 * block_bytes)
    hot = prompt_of(96)
    h.warm(hot, max_tokens=1)
    for i in range(6):  # 18 new blocks through an 8-block disk, while the hot prefix is used from RAM
        assert h.warm(hot, max_tokens=1).cached == h.hit_after(96, 96, 96)  # 95; 64 on the canonical schedule
        h.warm(prompt_of(96, salt=i + 1), max_tokens=1)
        assert h.pc.tiers.disk.flush(30)
    assert h.store.stats()["evictions"] > 0 and h.pc.tiers.disk.stats()["touches_sent"] > 0
    hot_ids = chain_ids(h.pc.namespace, hot, B)[: h.kept_after(96, 97) // B]  # what the schedule kept
    assert hot_ids and all(k in h.store.index for k in hot_ids)
    again = disk_harness("tiny-dense", node_dir=node, budget=8 * block_bytes)  # restart: empty RAM
    warm = again.warm(hot)
    assert warm.cached == h.hit_after(96, 96, 97, tail=False) and again.pc.tiers.disk.stats()["disk_hits"] == len(hot_ids)
    again.assert_same(warm, again.cold(hot))


class FailingLink(LocalLink):
    def __init__(self, store):
        super().__init__(store)
        self.calls = 0

    def present(self, ns, keys, timeout_s=None):
        self.calls += 1
        raise TimeoutError("the node store did not answer")


def test_the_breaker_stops_asking_a_failing_store_then_tries_again(tmp_path):
    now = [0.0]
    link = FailingLink(DiskStore(tmp_path / "node", budget=1 << 20))
    client = DiskClient(link, NS, breaker=Breaker(failures=3, cooldown_s=10, clock=lambda: now[0]))
    for _ in range(5):
        assert client.present([b"k" * 32]) == [False]
    assert link.calls == 3 and client.stats()["refused_by_breaker"] == 2 and client.breaker.state == "open"
    now[0] = 11.0  # cool-down over: one trial call
    assert client.present([b"k" * 32]) == [False] and link.calls == 4 and client.breaker.state == "open"
    assert client.breaker.opened == 2
    client.close()


@pytest.mark.parametrize("outcomes,state", [
    (["fail", "fail"], "closed"), (["fail"] * 3, "open"), (["fail", "fail", "ok", "fail", "fail"], "closed")])
def test_breaker_states(outcomes, state):
    b = Breaker(failures=3, cooldown_s=10, clock=lambda: 0.0)
    for o in outcomes:
        b.success() if o == "ok" else b.failure()
    assert b.state == state and b.allow() == (state == "closed")


def test_the_client_knows_how_many_bytes_its_namespace_holds_on_disk(tmp_path):
    blocks = chain(4)
    store = DiskStore(tmp_path / "node", budget=3 * len(blocks[0][2]))
    client = client_for(store)
    client.sync_events()  # the first sync is a resync: sizes from the store's listing
    store.write_many(blocks)  # the fourth evicts the first
    client.sync_events()
    assert client.disk_bytes == store.index.bytes == 3 * len(blocks[0][2])
    client.close()


def test_the_byte_count_is_right_for_a_client_that_joins_a_full_disk_and_after_every_gap(tmp_path):
    """A resync's key list already holds the events read with it: counting them again doubled the bytes."""
    blocks = chain(6)
    store = DiskStore(tmp_path / "node", budget=4 * len(blocks[0][2]), events_kept=3)
    store.write_many(blocks[:3])
    client = client_for(store)  # a replica (re)starting next to a running node store
    client.sync_events()
    assert client.disk_bytes == store.index.bytes == 3 * len(blocks[0][2])
    store.write_many(blocks[3:])  # 3 stored and 2 evicted: more events than kept, a gap
    client.sync_events()
    assert client.stats()["resyncs"] == 2
    assert client.disk_bytes == store.index.bytes == 4 * len(blocks[0][2])
    assert client.on_disk == set(store.keys(NS))
    client.close()


def test_a_transient_read_error_leaves_the_block_known_on_disk(tmp_path, monkeypatch):
    """EMFILE and the like are a miss for this read only: the block stays known, so RAM hits keep it hot."""
    import errno

    blocks = chain(2)
    store = DiskStore(tmp_path / "node", budget=1 << 30)
    store.write_many(blocks)
    client = client_for(store)
    client.sync_events()

    def too_many_files(path, size, alloc=None):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("cluster.store.block_files.read_file", too_many_files)
    assert client.get_many([k for _, k, _ in blocks]) == [None, None]
    assert client.on_disk == {k for _, k, _ in blocks} and client.stats()["read_errors"] == 2
    client.touch([blocks[0][1]])
    assert client._touches == {blocks[0][1]}
    client.close()


def test_each_written_batch_reports_its_bytes_and_time(tmp_path):
    blocks = chain(3)
    client = client_for(DiskStore(tmp_path / "node", budget=1 << 30))
    written = []
    client.on_written = lambda nbytes, seconds: written.append((nbytes, seconds))
    for _, key, data in blocks:
        client.put(key, data)
    assert client.flush(10)
    assert sum(n for n, _ in written) == sum(len(d) for *_, d in blocks) and all(s > 0 for _, s in written)
    client.close()
