"""The model thread: it owns the replica's MLX work and runs every sequence on it.

MLX work stays on this one thread (see model_thread.py): loading the model,
probing it, restoring caches, capturing blocks and generating. Everything that
waits - Ray, Redis, the disk - happens before a sequence is submitted (the
admission stage), so nothing here ever blocks on I/O, and the asyncio loop that
talks to Ray never blocks on this thread.

Batched (the default, when the model's cache classes can batch; batch.py),
each turn of the loop:
1. admits waiting sequences while fewer than `prefill_concurrency` are
   prefilling and fewer than `decode_concurrency` run in all (the rest wait,
   holding only their fetched blocks);
2. prefills about one chunk's worth of prompt tokens, in block-aligned
   chunks, so a long prompt delays the decoding ones by one chunk at most
   (the prompt with the fewest tokens left first, or the oldest, by turns:
   see _prefill_round);
3. runs one decode step for the whole batch, which prefilled sequences join.

Sequential (`batching=False`, or caches that cannot batch): every active
sequence takes one step per turn, alone: a prefill chunk or one token.

While no sequence is in flight it runs the idle work registered with
`when_idle` (a device tier's spills to the disk), a bounded piece at a time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, TypeVar

from cluster.engine import model_thread
from cluster.engine.batch import DecodeBatch
from cluster.engine.events import TERMINAL, Event, Failed
from cluster.engine.sequence import Sequence

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.005  # between pieces of idle work, the inbox is watched this long for a request
DRAIN_IDLE_S = 5.0  # at stop, idle work left (spills) gets this long to finish

Emit = Callable[[list[Event]], None]
T = TypeVar("T")


@dataclass
class Job:
    request_id: str
    seq: Sequence
    emit: Emit
    origin: str = ""  # the gateway that sent it (its loads are split by gateway: see load())


class Scheduler:
    """A thread that owns the model and runs its sequences, batched or one step each in turn."""

    EMA = 0.2  # weight of the newest prefill sample in the throughput average

    def __init__(self, name: str = "mlx-fleet-model", batching: bool = True, decode_concurrency: int = 32,
                 prefill_concurrency: int = 8, invariant: bool = False, pad_rows: bool = False):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._waiting: deque[Job] = deque()
        self._prefilling: deque[Job] = deque()
        self._ready: deque[Job] = deque()  # prefilled, waiting for a batch slot
        self._by_seq: dict[int, Job] = {}
        self._batch: DecodeBatch | None = None
        self.batching = batching
        self.batching_off_reason = "" if batching else "turned off in the config"
        self.decode_concurrency = decode_concurrency
        self.prefill_concurrency = prefill_concurrency
        # Batch-invariant decode (engine/invariant.py, on a model it prepared); on a GPU (pad_rows) every step's
        # matmuls at decode_concurrency rows.
        self.invariant, self.pad_rows = invariant, pad_rows
        self.deterministic = "on" if invariant else "off"  # how batched rows equal solo ones (status)
        self._stopping = False
        self._drain_at_stop = True  # idle work left (spills) gets DRAIN_IDLE_S at stop (not at the process's exit)
        self.steps = 0
        self._prefill_rounds = 0
        self.batched_steps = 0
        self.batched_rows = 0  # sum over batched steps of the rows in them (mean batch = rows / steps)
        self.prefill_tps: float = 0.0  # moving average of measured prefill throughput (0: not measured yet)
        self._idle: list[Callable[[], bool]] = []  # model-thread work for when no sequence is in flight
        self.broken = ""  # why this scheduler can serve no more (a sharded model lost a rank: sharded_scheduler.py)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        model_thread.running(self)  # stopped at the process's exit if still running then
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Whether `stop` was called (or a follower rank's leader stopped it)."""
        return self._stopping

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Block until the model thread has ended (`timeout_s` at most); whether it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def active(self) -> int:
        return len(self._jobs)

    def disable_batching(self, reason: str) -> None:
        """Serve sequentially (call before any request): the model's caches cannot batch."""
        self.batching = False
        self.batching_off_reason = reason

    def load(self) -> dict:
        """What is on this model thread: sequences by stage, and prompt tokens still to prefill.

        `by_origin` splits sequences and queued tokens by the gateway that sent them: a gateway knows its
        own requests exactly and at once, so it replaces its share of this (a flush old) with its own
        counts and keeps only the other gateways' share from here."""
        jobs = list(self._jobs.values())
        decoding = sum(1 for j in jobs if j.seq.prefilled and not j.seq.done)
        by_origin: dict[str, list[int]] = {}
        for j in jobs:
            if j.origin:
                counts = by_origin.setdefault(j.origin, [0, 0])
                counts[0] += 1
                counts[1] += j.seq.pending_prefill
        return {"active": len(jobs), "queued_tokens": sum(j.seq.pending_prefill for j in jobs),
                "decoding": decoding, "waiting": sum(1 for j in jobs if not j.seq.begun), "by_origin": by_origin}

    def stats(self) -> dict:
        """How the replica batches (for status)."""
        return {"batching": self.batching, "reason": self.batching_off_reason or None,
                "decode_concurrency": self.decode_concurrency, "prefill_concurrency": self.prefill_concurrency,
                "deterministic": self.deterministic,
                "batched_steps": self.batched_steps,
                "mean_batch": round(self.batched_rows / self.batched_steps, 2) if self.batched_steps else 0.0}

    def submit(self, request_id: str, seq: Sequence, emit: Emit, origin: str = "") -> None:
        self._inbox.put(("add", request_id, Job(request_id, seq, emit, origin), None))

    def run_all(self, seqs: list[Sequence], timeout_s: float | None = None) -> list[list[Event]]:
        """Submit `seqs` at once and wait until every one has ended; each one's events, in order.

        For benchmarks and tests; a replica streams each request's events as they come."""
        cond = threading.Condition()
        events: list[list[Event]] = [[] for _ in seqs]
        ended = [False] * len(seqs)

        def emit_for(i: int) -> Emit:
            def emit(batch: list[Event]) -> None:
                with cond:
                    events[i].extend(batch)
                    ended[i] = ended[i] or any(isinstance(e, TERMINAL) for e in batch)
                    cond.notify_all()
            return emit

        for i, seq in enumerate(seqs):
            self.submit(f"run-all-{id(seq)}", seq, emit_for(i))
        with cond:
            if not cond.wait_for(lambda: all(ended), timeout_s):
                raise TimeoutError(f"{ended.count(False)} of {len(seqs)} sequences still running after {timeout_s} s")
        return events

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id, None, None))

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the model thread between steps, without waiting for it."""
        self._inbox.put(("call", "", fn, None))

    def run(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run `fn` on the model thread and return its result (or raise its exception).

        For setup (loading the model, probing it); never call it from the model thread."""
        return self.future(fn).result(timeout_s)

    def future(self, fn: Callable[[], T]) -> Future:
        """Run `fn` on the model thread between steps; its future (the admission's moves of blocks read in:
        kvcache/uploads.py); on a stopped scheduler it fails at once (nothing would run it)."""
        future: Future = Future()
        if self._stopping:
            future.set_exception(RuntimeError("the model thread has stopped"))
            return future

        def task():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)

        self.call(task)
        return future

    def when_idle(self, fn: Callable[[], bool]) -> None:
        """Run `fn` on the model thread whenever no sequence is in flight (a device tier's spills: see
        PrefixCache.spill_idle). It returns whether it has more to do; then it runs again once the
        inbox has been empty for IDLE_POLL_S. A request that arrives waits for one call at most."""
        self.call(lambda: self._idle.append(fn))

    def stop(self) -> None:
        """End the model thread and wait for it (10 s at most); from the model thread itself, only ask."""
        self.request_stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def request_stop(self, drain: bool = True) -> None:
        """Ask the model thread to end after its current turn; `drain`: give idle work left DRAIN_IDLE_S."""
        self._drain_at_stop = drain
        self._stopping = True
        self._inbox.put(("stop", "", None, None))

    def _main(self) -> None:
        model_thread.claim()
        try:
            self._run()
        finally:
            model_thread.release()
            try:
                model_thread.release_streams()
            except Exception:  # the thread ends either way; what failed is logged
                log.exception("releasing the model thread's MLX streams failed")
            model_thread.ended(self)

    def _prepare_turn(self) -> bool:
        """Take in what arrived; whether to run a turn now (a sharded model's ranks agree on it first)."""
        if not self._jobs and self._idle_round():
            self._drain(block=True, timeout_s=IDLE_POLL_S)
        else:
            self._drain(block=not self._jobs)
        return True

    def _after_turns(self) -> None:
        """The loop has ended (a sharded model's followers are told here)."""

    def _run(self) -> None:
        import mlx.core as mx

        while not self._stopping:
            if not self._prepare_turn():
                continue
            if self.batching:
                self._turn_batched()
            else:
                for job in list(self._jobs.values()):
                    self._step_alone(job)
            self.steps += 1
            if self.steps % 256 == 0:
                mx.clear_cache()
        self._after_turns()
        for job in list(self._jobs.values()):
            job.seq.close()
            job.emit([Failed("replica is shutting down", status=503)])
        deadline = time.monotonic() + (DRAIN_IDLE_S if self._drain_at_stop else 0)  # spills go out before the end
        while time.monotonic() < deadline and self._idle_round():
            time.sleep(IDLE_POLL_S)

    def _idle_round(self) -> bool:
        more = False
        for fn in self._idle:
            try:
                more = bool(fn()) or more
            except Exception:  # idle work is best effort; the model thread must go on
                log.exception("idle work failed")
        return more

    # -- sequential -------------------------------------------------------------
    def _step_alone(self, job: Job) -> None:
        try:
            events = job.seq.step()
            self._measure(job.seq)
        except Exception as e:  # one bad request must not take the replica down
            self._fail(job, e)
            return
        if job.seq.done:  # before the last events go out: whoever sees them sees the load without it
            self._forget(job)
        if events:
            job.emit(events)

    # -- batched ----------------------------------------------------------------
    def _turn_batched(self) -> None:
        if self._batch is None:
            if not self._jobs:
                return
            self._batch = DecodeBatch(next(iter(self._jobs.values())).seq.model, self.invariant,
                                      self.decode_concurrency if self.pad_rows else 0)
        self._admit()
        self._prefill_round()
        joiners = []
        room = self.decode_concurrency - len(self._batch)
        while self._ready and len(joiners) < room:
            if self._ready[0].seq.done:
                self._ready.popleft()
            elif self._batch.accepts(self._ready[0].seq):
                joiners.append(self._ready.popleft())
            else:
                break
        if not joiners and not self._batch.rows:
            return
        try:
            results = self._batch.step([j.seq for j in joiners])
        except Exception as e:  # a failed forward fails its rows, not the replica
            log.exception("batched decode step failed")
            for seq in self._batch.fail_all():  # every row still going, joiners and leavers included
                job = self._job_of(seq)
                if job is not None:
                    self._fail(job, e)
            return
        rows = len(self._batch)
        if rows:
            self.batched_steps += 1
            self.batched_rows += rows
        for seq, events in results:
            job = self._job_of(seq)
            if job is None:
                continue
            if seq.done:
                self._forget(job)
            if events:
                job.emit(events)
        if not len(self._batch):
            self._batch.clear()  # nothing live (the last rows stopped or were cancelled): free the batched caches

    def _admit(self) -> None:
        running = len(self._prefilling) + len(self._ready) + len(self._batch)
        while self._waiting and len(self._prefilling) < self.prefill_concurrency and running < self.decode_concurrency:
            job = self._waiting.popleft()
            if job.seq.done:
                continue
            try:
                job.seq.begin()
            except Exception as e:
                self._fail(job, e)
                continue
            running += 1
            (self._ready if job.seq.prefilled else self._prefilling).append(job)

    def _prefill_round(self) -> None:
        """About one chunk's worth of prompt tokens (the first prompt's `prefill_step`), in one of two orders.

        Every other round goes fewest tokens left first (the oldest first among equals): a short prompt that
        comes while a long one prefills starts within a round or two, where first come, first served held it
        behind the long one's whole prefill (a 3-token request waited 27 s behind 7k tokens on a 2-core CPU).
        A burst of equal prompts still goes one at a time, so the first answers after its own prefill alone,
        not after all of theirs. The rounds between go oldest first, so a long prompt keeps at least half the
        rounds however many short ones keep coming. In each, a prompt prefills until it is done or the budget
        is spent (a chunk may be shorter than it: a checkpoint's), then the next."""
        self._prefilling = deque(j for j in self._prefilling if not j.seq.done)
        if not self._prefilling:
            return
        self._prefill_rounds += 1
        order = list(self._prefilling)
        if self._prefill_rounds % 2:
            order.sort(key=lambda j: j.seq.pending_prefill)  # stable: the oldest first among equals
        budget = order[0].seq.prefill_step
        for job in order:
            while budget > 0 and not job.seq.prefilled:  # a chunk can be shorter than the budget (a checkpoint's)
                try:
                    budget -= job.seq.prefill(budget)
                    self._measure(job.seq)
                except Exception as e:
                    self._prefilling.remove(job)
                    self._fail(job, e)
                    break
            if job.seq.prefilled and job in self._prefilling:
                self._prefilling.remove(job)
                self._ready.append(job)
            if budget <= 0:
                return

    def _job_of(self, seq: Sequence):
        job = self._by_seq.get(id(seq))
        return job if job is not None and job.seq is seq else None

    def _fail(self, job: Job, e: Exception) -> None:
        log.error("request %s failed", job.request_id, exc_info=e)
        try:
            job.seq.close()
        except Exception:  # the request fails either way; the model thread must not
            log.exception("closing request %s failed", job.request_id)
        job.emit([Failed(f"generation failed: {type(e).__name__}: {e}", status=500)])
        self._forget(job)

    def _break(self, why: str) -> None:
        """Serve no more: every request fails with a retryable 503, now and from now on (the replica's health
        check fails too, and Serve replaces it)."""
        self.broken = self.broken or why
        log.error("%s", self.broken)
        for job in list(self._jobs.values()):
            try:
                job.seq.close()
            except Exception:
                log.exception("closing request %s failed", job.request_id)
            job.emit([Failed(self.broken, status=503)])
            self._forget(job)
        self._waiting.clear(), self._prefilling.clear(), self._ready.clear()
        self._batch = None

    def _forget(self, job: Job) -> None:
        self._jobs.pop(job.request_id, None)
        self._by_seq.pop(id(job.seq), None)

    def _measure(self, seq: Sequence) -> None:
        if seq.prefill_sample is None:
            return
        tokens, seconds = seq.prefill_sample
        seq.prefill_sample = None
        if tokens >= 16 and seconds > 0:  # a handful of tokens says more about overheads than throughput
            tps = tokens / seconds
            self.prefill_tps = tps if not self.prefill_tps else (1 - self.EMA) * self.prefill_tps + self.EMA * tps

    def _add(self, job: Job) -> None:
        self._jobs[job.request_id] = job
        self._by_seq[id(job.seq)] = job
        if self.batching:
            self._waiting.append(job)

    def _cancel(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            job.seq.close()  # a batch drops the row at its next step
            self._forget(job)

    def _drain(self, block: bool, timeout_s: float | None = None) -> None:
        while True:
            try:
                kind, request_id, obj, emit = self._inbox.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._add(obj)
            elif kind == "cancel":
                self._cancel(request_id)
            elif kind == "call":
                try:
                    obj()
                except Exception:
                    log.exception("model-thread call failed")
            elif kind == "stop":
                return
