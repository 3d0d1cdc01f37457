"""The replica's side of its node's disk tier.

Writes (spills) go through the node's store, which owns the directory: they
queue here and a spiller thread ships them in batches, waiting for each batch's
acknowledgement, so at most one batch is in flight.

The spill queue is bounded (bytes). When it is full, the **oldest pending spill
is dropped** and counted; generation never waits for the disk. Why drop rather
than push back: a slow or failing disk must not slow down serving, and a dropped
block is not lost for good - it is still in the RAM tier, and goes back into
this queue when the RAM tier evicts it. The oldest entry goes first because the
newest belong to requests still running, whose next turn is the likeliest reuse.

Reads (restores) go straight to the files: the store pins the blocks and
returns their paths, this process reads and verifies them (one copy from the
page cache, no IPC of the bytes), then releases the pins and reports any bad
block, which the store quarantines.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Protocol

import numpy as np

from cluster.store.disk_tier import DiskStore, read_verified

log = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20
READ_THREADS = 4
CALL_TIMEOUT_S = 30.0


class StoreLink(Protocol):
    """The node store's API, called in-process or through its Ray actor."""

    def write(self, ns: bytes, items: list[tuple[bytes, np.ndarray]]) -> dict: ...
    def contains(self, ns: bytes, keys: list[bytes]) -> list[bool]: ...
    def open_read(self, ns: bytes, keys: list[bytes]) -> tuple[int, list]: ...
    def close_read(self, lease: int, good: list[bytes], bad: list[tuple[bytes, str, str]]) -> None: ...


class LocalLink:
    """A DiskStore in this process (tests, benchmarks)."""

    def __init__(self, store: DiskStore):
        self.store = store
        self._leases: dict[int, tuple[bytes, list[bytes]]] = {}
        self._next = 0

    def write(self, ns, items):
        return self.store.write_many([(ns, k, d) for k, d in items])

    def contains(self, ns, keys):
        return self.store.contains(ns, keys)

    def open_read(self, ns, keys):
        located = self.store.open_read(ns, keys)
        self._next += 1
        self._leases[self._next] = (ns, [k for k, loc in zip(keys, located) if loc])
        return self._next, located

    def close_read(self, lease, good, bad):
        ns, pinned = self._leases.pop(lease)
        self.store.close_read(ns, pinned, good, bad)


class ActorLink:
    """The node's NodeStore actor; every call is bounded by a timeout."""

    def __init__(self, handle):
        self.handle = handle

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.handle, method).remote(*args), timeout=CALL_TIMEOUT_S)

    def write(self, ns, items):
        return self._call("write", ns, items)

    def contains(self, ns, keys):
        return self._call("contains", ns, keys)

    def open_read(self, ns, keys):
        return self._call("open_read", ns, keys)

    def close_read(self, lease, good, bad):
        self.handle.close_read.remote(lease, good, bad)  # ordered after open_read; no need to wait


class DiskClient:
    def __init__(self, link: StoreLink, namespace: bytes, queue_bytes: int = 256 << 20):
        self.link = link
        self.ns = namespace
        self.queue_bytes = queue_bytes
        self.on_disk: set[bytes] = set()
        self._queue: deque[tuple[bytes, np.ndarray]] = deque()
        self._queued: set[bytes] = set()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False  # a batch is being written
        self.counters = {"spilled": 0, "dropped_spills": 0, "spill_errors": 0, "read_errors": 0,
                         "disk_hits": 0, "disk_misses": 0}
        # Reads overlap: several files in flight keep an SSD's queue busy (file reads release the GIL).
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="mlx-fleet-read")
        self._thread = threading.Thread(target=self._run, name="mlx-fleet-spiller", daemon=True)
        self._thread.start()

    # -- spills ------------------------------------------------------------------
    def spill(self, key: bytes, data) -> None:
        """Queue a block for the disk unless it is there or queued already; never blocks."""
        arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        with self._cond:
            if key in self.on_disk or key in self._queued or self._closed:
                return
            self._queue.append((key, arr))
            self._queued.add(key)
            self._pending_bytes += arr.nbytes
            while self._pending_bytes > self.queue_bytes and len(self._queue) > 1:
                old, old_arr = self._queue.popleft()
                self._queued.discard(old)
                self._pending_bytes -= old_arr.nbytes
                self.counters["dropped_spills"] += 1
            self._cond.notify()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued spill was acknowledged (tests, shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed and not self._queue:
                    return
                batch, size = [], 0
                while self._queue and size < BATCH_BYTES:
                    key, arr = self._queue.popleft()
                    batch.append((key, arr))
                    size += arr.nbytes
                self._busy = True
            try:
                self.link.write(self.ns, batch)
                acked = [k for k, _ in batch]
            except Exception as e:  # the store is down or slow: these spills are lost, RAM keeps the blocks
                log.warning("spill of %d blocks failed: %s", len(batch), e)
                self.counters["spill_errors"] += len(batch)
                acked = []
            with self._cond:
                for key, arr in batch:
                    self._queued.discard(key)
                    self._pending_bytes -= arr.nbytes
                self.on_disk.update(acked)
                self.counters["spilled"] += len(acked)
                self._busy = False
                self._cond.notify_all()

    # -- lookups and reads ----------------------------------------------------------
    def present(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        try:
            found = self.link.contains(self.ns, keys)
        except Exception as e:
            log.warning("disk lookup failed: %s", e)
            return [False] * len(keys)
        self.on_disk.update(k for k, f in zip(keys, found) if f)
        return found

    def read(self, keys: list[bytes]) -> list[Optional[np.ndarray]]:
        """Read and verify blocks from the node's disk; misses and bad blocks are None."""
        try:
            lease, located = self.link.open_read(self.ns, keys)
        except Exception as e:
            log.warning("disk read failed: %s", e)
            return [None] * len(keys)
        out, good, bad = [], [], []
        reads = self._pool.map(read_verified, located, [self.ns] * len(keys), keys)
        for key, (data, error) in zip(keys, reads):
            if error is not None:
                bad.append(error)
                self.counters["read_errors"] += 1
                self.on_disk.discard(key)
            elif data is not None:
                good.append(key)
            self.counters["disk_hits" if data is not None else "disk_misses"] += 1
            out.append(data)
        try:
            self.link.close_read(lease, good, bad)
        except Exception as e:
            log.warning("releasing a disk read failed: %s", e)
        return out

    def discard(self, key: bytes, reason: str, detail: str) -> None:
        """A block that decoded badly at a higher level: have the store quarantine it."""
        self.on_disk.discard(key)
        try:
            lease, located = self.link.open_read(self.ns, [key])
            self.link.close_read(lease, [], [(key, reason, detail)] if located[0] else [])
        except Exception as e:
            log.warning("could not quarantine %s: %s", key.hex()[:16], e)

    def stats(self) -> dict:
        with self._cond:
            return {**self.counters, "queued": len(self._queue), "queued_bytes": self._pending_bytes}
