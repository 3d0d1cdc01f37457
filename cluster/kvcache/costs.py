"""Restore or recompute, chosen per request from the replica's own measured speeds.

A hit is not free: its bytes move, from the device RAM tier (a concatenation)
or from the node's disk (a read, a check, a copy to the device). A short prompt
on a fast GPU can be quicker to recompute than to read back from a slow disk.
So before the admission stage reads anything, it asks `restore_pays` with the
plan's bytes by tier and the tokens the hit saves, and the faster way wins:
a hit is taken only when it is predicted to make the first token sooner.

The speeds are moving averages of what this replica measured itself:
- prefill tokens/s: the scheduler's (`prefill_tps`, set by the replica);
- RAM: bytes/s of restores built from device blocks alone (PrefixCache);
- disk: bytes/s of the admission stage's disk reads, checks included;
- write: bytes/s of the spills' writes, fsync included (disk_client.py). Until a read is
  measured, the write speed stands in for the read's: blocks on the disk were written
  first, an SSD reads at least as fast as it writes and syncs, and so a first disk hit
  is not taken where even a read at the write's speed loses to recomputing (on the
  H100 it took 1.0 s against a cold prefill's 0.3). A recompute chosen on that stand-in
  also has its first disk blocks read in the background (Admission._sample_read), off
  the request's path, so the read speed is measured and the next hit is chosen on it.
  A measured read speed goes stale (RESAMPLE_S): one taken while the disk was busy (a
  spill's writeback) or saved before a restart could keep every later disk hit
  recomputed, and so never measured again. A recompute chosen on a stale read speed
  samples the disk again the same way;
- move: bytes/s of moving blocks read in (disk, peer) to the device (PrefixCache). On a
  Mac this is a copy within unified memory; on CUDA the driver's DMA from page-locked read
  buffers (kernels/cuda_upload.py), 7.9 GB/s on an H100 (3.4-4.8 from pageable memory).
  Until measured, the RAM speed stands in. Where the admission moves the blocks in batches
  while later ones are read (`overlap_bytes`, uploads.py), the first batch is read and
  moved, then the slower of the two paces the rest, and the restore builds from them at
  the RAM speed.
A speed not measured yet (and no write speed for the disk) predicts nothing: the hit
is taken (it is the likelier win, and taking it measures the speed). The replica saves
what it measured on the node and a restart starts from it (speeds.py). Both sides of
the comparison share the prompt's last forward, so it is left out of both.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from cluster.kvcache.speeds import Speeds

EMA = 0.3
MIN_BYTES = 1 << 20  # a smaller transfer says more about fixed overheads than about bandwidth
# A disk read speed older than this is checked again by the next recompute that a disk plan lost to: often
# enough that a speed measured on a busy disk does not keep hits away for long, rarely enough that the sample
# reads (admission.SAMPLE_BYTES, a fraction of a second) cost nothing that matters.
RESAMPLE_S = 60.0


@dataclass
class Costs:
    prefill_tps: Callable[[], float] = lambda: 0.0
    ram_bps: float = 0.0
    disk_bps: float = 0.0
    move_bps: float = 0.0
    write_bps: float = 0.0
    read_at: float = 0.0  # time.monotonic() of the last disk read measured in this process (0: none yet)
    overlap_bytes: int = 0  # disk blocks move to the device in batches of this while the rest is read (0: after)
    choices: dict = field(default_factory=lambda: {"restore": 0, "recompute": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A measured restore from `tier` ("ram", "disk" or "move"), or spill ("write"), of `nbytes` in `seconds`."""
        if nbytes < MIN_BYTES or seconds <= 0:
            return
        bps = nbytes / seconds
        with self._lock:
            old = getattr(self, f"{tier}_bps")
            if tier == "disk" and self._read_stale():  # a stale read speed says nothing the new one does not
                old = 0.0
            setattr(self, f"{tier}_bps", bps if not old else (1 - EMA) * old + EMA * bps)
            if tier == "disk":
                self.read_at = time.monotonic()

    def predict(self, prompt_len: int, n: int, ram_bytes: int, disk_bytes: int) -> tuple[float, float] | None:
        """(seconds to restore n tokens and prefill the rest, seconds to prefill it all), or None when a
        speed it needs is not measured yet. Disk bytes also pay their move to the device (after the read, or
        beside it: `overlap_bytes`); until a read is measured, they are read at the spills' write speed."""
        tps = self.prefill_tps()
        read_bps = self.disk_bps or self.write_bps
        if tps <= 0 or (ram_bytes or disk_bytes) and not self.ram_bps or disk_bytes and not read_bps:
            return None
        moved = ram_bytes / self.ram_bps if ram_bytes else 0.0
        read = 0.0
        if disk_bytes:
            move_bps = self.move_bps or self.ram_bps
            if self.overlap_bytes:  # a two-stage pipeline: a batch's read and move, then the slower stage paces;
                # then the restore builds from them as from RAM (its build is no longer the move's, as below).
                # Optimistic where the admission cannot reach the model thread (uploads.submitter: none then).
                first = min(disk_bytes, self.overlap_bytes)
                read = (first / read_bps + first / move_bps + (disk_bytes - first) / min(read_bps, move_bps)
                        + disk_bytes / self.ram_bps)
            else:  # read, then moved by the restore (the move's speed is that build's)
                read = disk_bytes / read_bps + disk_bytes / move_bps
        return moved + read + (prompt_len - n) / tps, prompt_len / tps

    def restore_pays(self, prompt_len: int, n: int, ram_bytes: int, disk_bytes: int) -> bool:
        """Whether restoring n tokens beats recomputing them; counted either way."""
        predicted = self.predict(prompt_len, n, ram_bytes, disk_bytes)
        restore = predicted is None or predicted[0] < predicted[1]
        with self._lock:
            self.choices["restore" if restore else "recompute"] += 1
        return restore

    def read_worth_sampling(self) -> bool:
        """Whether a disk plan that lost to recomputing should have its read sampled (admission.py): reads are
        predicted from the write speed alone, or from a read speed not measured in this process within
        RESAMPLE_S (one seeded from before a restart is stale at once)."""
        if not self.disk_bps:
            return bool(self.write_bps)
        return self._read_stale()

    def _read_stale(self) -> bool:
        """The read speed was not measured in this process within RESAMPLE_S (seeded, or old): the next read
        measured replaces it rather than averaging into it (a speed measured on a busy disk, 0.1x the real
        one, would otherwise take several more samples to recover)."""
        return not self.read_at or time.monotonic() - self.read_at > RESAMPLE_S

    def seed(self, speeds: Speeds) -> None:
        """Start from speeds measured before (a restart): later measurements average into them."""
        with self._lock:
            self.ram_bps, self.disk_bps, self.move_bps = speeds.ram_bps, speeds.disk_bps, speeds.move_bps
            self.write_bps = speeds.write_bps

    def snapshot(self, namespace: bytes) -> Speeds:
        with self._lock:
            return Speeds(namespace=namespace.hex(), prefill_tps=self.prefill_tps(), ram_bps=self.ram_bps,
                          disk_bps=self.disk_bps, move_bps=self.move_bps, write_bps=self.write_bps)

    def stats(self) -> dict:
        return {"prefill_tps": round(self.prefill_tps(), 1), "ram_gbps": round(self.ram_bps / 1e9, 3),
                "disk_gbps": round(self.disk_bps / 1e9, 3), "move_gbps": round(self.move_bps / 1e9, 3),
                "write_gbps": round(self.write_bps / 1e9, 3),
                "choices": dict(self.choices)}
