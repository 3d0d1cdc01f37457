"""The replica's view of its node's disk tier, for one model namespace (the store contract).

Writes (spills) go through the node's store, which owns the directory: they
queue here and a background thread ships them in batches, waiting for each
batch's acknowledgement, so at most one batch is in flight.

A spill may come as the envelope's bytes or as a `Pending` one: a device
block's numpy views and the function that encodes them, run on this client's
thread, so the model thread never spends the copy or the checksum.

The spill queue is bounded (bytes). When it is full, the **oldest pending spill
is dropped** and counted; generation never waits for the disk. Why drop rather
than push back: a slow or failing disk must not slow down serving, and a dropped
block is not lost for good - it is still in the RAM tier, and goes back into
this queue when the RAM tier evicts it. The oldest entry goes first because the
newest belong to requests still running, whose next turn is the likeliest reuse.

`on_disk` (what this replica believes the disk holds, so it does not spill a
block twice) follows the store's event log: stored and evicted events arrive
exactly once, and a gap in them (or a restarted store) triggers a resync from
the store's key list. Blocks this replica serves from RAM are reported as uses
(`touch`, batched), so the disk's LRU keeps them too: the hottest prefixes are
the last to leave the disk, and so survive a restart.

Reads go straight to the files: the store pins the blocks and returns their
paths, this process reads and verifies them (one copy from the page cache, no
IPC of the bytes), then releases the pins and reports what failed. Lookups and
reads are only ever made from admission threads, under deadlines, behind a
circuit breaker (see admission.py); never from the model thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as ReadTimeout
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from cluster.kvcache.breaker import Breaker
from cluster.kvcache.store_link import StoreLink
from cluster.store.block_files import read_verified

log = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20
READ_THREADS = 4
SYNC_PERIOD_S = 1.0


@dataclass(frozen=True)
class Taken:
    """A block read that the caller took as it arrived (get_many's `arrived`): its size, not its bytes."""

    nbytes: int

    def __len__(self) -> int:
        return self.nbytes


@dataclass
class Pending:
    """A spill whose envelope is made when it is written: `encode()` gives its bytes (off the model thread)."""

    nbytes: int  # about what the envelope will take: what the queue bound counts
    encode: Callable[[], object]


class DiskClient:
    def __init__(self, link: StoreLink, namespace: bytes, queue_bytes: int = 256 << 20,
                 lookup_timeout_s: float = 1.0, read_timeout_s: float = 10.0, breaker: Optional[Breaker] = None):
        self.link = link
        self.ns = namespace
        self.queue_bytes = queue_bytes
        self.lookup_timeout_s = lookup_timeout_s
        self.read_timeout_s = read_timeout_s
        self.breaker = breaker or Breaker()
        # Where a read's bytes land (read_file): a device replica on CUDA reads into page-locked buffers
        # (kernels/cuda_upload.PinnedBuffers: take(n), stats(); set by setup_cache); else fresh ordinary memory.
        self.buffers = None
        # Told each acknowledged batch's (bytes, seconds), fsync included: the write speed that stands in for
        # the read speed until a read is measured (costs.py; set by setup_cache).
        self.on_written: Optional[Callable[[int, float], None]] = None
        self.on_disk: set[bytes] = set()
        # Each block's size as the store's events and resyncs report it. A map, not a running sum: a
        # resync's key list already holds the events read with it, and applying them again is a no-op.
        self._sizes: dict[bytes, int] = {}
        self.disk_bytes = 0  # bytes of this namespace's blocks on the node's disk: sum(self._sizes)
        self._queue: deque[tuple[bytes, Union[np.ndarray, Pending]]] = deque()
        self._queued: set[bytes] = set()
        self._pending_bytes = 0
        self._touches: set[bytes] = set()
        self._reports: list[tuple[bytes, str, str]] = []
        self._cursor: Optional[int] = None  # None: resync before trusting events
        self._epoch: Optional[str] = None
        self._next_sync = 0.0
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        # The fleet index follows this disk too: events as they are applied, and every resync.
        self.on_events: Optional[Callable[[list], None]] = None
        self.on_resync: Optional[Callable[[list], None]] = None
        self.counters = {"spilled": 0, "dropped_spills": 0, "spill_errors": 0, "read_errors": 0,
                         "disk_hits": 0, "disk_misses": 0, "lookup_errors": 0, "refused_by_breaker": 0,
                         "touches_sent": 0, "resyncs": 0, "events_applied": 0}
        # Reads overlap: several files in flight keep an SSD's queue busy (file reads release the GIL).
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="mlx-fleet-read")
        self._thread = threading.Thread(target=self._run, name="mlx-fleet-disk", daemon=True)
        self._thread.start()

    # -- the store contract ----------------------------------------------------------
    def present(self, keys: list[bytes]) -> list[bool]:
        """Ask the store (deadline, breaker); a store that cannot answer holds nothing."""
        if not keys:
            return []
        found = self._guarded(lambda: self.link.present(self.ns, keys, self.lookup_timeout_s), "lookup")
        if found is None:
            return [False] * len(keys)
        return found

    def get_many(self, keys: list[bytes], sample: bool = False,
                 arrived: Optional[Callable[[int, np.ndarray], Optional["Taken"]]] = None,
                 timing: Optional[dict] = None) -> list:
        """Read and verify blocks; misses, bad and unreadable blocks are None. `sample`: a measurement of the
        disk, not a hit (admission.py): ordinary memory (a first read would otherwise time the page-locked
        buffers' making) and not counted as hits. `arrived(i, data)`: called with each good block, in order,
        as soon as it and those before it are read (the admission moves them to the device meanwhile); where it
        returns a `Taken`, the result holds that in the block's place, so its buffer goes once the caller is done
        with it, not after the last read. `timing["read_s"]`: from the start to the last read's end (what the
        caller did with the blocks meanwhile not counted)."""
        if not keys:
            return []
        opened = self._guarded(lambda: self.link.open_read(self.ns, keys, self.lookup_timeout_s), "read")
        if opened is None:
            return [None] * len(keys)
        lease, located = opened
        out, good, failed = [], [], []
        alloc = self.buffers.take if self.buffers is not None and not sample else None
        t0, ended = time.perf_counter(), []

        def read(loc, key):
            try:
                return read_verified(loc, self.ns, key, alloc)
            finally:
                ended.append(time.perf_counter())

        reads = self._pool.map(read, located, keys, timeout=self.read_timeout_s)
        try:
            for i, (key, (data, failure)) in enumerate(zip(keys, reads)):
                if failure is not None:
                    failed.append(failure)
                    self.counters["read_errors"] += 1
                    if failure.bad_content or failure.reason == "ENOENT":  # gone, or about to be quarantined
                        with self._cond:
                            self.on_disk.discard(key)
                elif data is not None:
                    good.append(key)
                if not sample:
                    self.counters["disk_hits" if data is not None else "disk_misses"] += 1
                out.append(data if arrived is None or data is None else self._arrived(arrived, i, data))
        except ReadTimeout:  # the disk is too slow: what was not read in time is a miss (its pin expires)
            log.warning("disk reads took longer than %.1fs; the rest of this restore is a miss", self.read_timeout_s)
            self.breaker.failure()
            out += [None] * (len(keys) - len(out))
        try:
            self.link.close_read(lease, good, failed)
        except Exception as e:
            log.warning("releasing a disk read failed: %s", e)
        if timing is not None:
            timing["read_s"] = (max(ended) if ended else time.perf_counter()) - t0
        return out

    @staticmethod
    def _arrived(arrived, i: int, data: np.ndarray):
        """What the result keeps for a good read: `arrived`'s Taken, or the bytes (where it returns None, or
        fails: the caller then decodes them itself, and the read still ends in close_read)."""
        try:
            taken = arrived(i, data)
        except Exception:
            log.exception("taking block %d of a disk read as it arrived failed; it stays in the read's result", i)
            return data
        return data if taken is None else taken

    def backlog_bytes(self) -> int:
        """Bytes queued or being written now."""
        with self._cond:
            return self._pending_bytes

    def holds(self, key: bytes) -> bool:
        """The disk has this block, or it is queued for it."""
        with self._cond:
            return key in self.on_disk or key in self._queued

    def put(self, key: bytes, data) -> None:
        """Queue a block (its envelope, or a Pending one) for the disk unless it is there or queued
        already; never blocks."""
        arr = data if isinstance(data, (np.ndarray, Pending)) else np.frombuffer(data, dtype=np.uint8)
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

    def discard(self, key: bytes, reason: str, detail: str = "") -> None:
        """A block refused at decode: have the store quarantine it (asynchronously, never waited on)."""
        with self._cond:
            self.on_disk.discard(key)
            self._reports.append((key, reason, detail))
            self._cond.notify()

    def stats(self) -> dict:
        with self._cond:
            return {**self.counters, "queued": len(self._queue), "queued_bytes": self._pending_bytes,
                    "known_on_disk": len(self.on_disk), "breaker": self.breaker.state,
                    **({"read_buffers": self.buffers.stats()} if self.buffers is not None else {})}

    # -- uses, and background work ------------------------------------------------------------
    def touch(self, keys: list[bytes]) -> None:
        """Blocks served from RAM: tell the disk they were used (batched, asynchronous)."""
        with self._cond:
            self._touches.update(k for k in keys if k in self.on_disk)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued spill was acknowledged (tests, shutdown)."""
        with self._cond:
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._queue and not self._busy and not self._reports, timeout_s)

    def sync_events(self) -> None:
        """Apply the store's events now (the background thread does it every second)."""
        with self._cond:
            self._next_sync = 0.0
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._next_sync > 0.0, 30.0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _guarded(self, call, what: str):
        if not self.breaker.allow():
            self.counters["refused_by_breaker"] += 1
            return None
        try:
            result = call()
        except Exception as e:  # slow, dead or restarting store: a miss, and the breaker learns
            self.counters["lookup_errors"] += 1
            self.breaker.failure()
            log.warning("disk %s failed (breaker %s): %s", what, self.breaker.state, e)
            return None
        self.breaker.success()
        return result

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._reports or self._closed
                                    or time.monotonic() >= self._next_sync, timeout=SYNC_PERIOD_S)
                if self._closed and not self._queue:
                    return
                batch, size = [], 0
                while self._queue and size < BATCH_BYTES:
                    key, arr = self._queue.popleft()
                    batch.append((key, arr))
                    size += arr.nbytes
                reports, self._reports = self._reports, []
                touches, self._touches = list(self._touches), set()
                sync = time.monotonic() >= self._next_sync
                self._busy = bool(batch)
            self._send_reports(reports, touches)
            if batch:
                self._write(batch)
            if sync:
                self._sync()
            with self._cond:
                self._busy = False
                if sync:
                    self._next_sync = time.monotonic() + SYNC_PERIOD_S
                self._cond.notify_all()

    def _send_reports(self, reports: list, touches: list[bytes]) -> None:
        try:
            for key, reason, detail in reports:
                self.link.quarantine(self.ns, key, reason, detail)
            if touches:
                self.link.touch(self.ns, touches)
                self.counters["touches_sent"] += len(touches)
        except Exception as e:
            log.warning("could not report to the disk tier: %s", e)

    def _write(self, batch: list) -> None:
        acked = []
        if self.breaker.allow():
            try:
                items = self._encoded(batch)
                t0 = time.perf_counter()
                self.link.write(self.ns, items)
                seconds = time.perf_counter() - t0
                acked = [k for k, _ in items]
                self.breaker.success()
            except Exception as e:  # the store is down or slow: these spills are lost, RAM keeps the blocks
                log.warning("spill of %d blocks failed: %s", len(batch), e)
                self.breaker.failure()
            if acked and self.on_written is not None:
                try:  # a measurement: it never fails a spill, nor stops this thread
                    self.on_written(sum(a.nbytes for _, a in items), seconds)
                except Exception:
                    log.exception("reporting a spill's write speed failed")
        with self._cond:
            for key, arr in batch:
                self._queued.discard(key)
                self._pending_bytes -= arr.nbytes
            self.on_disk.update(acked)
            self.counters["spilled"] += len(acked)
            self.counters["spill_errors"] += len(batch) - len(acked)

    def _encoded(self, batch: list) -> list:
        """The batch with every Pending spill encoded; one that fails to encode is not written."""
        out = []
        for key, arr in batch:
            if isinstance(arr, Pending):
                try:
                    arr = np.frombuffer(arr.encode(), dtype=np.uint8)
                except Exception:  # a block not spilled is a later miss, never a wrong answer
                    log.exception("encoding block %s for the disk failed", key.hex()[:16])
                    continue
            out.append((key, arr))
        return out

    def _sync(self) -> None:
        """Follow the store's event log; resync from its key list after a gap or a store restart."""
        try:
            while True:
                batch = self.link.events_since(self._cursor or 0, self._epoch)
                if batch.gap or self._cursor is None:
                    held = self.link.holdings(self.ns)  # read after the batch: see events.py
                    with self._cond:
                        self.on_disk = {key for key, *_ in held}
                        self._sizes = {key: size for key, *_, size in held}
                        self.disk_bytes = sum(self._sizes.values())
                    self.counters["resyncs"] += 1
                    if self.on_resync is not None:
                        self.on_resync(held)
                self._apply(batch.events)
                self._cursor, self._epoch = batch.cursor, batch.epoch
                if not batch.events:
                    return
        except Exception as e:
            log.debug("disk event sync failed: %s", e)

    def holdings(self) -> list[tuple[bytes, str, bytes, int]]:
        """(key, kind, block id, bytes) of everything the disk holds for this namespace (one store call)."""
        return self.link.holdings(self.ns)

    def _apply(self, events: list) -> None:
        mine = [e for e in events if e.namespace == self.ns]
        with self._cond:
            for e in mine:
                if e.event == "stored":
                    self.on_disk.add(e.key)
                    self.disk_bytes += e.nbytes - self._sizes.get(e.key, 0)
                    self._sizes[e.key] = e.nbytes
                else:
                    self.on_disk.discard(e.key)
                    self.disk_bytes -= self._sizes.pop(e.key, 0)
                self.counters["events_applied"] += 1
        if mine and self.on_events is not None:
            self.on_events(mine)
