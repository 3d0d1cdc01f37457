"""A follower rank at a graceful stop: its queued spills reach its node's disk before its process goes."""

import threading

from cluster.actors.shard_rank import ShardRank
from cluster.config import AppConfig, CacheConfig, ModelSpec
from cluster.kvcache.disk_client import DiskClient
from cluster.kvcache.store_link import LocalLink
from cluster.store.disk_tier import DiskStore
from tests.store.blocks import NS, chain


def test_close_waits_for_the_model_thread_then_writes_the_queued_spills(tmp_path):
    spec = ModelSpec(name="tiny-dense", source="tiny-dense", shards=2)
    rank = ShardRank(spec, AppConfig(models=[spec], data_dir=str(tmp_path), cache=CacheConfig(disk=False)), 1)
    store = DiskStore(tmp_path / "disk", budget=1 << 30)
    link = LocalLink(store)
    gate, real_write = threading.Event(), link.write
    link.write = lambda ns, items: (gate.wait(30), real_write(ns, items))[1]  # a disk behind the model thread
    rank.disk = DiskClient(link, NS)
    blocks = chain(4)
    for _, key, data in blocks:
        rank.disk.put(key, data)
    rank.scheduler.stop()  # as the leader's last share does
    threading.Timer(0.3, gate.set).start()
    assert rank.close(timeout_s=10)
    assert set(store.keys(NS)) == {k for _, k, _ in blocks}
    assert rank.disk.backlog_bytes() == 0
