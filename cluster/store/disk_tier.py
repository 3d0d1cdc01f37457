"""One node's disk tier: crash-safe, checksummed block files with an LRU byte budget.

Layout under the node's data dir:

    blocks/<namespace hex>/<first key byte hex>/<key hex>.blk     published blocks
    blocks/<namespace hex>/<xx>/.<key hex>.<pid>.<n>.tmp            being written
    quarantine/<reason>/<namespace hex:16>-<key hex>.blk            refused blocks
    quarantine/log.jsonl                                            why, one line each

Publish protocol (a reader can never see a partial block):
    write to a temp name in the final directory -> fsync the file -> rename to the
    final name -> fsync the directory. A crash leaves at most a temp file, which
    recovery deletes. Blocks are content-named, so writing one twice is a no-op.

Reads are verified (framing, checksums, namespace, and that the block is the one
stored under its key); a bad block is moved to quarantine/ with its reason,
counted, and reported as a miss. Blocks being read are pinned and never evicted
under the reader. Eviction order: see DiskIndex. The budget is never exceeded by
more than one block: room is made before a write, and a write that cannot get
room (everything else pinned) is allowed only while the tier is within budget.

Disk full or I/O errors: the write is dropped and counted, the tier goes
`degraded` (shown in status and logged once), writes are retried after a
back-off, and spilling resumes by itself when space returns. Serving never
stops because of the disk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from cluster.store import block_format
from cluster.store.block_format import BlockError, Header
from cluster.store.disk_index import DiskIndex, Entry
from cluster.store.hashing import state_key

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class BlockEvent:
    """What the index (and tests) learn from a tier: a block arrived or left."""

    event: str  # "stored" | "evicted"
    tier: str  # "ram" | "disk"
    namespace: bytes
    key: bytes
    parent: bytes
    tokens: int
    nbytes: int


Listener = Callable[[BlockEvent], None]


def key_of(header: Header) -> bytes:
    """The storage key of a block: its id, or for a checkpoint the state key of its block."""
    return header.id if header.kind == "kv" else state_key(header.id)


def read_file(path: Path, size: Optional[int] = None) -> np.ndarray:
    """Read a whole file into a fresh uint8 array: one copy from the page cache."""
    with open(path, "rb", buffering=0) as f:
        n = size if size is not None else os.fstat(f.fileno()).st_size
        buf = np.empty(n, dtype=np.uint8)
        got = f.readinto(memoryview(buf))
        if got != n:
            return buf[:got]
        return buf


def read_verified(loc: Optional[tuple[str, int]], ns: bytes, key: bytes
                  ) -> tuple[Optional[np.ndarray], Optional[tuple[bytes, str, str]]]:
    """Read a located block file and verify it: (data, None), (None, (key, reason, detail)) for a bad
    block, or (None, None) for a miss (loc is None). Shared by the store and by replicas' direct reads."""
    if loc is None:
        return None, None
    try:
        data = read_file(Path(loc[0]), loc[1])
        block_format.verify(data, ns, key, key_of)
        return data, None
    except (BlockError, OSError) as e:
        return None, (key, getattr(e, "reason", "io"), str(e))


def default_budget(root: Path, fraction: float = 0.5, cap: int = 100 << 30) -> int:
    """Half of the free space where the blocks live, at most 100 GiB."""
    root.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(root)
    return min(int(st.f_bavail * st.f_frsize * fraction), cap)


class DiskStore:
    def __init__(self, node_dir: Path, budget: Optional[int] = None, listener: Optional[Listener] = None,
                 clock: Callable[[], float] = time.time):
        self.root = Path(node_dir) / "blocks"
        self.quarantine_dir = Path(node_dir) / "quarantine"
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget if budget is not None else default_budget(self.root)
        self.index = DiskIndex()
        self.listener = listener
        self.clock = clock
        self.write_lock = threading.Lock()
        self.degraded: Optional[dict] = None
        self._retry_at = 0.0
        self._tmp_seq = count()
        self.counters = {"written": 0, "deduped": 0, "write_errors": 0, "dropped_spills": 0, "evictions": 0,
                         "hits": 0, "misses": 0, "bytes_written": 0, "bytes_read": 0,
                         "quarantined": {r: 0 for r in _REASONS}}
        from cluster.store.disk_recovery import recover

        self.recovery = recover(self)

    # -- paths -----------------------------------------------------------------
    def path(self, ns: bytes, key: bytes) -> Path:
        return self.root / ns.hex() / key.hex()[:2] / f"{key.hex()}.blk"

    # -- writes ------------------------------------------------------------------
    def write_many(self, items: list[tuple[bytes, bytes, object]]) -> dict[str, int]:
        """Publish (namespace, key, bytes) items; returns how many were written, deduped, dropped."""
        out = {"written": 0, "deduped": 0, "dropped": 0}
        dirs: set[Path] = set()
        with self.write_lock:
            for ns, key, data in items:
                out[self._write_one(ns, key, memoryview(data), dirs)] += 1
            for d in dirs:
                _fsync_dir(d)
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
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    def _make_room(self, incoming: int) -> bool:
        for victim in self.index.evict(self.budget, incoming):
            self._delete(victim)
            self.counters["evictions"] += 1
            self._emit("evicted", victim)
        # Within budget, or over it by at most this one block when everything else is pinned.
        return self.index.bytes + incoming <= self.budget or self.index.bytes <= self.budget

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

    # -- lookups and reads ---------------------------------------------------------
    def contains(self, ns: bytes, keys: list[bytes]) -> list[bool]:
        return [k in self.index for k in keys]

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

    def close_read(self, ns: bytes, pinned: list[bytes], good: list[bytes],
                   bad: list[tuple[bytes, str, str]]) -> None:
        """Release pins; good reads count as a use, bad ones go to quarantine."""
        now = self.clock()
        for k in good:
            self.index.touch(k, now)
            e = self.index.get(k)
            if e is not None:
                self.counters["bytes_read"] += e.size
                _utime(self.path(ns, k), now)
        for k in pinned:
            self.index.unpin(k)
        for k, reason, detail in bad:
            self.quarantine(ns, k, reason, detail)

    def read_many(self, ns: bytes, keys: list[bytes]) -> list[Optional[np.ndarray]]:
        """Read and verify blocks in one pass (in key order); misses and bad blocks are None."""
        located = self.open_read(ns, keys)
        pinned = [k for k, loc in zip(keys, located) if loc]
        good, bad, out = [], [], []
        try:
            for k, loc in zip(keys, located):
                data, error = read_verified(loc, ns, k)
                if error is not None:
                    bad.append(error)
                elif data is not None:
                    good.append(k)
                out.append(data)
        finally:
            self.close_read(ns, pinned, good, bad)
        return out

    # -- quarantine -----------------------------------------------------------------
    def quarantine(self, ns: bytes, key: bytes, reason: str, detail: str, path: Optional[Path] = None) -> None:
        src = path or self.path(ns, key)
        e = self.index.remove(key)
        reason = reason if reason in _REASONS else "corrupt"
        dst_dir = self.quarantine_dir / reason
        dst_dir.mkdir(parents=True, exist_ok=True)
        dst = dst_dir / f"{ns.hex()[:16]}-{src.name}"
        try:
            shutil.move(str(src), dst)
        except FileNotFoundError:
            pass
        with open(self.quarantine_dir / "log.jsonl", "a") as f:
            f.write(json.dumps({"time": self.clock(), "key": key.hex(), "namespace": ns.hex(), "reason": reason,
                                "detail": detail, "file": str(dst)}) + "\n")
        self.counters["quarantined"][reason] += 1
        log.warning("quarantined block %s (%s): %s", key.hex()[:16], reason, detail)
        if e is not None:
            self._emit("evicted", e)

    # -- status ---------------------------------------------------------------------
    def stats(self) -> dict:
        return {"blocks": len(self.index), "bytes": self.index.bytes, "budget": self.budget,
                "degraded": self.degraded, "recovery": self.recovery,
                **{k: (dict(v) if isinstance(v, dict) else v) for k, v in self.counters.items()}}

    def _emit(self, event: str, e: Entry) -> None:
        if self.listener is not None:
            self.listener(BlockEvent(event, "disk", e.ns, e.key, e.parent, e.tokens, e.size))


_REASONS = sorted({cls.reason for cls in (BlockError, *BlockError.__subclasses__())} | {"io"})


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _utime(path: Path, t: float) -> None:
    try:
        os.utime(path, (t, t))
    except OSError:
        pass
