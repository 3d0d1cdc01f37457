"""A replica's tiers for one model: its RAM tier, and (optionally) its node's disk.

Writes are write-through: every captured block goes into RAM and is queued for
the disk (asynchronously), so a restarted node still has it; a block the RAM
tier evicts is queued again if the disk does not hold it. A block refused as bad
is discarded from both tiers at once and never spilled.

Tier events (stored / evicted, with id, namespace, parent, token count, tier
and bytes) go to `listener`; the fleet index consumes them.

Nothing here waits on the disk: reads and lookups belong to the admission
stage (admission.py).
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.kvcache.disk_client import DiskClient
from cluster.store import block_format
from cluster.store.block_format import BlockError
from cluster.store.events import BlockEvent
from cluster.store.ram_tier import RamTier


class Tiers:
    def __init__(self, ram_bytes: int, namespace: bytes, disk: Optional[DiskClient] = None,
                 listener: Optional[Callable[[BlockEvent], None]] = None):
        self.ns = namespace
        self.disk = disk
        self.listener = listener
        self.ram = RamTier(ram_bytes, listener=self._on_ram)

    def put(self, key: bytes, data) -> None:
        self.ram.put(key, data)
        if self.disk is not None:
            self.disk.put(key, data)

    def discard(self, key: bytes, reason: str, detail: str = "") -> None:
        """A block that failed to decode or restore: out of RAM (never spilled), quarantined on disk."""
        self.ram.discard(key, reason)
        if self.disk is not None:
            self.disk.discard(key, reason, detail)

    def stats(self) -> dict:
        out = {"ram": self.ram.stats()}
        if self.disk is not None:
            out["spill"] = self.disk.stats()
        return out

    def _on_ram(self, event: str, key: bytes, data) -> None:
        if event == "evicted" and self.disk is not None:
            self.disk.put(key, data)  # a no-op when the disk holds it already
        if self.listener is not None:
            try:
                h = block_format.peek(data)
            except BlockError:
                return
            self.listener(BlockEvent("stored" if event == "stored" else "evicted", "ram", self.ns, key,
                                     h.parent if h.kind == "kv" else h.id, h.tokens, len(data), h.kind))

    def ram_holdings(self) -> list[tuple[bytes, str, bytes, int]]:
        """(key, kind, block id, bytes) of every block in RAM: what a full announce publishes."""
        out = []
        for key, data in self.ram.snapshot():
            try:
                h = block_format.peek(data)
            except BlockError:
                continue
            out.append((key, h.kind, h.id, len(data)))
        return out
