"""Two nodes' caches, one real Redis: what the index says matches what each node can restore, it follows the
tiers' events, survives an empty Redis, and a node pulls a peer's blocks instead of recomputing them."""

import time

import pytest
import redis

from cluster.actors.fleet_view import ReplicaInfo
from cluster.actors.plan import FetchPlan
from cluster.actors.routing import restorable
from cluster.kvcache.admission import Admission
from cluster.kvcache.index_publisher import IndexPublisher
from cluster.kvcache.peers import PeerClient
from cluster.kvcache.session import BlockSession
from cluster.store.fleet_index import FleetIndex
from cluster.store.hashing import chain_ids
from tests.kvcache.conftest import prompt_of

B = 32


class Node:
    """A harness (real model, RAM and disk tiers) that publishes into the fleet index like a replica."""

    def __init__(self, harness, node_id, url, **publisher):
        self.h = harness
        self.id = node_id
        self.index = FleetIndex(redis.Redis.from_url(url))
        tiers = harness.pc.tiers
        self.pub = IndexPublisher(self.index, harness.pc.namespace, node_id, tiers, lambda: {"active": 0},
                                  **{"ttl_s": 3.0, "flush_s": 0.05, "gc_s": 0.5, **publisher})
        tiers.listener = self.pub.on_event
        tiers.disk.on_events = self.pub.on_events
        tiers.disk.on_resync = self.pub.on_disk_resync

    def settle(self):
        assert self.h.pc.tiers.disk.flush(30)
        self.h.pc.tiers.disk.sync_events()
        assert self.pub.flush(10)

    def info(self) -> ReplicaInfo:
        pc = self.h.pc
        return ReplicaInfo("m", self.id, self.id, "", True, pc.namespace, B, pc.layout.has_recurrent,
                           pc.planner.boundary_only, pc.schedule.resume_every)

    def holding(self, prompt):
        ids = chain_ids(self.h.pc.namespace, prompt, B)[: -(-(len(prompt) - 1) // B)]
        max_ck = (len(prompt) - 1) // B if self.h.pc.layout.has_recurrent else 0
        return {x.node_id: x for x in self.index.lookup(self.h.pc.namespace, ids, max_ck)}


@pytest.fixture
def node(disk_harness, redis_url, tmp_path):
    made = []

    def make(name, node_id="A", publisher=None, **kw):
        n = Node(disk_harness(name, node_dir=tmp_path / node_id, block_tokens=B, **kw), node_id, redis_url,
                 **(publisher or {}))
        made.append(n)
        return n

    yield make
    for n in made:
        n.pub.close()
        n.h.pc.tiers.disk.close()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-swa", "tiny-hybrid", "tiny-gemma4", "tiny-next"])
def test_the_index_predicts_exactly_what_the_node_restores(node, name):
    a = node(name)
    prompt = prompt_of(300)
    a.h.warm(prompt, max_tokens=2)
    a.settle()
    for probe in (prompt, prompt[:200], prompt[:97], prompt_of(300, salt=5)):
        h = a.holding(probe).get("A")
        predicted = restorable(a.info(), len(probe), h.hit, h.ck) if h else 0
        # What the node restores from blocks; a prompt's tail (RAM only, never announced) adds the rest of
        # the very same prompt on top (tails.py).
        got = Admission(a.h.pc).fetch(list(probe))
        assert predicted == (got.tail.start if got.tail else got.n), (name, len(probe))
    h = a.holding(prompt)["A"]
    kept = min(len(prompt) + 1, a.h.pc.kept_tokens(len(prompt)))  # prompt and reply, or complete chunks
    assert h.hit == h.ram == h.disk == kept // B  # every kept block in both tiers
    if a.h.pc.layout.has_recurrent:
        assert 0 < h.ck <= h.hit and h.ck_disk == h.ck  # hybrids resume only at a checkpoint


def test_blocks_are_announced_as_they_are_stored_not_at_the_next_tick(node):
    """A prompt repeated right after its first run is routed to its blocks: the publisher flushes as events
    come (its tick, 30 s here, is for the lease), so the index has them without waiting for it."""
    a = node("tiny-dense", publisher={"flush_s": 30.0, "ttl_s": 90.0})
    assert a.pub.flush(10)  # the first full announce, at once
    prompt = prompt_of(130)
    a.h.warm(prompt, max_tokens=1)
    deadline = time.monotonic() + 10
    while (a.holding(prompt).get("A") is None or a.holding(prompt)["A"].ram < 4) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.holding(prompt)["A"].ram == 4 and a.pub.counters["flushes"] >= 1


def test_evictions_leave_the_index_and_a_wiped_redis_is_refilled_within_seconds(node):
    a = node("tiny-dense", ram_bytes=600_000)  # about 4 blocks of RAM
    prompt = prompt_of(320)
    a.h.warm(prompt, max_tokens=1)
    a.settle()
    h = a.holding(prompt)["A"]
    assert h.disk == 10 and h.ram == 0 and h.hit == 10  # the first blocks left RAM; all are on disk
    a.index.client.flushall()  # Redis restarted empty
    deadline = time.monotonic() + 10
    while "A" not in a.holding(prompt) and time.monotonic() < deadline:
        time.sleep(0.01)
    # Live again only with its blocks: the renewal that finds the lease gone does not write it back.
    assert a.holding(prompt)["A"].hit == 10 and a.pub.counters["announces"] >= 2


def test_a_dead_node_drops_out_at_once_and_is_collected(node, redis_url):
    a, b = node("tiny-dense", "A"), node("tiny-dense", "B")
    prompt = prompt_of(100)
    a.h.warm(prompt, max_tokens=1)
    b.h.warm(prompt, max_tokens=1)
    a.settle()
    b.settle()
    assert set(a.holding(prompt)) == {"A", "B"}
    b.pub.close()  # withdraws its lease
    assert set(a.holding(prompt)) == {"A"}
    deadline = time.monotonic() + 10
    while "B" in a.index.nodes(a.h.pc.namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert a.index.nodes(a.h.pc.namespace) == ["A"]
    assert not a.index.client.keys(b"*kv:B:*")


def pull(b, prompt, peer_node, holding, store=None, chunk_bytes=64 << 20, timeout_s=10.0) -> tuple:
    plan = FetchPlan(peer_node.id, 0, holding.disk, b.h.pc.layout.has_recurrent, 0,
                     holding.disk * int(b.h.pc.shapes.kv_bytes_per_token * B))
    stores = {} if store is False else {peer_node.id: store or peer_node.h.store}
    peers = PeerClient(b.h.pc.namespace, chunk_bytes=chunk_bytes, local_stores=stores)
    prefetch = Admission(b.h.pc, peers=peers, fetch_timeout_s=timeout_s).fetch(list(prompt), plan)
    return prefetch, peers


class SlowStore:
    """A peer's store that takes `delay_s` per read call (a congested link, a busy Mac)."""

    def __init__(self, store, delay_s: float):
        self.store, self.delay_s = store, delay_s

    def read_many(self, ns, keys):
        time.sleep(self.delay_s)
        return self.store.read_many(ns, keys)


def test_a_dead_peer_means_recompute_and_the_answer_is_exact(node):
    a, b = node("tiny-dense", "A"), node("tiny-dense", "B")
    prompt = prompt_of(260)
    a.h.warm(prompt, max_tokens=2)
    a.settle()
    prefetch, peers = pull(b, prompt, a, a.holding(prompt)["A"], store=False)  # A is gone
    assert (prefetch.n, prefetch.fetched, peers.counters["failures"]) == (0, 0, 1)
    b.h.assert_same(b.h.run_with(prompt, BlockSession(b.h.pc, list(prompt), prefetch)), b.h.cold(prompt))


def test_a_slow_peer_is_cut_off_at_the_deadline_and_what_arrived_is_used(node):
    a, b = node("tiny-dense", "A"), node("tiny-dense", "B")
    prompt = prompt_of(260)
    a.h.warm(prompt, max_tokens=2)
    a.settle()
    held = a.holding(prompt)["A"]
    assert held.disk == 8
    one_block = int(b.h.pc.shapes.kv_bytes_per_token * B)  # one block per call, 0.4 s each, 1 s to do it all
    prefetch, peers = pull(b, prompt, a, held, store=SlowStore(a.h.store, 0.4), chunk_bytes=one_block, timeout_s=1.0)
    assert 0 < prefetch.fetched < 8 * B and prefetch.n == prefetch.fetched  # the leading blocks that arrived
    assert peers.counters["failures"] == 1
    warm = b.h.run_with(prompt, BlockSession(b.h.pc, list(prompt), prefetch))
    b.h.assert_same(warm, b.h.cold(prompt))


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_a_node_pulls_a_peers_prefix_and_answers_exactly(node, name):
    a, b = node(name, "A"), node(name, "B")
    prompt = prompt_of(260)
    a.h.warm(prompt, max_tokens=2)
    a.settle()
    prefetch, peers = pull(b, prompt, a, a.holding(prompt)["A"])
    assert prefetch.n > 0 and prefetch.fetched == prefetch.n and prefetch.fetched_from == "A"
    assert peers.counters["blocks"] > 0 and peers.link_bps["A"] > 0
    warm = b.h.run_with(prompt, BlockSession(b.h.pc, list(prompt), prefetch))
    b.h.assert_same(warm, b.h.cold(prompt))
    b.settle()  # B keeps the pulled blocks and announces them
    assert b.holding(prompt)["B"].hit >= prefetch.n // B


def test_a_corrupt_block_on_the_peer_is_caught_and_the_answer_is_still_exact(node):
    a, b = node("tiny-dense", "A"), node("tiny-dense", "B")
    prompt = prompt_of(260)
    a.h.warm(prompt, max_tokens=2)
    a.settle()
    ids = chain_ids(a.h.pc.namespace, prompt, B)
    path = a.h.store.path(a.h.pc.namespace, ids[4])
    data = bytearray(path.read_bytes())
    data[-100] ^= 8
    path.write_bytes(bytes(data))
    prefetch, _ = pull(b, prompt, a, a.holding(prompt)["A"])
    assert prefetch.n == 4 * B and prefetch.fetched == 4 * B  # the blocks before the bad one
    assert a.h.store.stats()["quarantined"]["payload"] == 1  # the peer refused to send it
    warm = b.h.run_with(prompt, BlockSession(b.h.pc, list(prompt), prefetch))
    b.h.assert_same(warm, b.h.cold(prompt))


def test_only_the_peers_blocks_count_as_fetched_when_the_rest_is_local(node):
    """B holds the prompt's blocks from 2 on (a request of its own stored them while this one was admitted),
    A's block 2 is corrupt: the pull brings blocks 0 and 1, B's own follow, and only the pulled 2 blocks are
    the peer's."""
    a, b = node("tiny-dense", "A"), node("tiny-dense", "B")
    prompt = prompt_of(260)
    a.h.warm(prompt, max_tokens=2)
    a.settle()
    b.h.warm(prompt, max_tokens=2)
    assert b.h.pc.tiers.disk.flush(30)
    ids = chain_ids(b.h.pc.namespace, prompt, B)
    for key in ids[:2]:
        b.h.pc.tiers.discard(key, "test")
    path = a.h.store.path(a.h.pc.namespace, ids[2])
    data = bytearray(path.read_bytes())
    data[-100] ^= 8
    path.write_bytes(bytes(data))
    prefetch, _ = pull(b, prompt, a, a.holding(prompt)["A"])
    assert prefetch.n >= 8 * B and (prefetch.fetched, prefetch.fetched_from) == (2 * B, "A")
    warm = b.h.run_with(prompt, BlockSession(b.h.pc, list(prompt), prefetch))
    b.h.assert_same(warm, b.h.cold(prompt))


def test_a_restarted_node_announces_what_its_disk_holds(node, disk_harness, redis_url, tmp_path):
    a = node("tiny-dense", "A")
    prompt = prompt_of(200)
    a.h.warm(prompt, max_tokens=1)
    a.settle()
    a.pub.close()  # the node goes away: its entries stop counting
    assert "A" not in a.holding(prompt)
    again = Node(disk_harness("tiny-dense", node_dir=tmp_path / "A", block_tokens=B), "A", redis_url)  # empty RAM
    try:
        assert again.pub.flush(10)
        h = again.holding(prompt)["A"]
        assert (h.hit, h.disk, h.ram) == (6, 6, 0) and again.pub.generation == 2
    finally:
        again.pub.close()
        again.h.pc.tiers.disk.close()
