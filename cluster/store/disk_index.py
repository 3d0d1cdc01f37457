"""The disk tier's in-memory index and its eviction order.

Eviction order (the invariant, pinned by tests/store/test_disk_index.py):
among entries that are not pinned, the next victim is the one with the
smallest

    (last_access, has_children, -start, key)

- least recently used first, where a use is a write or a read (not a lookup);
- at equal last access, chain tails (KV blocks that no stored block continues,
  and every checkpoint) before interior blocks, since an interior block is worth
  nothing once its prefix is gone but its tail still needs it;
- then deeper blocks before shallower ones, and finally by key, so the order is
  total and the same on every run.
Pinned entries (being read by a restore or a migration) are never chosen.

A lazy heap keeps this cheap: every change of an entry's sort key pushes a new
heap item and bumps the entry's version; stale items are skipped when popped.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Optional


@dataclass
class Entry:
    key: bytes
    ns: bytes
    kind: str  # "kv" | "state"
    parent: bytes  # previous block's id (== ns for a chain's first block); a checkpoint's own block id
    start: int
    tokens: int
    size: int
    atime: float


class DiskIndex:
    def __init__(self):
        self.entries: dict[bytes, Entry] = {}
        self.bytes = 0
        self._children: dict[bytes, int] = {}
        self._pins: dict[bytes, int] = {}
        self._version: dict[bytes, int] = {}
        self._heap: list[tuple] = []
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> Optional[Entry]:
        return self.entries.get(key)

    def add(self, e: Entry) -> None:
        with self.lock:
            if e.key in self.entries:
                self.remove(e.key)
            self.entries[e.key] = e
            self.bytes += e.size
            if e.kind == "kv" and e.parent != e.ns:
                self._children[e.parent] = self._children.get(e.parent, 0) + 1
                self._push(e.parent)
            self._push(e.key)

    def remove(self, key: bytes) -> Optional[Entry]:
        with self.lock:
            e = self.entries.pop(key, None)
            if e is None:
                return None
            self.bytes -= e.size
            self._version[key] = self._version.get(key, 0) + 1  # invalidates its heap items
            if e.kind == "kv" and e.parent != e.ns and self._children.get(e.parent):
                self._children[e.parent] -= 1
                if not self._children[e.parent]:
                    del self._children[e.parent]
                self._push(e.parent)
            return e

    def touch(self, key: bytes, atime: float) -> None:
        with self.lock:
            e = self.entries.get(key)
            if e is not None and atime > e.atime:
                e.atime = atime
                self._push(key)

    def pin(self, key: bytes) -> bool:
        with self.lock:
            if key not in self.entries:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def unpin(self, key: bytes) -> None:
        with self.lock:
            n = self._pins.get(key, 0) - 1
            if n > 0:
                self._pins[key] = n
            else:
                self._pins.pop(key, None)
                self._push(key)  # it may be the next victim again

    def pinned(self, key: bytes) -> bool:
        return key in self._pins

    def order_key(self, key: bytes) -> tuple:
        e = self.entries[key]
        return (e.atime, 1 if self._children.get(key) else 0, -e.start, key)

    def evict(self, budget: int, incoming: int = 0) -> list[Entry]:
        """Remove entries in eviction order until bytes + incoming fits `budget`; return them.

        Stops early when only pinned entries are left: the caller decides what to do then."""
        with self.lock:
            out, skipped = [], []
            while self.bytes + incoming > budget and self._heap:
                item = heapq.heappop(self._heap)
                key, version = item[-2], item[-1]
                if self._version.get(key) != version or key not in self.entries:
                    continue  # stale: the entry changed or left since this item was pushed
                if key in self._pins:
                    skipped.append(item)
                    continue
                out.append(self.remove(key))
            for item in skipped:
                heapq.heappush(self._heap, item)
            return out

    def eviction_order(self) -> list[bytes]:
        """Every unpinned key in the order victims() would yield it (for tests and status)."""
        return [k for k in sorted(self.entries, key=self.order_key) if k not in self._pins]

    def _push(self, key: bytes) -> None:
        if key not in self.entries:
            return
        v = self._version.get(key, 0) + 1
        self._version[key] = v
        heapq.heappush(self._heap, (*self.order_key(key)[:3], key, v))
