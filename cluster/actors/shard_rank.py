"""The other ranks of a sharded replica: one Ray actor per extra node, each with its own model thread.

A replica with `shards: N` is a Serve replica (the leader, the one the router and the gateway talk to) in
bundle 0 of its placement group (one bundle per node, STRICT_SPREAD: app.py), plus N-1 `ShardRank`
actors, one in each other bundle. The leader starts them (`start_ranks`):

1. each rank names its own `ip:port` (a free port on its node, as the fleet picks ports) and its node;
2. the ranks are numbered by their nodes' ids (engine/sharding.py `ranks_by_node`), so a node keeps its
   rank, and its disk's blocks, when the replica starts again over the same nodes, whichever node Serve
   puts the replica on; the replica is the leader, whatever its rank;
3. every rank, the leader included, joins MLX's group at once (ring: from a hostfile of the ranks' addresses;
   JACCL: from the device matrix the leader built from every rank's RDMA links, engine/jaccl.py), loads the
   model and keeps its part;
4. the followers then run the leader's turns (engine/lockstep.py) until the leader stops.

The actors are the leader's children: they die with it, and Serve replaces the replica whole. A follower
that dies is seen two ways: a collective in progress fails ("connection to a peer was lost"), and the leader's
watch on each follower's `until_stopped` call ends at once (Ray fails a dead actor's pending calls). The
watch matters: MLX's ring can wait forever in a collective whose peer died before it began (seen in 1 of
7 kills on this box), so the leader fails its requests from the watch's thread without waiting on the model
thread (ShardedScheduler.abandon); its health check then fails and Serve replaces it whole.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import ray

from cluster.actors.plan import FetchPlan
from cluster.config import NODE_RESOURCE, AppConfig, ModelSpec
from cluster.node import current_node

log = logging.getLogger(__name__)

RANK_RESOURCE_SHARE = 0.001
START_TIMEOUT_S = 600.0


def node_ip() -> str:
    return ray.util.get_node_ip_address()


def rank_address() -> str:
    """This node's `ip:port` for MLX's ring (a port free now on this node's address)."""
    from cluster.ports import free_port

    ip = node_ip()
    return f"{ip}:{free_port(ip)}"


class ShardRank:
    """A follower of a sharded replica (in bundle `bundle` > 0): the model's part on this node, following
    the leader's turns. Its rank comes with `start`."""

    def __init__(self, spec: ModelSpec, app: AppConfig, bundle: int):
        from cluster.engine.sharded_scheduler import ShardedScheduler

        self.spec, self.app, self.rank = spec, app, None
        self.node = current_node(app.data_dir)
        self.disk = None  # its prefix cache's disk client, once loaded (flushed when the rank stops)
        self.scheduler = ShardedScheduler(name=f"mlx-fleet-{spec.name}-bundle{bundle}", batching=spec.batching,
                                   decode_concurrency=spec.decode_concurrency or spec.max_ongoing_requests,
                                   prefill_concurrency=spec.prefill_concurrency)

    def address(self) -> tuple[str, str, Optional[list]]:
        """This rank's `ip:port`, node, and (`shard_backend: jaccl`) RDMA links. Its node's disk tier is reached
        here too, before the leader waits for every rank in the group's start."""
        from cluster.actors.node_store import disk_link

        self.link = disk_link(self.node, self.app)  # this node's disk tier: the rank spills its own blocks there
        return rank_address(), self.node.node_id, rdma_links(self.spec)

    def start(self, addresses: list[str], rank: int, leader: int, devices: Optional[list] = None) -> dict:
        """Join the group as `rank` (`addresses` in rank order; `devices`: JACCL's device matrix, else ring), load
        and shard the model, then follow the leader's turns (returns once following)."""
        from cluster.engine.lockstep import Lockstep

        t0 = time.monotonic()
        self.rank = rank
        parts = self.scheduler.run(lambda: load_rank(self.spec, self.app, self.node.data_dir, rank, addresses,
                                                     getattr(self, "link", None), devices))
        self.disk, self.parts = parts.disk, parts
        self.scheduler.join(Lockstep(parts.group, leader), parts.rebuild, self._reader(parts.read_ahead))
        log.info("rank %d of %s ready on node %s in %.1f s", self.rank, self.spec.name, self.node.node_id,
                 time.monotonic() - t0)
        return {"rank": self.rank, "node_id": self.node.node_id, "node_name": self.node.name,
                "namespace_hex": parts.namespace.hex() if parts.namespace is not None else None}

    def _reader(self, read_ahead: Optional[Callable]) -> Optional[Callable]:
        """The leader's `prefetch` item -> this rank's read, pulling its own blocks from its counterpart's node
        where the leader's plan pulls (none where that node is this one: its disk is already read)."""
        if read_ahead is None:
            return None

        def read(prompt: list[int], pull: Optional[dict]) -> None:
            try:  # the model thread: a bad plan means no pull, never a lost rank
                plan = FetchPlan.from_shared(pull).for_rank(self.rank, self.spec.shards) if pull else None
            except Exception:
                log.exception("rank %d of %s: the leader's pull plan is unreadable; reading without it", self.rank,
                              self.spec.name)
                plan = None
            read_ahead(prompt, plan if plan is not None and plan.peer != self.node.node_id else None)
        return read

    def cache_stats(self) -> Optional[dict]:
        """This rank's prefix cache, for the leader's status (None before `start`)."""
        parts = getattr(self, "parts", None)
        return parts.cache_stats() if parts is not None else None

    def alive(self) -> bool:
        return self.scheduler.alive

    def until_stopped(self) -> None:
        """Return when this rank's model thread ends (the leader's watch: a dead actor fails this call at once)."""
        self.scheduler.wait_stopped()

    def close(self, timeout_s: float = 10.0) -> bool:
        """The leader stops (its last share stops this rank's model thread): let this rank's queued spills reach
        its disk, as a leader's do, before the process goes. Whether they all did."""
        stopped = self.scheduler.wait_stopped(timeout_s)
        if self.disk is None:
            return stopped
        done = self.disk.flush(timeout_s=timeout_s)
        self.disk.close()
        return stopped and done


@dataclass
class Follower:
    """What a follower's model thread set up (load_rank)."""

    group: object  # its mx.distributed group
    rebuild: Callable  # the leader's request -> this rank's Sequence (engine/lockstep.py)
    setup: object  # its CacheSetup: its own prefix cache, or why it has none
    restore: Optional[object]  # its side of the ranks' agreement (kvcache/shard_restore.py), with a cache

    @property
    def read_ahead(self) -> Optional[Callable]:
        """(prompt, pull) starts its read of a prompt's prefix."""
        return self.restore.read_ahead if self.restore is not None else None

    @property
    def disk(self):
        """Its cache's DiskClient, or None."""
        return self.setup.cache.tiers.disk if self.setup.cache is not None else None

    @property
    def namespace(self) -> Optional[bytes]:
        """Its cache's fingerprint (its rank's), or None."""
        return self.setup.cache.namespace if self.setup.cache is not None else None

    def cache_stats(self) -> dict:
        """Its cache as status shows the leader's (replica.py cache_stats): read off the model thread, counters only."""
        pc = self.setup.cache
        if pc is None:
            return {"enabled": False, "reason": self.setup.disabled_reason}
        return {"enabled": True, "namespace": self.setup.fingerprint.short, "namespace_hex": pc.namespace.hex(),
                "shard_restore": self.restore.stats(),
                "migration": self.restore.admission.peers.stats(),
                **pc.stats()}


def load_rank(spec: ModelSpec, app: AppConfig, node_dir: Path, rank: int, addresses: list[str],
              link=None, devices: Optional[list] = None) -> Follower:
    """A follower's model thread: its group, its part of the model, its own prefix cache (RAM, and `link`, its
    node's disk tier, or None), and how it rebuilds the leader's requests. Each step runs at the same point as
    the leader's (replica.py `_load`): the cache's probes are forwards, whose collectives pair up.

    Its spills are written through as blocks are made (the leader holds its own until its model thread is
    idle: a follower waits inside the next turn's collective then, with no idle time of its own to spill in)."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.models.loading import load_model
    from mlx_lm.models.cache import make_prompt_cache

    from cluster.engine.cold_session import ColdSession
    from cluster.engine.constraints import Grammars
    from cluster.engine.schedule import Schedule
    from cluster.engine.sequence import Sequence
    from cluster.engine.sharding import geometry, join_group, shard
    from cluster.kvcache.admission import ADMISSION_THREADS, Admission
    from cluster.kvcache.peers import PeerClient
    from cluster.kvcache.session import BlockSession
    from cluster.kvcache.setup import setup_cache
    from cluster.kvcache.shard_restore import ShardRestore, cache_on_every_rank
    from cluster.models.resolve import resolve_model

    group = join_group(rank, addresses, Path(node_dir), devices)
    model_dir = resolve_model(spec.source, Path(app.data_dir).expanduser())
    model, tokenizer = load_model(model_dir, lazy=True)
    shard(model, group, spec.shard_mode)
    setup = cache_on_every_rank(setup_cache(model, tokenizer, model_dir, app.cache, node_dir, store_link=link,
                                            prefill_step=spec.prefill_step_tokens,
                                            shard=geometry(spec.shard_mode, spec.shards, rank)), group)
    pc = setup.cache
    schedule = pc.schedule if pc is not None else \
        Schedule.of(app.cache.resume_at, app.cache.block_tokens, spec.prefill_step_tokens)
    new_caches = pc.new_caches if pc is not None else (lambda: make_prompt_cache(model))
    restore = ShardRestore(Admission(pc, peers=PeerClient(pc.namespace), fetch_timeout_s=app.routing.fetch_timeout_s),
                           group, ThreadPoolExecutor(ADMISSION_THREADS, f"mlx-fleet-admit-r{rank}")) \
        if pc is not None else None
    grammars = Grammars(tokenizer._tokenizer)

    def rebuild(prompt, params, prefill_step, cached):
        if cached and pc is None:  # the leader has a cache and this rank none: they would part, so stop here
            raise RuntimeError(f"rank {rank} of {spec.name} has no prefix cache but its leader restores from one")
        session = BlockSession(pc, prompt, None, restore) if cached else ColdSession(model, new_caches, schedule)
        seq = Sequence(prompt, params, model, tokenizer, session, prefill_step, grammars)
        seq.compile_grammar()
        return seq
    return Follower(group, rebuild, setup, restore)


def rdma_links(spec: ModelSpec) -> Optional[list]:
    """This node's RDMA links where the replica's group is JACCL (engine/jaccl.py), else None."""
    if spec.shard_backend != "jaccl":
        return None
    from cluster.engine.jaccl import check_available, local_links

    check_available()
    return local_links()


def start_ranks(spec: ModelSpec, app: AppConfig) -> tuple[list, list[tuple[str, str, Optional[list]]]]:
    """The leader's side: the follower actors in this replica's placement group, and each one's (`ip:port`,
    node id, RDMA links or None), in bundle order."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError(f"{spec.name}: shards: {spec.shards} needs the replica's placement group (app.py)")
    remote = ray.remote(ShardRank)
    actors = [remote.options(
        num_cpus=0, resources={NODE_RESOURCE: RANK_RESOURCE_SHARE},
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
        max_concurrency=4,  # `until_stopped` waits for the whole life of the rank, beside `start` and `alive`
        name=None).remote(spec, app, b) for b in range(1, spec.shards)]
    return actors, ray.get([a.address.remote() for a in actors], timeout=START_TIMEOUT_S)


class ShardGroup:
    """The leader's side of a sharded replica (the Serve replica, on node `node_id`): its followers, every
    rank's address, its own rank, and the group once joined."""

    def __init__(self, spec: ModelSpec, app: AppConfig, model_dir: Path, node_id: str):
        from cluster.engine.sharding import check_shardable, ranks_by_node
        from cluster.models.resolve import read_config

        config = read_config(model_dir)
        mode = check_shardable(config.get("model_type", "?"), spec.shard_mode, spec.shards, config)
        self.spec = spec.model_copy(update={"shard_mode": mode})  # auto resolved: every rank splits the same way
        spec = self.spec
        links = rdma_links(spec)  # first: a leader without JACCL says so before any follower starts
        self.actors, theirs = start_ranks(spec, app)
        joined = [(rank_address(), node_id, links), *theirs]
        ranks = ranks_by_node([n for _, n, _ in joined])
        self.rank = ranks[0]  # the leader's
        in_order = [j for _, j in sorted(zip(ranks, joined))]
        self.addresses = [a for a, _, _ in in_order]  # as the hostfile lists them
        self.devices = None  # ring; JACCL's device matrix where the spec asks for it (engine/jaccl.py)
        if spec.shard_backend == "jaccl":
            from cluster.engine.jaccl import device_matrix

            self.devices = device_matrix([lk for _, _, lk in in_order], [n for _, n, _ in in_order])
        self._starts = [a.start.remote(self.addresses, r, self.rank, self.devices)
                        for a, r in zip(self.actors, ranks[1:])]
        self.group = None
        self.node_id = node_id
        self.ranks: list[dict] = []
        self.caches: dict[int, dict] = {}  # each follower's cache stats by rank, as last read (`refresh`)

    def geometry(self) -> dict:
        """The leader's place in the model (its cache's fingerprint names it)."""
        from cluster.engine.sharding import geometry

        return geometry(self.spec.shard_mode, self.spec.shards, self.rank)

    def load(self, model_dir: Path, node_dir: Path):
        """The leader's model thread: join the group, load the model lazily and keep its own part."""
        from cluster.models.loading import load_model

        from cluster.engine.sharding import join_group, shard

        self.group = join_group(self.rank, self.addresses, Path(node_dir), self.devices)
        model, tokenizer = load_model(model_dir, lazy=True)
        shard(model, self.group, self.spec.shard_mode)
        return model, tokenizer

    def lead(self, scheduler) -> None:
        """Once every follower is following: the leader's scheduler leads the turns from now on."""
        from cluster.engine.lockstep import Lockstep

        self.ranks = ray.get(self._starts, timeout=START_TIMEOUT_S)
        scheduler.join(Lockstep(self.group, self.rank))
        self._watch(scheduler)

    def _watch(self, scheduler) -> None:
        """A thread (no MLX work) that abandons the leader's scheduler the moment a follower ends while it serves."""
        import threading

        waits = {a.until_stopped.remote(): r for a, r in zip(self.actors, self.ranks)}

        def watch() -> None:
            [ended], _ = ray.wait(list(waits), num_returns=1)
            try:
                ray.get(ended)
                how = "its model thread stopped"
            except Exception as e:  # the actor died: its process was killed, or its node went away
                how = f"{type(e).__name__}"
            if not scheduler.stopping:
                rank = waits[ended]
                scheduler.abandon(f"rank {rank['rank']} of this sharded replica (node {rank['node_id']}) was lost "
                                  f"({how}); it is being replaced, retry shortly")
        threading.Thread(target=watch, name=f"mlx-fleet-{self.spec.name}-watch", daemon=True).start()

    def close(self, timeout_s: float = 10.0) -> None:
        """After the leader's scheduler stopped (its last share stops the followers): wait, `timeout_s` at most,
        for each follower to write its queued spills to its disk, before this process, and so its children, go."""
        try:
            done = ray.get([a.close.remote(timeout_s) for a in self.actors], timeout=timeout_s + 5)
        except Exception as e:  # a follower already gone: nothing of its own to wait for
            log.warning("%s: not every rank closed cleanly: %s", self.spec.name, e)
            return
        if not all(done):
            log.warning("%s: rank(s) %s did not write all their queued spills in %.0f s", self.spec.name,
                        [r["rank"] for r, ok in zip(self.ranks, done) if not ok], timeout_s)

    async def check(self, timeout_s: float = 10.0) -> None:
        """Raise unless every follower answers and its model thread lives (Serve then replaces the replica)."""
        import asyncio

        alive = await asyncio.wait_for(asyncio.gather(*(a.alive.remote() for a in self.actors)), timeout_s)
        dead = [r["rank"] for r, ok in zip(self.ranks, alive) if not ok]
        if dead:
            raise RuntimeError(f"rank(s) {dead} of {self.spec.name} lost their model thread")

    def rank_caches(self, namespace: bytes) -> list[dict]:
        """Each rank's node and cache fingerprint, by rank (the leader's is `namespace`): the router plans pulls
        between sharded replicas that agree on all of them (fleet_view.py ReplicaInfo.geometry)."""
        mine = {"rank": self.rank, "node_id": self.node_id, "namespace_hex": namespace.hex()}
        return sorted([mine, *({k: r.get(k) for k in ("rank", "node_id", "namespace_hex")} for r in self.ranks)],
                      key=lambda r: r["rank"])

    def refresh(self, timeout_s: float = 2.0) -> None:
        """Read each follower's cache stats (the replica's metrics thread: never where a request waits)."""
        try:
            got = ray.get([a.cache_stats.remote() for a in self.actors], timeout=timeout_s)
        except Exception as e:  # a follower gone or slow: its last stats stay (the health check acts on it)
            log.debug("%s: follower stats not read: %s", self.spec.name, e)
            return
        self.caches = {r["rank"]: c for r, c in zip(self.ranks, got) if c is not None}

    def stats(self, node: dict) -> dict:
        """`nodes`: the leader's (`node`) first, then its followers', each with its rank and its cache's stats (as
        last read: `refresh`; the leader's own are the replica's `cache`)."""
        return {"size": self.spec.shards, "mode": self.spec.shard_mode, "backend": self.spec.shard_backend,
                "nodes": [{**node, "rank": self.rank}] + [{"node_id": r["node_id"], "node_name": r["node_name"],
                                                           "rank": r["rank"], "cache": self.caches.get(r["rank"])}
                                                          for r in self.ranks]}
