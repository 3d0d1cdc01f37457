"""The model thread: it owns the replica's MLX work and runs every sequence on it.

MLX work stays on this one thread (see model_thread.py): loading the model,
probing it, restoring caches, capturing blocks and generating. Everything that
waits - Ray, Redis, the disk - happens before a sequence is submitted (the
admission stage), so nothing here ever blocks on I/O, and the asyncio loop that
talks to Ray never blocks on this thread. Active sequences are advanced
round-robin, one step each: a long prefill is cut into chunks and other
requests' tokens flow between them.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

from cluster.engine import model_thread
from cluster.engine.events import Event, Failed
from cluster.engine.sequence import Sequence

log = logging.getLogger(__name__)

Emit = Callable[[list[Event]], None]
T = TypeVar("T")


class Scheduler:
    """A thread that owns the model and steps sequences in turn."""

    EMA = 0.2  # weight of the newest prefill sample in the throughput average

    def __init__(self, name: str = "mlx-fleet-model"):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, tuple[Sequence, Emit]] = {}
        self._stopping = False
        self.steps = 0
        self.prefill_tps: float = 0.0  # moving average of measured prefill throughput (0: not measured yet)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def active(self) -> int:
        return len(self._active)

    def load(self) -> dict:
        """What is queued on this model thread: sequences and prompt tokens still to prefill."""
        sequences = list(self._active.values())
        return {"active": len(sequences), "queued_tokens": sum(seq.pending_prefill for seq, _ in sequences)}

    def submit(self, request_id: str, seq: Sequence, emit: Emit) -> None:
        self._inbox.put(("add", request_id, seq, emit))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id, None, None))

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the model thread between steps, without waiting for it."""
        self._inbox.put(("call", "", fn, None))

    def run(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run `fn` on the model thread and return its result (or raise its exception).

        For setup (loading the model, probing it); never call it from the model thread."""
        future: Future = Future()

        def task():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)

        self.call(task)
        return future.result(timeout_s)

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", "", None, None))
        self._thread.join(timeout=10)

    def _main(self) -> None:
        model_thread.claim()
        try:
            self._run()
        finally:
            model_thread.release()

    def _run(self) -> None:
        import mlx.core as mx

        while not self._stopping:
            self._drain(block=not self._active)
            for request_id, (seq, emit) in list(self._active.items()):
                self._step(request_id, seq, emit)
            self.steps += 1
            if self.steps % 256 == 0:
                mx.clear_cache()
        for request_id, (seq, emit) in list(self._active.items()):
            seq.close()
            emit([Failed("replica is shutting down", status=503)])

    def _step(self, request_id: str, seq: Sequence, emit: Emit) -> None:
        try:
            events = seq.step()
            self._measure(seq)
        except Exception as e:  # one bad request must not take the replica down
            log.exception("request %s failed", request_id)
            seq.close()
            events = [Failed(f"generation failed: {type(e).__name__}: {e}", status=500)]
        if events:
            emit(events)
        if seq.done:
            self._active.pop(request_id, None)

    def _measure(self, seq: Sequence) -> None:
        if seq.prefill_sample is None:
            return
        tokens, seconds = seq.prefill_sample
        seq.prefill_sample = None
        if tokens >= 16 and seconds > 0:  # a handful of tokens says more about overheads than throughput
            tps = tokens / seconds
            self.prefill_tps = tps if not self.prefill_tps else (1 - self.EMA) * self.prefill_tps + self.EMA * tps

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, request_id, obj, emit = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._active[request_id] = (obj, emit)
            elif kind == "cancel":
                entry = self._active.pop(request_id, None)
                if entry:
                    entry[0].close()
            elif kind == "call":
                try:
                    obj()
                except Exception:
                    log.exception("model-thread call failed")
            elif kind == "stop":
                return
