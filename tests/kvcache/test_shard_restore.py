"""A sharded replica's follower restores from its own read, made off its model thread, and never waits on its disk.

The ranks' agreement runs here over a one-process group (every `all_min` returns this rank's own offer), so
what is checked is one rank's side: what it offers, where its reads run, and that what it restores is exact.
The two-process agreement itself is tests/engine/test_lockstep.py's.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from cluster.actors.plan import FetchPlan
from cluster.engine import model_thread
from cluster.kvcache import shard_restore
from cluster.kvcache.admission import Admission
from cluster.kvcache.peers import PeerClient
from cluster.kvcache.session import BlockSession
from cluster.kvcache.shard_restore import ShardRestore
from cluster.store.hashing import chain_ids
from tests.kvcache.conftest import forget_ram, prompt_of


@pytest.fixture
def disk_only(disk_harness):
    """A tiny-dense cache whose blocks of a 200-token prompt are on its disk only, and the threads that ask its
    disk anything (presence or reads)."""
    h = disk_harness("tiny-dense")
    prompt = prompt_of(200)
    h.warm(prompt, max_tokens=2)
    forget_ram(h)
    asked: list[str] = []
    link = h.pc.tiers.disk.link
    def asking(real):
        def call(*a, **k):
            asked.append(threading.current_thread().name)
            return real(*a, **k)
        return call
    for name in ("present", "open_read"):
        setattr(link, name, asking(getattr(link, name)))
    return h, prompt, asked


def settle_on_a_model_thread(restore: ShardRestore, prompt: list[int]):
    """`settle` as a follower's session calls it: on its model thread, with no prefetch of its own."""
    out = {}

    def run():
        model_thread.claim()
        try:
            out["prefetch"] = restore.settle(prompt, None)
        finally:
            model_thread.release()
    t = threading.Thread(target=run, name="model")
    t.start()
    t.join(60)
    return out["prefetch"]


def test_a_follower_restores_what_its_read_ahead_brought_from_disk_exactly(disk_only):
    h, prompt, asked = disk_only
    restore = ShardRestore(Admission(h.pc), mx.distributed.init(), ThreadPoolExecutor(2, "admit"))
    restore.read_ahead(prompt)
    prefetch = settle_on_a_model_thread(restore, prompt)
    assert prefetch.n == h.hit_after(200, 200, 201, tail=False) > 0 and prefetch.from_disk > 0
    assert asked and "model" not in asked  # every disk call ran on the admission threads
    assert restore.stats() == {"agreed": 1, "cut_short": 0, "dropped": 0, "reads": 1, "late_reads": 0}
    h.assert_same(h.run_with(prompt, BlockSession(h.pc, prompt, prefetch)), h.cold(prompt))


def test_without_a_read_ahead_a_follower_offers_ram_only(disk_only):
    h, prompt, asked = disk_only
    restore = ShardRestore(Admission(h.pc), mx.distributed.init(), ThreadPoolExecutor(2, "admit"))
    assert settle_on_a_model_thread(restore, prompt).n == 0  # its RAM holds nothing; its disk is not asked
    assert asked == []


def test_a_read_not_done_in_time_gives_way_to_ram(disk_only, monkeypatch):
    h, prompt, asked = disk_only
    monkeypatch.setattr(shard_restore, "FOLLOWER_WAIT_S", 0.05)
    gate = threading.Event()
    admission = Admission(h.pc)
    real = admission.fetch_own
    admission.fetch_own = lambda p, pull=None: (gate.wait(30), real(p, pull))[1]  # a disk slower than the agreement waits
    restore = ShardRestore(admission, mx.distributed.init(), ThreadPoolExecutor(2, "admit"))
    restore.read_ahead(prompt)
    assert settle_on_a_model_thread(restore, prompt).n == 0
    gate.set()
    assert restore.stats()["late_reads"] == 1 and "model" not in asked


def test_an_agreement_below_the_read_keeps_that_many_tokens_of_it(disk_only):
    h, prompt, asked = disk_only
    admission = Admission(h.pc)
    with ThreadPoolExecutor(1, "admit") as pool:  # a follower reads on its admission threads
        read = pool.submit(admission.fetch_own, prompt).result()
    shorter = h.B * 2  # a block end: a resume point of tiny-dense's schedule
    assert shorter in h.pc.planner.candidates(len(prompt), read.n // h.B) and shorter < read.n
    asked.clear()
    prefetch = admission.fetch_exactly(prompt, shorter, have=read.blocks)
    assert prefetch.n == shorter and asked == []  # from what the read brought: no disk call
    assert admission.fetch_exactly(prompt, shorter).n == 0  # without it, RAM holds nothing: none
    h.assert_same(h.run_with(prompt, BlockSession(h.pc, prompt, prefetch)), h.cold(prompt))


def test_a_follower_pulls_its_own_blocks_from_its_counterpart_and_restores_exactly(disk_harness, tmp_path):
    """The leader's route plan pulls from a peer replica of the same geometry: this rank (1) reads its blocks from
    the peer's rank-1 node, on its admission threads, checks them, keeps them on its own disk, and restores
    exactly. (One process: the peer's rank-1 node is a DiskStore here, reached as a peer's node store is.)"""
    peer = disk_harness("tiny-dense", node_dir=tmp_path / "peer-r1")
    prompt = prompt_of(200)
    peer.warm(prompt, max_tokens=2)
    assert peer.pc.tiers.disk.flush(30)
    h = disk_harness("tiny-dense", node_dir=tmp_path / "mine")
    assert h.pc.namespace == peer.pc.namespace and not any(h.pc.tiers.disk.present(chain_ids(h.pc.namespace,
                                                                                               prompt, h.B)))
    end = 192 // h.B
    plan = FetchPlan("peer-r0", 0, end, False, 192, end * h.pc.block_bytes, ("peer-r0", "peer-r1"))
    admission = Admission(h.pc, peers=PeerClient(h.pc.namespace, local_stores={"peer-r1": peer.store}))
    restore = ShardRestore(admission, mx.distributed.init(), ThreadPoolExecutor(2, "admit"))
    pulled_on = []
    read_many = peer.store.read_many
    peer.store.read_many = lambda *a: (pulled_on.append(threading.current_thread().name), read_many(*a))[1]
    restore.read_ahead(prompt, FetchPlan.from_shared(plan.shared()).for_rank(1, 2))
    prefetch = settle_on_a_model_thread(restore, prompt)
    assert (prefetch.n, prefetch.fetched, prefetch.fetched_from) == (h.hit_after(200, 200, 201, tail=False), 192, "peer-r1")
    assert pulled_on and "model" not in pulled_on
    assert admission.peers.counters["blocks"] == end and h.pc.tiers.disk.flush(30)
    assert all(h.pc.tiers.disk.present(chain_ids(h.pc.namespace, prompt, h.B)[:end]))  # its own now
    h.assert_same(h.run_with(prompt, BlockSession(h.pc, prompt, prefetch)), h.cold(prompt))
