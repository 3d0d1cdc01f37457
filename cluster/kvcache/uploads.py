"""Blocks read from the disk move to the device while later ones are still being read.

A disk hit's blocks arrive as host bytes, in order, from the disk client's read threads. They must be on the
device before the restore can use them. Moved at the restore, all at once, the move waits for the last read:
at 8k tokens of the Qwen3-8B shape on an H100 that put about 0.15 s of DMA behind a 0.86 s read, and the disk
hit at 1.25x its limit (docs/gpu.md, the twelfth session). So the admission stage hands each batch of decoded
(and so checked) blocks to the model thread as it arrives (`UPLOAD_BYTES`), and what is left for the restore
is the last batch's move. SGLang's HiCache overlaps its loads with compute in the same spirit.

The move is MLX work, so it runs on the model thread: through the replica's scheduler (`PrefixCache.device_work`,
between its steps) or, where the admission runs on the model thread itself (a benchmark, a script), at once.
Anywhere else there is no way to the model thread and the restore moves the blocks, as before. A batch whose
move fails is left to the restore, which moves it or counts the failure as a miss; nothing here answers a
request.

The moved blocks go into the device RAM tier (PrefixCache.to_device), as a restore's moved blocks do, and take
their host blocks' places at once (`moved`), so a read buffer goes (on CUDA, back to the page-locked pool) once
its batch is moved rather than after the last read. Nothing holds the reads back, so what is held is what was
read and not yet moved: little where moves keep up with the disk (on a GPU they run several times faster),
up to the whole read where the model thread is busy (a long prefill) until the end.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

from cluster.engine import model_thread
from cluster.kvcache.device_blocks import DeviceBlock
from cluster.store.block_format import Block

log = logging.getLogger(__name__)

UPLOAD_BYTES = 64 << 20  # a batch: enough bytes per call to move at the bus's speed, few enough to overlap
WAIT_S = 15.0  # all of a read's moves, at most (the admission's own deadline): past it the restore moves them

ToDevice = Callable[[list[tuple[bytes, Block, str]]], list[DeviceBlock]]
Submit = Callable[[Callable[[], object]], Future]


def inline(fn: Callable[[], object]) -> Future:
    """Run `fn` now, on this thread (the model thread), and return its finished future."""
    future: Future = Future()
    try:
        future.set_result(fn())
    except BaseException as e:  # the caller's result() raises it, as a queued one would
        future.set_exception(e)
    return future


def submitter(device_work: Optional[Submit]) -> Optional[Submit]:
    """How this thread reaches the model thread: at once on it (or on the main thread where no model thread is
    claimed: a benchmark driving a cache there), through `device_work` elsewhere, or None: no way."""
    if model_thread.on_model_thread() or (
            not model_thread.claimed() and threading.current_thread() is threading.main_thread()):
        return inline
    return device_work


class Uploads:
    """One admission read's blocks, moved to the device in batches as they arrive."""

    def __init__(self, to_device: ToDevice, submit: Submit, moved: Callable[[bytes, DeviceBlock], None]):
        self.to_device = to_device
        self.submit = submit
        self.moved = moved  # each block moved, as soon as its batch is (on the model thread)
        self._batch: list[tuple[bytes, Block, str]] = []
        self._bytes = 0
        self._sent: list[tuple[list[bytes], Future]] = []

    def add(self, key: bytes, block: Block, kind: str, nbytes: int) -> None:
        """A decoded block (`nbytes`: what was read); a full batch goes to the model thread."""
        self._batch.append((key, block, kind))
        self._bytes += nbytes
        if self._bytes >= UPLOAD_BYTES:
            self._send()

    def finish(self) -> None:
        """Send what is left and wait for every batch, WAIT_S in all. A failed batch's blocks, and those not moved
        by then (cancelled, if not yet begun), are left to the restore: it moves them, or refuses them there."""
        self._send()
        deadline = time.monotonic() + WAIT_S
        for keys, future in self._sent:
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except Exception as e:
                future.cancel()
                log.warning("moving %d blocks read from the disk to the device failed (%s: %s); the restore "
                            "moves them", len(keys), type(e).__name__, e)
        self._sent = []

    def _send(self) -> None:
        if not self._batch:
            return
        batch, self._batch, self._bytes = self._batch, [], 0

        def move() -> None:
            try:
                for (key, _, _), block in zip(batch, self.to_device(batch)):
                    self.moved(key, block)  # in the host block's place: it and its read buffer can go now
            finally:
                batch.clear()

        self._sent.append(([key for key, _, _ in batch], self.submit(move)))
