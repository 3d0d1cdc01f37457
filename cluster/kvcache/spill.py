"""Spills: the device RAM tier's blocks written through to the node's disk, when the model thread can spare it.

A device tier (device_blocks.py) keeps a replica's own blocks as MLX arrays. Writing one to the disk means
reading it from the host, and on a working GPU that costs: on the H200 a host thread reading an 8k prompt's
1.2 GB slowed the cold prefill beside it by 30-50% (CUDA migrates managed pages; the envelope's hashing
competes for the interpreter). So:

- **Spills wait for idle** (`when_idle`, set by a replica whose scheduler calls `idle()` while no sequence
  is in flight): captured blocks wait in a backlog (RAM holds them anyway), handed to the disk client one
  `BATCH_BYTES` batch at a time once it has taken the last. Under sustained load a block waits at most
  `SPILL_DELAY_S` (`overdue()`, at every seal), then spills beside the work.
- **The backlog never holds memory beyond RAM's budget**: a block the RAM tier evicts spills at once
  (`evicted`), and leaves the backlog.
- **Only what the disk's queue has room for** is handed over: past it the queue drops its oldest spill, and a
  dropped block breaks its prompt's chain on the disk.
- **On CUDA a spill reads a device copy made for it** (`stage`): every array is managed memory, a host read
  moves its pages to the host, and the next restore would pay to bring them back (150 ms for an 8k prompt's
  1.2 GB on the H200, against 7 ms for the copy). Metal's unified memory and the CPU need none.

The model thread takes numpy views of the evaluated arrays (`write_out`); the envelope (copy, checksum,
framing) is made on the disk client's thread, from a `Pending`.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable

import mlx.core as mx

from cluster.engine.schedule import cuda
from cluster.kvcache import device_blocks
from cluster.kvcache.device_blocks import DeviceBlock, Run
from cluster.kvcache.disk_client import BATCH_BYTES, Pending
from cluster.kvcache.tiers import Tiers

SPILL_DELAY_S = 2.0  # a captured block waits at most this long for the model thread to be idle


class Spiller:
    """A PrefixCache's spills to its node's disk (model thread)."""

    def __init__(self, tiers: Tiers, runs: dict[str, tuple[Run, ...]], n_entries: int,
                 envelope: Callable[[DeviceBlock, list], memoryview]):
        """`runs`: the device runs of each block kind; `envelope(block, entries)`: a block's envelope from its
        host entries (on the disk client's thread)."""
        self.tiers = tiers
        self.runs = runs
        self.n_entries = n_entries
        self.envelope = envelope
        self.when_idle = False
        self.pending: "OrderedDict[bytes, tuple[DeviceBlock, float]]" = OrderedDict()  # oldest first
        self.stage = cuda()

    def spill(self, items: list[tuple[bytes, DeviceBlock]]) -> None:
        """Blocks just sealed that the disk lacks: written out now, or queued for idle (`when_idle`)."""
        if self.tiers.disk is None or not items:
            return
        if not self.when_idle:
            self.write_out(items)
            return
        now = time.monotonic()
        for key, block in items:
            self.pending.setdefault(key, (block, now))

    def overdue(self) -> None:
        """Never idle for long (sustained load): what waited past SPILL_DELAY_S goes now."""
        if self.pending:
            self.write_out(self._take(due=time.monotonic() - SPILL_DELAY_S))

    def idle(self) -> bool:
        """The model thread has no sequence in flight: hand the disk the backlog's next batch once it has taken
        the last one. Returns whether a backlog is left (the scheduler calls again, soon)."""
        disk = self.tiers.disk
        if disk is None or not self.pending:
            return False
        if disk.backlog_bytes() < BATCH_BYTES:
            self.write_out(self._take(limit=BATCH_BYTES))
        return bool(self.pending)

    def drop(self, key: bytes) -> None:
        """A block refused at restore (corrupt or failing): it must not reach the disk from the backlog."""
        self.pending.pop(key, None)

    def evicted(self, key: bytes, block: DeviceBlock) -> None:
        """The RAM tier let a block go that the disk lacks: it spills now."""
        self.pending.pop(key, None)
        self.write_out([(key, block)])

    def write_out(self, items: list[tuple[bytes, DeviceBlock]]) -> None:
        """Queue device blocks for the disk: numpy views taken here (one evaluation; of a device copy on CUDA),
        the envelope made on the disk client's thread."""
        disk = self.tiers.disk
        if disk is None or not items:
            return
        sources = [b for _, b in items]
        if self.stage:
            sources = [DeviceBlock(b.kind, b.id, b.parent, b.start, b.tokens, [mx.array(a) for a in b.runs])
                       for b in sources]
        for (key, block), entries in zip(items, self.host_entries(sources)):
            disk.put(key, Pending(block.nbytes, lambda block=block, entries=entries: self.envelope(block, entries)))

    def host_entries(self, blocks: list[DeviceBlock]) -> list:
        """Each block's entries as numpy views of its device arrays."""
        return device_blocks.to_host(blocks, [self.runs[b.kind] for b in blocks], self.n_entries)

    def backlog(self) -> dict:
        return {"blocks": len(self.pending), "bytes": sum(b.nbytes for b, _ in self.pending.values())}

    def _take(self, due: float = math.inf, limit: int = 1 << 62) -> list[tuple[bytes, DeviceBlock]]:
        """The backlog's oldest blocks, up to the first that arrived after `due`, `limit` bytes in all, and what
        the disk's queue has room for. What is not taken waits for the next call."""
        disk, out = self.tiers.disk, []
        queued = disk.backlog_bytes()
        room = min(limit, disk.queue_bytes - queued)
        while self.pending:
            block, since = next(iter(self.pending.values()))
            if since >= due or (block.nbytes > room and (out or queued)):  # one block always goes to an idle queue
                break
            key, _ = self.pending.popitem(last=False)
            out.append((key, block))
            room -= block.nbytes
        return out

