"""What the ranks of a sharded replica restore: the same number of tokens on every rank, or none.

Each rank of a tensor-parallel model keeps the KV of its own heads, in its own tiers, under a fingerprint
that names its place (mode, size, rank): no other geometry's blocks ever restore into it. The ranks run
the same turns (engine/lockstep.py), so they capture the same blocks; but a rank's tiers can still differ
(evictions, a refused block), and a forward over different prefixes would part the ranks' shapes and
hang their collectives. So on every cached request, at restore time on each model thread:

1. every rank offers the most it can restore: the leader its admission's plan (its restore-or-recompute
   choice included), a follower what its own tiers hold (`Admission.restorable`);
2. the ranks take the least offer (`all_min`), and each fetches exactly that many tokens, or nothing;
3. each builds its caches, and the ranks check that all of them did (`all_min` again); if one could not,
   every rank drops what it built and prefills cold.

Two one-integer collectives per cached request; a cold request (`use_cache` off) has none, on every rank.
"""

from __future__ import annotations

from typing import Optional

from cluster.engine import model_thread
from cluster.kvcache.admission import Admission
from cluster.kvcache.prefix_cache import Prefetch


class ShardRestore:
    """One rank's side of the agreement, over the sharded model's mx.distributed group."""

    def __init__(self, admission: Admission, group):
        self.admission = admission
        self.group = group
        self.agreed = self.short = self.dropped = 0  # restores agreed, cut below this rank's offer, dropped

    def settle(self, prompt: list[int], prefetch: Optional[Prefetch]) -> Prefetch:
        """What this rank restores: `prefetch` (the leader's admission) if every rank can restore as much,
        else exactly the tokens all can (this rank's tiers, read on the model thread: RAM and, since each rank
        has its node's disk tier, the disk too; a slow store holds every rank's turn, see docs/sharding.md)."""
        offer = prefetch.n if prefetch is not None else self.admission.restorable(prompt)
        n = self._least(offer)
        self.agreed += 1
        if prefetch is not None and prefetch.n == n:
            return prefetch
        self.short += n < offer
        return self.admission.fetch_exactly(prompt, n)

    def confirm(self, restored: bool) -> bool:
        """Whether every rank built its caches as agreed (if not, all of them prefill cold)."""
        ok = self._least(int(restored)) == 1
        self.dropped += not ok
        return ok

    def _least(self, value: int) -> int:
        import mlx.core as mx

        model_thread.check("ShardRestore")
        return int(mx.distributed.all_min(mx.array([value], mx.int32), group=self.group).item())

    def stats(self) -> dict:
        return {"agreed": self.agreed, "cut_short": self.short, "dropped": self.dropped}


def cache_on_every_rank(setup, group):
    """`setup` (this rank's CacheSetup) if every rank of the group set up a cache, else one without: a rank
    restoring while another cannot would part them (its probe failed, its family has no layout on its
    layers). Every rank calls it right after setup_cache (model thread)."""
    import mlx.core as mx

    from cluster.kvcache.setup import CacheSetup

    model_thread.check("cache_on_every_rank")
    every = int(mx.distributed.all_min(mx.array([int(setup.cache is not None)], mx.int32), group=group).item())
    if every or setup.cache is None:
        return setup
    return CacheSetup(None, None, "another rank of this sharded replica runs without a prefix cache (its log says "
                                  "why), so no rank keeps one")
