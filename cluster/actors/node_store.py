"""NodeStore: the one process on a node that owns its disk tier, as a Ray actor.

The node's replicas (and, later, peers) talk to it: spills arrive as batches,
lookups and read leases are answered from its index, and every block it stores
or evicts becomes an event. Replicas read pinned block files directly (same
machine), so restores do not pay for an extra copy through Ray.

It is a detached, named actor per node (`node-store:<node id>` in the
`mlx-fleet` namespace, see node.py) pinned to its node: replicas that restart find the same
one, and a restarted node rebuilds its index from the files (DiskStore.recover).
Its stats go to Redis (`mlxf:node:<node id>`, expiring) for `mlx-fleet status`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Optional

import msgpack

from cluster import metrics
from cluster.store.block_files import ReadFailure
from cluster.store.disk_tier import DiskStore
from cluster.store.events import EventBatch
from cluster.node import RAY_NAMESPACE, store_actor_name
from cluster.store.keys import node_stats_key

log = logging.getLogger(__name__)

LEASE_TTL_S = 120.0


class NodeStore:
    def __init__(self, node_id: str, node_name: str, node_dir: str, budget: Optional[int], redis_url: Optional[str],
                 redis_settings: Optional[dict] = None, stats_ttl_s: float = 6.0):
        import ray

        self.node_id = node_id
        self.node_name = node_name
        self.ray_node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.disk = DiskStore(Path(node_dir), budget)
        self.served = {"blocks": 0, "bytes": 0}  # sent to peers
        self._leases: dict[int, tuple[bytes, list[bytes], float]] = {}
        self._next_lease = 0
        self._stop = threading.Event()
        self._redis_url = redis_url
        self._redis_settings = redis_settings
        self._stats_ttl_s = stats_ttl_s
        threading.Thread(target=self._maintain, name="mlx-fleet-store", daemon=True).start()
        log.info("node store for %s at %s: %s", node_id, node_dir, self.disk.recovery)

    # -- the StoreLink API ----------------------------------------------------------
    async def write(self, ns: bytes, items: list) -> dict:
        return await asyncio.to_thread(self.disk.write_many, [(ns, k, d) for k, d in items])

    async def present(self, ns: bytes, keys: list[bytes]) -> list[bool]:
        return self.disk.present(ns, keys)

    async def keys(self, ns: bytes) -> list[bytes]:
        return self.disk.keys(ns)

    async def holdings(self, ns: bytes) -> list[tuple[bytes, str, bytes, int]]:
        return self.disk.holdings(ns)

    async def touch(self, ns: bytes, keys: list[bytes]) -> int:
        return await asyncio.to_thread(self.disk.touch, ns, keys)

    def quarantine(self, ns: bytes, key: bytes, reason: str, detail: str) -> None:
        """A replica refused this block at decode. Synchronous on purpose: a spill of the
        recomputed block, sent right after, must find the bad one already gone."""
        if self.disk.present(ns, [key])[0]:
            self.disk.quarantine(ns, key, reason, detail)

    async def open_read(self, ns: bytes, keys: list[bytes], ttl_s: float = LEASE_TTL_S) -> tuple[int, list]:
        located = self.disk.open_read(ns, keys)
        self._next_lease += 1
        self._leases[self._next_lease] = (ns, [k for k, loc in zip(keys, located) if loc], time.monotonic() + ttl_s)
        return self._next_lease, located

    async def read_blocks(self, ns: bytes, keys: list[bytes]) -> list:
        """Verified block bytes for a peer (migration); a miss or a bad block (quarantined here) is None."""
        got = await asyncio.to_thread(self.disk.read_many, ns, keys)
        self.served["blocks"] += sum(1 for g in got if g is not None)
        self.served["bytes"] += sum(len(g) for g in got if g is not None)
        return got

    async def close_read(self, lease: int, good: list[bytes], failed: list[ReadFailure]) -> None:
        entry = self._leases.pop(lease, None)
        if entry is None:
            return  # expired: its pins were already released
        ns, pinned, _ = entry
        await asyncio.to_thread(self.disk.close_read, ns, pinned, good, failed)

    # -- inspection -------------------------------------------------------------------
    async def stats(self) -> dict:
        return self._stats()

    def _stats(self) -> dict:
        return {"node_id": self.node_id, "node_name": self.node_name, "ray_node_id": self.ray_node_id,
                "read_leases": len(self._leases), "renewed": time.time(), "served_to_peers": dict(self.served),
                **self.disk.stats()}

    async def events_since(self, cursor: int, epoch: Optional[str] = None, limit: int = 10_000) -> EventBatch:
        """Block events after `cursor`, exactly once, or with `gap` set (see store/events.py)."""
        return self.disk.events.since(cursor, limit, epoch)

    async def ping(self) -> str:
        return self.node_id

    # -----------------------------------------------------------------------------------
    def _maintain(self) -> None:
        """Expire read leases of readers that died, and publish stats to Redis."""
        client = self._publish(None) if self._redis_url else None
        exporter = metrics.StatsExporter()
        while not self._stop.wait(self._stats_ttl_s / 3):
            metrics.export_node_store(exporter, self._stats())
            now = time.monotonic()
            for lease, (ns, pinned, expires) in list(self._leases.items()):
                if expires < now and self._leases.pop(lease, None) is not None:
                    self.disk.close_read(ns, pinned, [], [])
            if self._redis_url:
                client = self._publish(client)

    def _publish(self, client):
        import redis

        from cluster.store.redis_client import connect

        try:
            from cluster.config import RedisConfig

            settings = RedisConfig(**self._redis_settings) if self._redis_settings else None
            client = client or connect(self._redis_url, settings)
            payload = self._stats()
            client.set(node_stats_key(self.node_id), msgpack.packb(payload), px=int(self._stats_ttl_s * 1000))
        except redis.RedisError as e:
            log.debug("could not publish node stats: %s", e)
            metrics.inc("mlx_fleet_redis_errors", node=self.node_name, component="node_stats")
            client = None
        return client


def get_or_create(node, budget: Optional[int], redis_url: Optional[str], redis_settings: Optional[dict] = None):
    """This node's store actor (created on first use, pinned to the calling process's node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(NodeStore).options(
        name=store_actor_name(node.node_id), namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    )
    handle = actor.remote(node.node_id, node.name, str(node.data_dir), budget, redis_url, redis_settings)
    ray.get(handle.ping.remote(), timeout=120)
    return handle


def disk_link(node, app):
    """`node`'s disk tier as a replica's cache reaches it (a StoreLink), or None (RAM only) if the app turns
    it off or the store cannot be reached. Every rank of a sharded replica takes its own node's."""
    from cluster.kvcache.store_link import ActorLink

    if not (app.cache.enabled and app.cache.disk):
        return None
    try:
        return ActorLink(get_or_create(node, app.cache.disk_bytes, app.redis_url, app.redis.model_dump()))
    except Exception as e:  # serve from RAM rather than not at all
        log.warning("no disk tier on node %s (%s); caching in RAM only", node.node_id, e)
        return None
