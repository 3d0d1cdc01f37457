"""A circuit breaker for calls to the node store.

closed     calls go through; `failures` consecutive failures open it
open       calls are refused at once (a miss) for `cooldown_s`
half-open  after the cool-down one trial call goes through: success closes
           the breaker, failure opens it for another cool-down

So a stalled or dead store costs each request at most one deadline while the
breaker learns, and then nothing at all until it may have recovered.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Breaker:
    def __init__(self, failures: int = 3, cooldown_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._consecutive = 0
        self._open_until = 0.0
        self._trial = False
        self._lock = threading.Lock()
        self.opened = 0  # times it opened (status)

    @property
    def state(self) -> str:
        with self._lock:
            if self._consecutive < self.failures:
                return "closed"
            return "half-open" if self.clock() >= self._open_until else "open"

    def allow(self) -> bool:
        """May a call go through now? (In half-open, only one trial at a time.)"""
        with self._lock:
            if self._consecutive < self.failures:
                return True
            if self.clock() < self._open_until or self._trial:
                return False
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            trial, self._trial = self._trial, False
            self._consecutive += 1
            if self._consecutive == self.failures or (trial and self._consecutive > self.failures):
                self.opened += 1
            if self._consecutive >= self.failures:
                self._open_until = self.clock() + self.cooldown_s
