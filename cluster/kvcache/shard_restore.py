"""What the ranks of a sharded replica restore: the same number of tokens on every rank, or none.

Each rank of a tensor-parallel model keeps the KV of its own heads, in its own tiers, under a fingerprint
that names its place (mode, size, rank): no other geometry's blocks ever restore into it. The ranks run
the same turns (engine/lockstep.py), so they capture the same blocks; but a rank's tiers can still differ
(evictions, a refused block), and a forward over different prefixes would part the ranks' shapes and
hang their collectives. So on every cached request, at restore time on each model thread:

1. every rank offers the most it can restore: the leader its admission's plan (its restore-or-recompute
   choice included), a follower what its own read brought (below);
2. the ranks take the least offer (`all_min`), and each keeps exactly that many tokens, or nothing;
3. each builds its caches, and the ranks check that all of them did (`all_min` again); if one could not,
   every rank drops what it built and prefills cold.

Two one-integer collectives per cached request; a cold request (`use_cache` off) has none, on every rank.

No rank's model thread waits on its disk. The leader reads at admission, on its admission threads, and before
that tells its followers the prompt (a `prefetch` item of the next turn's share: lockstep.py). Each follower
then reads, on admission threads of its own, the longest prefix its tiers hold (`Admission.fetch_own`), at
the same time as the leader reads its own. Where the leader's route plan pulls the prefix from a peer replica of
the same geometry, each rank pulls its own heads' blocks from its counterpart's node (rank r from the peer's
rank r) in that read, checked like any block that enters the process. At the agreement a follower offers what its read brought, waiting
`FOLLOWER_WAIT_S` at most for it; a read not done by then, or one never started, is replaced by what RAM alone
holds. Once the ranks agree on less than a rank read, it keeps that many tokens of what it read and of its RAM,
never the disk (`Admission.fetch_exactly`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as WaitTimeout
from typing import Optional

from cluster.engine import model_thread
from cluster.kvcache.admission import Admission
from cluster.kvcache.prefix_cache import Prefetch

log = logging.getLogger(__name__)

# How long a follower's model thread waits for its own read at the agreement. The leader's read of the same
# prefix has just ended, and a follower's began at about the same time, so a healthy disk has done by then;
# every rank waits in the agreement meanwhile, so the wait is short, and past it RAM alone is offered.
FOLLOWER_WAIT_S = 1.0
PENDING_READS = 64  # a follower's reads whose requests have not come (yet): a cancelled one's is dropped in time


class ShardRestore:
    """One rank's side of the agreement, over the sharded model's mx.distributed group."""

    def __init__(self, admission: Admission, group, executor: Optional[Executor] = None):
        """`executor`: a follower's admission threads, where its reads run (the leader reads in its own admission)."""
        self.admission = admission
        self.group = group
        self.executor = executor
        self._reads: OrderedDict[tuple, list[Future]] = OrderedDict()  # prompt -> its reads, oldest first
        self.agreed = self.short = self.dropped = 0  # restores agreed, cut below this rank's offer, dropped
        self.reads = self.late = 0  # a follower's reads offered, and those not done in time (RAM alone offered)

    def read_ahead(self, prompt: list[int], pull=None) -> None:
        """A follower, told by the leader that `prompt` is coming: read its prefix off the model thread now, and
        pull what `pull` (this rank's part of the leader's route plan: admission.py FetchPlan) says first."""
        if self.executor is None:
            return
        key = tuple(prompt)
        self._reads.setdefault(key, []).append(self.executor.submit(self.admission.fetch_own, prompt, pull))
        self._reads.move_to_end(key)
        while sum(len(v) for v in self._reads.values()) > PENDING_READS:
            _, old = self._reads.popitem(last=False)
            for f in old:
                f.cancel()

    def settle(self, prompt: list[int], prefetch: Optional[Prefetch]) -> Prefetch:
        """What this rank restores: `prefetch` (the leader's admission, or a follower's own read) if every rank
        can restore as much, else exactly the tokens all can, from what it read and its RAM."""
        if prefetch is None:
            prefetch = self._own_read(prompt)
        offer = prefetch.n if prefetch is not None else self.admission.restorable(prompt, disk=False)
        n = self._least(offer)
        self.agreed += 1
        if prefetch is not None and prefetch.n == n:
            return prefetch
        self.short += n < offer
        return self.admission.fetch_exactly(prompt, n, have=prefetch.blocks if prefetch is not None else None)

    def _own_read(self, prompt: list[int]) -> Optional[Prefetch]:
        """A follower's read of `prompt`, if it was started and ends within FOLLOWER_WAIT_S (model thread)."""
        key = tuple(prompt)
        reads = self._reads.get(key)
        if not reads:
            return None
        future = reads.pop(0)
        if not reads:
            del self._reads[key]
        try:
            read = future.result(FOLLOWER_WAIT_S)
            self.reads += 1
            return read
        except WaitTimeout:
            self.late += 1
            log.warning("this rank's read of a %d-token prompt took longer than %.1fs; offering what RAM holds",
                        len(prompt), FOLLOWER_WAIT_S)
        except Exception:  # never fail a request because its cache read failed
            log.exception("this rank's read failed; offering what RAM holds")
        return None

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
        return {"agreed": self.agreed, "cut_short": self.short, "dropped": self.dropped, "reads": self.reads,
                "late_reads": self.late}


def cache_on_every_rank(setup, group):
    """`setup` (this rank's CacheSetup) if every rank of the group set up a cache, else one without: a rank
    restoring while another cannot would part them (its probe failed, its family has no layout on its
    layers). Every rank calls it right after setup_cache (model thread).

    The ranks' caches also take one checkpoint interval, the largest of theirs: each rank's own follows its
    layers' state and KV bytes, which differ between a pipeline's stages, and on the block schedule a hybrid's
    prefill chunks end where checkpoints are due. Left apart, the stages cut one prompt into different chunks
    (a tiny-next stage every 64 tokens, the other at 512), so their forwards, whose sends and receives must
    pair up, no longer did: MLX's ring streamed the bytes through only while each turn's chunks added up to
    the same tokens on both."""
    import mlx.core as mx

    from cluster.kvcache.setup import CacheSetup

    model_thread.check("cache_on_every_rank")
    on_all = int(mx.distributed.all_min(mx.array([int(setup.cache is not None)], mx.int32), group=group).item())
    if on_all:
        setup.cache.every = int(mx.distributed.all_max(mx.array([setup.cache.every], mx.int32), group=group).item())
    if on_all or setup.cache is None:
        return setup
    if setup.cache.tiers.disk is not None:
        setup.cache.tiers.disk.close()  # its spill thread, with nothing left to spill
    return CacheSetup(None, None, "another rank of this sharded replica runs without a prefix cache (its log says "
                                  "why), so no rank keeps one")
