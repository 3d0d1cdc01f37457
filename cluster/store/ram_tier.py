"""The replica's RAM tier: blocks in an LRU bounded by bytes.

It implements the store contract (store/contract.py). What it holds is up to
its owner (kvcache/tiers.py): device-resident blocks (kvcache/device_blocks.py,
their `nbytes` counted) for the model's own codec, or encoded envelopes (their
length counted) for a packing codec. Either way the budget counts real bytes.

Eviction order: least recently used first, where get_many() and put() both
count as a use; present() does not (a lookup that is not followed by a restore
must not keep a block alive). The budget is never exceeded: a put that does not
fit evicts until it does, and a block larger than the whole budget is refused.

Listener events: `stored`, `evicted` (the LRU pushed it out: its bytes come
along so the owner may spill them) and `discarded` (refused as bad: never to be
spilled anywhere).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterable, Optional

Listener = Callable[[str, bytes, object], None]  # (event, key, the block)


def size_of(block) -> int:
    """Bytes a held block takes: a device block's arrays, or an envelope's length."""
    nbytes = getattr(block, "nbytes", None)
    return int(nbytes) if nbytes is not None else len(block)


class RamTier:
    def __init__(self, budget_bytes: int, listener: Optional[Listener] = None):
        self.budget = budget_bytes
        self._blocks: "OrderedDict[bytes, object]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._listener = listener
        self.hits = self.misses = self.evictions = self.rejected = self.discarded = 0

    # -- the store contract ------------------------------------------------------------
    def present(self, keys: Iterable[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._blocks for k in keys]

    def get_many(self, keys: Iterable[bytes]) -> list[Optional[object]]:
        out = []
        with self._lock:
            for key in keys:
                data = self._blocks.get(key)
                if data is None:
                    self.misses += 1
                else:
                    self._blocks.move_to_end(key)
                    self.hits += 1
                out.append(data)
        return out

    def put(self, key: bytes, data) -> bool:
        evicted = []
        size = size_of(data)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
            if size > self.budget:
                self.rejected += 1
                return False
            while self._bytes + size > self.budget:
                old, old_data = self._blocks.popitem(last=False)
                self._bytes -= size_of(old_data)
                self.evictions += 1
                evicted.append((old, old_data))
            self._blocks[key] = data
            self._bytes += size
        self._emit("stored", key, data)
        for old, old_data in evicted:
            self._emit("evicted", old, old_data)  # with its bytes: a listener may spill them
        return True

    def discard(self, key: bytes, reason: str = "") -> bool:
        """Drop a block refused as bad; it is never spilled. False if it was not here."""
        with self._lock:
            data = self._blocks.pop(key, None)
            if data is None:
                return False
            self._bytes -= size_of(data)
            self.discarded += 1
        self._emit("discarded", key, data)
        return True

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._blocks), "bytes": self._bytes, "budget": self.budget, "hits": self.hits,
                    "misses": self.misses, "evictions": self.evictions, "rejected": self.rejected,
                    "discarded": self.discarded}

    # -- inspection --------------------------------------------------------------------
    def get(self, key: bytes) -> Optional[object]:
        return self.get_many([key])[0]

    def peek(self, key: bytes) -> Optional[object]:
        """The block if held, without counting a hit or a miss and without refreshing its place in the LRU
        order: for a lookup whose answer may go unused."""
        with self._lock:
            return self._blocks.get(key)

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._blocks)

    def snapshot(self) -> list[tuple[bytes, object]]:
        """Every (key, block), least recently used first, without counting as a use."""
        with self._lock:
            return list(self._blocks.items())

    def _emit(self, event: str, key: bytes, data) -> None:
        if self._listener is not None:
            self._listener(event, key, data)
