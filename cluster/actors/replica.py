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
from typing import Optional

from cluster import metrics
from cluster.actors import loopback, node_store
from cluster.actors.outbox import Outbox, visible
from cluster.config import AppConfig, ModelSpec
from cluster.engine.cold_session import ColdSession
from cluster.engine.constraints import Grammars
from cluster.engine.events import TERMINAL, Accepted, Event, Failed, Finished, Started
from cluster.actors.plan import GenerateRequest
from cluster.engine.scheduler import Scheduler
from cluster.engine.sharded_scheduler import ShardedScheduler
from cluster.engine.sequence import Sequence
from cluster.kvcache.admission import ADMISSION_THREADS, Admission
from cluster.kvcache.index_publisher import IndexPublisher
from cluster.kvcache.peers import PeerClient
from cluster.kvcache.session import BlockSession
from cluster.kvcache.speeds import load_speeds, save_speeds, speeds_path
from cluster.models.resolve import resolve_model
from cluster.node import current_node
from cluster.store.fleet_index import FleetIndex
from cluster.store.leases import LeaseWriter
from cluster.store.redis_client import connect

log = logging.getLogger(__name__)

METRICS_PERIOD_S = 5.0  # how often counters become metrics (Ray exports every 10 s)


class ModelReplica:
    """Loads the model on its model thread, runs requests, keeps its lease in Redis."""

    def __init__(self, spec: ModelSpec, app: AppConfig):
        loopback.apply()
        self.spec = spec
        self.node = current_node(app.data_dir)
        self.started = time.time()
        link = self._disk_link(app)  # a sharded replica's leader: its own node's, as each rank takes its own
        self.scheduler = (ShardedScheduler if spec.shards > 1 else Scheduler)(
            name=f"mlx-fleet-{spec.name}", batching=spec.batching,
            decode_concurrency=spec.decode_concurrency or spec.max_ongoing_requests,
            prefill_concurrency=spec.prefill_concurrency)
        self.shards = None  # a sharded replica's other ranks (shard_rank.py)
        if spec.shards > 1:
            from cluster.actors.shard_rank import ShardGroup

            model_dir = self.scheduler.run(lambda: resolve_model(spec.source, Path(app.data_dir).expanduser()))
            self.shards = ShardGroup(spec, app, model_dir, self.node.node_id)
        self.path, self.model, self.tokenizer, self.cache, self.memory = self.scheduler.run(lambda: self._load(app, link))
        if self.shards is not None:
            self.shards.lead(self.scheduler)
        self.grammars = Grammars(self.tokenizer._tokenizer)  # its llguidance tokenizer is built on first use
        self.ray_node_id = _ray_node_id()
        self.admission = self.peers = self.publisher = self.shard_restore = None
        if self.cache.cache is not None:
            self.cache.cache.costs.prefill_tps = lambda: self.scheduler.prefill_tps  # restore or recompute
            self._seed_speeds()
            if self.cache.cache.device:  # spills wait for the model thread to be idle (PrefixCache.spill_idle)
                self.cache.cache.spill_when_idle = True
                self.scheduler.when_idle(self.cache.cache.spill_idle)
                self.cache.cache.device_work = self.scheduler.future  # disk blocks move as they are read (uploads.py)
            # A sharded replica's ranks keep their blocks, each its own heads, in RAM and on their own nodes'
            # disks, and restore the same tokens or none (kvcache/shard_restore.py); each pulls its own from
            # its counterpart in a peer replica of the same geometry (plan.py FetchPlan.for_rank).
            self.peers = PeerClient(self.cache.cache.namespace)
            self.admission = Admission(self.cache.cache, ThreadPoolExecutor(ADMISSION_THREADS, "mlx-fleet-admit"),
                                       app.cache.admission_timeout_s, self.peers, app.routing.fetch_timeout_s)
            if self.shards is not None:
                from cluster.kvcache.shard_restore import ShardRestore

                self.shard_restore = ShardRestore(self.admission, self.shards.group)
        self.counters = {"requests": 0, "finished": 0, "failed": 0, "cancelled": 0, "prompt_tokens": 0,
                         "cached_tokens": 0, "fetched_tokens": 0, "completion_tokens": 0}
        self.streams = 0  # requests streaming from this replica now (its event loop only)
        self.lease = None
        if app.redis_url:  # the publisher first: the lease's first write already shows its counters
            if self.cache.cache is not None:  # a sharded replica: the leader announces, its ranks hold the same blocks
                self.publisher = self._publish(app)
            self.lease = LeaseWriter(app.redis_url, spec.name, self.node.node_id, app.lease_ttl_s, self.stats,
                                     app.redis, node_name=self.node.name)
        self.exporter = metrics.StatsExporter()
        self.metrics_loop = metrics.Every(self._every_period, METRICS_PERIOD_S, "mlx-fleet-metrics")
        log.info("replica of %s ready on node %s (%s)", spec.name, self.node.node_id, self.path)

    def _every_period(self) -> None:
        if self.shards is not None and self.shards.ranks:
            self.shards.refresh()  # its followers' caches, for status
        metrics.export_replica(self.exporter, self.stats())
        self._save_speeds()

    def _seed_speeds(self) -> None:
        """Start from the speeds a replica of the same fingerprint measured on this node (speeds.py)."""
        pc = self.cache.cache
        self.speeds_path = speeds_path(self.node.data_dir, pc.namespace)
        self._saved_speeds = load_speeds(self.speeds_path, pc.namespace)
        if self._saved_speeds is not None:
            pc.costs.seed(self._saved_speeds)
            self.scheduler.prefill_tps = self._saved_speeds.prefill_tps  # before any request: no race
            log.info("%s: starting from the speeds measured before: %s", self.spec.name,
                     pc.costs.stats())

    def _save_speeds(self) -> None:
        """Off the model thread (the metrics loop, and the replica's end); only when they changed."""
        pc = self.cache.cache if getattr(self, "cache", None) is not None else None
        if pc is None or not hasattr(self, "speeds_path"):
            return
        speeds = pc.costs.snapshot(pc.namespace)
        if speeds.measured() and not speeds.same(self._saved_speeds):
            save_speeds(self.speeds_path, speeds)
            self._saved_speeds = speeds

    def _publish(self, app: AppConfig) -> IndexPublisher:
        """Announce this node's blocks of the model in the fleet index, and keep them true from the tiers' events."""
        tiers = self.cache.cache.tiers
        index = FleetIndex(connect(app.redis_url, app.redis))
        publisher = IndexPublisher(index, self.cache.cache.namespace, self.node.node_id, tiers, self.index_lease,
                                   app.lease_ttl_s, app.routing.index_flush_s, app.routing.index_gc_s)
        tiers.listener = publisher.on_event
        if tiers.disk is not None:
            tiers.disk.on_events = publisher.on_events
            tiers.disk.on_resync = publisher.on_disk_resync
        return publisher

    def _load(self, app: AppConfig, link):
        """Runs on the model thread: memory limits, weights (a built-in model is built with MLX), the cache probe."""
        from cluster.models.loading import load_model
        from mlx_lm.models.cache import make_prompt_cache

        from cluster.engine.batch import batchable
        from cluster.engine.metal import configure_memory
        from cluster.engine.schedule import Schedule
        from cluster.kvcache.setup import setup_cache

        from cluster.store.fingerprint import backend

        memory = configure_memory()
        self.backend = backend()  # what status shows; the fingerprint pins it too
        path = resolve_model(self.spec.source, Path(app.data_dir).expanduser())
        if self.shards is not None:  # the followers load theirs, and probe their caches, in step with this
            model, tokenizer = self.shards.load(path, self.node.data_dir)
        else:
            model, tokenizer = load_model(path)
        cache = setup_cache(model, tokenizer, path, app.cache, self.node.data_dir, store_link=link,
                            prefill_step=self.spec.prefill_step_tokens,
                            shard=self.shards.geometry() if self.shards is not None else None)
        if self.shards is not None:
            from cluster.kvcache.shard_restore import cache_on_every_rank

            cache = cache_on_every_rank(cache, self.shards.group)
        if cache.cache is not None and cache.cache.device:
            from mlx.utils import tree_flatten

            from cluster.engine.metal import budget_warning

            weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
            warning = budget_warning(memory, weights, app.cache.ram_bytes)
            if warning:
                log.warning("%s: %s", self.spec.name, warning)
        # How prefill is cut, with the cache on or off: a bypassed cold run is cut as a cached one is.
        self.schedule = cache.cache.schedule if cache.cache is not None else \
            Schedule.of(app.cache.resume_at, app.cache.block_tokens, self.spec.prefill_step_tokens)
        self.new_caches = cache.cache.new_caches if cache.cache is not None else (lambda: make_prompt_cache(model))
        can_batch, why = batchable(self.new_caches())
        if not can_batch and self.scheduler.batching:
            log.warning("%s: %s", self.spec.name, why)
            self.scheduler.disable_batching(why)
        if self.spec.deterministic:
            self._deterministic(model)
        return path, model, tokenizer, cache, memory

    def _deterministic(self, model) -> None:
        """Batch-invariant decode (engine/invariant.py); refused where the backend has none (Metal, for now)."""
        from cluster.engine import invariant

        pad = invariant.pads_rows()  # DeterministicUnsupported on Metal: the replica does not start
        if not self.scheduler.batching:
            self.scheduler.deterministic = "sequential: every sequence decodes alone"
        else:
            invariant.prepare(model)
            self.scheduler.invariant, self.scheduler.pad_rows = True, pad
            self.scheduler.deterministic = (f"invariant kernel, every step at {self.scheduler.decode_concurrency} rows"
                                            if pad else "per-row attention (this backend's matmuls are row-exact)")
        log.info("%s: deterministic decode: %s", self.spec.name, self.scheduler.deterministic)

    def _disk_link(self, app: AppConfig):
        """This node's disk tier, or None (RAM only)."""
        return node_store.disk_link(self.node, app)

    async def generate(self, request: GenerateRequest):
        """Stream lists of events for one request; the first list is [Accepted]."""
        loop = asyncio.get_running_loop()
        self.counters["requests"] += 1
        yield [Accepted(self.node.node_id, tuple(r["node_id"] for r in self.shards.ranks) if self.shards else ())]
        prompt = list(request.prompt_tokens)
        pull = request.route.fetch if request.route is not None else None
        if request.use_cache:
            session = await self._session(prompt, pull)
        else:
            session = ColdSession(self.model, self.new_caches, self.schedule)
        seq = None
        try:
            seq = Sequence(prompt, request.params, self.model, self.tokenizer, session,
                           self.spec.prefill_step_tokens, self.grammars)
            if seq.grammar is not None:
                await asyncio.to_thread(seq.compile_grammar)
        except ValueError as e:  # what the request asks of this model it cannot do (tools, tool_choice, grammar)
            param = getattr(e, "param", None) or ("tool_choice" if request.params.tool_choice else "response_format")
            yield [Failed(str(e), status=400, param=param)]
            return
        outbox = Outbox(loop)
        self.scheduler.submit(request.request_id, seq, outbox.put,
                              request.route.origin if request.route is not None else "")
        ended = shown = False
        last = 0.0
        self.streams += 1
        try:
            while not ended:
                # Every item crosses Ray twice (here to the gateway, the gateway to Serve's proxy): send what
                # `interval` gathers as one item, not one per decode step; the end goes out the moment it
                # comes, and so does the first text: a first token whose text is still pending (part of a
                # character, a possible stop string, an undecided tool call) must not hold it back.
                interval = stream_interval(self.spec.stream_interval_s, self.spec.stream_messages_per_s, self.streams)
                events = await outbox.take(last + interval, until_text=not shown)
                ended = any(isinstance(e, TERMINAL) for e in events)
                shown = shown or visible(events)
                self._count(events)  # Started (fetched tokens) comes batches before the end
                yield events
                last = loop.time()
        finally:
            self.streams -= 1
            if not ended:
                self.counters["cancelled"] += 1
                self.scheduler.cancel(request.request_id)

    async def _session(self, prompt: list[int], pull=None):
        """The admission stage: the cached prefix is fetched here (and pulled from a peer if the plan says
        so), before the model thread sees the request."""
        if self.admission is None:
            return ColdSession(self.model, self.new_caches, self.schedule)
        rank, size = (self.shards.rank, self.spec.shards) if self.shards is not None else (0, 1)
        mine = pull.for_rank(rank, size) if pull is not None else None  # None: a peer split otherwise
        if self.shard_restore is not None:  # each follower reads (and pulls) its own blocks of the prefix meanwhile
            self.scheduler.read_ahead(prompt, pull.shared() if mine is not None else None)
        pull = mine if mine is not None and mine.peer != self.node.node_id else None  # its own node's: local
        prefetch = await self.admission.fetch_async(prompt, pull)
        return BlockSession(self.cache.cache, prompt, prefetch, self.shard_restore)

    def _count(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Started):
                self.counters["fetched_tokens"] += e.fetched_tokens
            elif isinstance(e, Finished):
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
            "ray_node_id": self.ray_node_id,
            "model": self.spec.name,
            "pid": os.getpid(),
            "started": self.started,
            "renewed": time.time(),
            "healthy": self.scheduler.alive and not self.scheduler.broken,
            "broken": self.scheduler.broken or None,  # why it serves no more (a sharded replica lost a rank)
            "backend": getattr(self, "backend", None),
            "prefill_tps": round(self.scheduler.prefill_tps, 1),
            "streams": self.streams,
            **self.scheduler.load(),
            "batching": self.scheduler.stats(),
            "shards": self.shards.stats({"node_id": self.node.node_id, "node_name": self.node.name})
            if getattr(self, "shards", None) is not None else None,
            **self.counters,
            "cache": self.cache_stats(),
        }

    def cache_stats(self) -> dict:
        if self.cache.cache is None:
            return {"enabled": False, "reason": self.cache.disabled_reason}
        pc = self.cache.cache
        return {"enabled": True, "namespace": self.cache.fingerprint.short, "namespace_hex": pc.namespace.hex(),
                "recurrent": pc.layout.has_recurrent, "boundary_only": pc.planner.boundary_only,
                "resume_every": pc.schedule.resume_every,
                "ranks": self.shards.rank_caches(pc.namespace) if self.shards is not None else None,
                "admission_timeouts": self.admission.timeouts, "migration": self.migration_stats(),
                "index": self.publisher.counters if self.publisher else None,
                "shard_restore": self.shard_restore.stats() if self.shard_restore is not None else None, **pc.stats()}

    def migration_stats(self) -> Optional[dict]:
        if self.peers is None:
            return None
        return self.peers.stats()

    def index_lease(self) -> dict:
        """What routing reads about this node in the fleet index (store/fleet_index.py)."""
        import psutil

        pc = self.cache.cache
        return {"node_name": self.node.name, "ray_node_id": self.ray_node_id, "model": self.spec.name,
                "prefill_tps": round(self.scheduler.prefill_tps, 1), **self.scheduler.load(),
                "block_bytes": pc.block_bytes, "state_bytes": pc.shapes.state_bytes,
                "link_bps": {k: round(v) for k, v in self.peers.link_bps.items()} if self.peers is not None else {},
                "free_memory": psutil.virtual_memory().available,
                "disk_blocks": len(pc.tiers.disk.on_disk) if pc.tiers.disk is not None else 0,
                "disk_bytes": pc.tiers.disk.disk_bytes if pc.tiers.disk is not None else 0}

    async def check_health(self) -> None:
        if not self.scheduler.alive:
            raise RuntimeError("model thread died")
        if self.scheduler.broken:
            raise RuntimeError(self.scheduler.broken)
        if self.shards is not None:
            await self.shards.check()
        loopback.check_listeners()

    def __del__(self):
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.stop()  # first: its last idle work hands the spill backlog to the disk client
        shards = getattr(self, "shards", None)
        if shards is not None and shards.ranks and not (scheduler is not None and scheduler.broken):
            shards.close()  # the followers' spills reach their disks too (the leader's last share stopped them)
        cache = getattr(self, "cache", None)
        disk = cache.cache.tiers.disk if cache is not None and cache.cache is not None else None
        if disk is not None:
            disk.flush(timeout_s=10)  # let queued spills reach the disk before the replica goes
            disk.close()
        lease = getattr(self, "lease", None)
        if lease is not None:
            lease.close()
        loop = getattr(self, "metrics_loop", None)
        if loop is not None:
            loop.stop()
        try:
            self._save_speeds()
        except OSError as e:
            log.warning("could not save the measured speeds: %s", e)
        publisher = getattr(self, "publisher", None)
        if publisher is not None:
            publisher.close()


def _ray_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def stream_interval(base_s: float, messages_per_s: float, streams: int) -> float:
    """Seconds between one stream's messages: `base_s`, or longer when `streams` at that interval would pass
    the replica's message budget. Every message costs the same CPU in two Ray hops however many tokens it
    carries, so the budget, not the token rate, is what bounds that cost; a stream with more tokens per
    message loses nothing but update rate (8 streams at 100/s: 12.5 updates a second each)."""
    if messages_per_s <= 0:
        return base_s
    return max(base_s, streams / messages_per_s)
