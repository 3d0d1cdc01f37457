"""The replica's tiers as one store: RAM first, then the node's disk.

Same contract as every tier: get / put / exists, and prefix_hits = how many
keys from the first are present (in either tier). Every stored block is also
queued for the disk (write-through, asynchronous), so a restarted node still
has it; a block the RAM tier evicts is queued too if the disk does not have it
yet. Blocks read from disk are promoted into RAM.

Tier events (stored / evicted, with id, namespace, parent, token count, tier
and bytes) go to `listener`; the fleet index consumes them.
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.kvcache.disk_client import DiskClient
from cluster.store import block_format
from cluster.store.block_format import BlockError
from cluster.store.disk_tier import BlockEvent
from cluster.store.ram_tier import RamTier


class TieredBlocks:
    def __init__(self, ram_bytes: int, namespace: bytes, disk: Optional[DiskClient] = None,
                 listener: Optional[Callable[[BlockEvent], None]] = None):
        self.ns = namespace
        self.disk = disk
        self.listener = listener
        self.ram = RamTier(ram_bytes, listener=self._on_ram)
        self._discarding: Optional[bytes] = None

    # -- the store contract ----------------------------------------------------------
    def present(self, keys: list[bytes]) -> list[bool]:
        found = self.ram.present(keys)
        missing = [k for k, f in zip(keys, found) if not f]
        if self.disk is not None and missing:
            on_disk = dict(zip(missing, self.disk.present(missing)))
            found = [f or on_disk.get(k, False) for k, f in zip(keys, found)]
        return found

    def prefix_hits(self, keys: list[bytes]) -> int:
        h = self.ram.prefix_hits(keys)
        if self.disk is None or h == len(keys):
            return h
        for f in self.present(keys[h:]):
            if not f:
                break
            h += 1
        return h

    def exists(self, key: bytes) -> bool:
        return self.present([key])[0]

    def get_many(self, keys: list[bytes]) -> list[Optional[object]]:
        """RAM hits, then one batched disk read for the rest (promoted into RAM)."""
        out = [self.ram.get(k) for k in keys]
        missing = [i for i, d in enumerate(out) if d is None]
        if self.disk is not None and missing:
            for i, data in zip(missing, self.disk.read([keys[i] for i in missing])):
                if data is not None:
                    out[i] = data
                    self.ram.put(keys[i], data)
        return out

    def get(self, key: bytes):
        return self.get_many([key])[0]

    def put(self, key: bytes, data) -> None:
        self.ram.put(key, data)
        if self.disk is not None:
            self.disk.spill(key, data)

    def in_ram(self, key: bytes) -> bool:
        return self.ram.exists(key)

    def remove(self, key: bytes) -> bool:
        """Drop a block from RAM (it stays on disk)."""
        return self.ram.remove(key)

    def keys(self) -> list[bytes]:
        return self.ram.keys()

    def discard(self, key: bytes, error: BlockError) -> None:
        """A block that failed to decode: out of RAM (never spilled), quarantined on disk if there."""
        self._discarding = key
        try:
            self.ram.remove(key)
        finally:
            self._discarding = None
        if self.disk is not None and key in self.disk.on_disk:
            self.disk.discard(key, error.reason, str(error))

    def stats(self) -> dict:
        out = {"ram": self.ram.stats()}
        if self.disk is not None:
            out["spill"] = self.disk.stats()
        return out

    # -- events ----------------------------------------------------------------------
    def _on_ram(self, event: str, key: bytes, data) -> None:
        if (event == "evicted" and self.disk is not None and key not in self.disk.on_disk
                and key != self._discarding):
            self.disk.spill(key, data)
        if self.listener is not None:
            try:
                h = block_format.peek(data)
            except BlockError:
                return
            self.listener(BlockEvent(event, "ram", self.ns, key, h.parent if h.kind == "kv" else h.id, h.tokens,
                                     len(data)))
