"""The fleet index on a real Redis: one round trip per lookup, per-node holdings, leases, garbage collection."""

import asyncio

import pytest
import redis

from cluster.store.fleet_index import FleetIndex, member, set_key
from cluster.store.hashing import chain_ids

NS = bytes(range(32))
B = 16


def ids(n: int, salt: int = 0) -> list[bytes]:
    return chain_ids(NS, [(salt * 7919 + i) % 50000 for i in range(n * B)], B)


@pytest.fixture
def index(redis_url):
    return FleetIndex(redis.Redis.from_url(redis_url))


def announce(index, node, ram=(), disk=(), ck_ram=(), ck_disk=(), lease=None):
    index.replace(NS, node, "ram", ram, ck_ram)
    index.replace(NS, node, "disk", disk, ck_disk)
    index.renew(NS, node, lease or {"name": node}, 60_000)


def test_each_live_node_reports_its_longest_leading_run_per_tier(index):
    chain = ids(10)
    announce(index, "a", ram=chain[:6], disk=chain[:3])
    announce(index, "b", disk=chain[:8] + [chain[9]])  # a gap at 8: 9 does not count
    announce(index, "c", ram=chain[1:5])  # does not hold block 0: nothing counts
    got = {h.node_id: (h.hit, h.ram, h.disk) for h in index.lookup(NS, chain)}
    assert got == {"a": (6, 6, 3), "b": (8, 0, 8), "c": (0, 0, 0)}


def test_ram_and_disk_together_make_the_run(index):
    chain = ids(6)
    announce(index, "a", ram=chain[:2] + chain[4:], disk=chain[2:4])
    (h,) = index.lookup(NS, chain)
    assert (h.hit, h.ram, h.disk) == (6, 2, 0)


def test_checkpoints_are_positions_at_or_below_the_hit(index):
    chain = ids(8)
    announce(index, "a", ram=chain[:7], ck_ram=[chain[2], chain[5], chain[7]], disk=chain[:4], ck_disk=[chain[1]])
    (h,) = index.lookup(NS, chain, max_ck=8)
    assert (h.hit, h.ck, h.disk, h.ck_disk) == (7, 6, 4, 2)  # chain[7]'s checkpoint is past the hit
    (capped,) = index.lookup(NS, chain, max_ck=4)  # a checkpoint must leave a token to prefill
    assert capped.ck == 3
    (dense,) = index.lookup(NS, chain, max_ck=0)
    assert dense.ck == 0


def test_only_live_nodes_count_and_dead_ones_are_collected(index):
    chain = ids(4)
    announce(index, "a", ram=chain)
    announce(index, "b", ram=chain)
    index.client.delete("mlxf:{" + NS[:16].hex() + "}:live:b")  # b's lease expired
    assert [h.node_id for h in index.lookup(NS, chain)] == ["a"]
    assert index.collect(NS) == ["b"]
    assert index.nodes(NS) == ["a"] and not index.client.exists(set_key(NS, "kv", "b", "ram"))
    assert index.client.scard(set_key(NS, "kv", "a", "ram")) == 4


def test_leases_carry_stats_and_tell_when_redis_lost_them(index):
    assert index.renew(NS, "a", {"prefill_tps": 1234.5}, 60_000) is False  # first time: announce everything
    assert index.renew(NS, "a", {"prefill_tps": 1500.0}, 60_000) is True
    (h,) = index.lookup(NS, ids(1))
    assert h.lease == {"prefill_tps": 1500.0}
    index.client.flushall()  # Redis restarted empty
    assert index.renew(NS, "a", {}, 60_000, existing_only=True) is False
    assert index.lookup(NS, ids(1)) == []  # not live again before its blocks are announced
    assert index.renew(NS, "a", {}, 60_000) is False and [h.node_id for h in index.lookup(NS, ids(1))] == ["a"]
    assert index.next_generation(NS, "a") == 1 and index.next_generation(NS, "a") == 2


def test_apply_adds_and_removes_and_replace_is_exact(index):
    chain = ids(5)
    announce(index, "a", ram=chain[:3])
    index.apply(NS, "a", {("kv", "ram"): ({chain[3], chain[4]}, {chain[0]}), ("ck", "disk"): ({chain[1]}, set())})
    assert index.client.smembers(set_key(NS, "kv", "a", "ram")) == {member(i) for i in chain[1:]}
    index.replace(NS, "a", "ram", chain[:1], [])
    assert index.client.smembers(set_key(NS, "kv", "a", "ram")) == {member(chain[0])}
    assert index.client.smembers(set_key(NS, "ck", "a", "disk")) == {member(chain[1])}


@pytest.mark.parametrize("blocks", [16, 128, 512])  # 1k to 32k tokens at B=64
def test_a_lookup_is_one_round_trip_whatever_the_prompt_length(index, blocks, monkeypatch):
    chain = ids(blocks, salt=blocks)
    for node in ("a", "b", "c"):
        announce(index, node, ram=chain[: blocks // 2], disk=chain)
    index.lookup(NS, chain)  # loads the script
    before = index.client.info("commandstats")["cmdstat_evalsha"]["calls"]
    sent = []
    real = index.client.execute_command
    monkeypatch.setattr(index.client, "execute_command", lambda *a, **k: sent.append(a[0]) or real(*a, **k))
    assert [h.hit for h in index.lookup(NS, chain)] == [blocks] * 3
    assert sent == ["EVALSHA"]  # one command from the client: one round trip
    monkeypatch.setattr(index.client, "execute_command", real)
    assert index.client.info("commandstats")["cmdstat_evalsha"]["calls"] == before + 1


def test_the_asyncio_client_gets_the_same_answer(redis_url):
    import redis.asyncio as aioredis

    chain = ids(6)
    sync = FleetIndex(redis.Redis.from_url(redis_url))
    announce(sync, "a", ram=chain[:4])

    async def go():
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await FleetIndex(client).alookup(NS, chain)
        finally:
            await client.aclose()

    assert asyncio.run(go()) == sync.lookup(NS, chain)


def test_a_prompt_of_tens_of_thousands_of_blocks_is_looked_up_whole(index):
    """Lua's unpack() takes about 8000 values: a 20k-block prompt (320k tokens at B=16, a hybrid's
    checkpoints at every block) must still be one answer, not an error the router falls back from."""
    chain = ids(20_000)
    announce(index, "a", ram=chain[:15_000], disk=chain[:12_000], ck_ram=[chain[14_999]],
             ck_disk=[chain[9_999]])
    (h,) = index.lookup(NS, chain, max_ck=20_000)
    assert (h.hit, h.ram, h.disk, h.ck, h.ck_disk) == (15_000, 15_000, 12_000, 15_000, 10_000)
