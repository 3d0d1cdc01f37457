"""One model split over ranks (mx.distributed): every rank runs the same scheduler turns, in lockstep.

A sharded model's forward is a collective: tensor parallel sums every layer's partial products
over the ranks (`all_sum` inside mlx-lm's sharded linears). So every rank must run the same
forwards, with the same shapes, in the same order. The scheduler decides its forwards from what
enters it (requests, cancellations) and from nothing else that differs between processes (token
budgets, not clocks; greedy or seeded sampling on logits every rank holds whole). So:

    the leader (the replica's rank)            every other rank (a follower)
    inbox -> drained items ----share(items)--> the same items -> the same jobs (no one listens)
    turn: admit, prefill, decode    <-all_sum->  turn: admit, prefill, decode

- The leader shares, before a turn, what its inbox brought: each new request as plain data (its prompt
  and parameters, with the seed of a sampled request fixed first so that every rank draws the same
  tokens), each cancellation, and each prompt whose cached prefix the leader's admission starts to read (a
  follower reads its own meanwhile). A follower rebuilds the request as a Sequence of its own and runs
  the same turn. A turn with nothing to run is not shared: an idle leader sends nothing, and the
  followers wait in the collective.
- The share is itself a collective on the model thread: the payload's size, then its bytes, each an
  `all_sum` to which only the leader adds anything (as mlx_lm.server shares its requests). It is
  msgpack, never pickle: nothing that crosses a process is unpickled.
- Stopping is an item too: the leader's scheduler stops, and its followers after it.

What each rank restores from a prefix cache must be the same number of tokens, or the ranks' shapes
part: a request says whether it uses the cache, and the ranks' sessions agree on what they restore
(kvcache/shard_restore.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import msgpack

from cluster.engine import model_thread
from cluster.engine.request import params_from_wire, params_to_wire
from cluster.engine.sequence import Sequence

STOP = "stop"


class Lockstep:
    """The ranks' shared turns over one mx.distributed group; `leader` (the replica's rank) leads.

    Any rank can lead: a share is a sum to which only the leader adds. A sharded replica's ranks follow its
    nodes (sharding.py `ranks_by_node`), so the replica, which leads, is not always rank 0."""

    def __init__(self, group, leader: int = 0):
        self.group = group
        self.rank, self.size, self.leader = group.rank(), group.size(), leader
        self.shared = 0  # turns shared (status)

    @property
    def leads(self) -> bool:
        return self.rank == self.leader

    def share(self, items: list | None = None) -> list:
        """The leader sends `items`; every other rank gets them. Every rank calls it at the same point of its loop."""
        import mlx.core as mx
        import numpy as np

        model_thread.check("Lockstep.share")
        data = msgpack.packb(items) if self.leads else b""
        size = mx.distributed.all_sum(mx.array([len(data)], mx.int32), group=self.group).item()
        buf = mx.array(np.frombuffer(data, np.uint8)) if self.leads else mx.zeros((size,), mx.uint8)
        got = mx.distributed.all_sum(buf, group=self.group)
        mx.eval(got)
        self.shared += 1
        return items if self.leads else msgpack.unpackb(np.array(got).tobytes())


def group_lost(e: BaseException) -> bool:
    """Whether `e` is MLX's distributed backend losing a peer (a rank died or its node went away)."""
    return isinstance(e, RuntimeError) and str(e).startswith(("[ring]", "[jaccl]", "[mpi]", "[nccl]"))


def fix_seed(seq: Sequence) -> None:
    """A sampled request without a seed gets one now, on the leader, so that every rank draws the same tokens."""
    import os

    s = seq.params.sampling
    if not s.greedy and s.seed is None:
        seed = int.from_bytes(os.urandom(8), "little", signed=True)
        seq.params = replace(seq.params, sampling=replace(s, seed=seed))


def describe(request_id: str, seq: Sequence) -> dict:
    """A new request as plain data, for the followers."""
    return {"add": request_id, "prompt": seq.prompt, "params": params_to_wire(seq.params),
            "prefill_step": seq.prefill_step, "cached": bool(getattr(seq.session, "uses_cache", False))}


def cancelled(request_id: str) -> dict:
    return {"cancel": request_id}


# (prompt, params, prefill_step, cached) -> a follower's Sequence; `cached`: it restores from the cache
Rebuild = Callable[[list[int], "object", int, bool], Sequence]


def rebuilt(item: dict, rebuild: Rebuild) -> Sequence:
    return rebuild(list(item["prompt"]), params_from_wire(item["params"]), int(item["prefill_step"]),
                   bool(item.get("cached", False)))
