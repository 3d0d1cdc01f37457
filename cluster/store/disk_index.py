"""The disk tier's in-memory index and its eviction order.

Eviction order (the invariant, pinned by tests/store/test_disk_index.py through
evict() itself): among entries that are not pinned, the next victim is the one
with the smallest

    (last_access, has_children, -start, key)

- least recently used first, where a use is a write, a read, or a touch (a RAM
  hit in some replica, reported in batches), but not a lookup;
- at equal last access, chain tails (KV blocks that no stored block continues,
  and every checkpoint) before interior blocks, since an interior block is worth
  nothing once its prefix is gone but its tail still needs it;
- then deeper blocks before shallower ones, and finally by key, so the order is
  total and the same on every run.
The order is re-evaluated after each victim: removing a tail can make its
parent the next tail. Pinned entries (being read by a restore or a migration)
are never chosen.

The order lives in a sorted list holding exactly one item per entry, so its
size is bounded by the number of entries however often they are touched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

from sortedcontainers import SortedList


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
        self._order = SortedList()
        self._rank: dict[bytes, tuple] = {}  # key -> its current item in _order
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> Optional[Entry]:
        return self.entries.get(key)

    def keys(self, ns: Optional[bytes] = None) -> list[bytes]:
        with self.lock:
            return [k for k, e in self.entries.items() if ns is None or e.ns == ns]

    def add(self, e: Entry) -> None:
        with self.lock:
            if e.key in self.entries:
                self.remove(e.key)
            self.entries[e.key] = e
            self.bytes += e.size
            self._rerank(e.key)
            if self._links(e):
                self._children[e.parent] = self._children.get(e.parent, 0) + 1
                self._rerank(e.parent)

    def remove(self, key: bytes) -> Optional[Entry]:
        with self.lock:
            e = self.entries.pop(key, None)
            if e is None:
                return None
            self.bytes -= e.size
            self._order.discard(self._rank.pop(key))
            self._pins.pop(key, None)
            if self._links(e) and self._children.get(e.parent):
                self._children[e.parent] -= 1
                if not self._children[e.parent]:
                    del self._children[e.parent]
                self._rerank(e.parent)
            return e

    def touch(self, key: bytes, atime: float) -> bool:
        """Record a use at `atime` (never moves an entry back in time); False if absent."""
        with self.lock:
            e = self.entries.get(key)
            if e is None:
                return False
            if atime > e.atime:
                e.atime = atime
                self._rerank(key)
            return True

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

    def pinned(self, key: bytes) -> bool:
        return key in self._pins

    def evict(self, budget: int, incoming: int = 0) -> list[Entry]:
        """Remove entries in eviction order until bytes + incoming fits `budget`; return them in order.

        Stops early when only pinned entries are left: the caller decides what to do then."""
        with self.lock:
            out = []
            while self.bytes + incoming > budget:
                victim = next((item[-1] for item in self._order if item[-1] not in self._pins), None)
                if victim is None:
                    break
                out.append(self.remove(victim))
            return out

    def order_size(self) -> int:
        """Items in the eviction order structure (equals len(self): nothing accumulates)."""
        return len(self._order)

    # -----------------------------------------------------------------------------
    @staticmethod
    def _links(e: Entry) -> bool:
        """Whether `e` continues a stored block (a checkpoint never makes its block interior)."""
        return e.kind == "kv" and e.parent != e.ns

    def _rerank(self, key: bytes) -> None:
        e = self.entries.get(key)
        if e is None:
            return
        old = self._rank.get(key)
        if old is not None:
            self._order.discard(old)
        item = (e.atime, 1 if self._children.get(key) else 0, -e.start, key)
        self._rank[key] = item
        self._order.add(item)
