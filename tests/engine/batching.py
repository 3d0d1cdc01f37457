"""Helpers for batching tests: submit sequences to a Scheduler and collect what each streams.

Every MLX call of a test that has a Scheduler runs on its model thread
(`scheduler.run`); the thread guard fails the test otherwise.
"""

from __future__ import annotations

import threading

import pytest

from cluster.engine.events import TERMINAL, Delta
from cluster.engine.schedule import on_gpu
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence

# Tests that a batched row answers as the same request alone, in the default mode. On a GPU, MLX picks its
# kernels by the batch's shape, so a row rounds differently in the last bits and greedy tokens part near ties:
# measured with `mlx-fleet bench agreement` (docs/gpu.md). The deterministic mode makes it bitwise there
# (tests/engine/test_invariant.py runs on the GPU too).
solo_equals_batched = pytest.mark.skipif(
    on_gpu(), reason="on a GPU a batched row is bitwise its solo run in the deterministic mode only "
                     "(test_invariant.py); the default's agreement is measured by bench agreement (docs/gpu.md)")


def tokens(events) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def run_alone(seq: Sequence) -> list:
    events = []
    while not seq.done:
        events += seq.step()
    return events


class Collector:
    """Events per request id, and a way to wait until requests end."""

    def __init__(self):
        self.events: dict[str, list] = {}
        self._cond = threading.Condition()

    def emit_for(self, request_id: str):
        self.events[request_id] = []

        def emit(events):
            with self._cond:
                self.events[request_id].extend(events)
                self._cond.notify_all()
        return emit

    def ended(self, request_id: str) -> bool:
        got = self.events[request_id]
        return bool(got) and isinstance(got[-1], TERMINAL)

    def wait(self, ids, timeout: float = 120.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: all(self.ended(i) for i in ids), timeout), \
                {i: len(self.events[i]) for i in ids}

    def wait_tokens(self, request_id: str, n: int, timeout: float = 60.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(tokens(self.events[request_id])) >= n, timeout)


def serve_all(scheduler: Scheduler, seqs: list[Sequence], timeout: float = 120.0) -> list[list]:
    """Submit every sequence at once; return each one's events once all have ended."""
    return scheduler.run_all(seqs, timeout)
