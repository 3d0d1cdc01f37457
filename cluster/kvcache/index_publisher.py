"""Keeps this node's entries of one model namespace in the fleet index true (store/fleet_index.py).

One writer per node and namespace: the node's replica of that model. What it
publishes comes from the tiers' events, never from scans:
- RAM: the tier's own stored/evicted events, in process;
- disk: the node store's event log, as the replica's DiskClient follows it
  (exactly once, or a detected gap answered by a resync - which replaces the
  node's disk entries wholesale).
Events are queued (never blocking the model thread that stores blocks) and
flushed in one pipeline as soon as they come, at most every `gap_s` (a burst
goes in one pipeline), and the lease renewed at least every `flush_s`. Before,
events waited for the next `flush_s` tick: a prompt repeated within 0.2 s of its
first run's blocks was routed as a miss.

Full announces. The node's whole holding (RAM and disk) is written at start
(a restarted node re-announces what its disk holds), and again whenever its
lease renewal finds the lease gone: Redis restarted empty, or the node was
away long enough to be collected. Redis errors mark the publisher dirty, and
the next success starts with a full announce, so nothing is lost while Redis
is away. Every `gc_s` it also deletes the entries of dead nodes in its
namespace.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from cluster.store.events import BlockEvent
from cluster.store.fleet_index import FleetIndex
from cluster.store.redis_client import redact

log = logging.getLogger(__name__)


class IndexPublisher:
    def __init__(self, index: FleetIndex, namespace: bytes, node_id: str, tiers, lease: Callable[[], dict],
                 ttl_s: float = 6.0, flush_s: float = 0.2, gc_s: float = 10.0, gap_s: float = 0.02):
        self.index = index
        self.ns = namespace
        self.node = node_id
        self.tiers = tiers
        self.lease = lease
        self.ttl_ms = int(ttl_s * 1000)
        self.renew_s = ttl_s / 3
        self.flush_s = flush_s
        self.gap_s = gap_s
        self._wake = threading.Event()  # events queued: flush now
        self._wake.set()  # and the first full announce at once
        self.gc_s = gc_s
        self.generation = 0
        self._pending: dict[tuple[str, str], tuple[set, set]] = {}
        self._disk_resync: Optional[list] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dirty = True  # start with a full announce
        self._last_lease: dict = {}
        self.counters = {"announces": 0, "flushes": 0, "events": 0, "errors": 0, "collected": 0}
        self._thread = threading.Thread(target=self._run, name="mlx-fleet-index", daemon=True)
        self._thread.start()

    # -- inputs (any thread; never blocking) ------------------------------------------------
    def on_event(self, event: BlockEvent) -> None:
        self.on_events([event])

    def on_events(self, events: list[BlockEvent]) -> None:
        with self._lock:
            for e in events:
                added, removed = self._pending.setdefault(("kv" if e.kind == "kv" else "ck", e.tier), (set(), set()))
                if e.event == "stored":
                    added.add(e.block_id)
                    removed.discard(e.block_id)
                else:
                    removed.add(e.block_id)
                    added.discard(e.block_id)
            self.counters["events"] += len(events)
        self._wake.set()

    def on_disk_resync(self, holdings: list) -> None:
        """The disk's whole holding after a gap in its events: replaces the node's disk entries."""
        with self._lock:
            self._disk_resync = holdings
            for kind in ("kv", "ck"):
                self._pending.pop((kind, "disk"), None)
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            self.index.withdraw(self.ns, self.node)
        except Exception:  # it expires on its own
            pass

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far is in Redis (tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                idle = not self._pending and self._disk_resync is None and not self._dirty
            if idle:
                return True
            time.sleep(0.02)
        return False

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        next_renew = next_gc = 0.0
        while not self._stop.wait(self.gap_s):  # what comes within the gap goes in the same pipeline
            self._wake.wait(self.flush_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                now = time.monotonic()
                if self._dirty:
                    self._announce()
                lease = self._lease()
                if now >= next_renew or _load_of(lease) != _load_of(self._last_lease):
                    # Renewed on schedule, and at once when the load changed: routing reads it.
                    self._last_lease = lease
                    if not self.index.renew(self.ns, self.node, {**lease, "renewed": time.time()}, self.ttl_ms,
                                            existing_only=True):
                        log.info("index lease for %s was gone (Redis restarted or node collected): re-announcing",
                                 self.node)
                        self._announce()
                    next_renew = now + self.renew_s
                self._flush()
                if now >= next_gc:
                    collected = self.index.collect(self.ns)
                    self.counters["collected"] += len(collected)
                    if collected:
                        log.info("collected the index entries of dead node(s) %s", ", ".join(collected))
                    next_gc = now + self.gc_s
            except Exception as e:  # Redis away: keep serving, announce everything once it is back
                if not self._dirty:
                    log.warning("fleet index unreachable (%s); will re-announce", redact(str(e)))
                self._dirty = True
                self.counters["errors"] += 1
                next_renew = 0.0
                self._stop.wait(self.flush_s)  # retry at the tick, not at every event

    def _lease(self) -> dict:
        """The lease payload (its `renewed` time is added when written)."""
        return {**self.lease(), "generation": self.generation}

    def _written(self) -> dict:
        return {**self._lease(), "renewed": time.time()}

    def _announce(self) -> None:
        """Publish the node's whole holding: RAM from the tier, disk from the node store."""
        with self._lock:  # events from here on are applied after the snapshot, in order
            self._pending.clear()
            self._disk_resync = None
        ram = self.tiers.ram_holdings()
        disk = self.tiers.disk.holdings() if self.tiers.disk is not None else []
        if not self.generation or self._dirty:
            self.generation = self.index.next_generation(self.ns, self.node)
        for tier, held in (("ram", ram), ("disk", disk)):
            self.index.replace(self.ns, self.node, tier, [b for _, k, b, *_ in held if k == "kv"],
                               [b for _, k, b, *_ in held if k != "kv"])
        self.index.renew(self.ns, self.node, self._written(), self.ttl_ms)
        self._dirty = False
        self.counters["announces"] += 1

    def _flush(self) -> None:
        with self._lock:
            changes, self._pending = self._pending, {}
            resync, self._disk_resync = self._disk_resync, None
        try:
            if resync is not None:
                self.index.replace(self.ns, self.node, "disk", [b for _, k, b, *_ in resync if k == "kv"],
                                   [b for _, k, b, *_ in resync if k != "kv"])
            if changes:
                self.index.apply(self.ns, self.node, changes)
                self.counters["flushes"] += 1
        except Exception:
            self._dirty = True  # what was taken is lost: the next announce rewrites everything
            raise


def _load_of(lease: dict) -> tuple:
    return lease.get("active"), lease.get("queued_tokens"), lease.get("by_origin")
