"""A replica's tiers for one model: its RAM tier, and (optionally) its node's disk.

The RAM tier holds one of two things (`device`):
- device blocks (device_blocks.py), for the model's own codec: MLX arrays laid
  out for a restore, made on the model thread and used there with no copy to
  the host and no check. Only the model thread puts into it; admission threads
  look up and take references.
- encoded envelopes, for a packing codec (tq*): the packed bytes are what that
  codec is for, decoded and checked on every hit.

Writes are write-through: every captured block goes into RAM and is queued for
the disk (asynchronously; a device block's envelope is encoded on the disk
client's thread), so a restarted node still has it; a block the RAM tier
evicts is queued again if the disk does not hold it. A block refused as bad
is discarded from both tiers at once and never spilled.

Tier events (stored / evicted, with id, namespace, parent, token count, tier
and bytes) go to `listener`; the fleet index consumes them.

Nothing here waits on the disk: reads and lookups belong to the admission
stage (admission.py).
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.kvcache.device_blocks import DeviceBlock
from cluster.kvcache.disk_client import DiskClient
from cluster.store import block_format
from cluster.store.block_format import BlockError
from cluster.store.events import BlockEvent
from cluster.store.ram_tier import RamTier, size_of


class Tiers:
    def __init__(self, ram_bytes: int, namespace: bytes, disk: Optional[DiskClient] = None,
                 listener: Optional[Callable[[BlockEvent], None]] = None, device: bool = True):
        self.ns = namespace
        self.disk = disk
        self.listener = listener
        self.device = device
        # For device blocks: how an evicted one the disk lacks is queued for it (set by the PrefixCache,
        # which knows the layout); called on the model thread, where every put into a device tier happens.
        self.spill: Optional[Callable[[bytes, DeviceBlock], None]] = None
        self.ram = RamTier(ram_bytes, listener=self._on_ram)

    def put(self, key: bytes, data) -> None:
        """An envelope into RAM and through to the disk (packing codecs)."""
        self.ram.put(key, data)
        if self.disk is not None:
            self.disk.put(key, data)

    def arrived(self, key: bytes, data) -> None:
        """A checked envelope pulled from a peer (admission threads): through to this node's disk, and into
        an envelope tier; a device tier gets the block when the model thread restores it (PrefixCache)."""
        if not self.device:
            self.ram.put(key, data)
        if self.disk is not None:
            self.disk.put(key, data)

    def discard(self, key: bytes, reason: str, detail: str = "") -> None:
        """A block that failed to decode or restore: out of RAM (never spilled), quarantined on disk."""
        self.ram.discard(key, reason)
        if self.disk is not None:
            self.disk.discard(key, reason, detail)

    def stats(self) -> dict:
        out = {"ram": {**self.ram.stats(), "holds": "device arrays" if self.device else "envelopes"}}
        if self.disk is not None:
            out["spill"] = self.disk.stats()
        return out

    def _on_ram(self, event: str, key: bytes, data) -> None:
        if event == "evicted" and self.disk is not None and not self.disk.holds(key):
            if isinstance(data, DeviceBlock):
                if self.spill is not None and data.kind != "tail":  # a prompt's tail stays in RAM (tails.py)
                    self.spill(key, data)
            else:
                self.disk.put(key, data)
        if self.listener is not None:
            head = _head(data)
            if head is None:
                return
            kind, block_id, parent, tokens = head
            self.listener(BlockEvent("stored" if event == "stored" else "evicted", "ram", self.ns, key,
                                     parent if kind == "kv" else block_id, tokens, size_of(data), kind))

    def ram_holdings(self) -> list[tuple[bytes, str, bytes, int]]:
        """(key, kind, block id, bytes) of every block in RAM: what a full announce publishes."""
        out = []
        for key, data in self.ram.snapshot():
            head = _head(data)
            if head is not None:
                out.append((key, head[0], head[1], size_of(data)))
        return out


def _head(data) -> Optional[tuple[str, bytes, bytes, int]]:
    """(kind, id, parent, tokens) of a held block; None for bytes that are no envelope."""
    if isinstance(data, DeviceBlock):  # a prompt's tail is no block: never announced (tails.py)
        return None if data.kind == "tail" else (data.kind, data.id, data.parent, len(data.tokens))
    try:
        h = block_format.peek(data)
    except BlockError:
        return None
    return h.kind, h.id, h.parent, h.tokens
