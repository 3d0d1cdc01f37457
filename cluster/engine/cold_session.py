"""The no-cache session: fresh mlx-lm caches, nothing captured.

Used when caching is off, for models whose layout is unsupported, and as the
reference "cold run" the cache tests compare against.
"""

from __future__ import annotations

from mlx_lm.models.cache import make_prompt_cache


class ColdSession:
    def __init__(self, model, make_caches=None):
        self.make_caches = make_caches or (lambda: make_prompt_cache(model))

    def restore(self) -> tuple[list, int]:
        return self.make_caches(), 0

    def next_stop(self, start: int, limit: int, step: int) -> int:
        return min(start + step, limit)

    def observe(self, cache: list, fed: list[int]) -> None:
        pass

    def close(self, cache: list, fed: list[int], completed: bool) -> None:
        pass
