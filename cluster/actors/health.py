"""Is each model servable right now? Answered from replica state, never by a request to a replica.

A ping sent through a deployment handle waits in the same queue as real
requests, so under load it times out and health flaps exactly when it matters.
Instead:
- each replica renews a lease in Redis from a background thread, carrying
  whether its model thread is alive; the gateway's FleetView re-reads them
  every second in the background, and a model is healthy while at least one
  of its replicas holds a live, healthy lease;
- when Redis cannot be asked, Serve's own view (the controller's replica
  states) is the fallback, cached for `cache_s`;
- so is it for a model with no healthy lease while Redis is younger than a
  lease's TTL: a restarted Redis starts empty, and the replicas renew their
  leases within a third of the TTL. Taken alone, its leases turned /health to
  503 for a second or two while requests were served all along. Past that, a
  missing lease means a replica that stopped renewing it (dead or hung), which
  Serve may not notice for tens of seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from cluster.actors.fleet_view import FleetView

log = logging.getLogger(__name__)


class Health:
    def __init__(self, view: FleetView, models: dict[str, str], lease_ttl_s: float, cache_s: float = 1.0):
        """`models` maps a model name to its Serve deployment name."""
        self.view = view
        self.lease_ttl_s = lease_ttl_s
        self.models = models
        self.cache_s = cache_s
        self._cached: Optional[tuple[float, dict]] = None
        self._lock = asyncio.Lock()

    async def check(self) -> dict:
        """{"models": {name: bool}, "source": "leases" | "serve" | "leases+serve"}."""
        self.view.start()
        if self.view.ok:
            leases = {m: any(r.healthy for r in self.view.of(m)) for m in self.models}
            if all(leases.values()) or self.view.redis_age_s() >= self.lease_ttl_s:
                return {"models": leases, "source": "leases"}
            serve = (await self._serve())["models"]  # for a model with no lease at all: one not renewed yet
            return {"models": {m: leases[m] or (not self.view.of(m) and serve[m]) for m in self.models},
                    "source": "leases+serve"}
        return await self._serve()

    async def _serve(self) -> dict:
        async with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.cache_s:
                self._cached = (now, await self._from_serve())
            return self._cached[1]

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
