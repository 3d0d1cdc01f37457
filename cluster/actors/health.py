"""Is each model servable right now? Answered from replica state, never by a request to a replica.

A ping sent through a deployment handle waits in the same queue as real
requests, so under load it times out and health flaps exactly when it matters.
Instead:
- each replica renews a lease in Redis from a background thread, carrying
  whether its model thread is alive; a model is healthy while at least one of
  its replicas holds a live, healthy lease;
- when Redis cannot be asked, Serve's own view (the controller's replica states)
  is the fallback.
Answers are cached for `cache_s`, so /health costs one Redis round trip a
second at most, however often it is polled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import msgpack

from cluster.store.keys import lease_pattern

log = logging.getLogger(__name__)


class Health:
    def __init__(self, redis_url: Optional[str], models: dict[str, str], cache_s: float = 1.0,
                 timeout_s: float = 0.5):
        """`models` maps a model name to its Serve deployment name."""
        self.models = models
        self.cache_s = cache_s
        self.timeout_s = timeout_s
        self._client = None
        if redis_url:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                                   socket_connect_timeout=timeout_s)
        self._cached: Optional[tuple[float, dict]] = None
        self._lock = asyncio.Lock()

    async def check(self) -> dict:
        """{"models": {name: bool}, "source": "leases" | "serve"}."""
        async with self._lock:
            now = time.monotonic()
            if self._cached and now - self._cached[0] < self.cache_s:
                return self._cached[1]
            result = await self._from_leases()
            if result is None:
                result = await self._from_serve()
            self._cached = (now, result)
            return result

    async def _from_leases(self) -> Optional[dict]:
        if self._client is None:
            return None
        try:
            leases = await asyncio.wait_for(self._read_leases(), self.timeout_s * 2)
        except Exception as e:  # Redis away: Serve knows too
            log.debug("health from leases failed: %s", e)
            return None
        healthy = {m: any(lease.get("model") == m and lease.get("healthy", True) for lease in leases)
                   for m in self.models}
        return {"models": healthy, "source": "leases"}

    async def _read_leases(self) -> list[dict]:
        keys = [k async for k in self._client.scan_iter(match=lease_pattern(), count=1000)]
        if not keys:
            return []
        return [msgpack.unpackb(raw) for raw in await self._client.mget(keys) if raw is not None]

    async def _from_serve(self) -> dict:
        try:
            states = await asyncio.wait_for(asyncio.to_thread(_serve_running), 5.0)
        except Exception as e:
            log.warning("health from Serve failed: %s", e)
            states = {}
        return {"models": {m: states.get(dep, 0) > 0 for m, dep in self.models.items()}, "source": "serve"}


def _serve_running() -> dict[str, int]:
    """Running replicas per deployment, from the Serve controller."""
    from ray import serve

    out: dict[str, int] = {}
    for app in serve.status().applications.values():
        for name, dep in app.deployments.items():
            out[name] = out.get(name, 0) + dep.replica_states.get("RUNNING", 0)
    return out
