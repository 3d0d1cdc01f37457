"""The gateway's view of the replicas it can route to, from their Redis leases.

Each replica renews a lease (store/leases.py) with what routing needs: its
node (persistent id, name, Ray node id), whether its model thread is alive,
and its cache's namespace, block size and layout kind. The gateway never
hashes weights: it learns each model's namespace from these. A background task
re-reads them every `period_s` with the asyncio client, so a request never
waits on Redis for them, and every gateway replica sees the same fleet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional

import msgpack

from cluster import metrics
from cluster.store.keys import lease_pattern
from cluster.store.redis_client import redact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaInfo:
    model: str
    node_id: str
    node_name: str
    ray_node_id: str
    healthy: bool
    namespace: Optional[bytes]  # None: this replica serves without the block cache
    block_tokens: int = 0
    recurrent: bool = False
    boundary_only: bool = False
    resume_every: int = 1  # a hit resumes only at multiples of this many tokens (its prefill schedule's chunk)
    # A sharded replica's nodes and its ranks' fingerprints, by rank (its leader's among them): blocks move only
    # between replicas that agree on all of them, rank to rank (plan.py FetchPlan.for_rank).
    ranks: tuple[str, ...] = ()
    rank_namespaces: tuple[bytes, ...] = ()

    @property
    def geometry(self) -> tuple:
        """What two replicas must share for one to pull the other's blocks: every rank's fingerprint."""
        return self.rank_namespaces or (self.namespace,)


def replica_info(lease: dict) -> ReplicaInfo:
    cache = lease.get("cache") or {}
    ns = cache.get("namespace_hex")
    return ReplicaInfo(model=lease.get("model", ""), node_id=lease.get("node_id", ""),
                       node_name=lease.get("node_name", ""), ray_node_id=lease.get("ray_node_id", ""),
                       healthy=bool(lease.get("healthy", True)), namespace=bytes.fromhex(ns) if ns else None,
                       block_tokens=int(cache.get("block_tokens") or 0), recurrent=bool(cache.get("recurrent")),
                       boundary_only=bool(cache.get("boundary_only")),
                       resume_every=max(1, int(cache.get("resume_every") or 1)),
                       ranks=tuple(r["node_id"] for r in cache.get("ranks") or ()),
                       rank_namespaces=tuple(bytes.fromhex(r["namespace_hex"]) for r in cache.get("ranks") or ()))


class FleetView:
    def __init__(self, client, period_s: float = 1.0):
        self.client = client  # redis.asyncio client, or None without Redis
        self.period_s = period_s
        self.replicas: dict[str, list[ReplicaInfo]] = {}
        self.fresh_at: Optional[float] = None  # monotonic time of the last good read
        self.redis_started: Optional[float] = None  # when (monotonic) the Redis last read was started: its uptime
        self._task: Optional[asyncio.Task] = None

    @property
    def ok(self) -> bool:
        """Whether the view is current (Redis answered within the last few periods)."""
        return self.fresh_at is not None and time.monotonic() - self.fresh_at < 3 * self.period_s + 1

    def of(self, model: str) -> list[ReplicaInfo]:
        return self.replicas.get(model, [])

    def redis_age_s(self) -> float:
        """How long the Redis last read has been up (inf before a read): one younger than the lease TTL may
        not hold every live replica's lease yet (a restarted Redis starts empty)."""
        return float("inf") if self.redis_started is None else time.monotonic() - self.redis_started

    async def ensure(self, timeout_s: float) -> None:
        """Read the leases now if the view was never read (the first requests after a start)."""
        self.start()
        if self.fresh_at is None and self.client is not None:
            try:
                await asyncio.wait_for(self.refresh(), timeout_s)
            except Exception as e:
                log.debug("fleet view read failed: %s", redact(str(e)))

    def start(self) -> None:
        """Start refreshing (call from the event loop; idempotent)."""
        if self.client is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def refresh(self) -> None:
        keys = [k async for k in self.client.scan_iter(match=lease_pattern(), count=1000)]
        raws = await self.client.mget(keys) if keys else []
        out: dict[str, list[ReplicaInfo]] = {}
        for raw in raws:
            if raw is None:
                continue
            info = replica_info(msgpack.unpackb(raw, strict_map_key=False))
            out.setdefault(info.model, []).append(info)
        uptime = (await self.client.info("server")).get("uptime_in_seconds")
        self.replicas = {m: sorted(v, key=lambda r: r.node_id) for m, v in out.items()}
        self.fresh_at = time.monotonic()
        self.redis_started = None if uptime is None else self.fresh_at - float(uptime)

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.refresh(), self.period_s * 2)
            except Exception as e:  # Redis away: the view goes stale and routing falls back
                log.debug("fleet view refresh failed: %s", redact(str(e)))
                metrics.inc("mlx_fleet_redis_errors", node="", component="gateway_view")
            await asyncio.sleep(self.period_s)
