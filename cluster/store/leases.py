"""Replica leases in Redis: which replica of which model is alive on which node.

Key schema (store/keys.py; one key per replica, msgpack value, expires unless renewed):

    mlxf:lease:<model>:<node_id>  ->  {node_id, node_name, model, pid, started, renewed, stats...}
                                      PX lease_ttl_s, renewed every ttl/3

A replica that dies stops renewing and its key expires; one that shuts down
cleanly deletes it. Readers never trust a key older than the TTL because Redis
has already dropped it.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import msgpack
import redis

from cluster import metrics
from cluster.store.keys import lease_key, lease_pattern
from cluster.store.redis_client import connect, redact

log = logging.getLogger(__name__)


class LeaseWriter:
    """Keeps one replica's lease alive from a background thread."""

    def __init__(self, url: str, model: str, node_id: str, ttl_s: float,
                 payload: Callable[[], dict], settings=None, node_name: str = ""):
        self._redis = connect(url, settings)
        self._node_name = node_name  # the metrics' node tag
        self._key = lease_key(model, node_id)
        self._ttl_ms = int(ttl_s * 1000)
        self._payload = payload
        self._period = ttl_s / 3
        self._stop = threading.Event()
        self.healthy = False
        self._thread = threading.Thread(target=self._run, name="mlx-fleet-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._redis.set(self._key, msgpack.packb(self._payload()), px=self._ttl_ms)
                self.healthy = True
            except redis.RedisError as e:
                if self.healthy:
                    log.warning("lease renewal failed: %s", redact(str(e)))
                self.healthy = False
                metrics.inc("mlx_fleet_redis_errors", node=self._node_name, component="lease")
            self._stop.wait(self._period)

    def close(self) -> None:
        self._stop.set()
        try:
            self._redis.delete(self._key)
        except redis.RedisError:
            pass  # it expires on its own


def read_leases(client: redis.Redis, model: Optional[str] = None) -> list[dict]:
    """All live leases (of one model if given), sorted by model then node."""
    keys = sorted(client.scan_iter(match=lease_pattern(model), count=1000))
    if not keys:
        return []
    out = []
    for raw in client.mget(keys):
        if raw is not None:
            out.append(msgpack.unpackb(raw))
    return sorted(out, key=lambda d: (d.get("model", ""), d.get("node_id", "")))

