"""One node's disk tier: crash-safe, checksummed block files with an LRU byte budget.

Layout under the node's data dir:

    blocks/<namespace hex>/<first key byte hex>/<key hex>.blk     published blocks
    blocks/<namespace hex>/<xx>/.<key hex>.<pid>.<n>.tmp            being written
    quarantine/...                                                  refused blocks (see quarantine.py)

Publish protocol (a reader can never see a partial block):
    write to a temp name in the final directory -> durable sync of the file
    (fsync; F_FULLFSYNC on macOS) -> rename to the final name -> durable sync
    of the directory. A crash leaves at most a temp file, which recovery
    deletes. Blocks are content-named, so writing one twice is a no-op.

Reads are verified (framing, checksums, namespace, and that the block is the one
stored under its key). A block with bad content is moved to quarantine with its
reason, counted, and reported as a miss; a transient error (ENOENT, EMFILE,
EAGAIN, ...) is only a miss and a log line. Blocks being read are pinned and
never evicted under the reader. Eviction order: see DiskIndex. The budget covers
the blocks and the quarantine together, and is never exceeded by more than one
block: room is made before a write, and a write that cannot get room
(everything else pinned) is allowed only while the tier is within budget.

Every block stored or evicted is an event in `events` (see events.py), which the
replicas' views of this disk and the fleet index follow.

Disk full or I/O errors: the write is dropped and counted, the tier goes
`degraded` (shown in status and logged once), writes are retried after a
back-off, and spilling resumes by itself when space returns. Serving never
stops because of the disk.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from itertools import count
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from cluster.store import block_format
from cluster.store.block_files import ReadFailure, durable_sync, key_of, read_verified, sync_dir
from cluster.store.block_format import REASONS, BlockError
from cluster.store.disk_index import DiskIndex, Entry
from cluster.store.disk_recovery import recover
from cluster.store.events import BlockEvent, EventLog
from cluster.store.quarantine import Quarantine

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0
QUARANTINE_SHARE = 0.05  # of the budget, at most QUARANTINE_CAP
QUARANTINE_CAP = 1 << 30

Listener = Callable[[BlockEvent], None]


def default_budget(root: Path, fraction: float = 0.5, cap: int = 100 << 30) -> int:
    """Half of the free space where the blocks live, at most 100 GiB."""
    root.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(root)
    return min(int(st.f_bavail * st.f_frsize * fraction), cap)


class DiskStore:
    def __init__(self, node_dir: Path, budget: Optional[int] = None, listener: Optional[Listener] = None,
                 clock: Callable[[], float] = time.time, events_kept: int = 100_000):
        self.root = Path(node_dir) / "blocks"
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget if budget is not None else default_budget(self.root)
        self.quarantine_bin = Quarantine(Path(node_dir) / "quarantine",
                                         min(int(self.budget * QUARANTINE_SHARE), QUARANTINE_CAP))
        self.index = DiskIndex()
        self.events = EventLog(events_kept)
        self.listener = listener
        self.clock = clock
        self.write_lock = threading.Lock()
        self.degraded: Optional[dict] = None
        self._retry_at = 0.0
        self._tmp_seq = count()
        self.counters = {"written": 0, "deduped": 0, "write_errors": 0, "dropped_spills": 0, "evictions": 0,
                         "hits": 0, "misses": 0, "read_errors": 0, "bytes_written": 0, "bytes_read": 0,
                         "touched": 0, "quarantined": {r: 0 for r in REASONS}}
        self.recovery = recover(self)

    # -- paths -----------------------------------------------------------------
    def path(self, ns: bytes, key: bytes) -> Path:
        return self.root / ns.hex() / key.hex()[:2] / f"{key.hex()}.blk"

    @property
    def used(self) -> int:
        """Bytes counted against the budget: blocks plus quarantine."""
        return self.index.bytes + self.quarantine_bin.bytes

    # -- writes ------------------------------------------------------------------
    def write_many(self, items: list[tuple[bytes, bytes, object]]) -> dict[str, int]:
        """Publish (namespace, key, bytes) items; returns how many were written, deduped, dropped."""
        out = {"written": 0, "deduped": 0, "dropped": 0}
        dirs: set[Path] = set()
        with self.write_lock:
            for ns, key, data in items:
                out[self._write_one(ns, key, memoryview(data), dirs)] += 1
            for d in dirs:
                sync_dir(d)
        return out

    def _write_one(self, ns: bytes, key: bytes, data: memoryview, dirs: set) -> str:
        if key in self.index:
            self.index.touch(key, self.clock())
            self.counters["deduped"] += 1
            return "deduped"
        if self.degraded and self.clock() < self._retry_at:
            self.counters["dropped_spills"] += 1
            return "dropped"
        try:
            header = block_format.verify(data, ns, key, key_of)
        except BlockError as e:  # never publish what we could not read back
            log.warning("refusing to store a bad block %s: %s", key.hex()[:16], e)
            self.counters["dropped_spills"] += 1
            return "dropped"
        if not self._make_room(len(data)):
            self.counters["dropped_spills"] += 1
            return "dropped"
        final = self.path(ns, key)
        try:
            self._publish(final, data)
        except OSError as e:
            self._fail(e)
            return "dropped"
        dirs.add(final.parent)
        self._recovered()
        e = Entry(key=key, ns=ns, kind=header.kind, parent=header.parent if header.kind == "kv" else header.id,
                  start=header.start, tokens=header.tokens, size=len(data), atime=self.clock())
        self.index.add(e)
        self.counters["written"] += 1
        self.counters["bytes_written"] += len(data)
        self._emit("stored", e)
        return "written"

    def _publish(self, final: Path, data: memoryview) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.stem}.{os.getpid()}.{next(self._tmp_seq)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = data
            while view:
                view = view[os.write(fd, view):]
            durable_sync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    def _make_room(self, incoming: int) -> bool:
        room = self.budget - self.quarantine_bin.bytes
        for victim in self.index.evict(room, incoming):
            self._delete(victim)
            self.counters["evictions"] += 1
            self._emit("evicted", victim)
        # Within budget, or over it by at most this one block when everything else is pinned.
        return self.index.bytes + incoming <= room or self.index.bytes <= room

    def _delete(self, e: Entry) -> None:
        try:
            self.path(e.ns, e.key).unlink()
        except FileNotFoundError:
            pass

    def _fail(self, e: OSError) -> None:
        """Any write error (disk full, I/O, read-only) pauses spilling until a retry succeeds."""
        self.counters["write_errors"] += 1
        self.counters["dropped_spills"] += 1
        if self.degraded is None:
            log.warning("disk tier %s degraded, spilling paused: %s", self.root, e)
        self.degraded = {"reason": os.strerror(e.errno) if e.errno else str(e), "errno": e.errno,
                         "since": self.degraded["since"] if self.degraded else self.clock()}
        self._retry_at = self.clock() + RETRY_AFTER_S

    def _recovered(self) -> None:
        if self.degraded is not None:
            log.warning("disk tier %s writable again, spilling resumed", self.root)
            self.degraded = None

    # -- lookups, uses and reads ---------------------------------------------------------
    def present(self, ns: bytes, keys: list[bytes]) -> list[bool]:
        return [(e := self.index.get(k)) is not None and e.ns == ns for k in keys]

    def keys(self, ns: bytes) -> list[bytes]:
        """Every key held for `ns` (a consumer's resync after an event gap)."""
        return self.index.keys(ns)

    def holdings(self, ns: bytes) -> list[tuple[bytes, str, bytes, int]]:
        """(key, kind, block id, bytes) of every block held for `ns`: what a full announce publishes."""
        with self.index.lock:
            return [(e.key, e.kind, e.key if e.kind == "kv" else e.parent, e.size)
                    for e in self.index.entries.values() if e.ns == ns]

    def touch(self, ns: bytes, keys: list[bytes]) -> int:
        """Count a use of blocks some replica served from its RAM: they stay hot on disk too.

        The file's mtime moves with it, so the order survives a restart."""
        now, n = self.clock(), 0
        for k in keys:
            e = self.index.get(k)
            if e is not None and e.ns == ns and self.index.touch(k, now):
                _utime(self.path(ns, k), now)
                n += 1
        self.counters["touched"] += n
        return n

    def open_read(self, ns: bytes, keys: list[bytes]) -> list[Optional[tuple[str, int]]]:
        """Pin the present keys; return (path, size) for each, None for a miss."""
        out = []
        with self.index.lock:
            for k in keys:
                e = self.index.get(k)
                if e is not None and e.ns == ns and self.index.pin(k):
                    out.append((str(self.path(ns, k)), e.size))
                    self.counters["hits"] += 1
                else:
                    out.append(None)
                    self.counters["misses"] += 1
        return out

    def close_read(self, ns: bytes, pinned: list[bytes], good: list[bytes], failed: list[ReadFailure]) -> None:
        """Release pins; good reads count as a use, bad content goes to quarantine, the rest is a miss."""
        now = self.clock()
        for k in good:
            e = self.index.get(k)
            if e is not None and self.index.touch(k, now):
                self.counters["bytes_read"] += e.size
                _utime(self.path(ns, k), now)
        for k in pinned:
            self.index.unpin(k)
        for f in failed:
            self.counters["read_errors"] += 1
            if f.bad_content:
                self.quarantine(ns, f.key, f.reason, f.detail, file_id=f.file_id)
            else:
                self._transient(ns, f)

    def _transient(self, ns: bytes, f: ReadFailure) -> None:
        log.warning("reading block %s failed (%s), treated as a miss: %s", f.key.hex()[:16], f.reason, f.detail)
        if f.gone and f.key in self.index and not self.path(ns, f.key).exists():
            e = self.index.remove(f.key)  # the file went behind our back: the index follows the files
            if e is not None:
                self._emit("evicted", e)

    def read_many(self, ns: bytes, keys: list[bytes]) -> list[Optional[np.ndarray]]:
        """Read and verify blocks in one pass (in key order); misses and bad blocks are None."""
        located = self.open_read(ns, keys)
        pinned = [k for k, loc in zip(keys, located) if loc]
        good, failed, out = [], [], []
        try:
            for k, loc in zip(keys, located):
                data, failure = read_verified(loc, ns, k)
                if failure is not None:
                    failed.append(failure)
                elif data is not None:
                    good.append(k)
                out.append(data)
        finally:
            self.close_read(ns, pinned, good, failed)
        return out

    # -- quarantine -----------------------------------------------------------------
    def quarantine(self, ns: bytes, key: bytes, reason: str, detail: str, path: Optional[Path] = None,
                   file_id: Optional[tuple[int, int]] = None) -> None:
        """Move a block with bad content out of the tier, as evidence; it is a miss from now on.

        With `file_id` (the device and inode the bad bytes were read from), only that file is moved. A
        reader that read the bad file before another reader's refusal moved it reports late; by then a
        replica may have spilled a good copy under the same name (its RAM copy was intact), which must
        stay. Under the write lock, so no spill renames a file into place between the check and the move."""
        src = path or self.path(ns, key)
        with self.write_lock:
            if file_id is not None and _file_id(src) != file_id:
                return  # that file is gone already (counted once); what is there now is another file
            e = self.index.remove(key)
            reason = reason if reason in REASONS else "corrupt"
            if not self.quarantine_bin.add(src, ns, key, reason, detail, self.clock()):
                return  # another reader of the same bad block got here first: it is counted once
            self.counters["quarantined"][reason] += 1
        log.warning("quarantined block %s (%s): %s", key.hex()[:16], reason, detail)
        if e is not None:
            self._emit("evicted", e)

    # -- status ---------------------------------------------------------------------
    def stats(self) -> dict:
        return {"blocks": len(self.index), "bytes": self.index.bytes, "budget": self.budget,
                "degraded": self.degraded, "recovery": self.recovery, "quarantine": self.quarantine_bin.stats(),
                **{k: (dict(v) if isinstance(v, dict) else v) for k, v in self.counters.items()}}

    def _emit(self, event: str, e: Entry) -> None:
        ev = BlockEvent(event, "disk", e.ns, e.key, e.parent, e.tokens, e.size, e.kind)
        self.events.append(ev)
        if self.listener is not None:
            self.listener(ev)


def _file_id(path: Path) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _utime(path: Path, t: float) -> None:
    try:
        os.utime(path, (t, t))
    except OSError:
        pass
