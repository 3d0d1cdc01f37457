"""ModelReplica: one mlx-lm model on one fleet node, as a Ray Serve deployment.

The gateway calls `generate` through a DeploymentHandle with token ids and gets
a stream of event lists back. Three kinds of thread share the work:
- Ray's asyncio loop: receives requests and streams events back;
- admission threads: look up and read each prompt's cached prefix (Ray calls,
  disk reads), under deadlines;
- the model thread (the scheduler): every MLX call, from loading the model to
  the last token. It never waits on Ray, Redis or the disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster.actors import loopback, node_store
from cluster.config import AppConfig, ModelSpec
from cluster.engine.cold_session import ColdSession
from cluster.engine.events import TERMINAL, Accepted, Event, Failed, Finished
from cluster.engine.request import GenerateRequest
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence
from cluster.kvcache.admission import Admission
from cluster.kvcache.session import BlockSession
from cluster.kvcache.store_link import ActorLink
from cluster.models.resolve import resolve_model
from cluster.node import current_node
from cluster.store.leases import LeaseWriter

log = logging.getLogger(__name__)

ADMISSION_THREADS = 4


class ModelReplica:
    """Loads the model on its model thread, runs requests, keeps its lease in Redis."""

    def __init__(self, spec: ModelSpec, app: AppConfig):
        loopback.apply()
        self.spec = spec
        self.node = current_node(app.data_dir)
        self.started = time.time()
        link = self._disk_link(app)
        self.scheduler = Scheduler(name=f"mlx-fleet-{spec.name}")
        self.path, self.model, self.tokenizer, self.cache, self.memory = self.scheduler.run(lambda: self._load(app, link))
        self.admission = None
        if self.cache.cache is not None:
            self.admission = Admission(self.cache.cache, ThreadPoolExecutor(ADMISSION_THREADS, "mlx-fleet-admit"),
                                       app.cache.admission_timeout_s)
        self.counters = {"requests": 0, "finished": 0, "failed": 0, "cancelled": 0,
                         "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
        self.lease = None
        if app.redis_url:
            self.lease = LeaseWriter(app.redis_url, spec.name, self.node.node_id, app.lease_ttl_s, self.stats)
        log.info("replica of %s ready on node %s (%s)", spec.name, self.node.node_id, self.path)

    def _load(self, app: AppConfig, link):
        """Runs on the model thread: memory limits, weights (a built-in model is built with MLX), the cache probe."""
        from mlx_lm import load

        from cluster.engine.metal import configure_memory
        from cluster.kvcache.setup import setup_cache

        memory = configure_memory()
        path = resolve_model(self.spec.source, Path(app.data_dir).expanduser())
        model, tokenizer = load(str(path))
        cache = setup_cache(model, tokenizer, path, app.cache, self.node.data_dir, store_link=link)
        return path, model, tokenizer, cache, memory

    def _disk_link(self, app: AppConfig):
        """This node's disk tier, or None (RAM only) if it is off or cannot be reached."""
        if not (app.cache.enabled and app.cache.disk):
            return None
        try:
            handle = node_store.get_or_create(self.node, app.cache.disk_bytes, app.redis_url)
            return ActorLink(handle)
        except Exception as e:  # serve from RAM rather than not at all
            log.warning("no disk tier on node %s (%s); caching in RAM only", self.node.node_id, e)
            return None

    async def generate(self, request: GenerateRequest):
        """Stream lists of events for one request; the first list is [Accepted]."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.counters["requests"] += 1
        yield [Accepted(self.node.node_id)]
        prompt = list(request.prompt_tokens)
        session = await self._session(prompt)
        seq = Sequence(prompt, request.params, self.model, self.tokenizer, session, self.spec.prefill_step_tokens)
        self.scheduler.submit(request.request_id, seq, _emitter(loop, inbox))
        ended = False
        try:
            while not ended:
                events = await inbox.get()
                while not inbox.empty():
                    events.extend(inbox.get_nowait())
                ended = any(isinstance(e, TERMINAL) for e in events)
                if ended:
                    self._count(events)
                yield events
        finally:
            if not ended:
                self.counters["cancelled"] += 1
                self.scheduler.cancel(request.request_id)

    async def _session(self, prompt: list[int]):
        """The admission stage: the cached prefix is fetched here, before the model thread sees the request."""
        if self.admission is None:
            return ColdSession(self.model)
        prefetch = await self.admission.fetch_async(prompt)
        return BlockSession(self.cache.cache, prompt, prefetch)

    def _count(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Finished):
                self.counters["finished"] += 1
                self.counters["prompt_tokens"] += e.prompt_tokens
                self.counters["cached_tokens"] += e.cached_tokens
                self.counters["completion_tokens"] += e.completion_tokens
            elif isinstance(e, Failed):
                self.counters["failed"] += 1

    def stats(self) -> dict:
        """Small, msgpack-able: goes into the lease and into status."""
        return {
            "node_id": self.node.node_id,
            "node_name": self.node.name,
            "model": self.spec.name,
            "pid": os.getpid(),
            "started": self.started,
            "renewed": time.time(),
            "active": self.scheduler.active,
            "healthy": self.scheduler.alive,
            **self.counters,
            "cache": self.cache_stats(),
        }

    def cache_stats(self) -> dict:
        if self.cache.cache is None:
            return {"enabled": False, "reason": self.cache.disabled_reason}
        return {"enabled": True, "namespace": self.cache.fingerprint.short,
                "admission_timeouts": self.admission.timeouts, **self.cache.cache.stats()}

    def check_health(self) -> None:
        if not self.scheduler.alive:
            raise RuntimeError("model thread died")
        loopback.check_listeners()

    def __del__(self):
        cache = getattr(self, "cache", None)
        disk = cache.cache.tiers.disk if cache is not None and cache.cache is not None else None
        if disk is not None:
            disk.flush(timeout_s=10)  # let queued spills reach the disk before the replica goes
            disk.close()
        lease = getattr(self, "lease", None)
        if lease is not None:
            lease.close()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.stop()


def _emitter(loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue):
    """Hand events from the model thread to the request's loop; a loop already gone means nobody listens."""

    def emit(events: list[Event]) -> None:
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, events)
        except RuntimeError:  # the loop closed: the request was abandoned
            pass

    return emit
