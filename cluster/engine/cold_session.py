"""The no-cache session: fresh mlx-lm caches, nothing captured.

Used when caching is off, for models whose layout is unsupported, and as the
reference "cold run" the cache tests compare against.
"""

from __future__ import annotations

from typing import Optional

from mlx_lm.models.cache import make_prompt_cache

from cluster.engine.schedule import Schedule


class ColdSession:
    """`schedule`: the replica's (engine/schedule.py), so a bypassed cold run is cut as a cached one is; None
    cuts every `step` tokens from the start."""

    uses_cache = False

    def __init__(self, model, make_caches=None, schedule: Optional[Schedule] = None):
        self.make_caches = make_caches or (lambda: make_prompt_cache(model))
        self.schedule = schedule

    def restore(self) -> tuple[list, int]:
        return self.make_caches(), 0

    def next_stop(self, start: int, limit: int, step: int) -> int:
        if self.schedule is not None:
            return self.schedule.next_stop(start, limit, step)
        return min(start + step, limit)

    def observe(self, cache: list, fed: list[int]) -> None:
        pass

    def close(self, cache: list, fed: list[int], completed: bool) -> None:
        pass
