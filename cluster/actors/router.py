"""The ModelReplica deployment's request router: honours the gateway's route plan, guards against stale load.

Ray Serve calls `choose_replicas` in the caller's process (the gateway) for
every request to a ModelReplica; it returns ranks of replicas, most preferred
first, and Serve sends the request to the least-queued replica of the first
rank that has room. So:
- affinity: the plan's nodes in its order, one replica per rank. The plan's
  first choice is moved behind the least-queued replica when Serve's own
  queue-length view says it is `slack` requests busier (the plan's load view
  can be a couple of seconds old); a replica at its limit is skipped by Serve.
- pow2: two random replicas in one rank (Serve's power of two choices);
- round_robin: the next replica in turn, then the rest;
- no plan: as pow2.
It never blocks: everything it reads is in memory. It sets should_backoff, so
when every replica is full it retries with backoff instead of spinning.
"""

from __future__ import annotations

import itertools
import random
from typing import Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def plan_of(pending: Optional[PendingRequest]):
    if pending is None or not pending.args:
        return None
    return getattr(pending.args[0], "route", None)


def rank(candidates: list, plan, queue_len, turn: int, slack: int = 4) -> list[list]:
    """The ranks for one request (pure, for tests): `queue_len(replica)` is Serve's cached view or None."""
    if not candidates:
        return []
    policy = plan.policy if plan is not None else "pow2"
    if policy == "round_robin":
        first = candidates[turn % len(candidates)]
        return [[first], [c for c in candidates if c is not first]]
    if policy != "affinity" or not plan.ranked:
        return [random.sample(candidates, min(2, len(candidates)))]
    by_node: dict = {}
    for c in candidates:
        by_node.setdefault(c.node_id, c)
    ordered = [by_node[n] for n in plan.ranked if n in by_node]
    rest = [c for c in candidates if c not in ordered]
    if len(ordered) > 1:
        known = {c: queue_len(c) for c in ordered}
        target, least = ordered[0], min(ordered, key=lambda c: known[c] if known[c] is not None else 0)
        if known[target] is not None and known[least] is not None and known[target] >= known[least] + slack:
            ordered.remove(least)
            ordered.insert(0, least)  # the plan's load view was stale
    return [[c] for c in ordered] + ([rest] if rest else [])


class PlanRouter(RequestRouter):
    def initialize_state(self, slack: int = 4, **kwargs) -> None:
        self.slack = slack
        self._turns = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        cache = self.replica_queue_len_cache
        return rank(list(candidate_replicas), plan_of(pending_request), lambda r: cache.get(r.replica_id),
                    next(self._turns), getattr(self, "slack", 4))
