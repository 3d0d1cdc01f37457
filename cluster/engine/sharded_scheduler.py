"""The scheduler of one rank of a sharded model: its turns run in lockstep with the other ranks' (lockstep.py).

Until `join`, it is a plain Scheduler (the model loads on its thread). Then:
- the leader records what its inbox brings (each new request, with a sampled one's seed fixed first, and each
  cancellation) and shares it before the turn that takes it in; a turn with nothing to run is not shared;
- a follower takes each turn's items from the leader, rebuilds the requests and runs the same turn;
- a cached request's prompt goes ahead of it (`read_ahead`), as the leader's admission starts to read its
  prefix, so that each follower reads its own off its model thread meanwhile (kvcache/shard_restore.py), and
  pulls its own from its counterpart in a peer replica where the leader's route plan pulls;
- a lost rank (MLX's backend says "connection to a peer was lost") breaks the replica: every request gets a
  retryable 503 from then on, a follower stops, and the leader's health check fails so Serve replaces it whole;
- the leader stopping stops its followers;
- a rank found dead from outside (the leader's watch on its followers' actors: shard_rank.py) `abandon`s the
  replica from that thread: MLX's ring can wait forever in a collective whose peer died before it began,
  and no collective can be interrupted, so the requests are failed without the model thread, which is
  left stuck until Serve replaces the replica (its followers die with it, as Ray's children).
"""

from __future__ import annotations

import threading
from typing import Callable

from cluster.engine.events import TERMINAL, Event, Failed
from cluster.engine.lockstep import STOP, Lockstep, Rebuild, cancelled, describe, fix_seed, group_lost, rebuilt
from cluster.engine.scheduler import Emit, Job, Scheduler
from cluster.engine.sequence import Sequence


class ShardedScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        self.lockstep: Lockstep | None = None  # before the base starts the model thread, which reads them
        self._rebuild: Rebuild | None = None
        self._read_ahead: Callable[[list[int], dict | None], None] | None = None
        self._turn_items: list[dict] = []
        self._open: dict[str, Emit] = {}  # each request not yet ended, and where its events go
        self._open_lock = threading.Lock()
        self.abandoned = False
        super().__init__(*args, **kwargs)

    def submit(self, request_id: str, seq: Sequence, emit: Emit, origin: str = "") -> None:
        with self._open_lock:
            if self.abandoned:
                emit([Failed(self.broken, status=503)])
                return
            self._open[request_id] = emit
        super().submit(request_id, seq, lambda events: self._emit(request_id, events), origin)

    def _emit(self, request_id: str, events: list[Event]) -> None:
        with self._open_lock:  # after `abandon` a request has ended: what its turns still make goes nowhere
            emit = self._open.get(request_id)
            if emit is None:
                return
            if any(isinstance(e, TERMINAL) for e in events):
                del self._open[request_id]
            emit(events)

    def abandon(self, why: str) -> None:
        """From any thread: fail every open request and every later one with a retryable 503, and break the
        replica (its health check fails), without the model thread, which may be stuck in a collective."""
        with self._open_lock:
            self.broken = self.broken or why
            self.abandoned = True
            open_, self._open = self._open, {}
            for emit in open_.values():
                emit([Failed(self.broken, status=503)])

    def join(self, lockstep: Lockstep, rebuild: Rebuild | None = None,
             read_ahead: Callable[[list[int], dict | None], None] | None = None) -> None:
        """From now on run in lockstep with the other ranks: the leader leads, the others follow (they need `rebuild`;
        `read_ahead` starts a follower's read of a prompt's cached prefix) until the leader stops. Call it once the
        model is loaded, before any request."""
        if not lockstep.leads and rebuild is None:
            raise ValueError("a follower rank needs a way to rebuild the leader's requests")

        def set_() -> None:
            self.lockstep, self._rebuild, self._read_ahead = lockstep, rebuild, read_ahead
        self.run(set_)

    def read_ahead(self, prompt: list[int], pull: dict | None = None) -> None:
        """The leader, as its admission starts to read `prompt`'s cached prefix (and to pull it, where the route
        plan says: `pull`, actors/plan.py FetchPlan.shared): the followers start theirs (the next turn's share
        carries it; an idle leader runs a turn for it)."""
        item = {"prefetch": prompt, "pull": pull}
        self.call(lambda: self._turn_items.append(item) if self._leads else None)

    @property
    def _leads(self) -> bool:
        return self.lockstep is not None and self.lockstep.leads

    def _add(self, job: Job) -> None:
        if self._leads:
            fix_seed(job.seq)
            self._turn_items.append(describe(job.request_id, job.seq))
        super()._add(job)

    def _cancel(self, request_id: str) -> None:
        if self._leads and request_id in self._jobs:
            self._turn_items.append(cancelled(request_id))
        super()._cancel(request_id)

    def _prepare_turn(self) -> bool:
        if self.lockstep is None:
            return super()._prepare_turn()
        if not self.lockstep.leads:
            return self._follow()
        super()._prepare_turn()
        try:
            if self.broken:  # refuse what arrived since
                self._break(self.broken)
                return False
            if not (self._turn_items or self._jobs):
                return False  # nothing to run: the followers wait for the next turn
            self.lockstep.share(self._turn_items)
            return True
        except RuntimeError as e:  # a follower is gone
            if not group_lost(e):
                raise
            self._lost(e)
            return False
        finally:
            self._turn_items = []

    def _follow(self) -> bool:
        """A follower's turn: the leader's items, applied as the leader applied them; False when no turn runs."""
        try:
            items = self.lockstep.share(None)
        except RuntimeError as e:  # the leader is gone
            if not group_lost(e):
                raise
            self._lost(e)
            return False
        for item in items:
            if STOP in item:
                self._stopping = True
                return False
            if "add" in item:
                super()._add(Job(item["add"], rebuilt(item, self._rebuild), lambda events: None))
            elif "prefetch" in item:
                if self._read_ahead is not None:
                    self._read_ahead(list(item["prefetch"]), item.get("pull"))
            else:
                super()._cancel(item["cancel"])
        return True

    def _fail(self, job: Job, e: Exception) -> None:
        if self.lockstep is not None and group_lost(e):
            self._lost(e)
            return
        super()._fail(job, e)

    def _lost(self, e: Exception) -> None:
        self._break(f"a rank of this sharded replica was lost ({e}); it is being replaced, retry shortly")
        if not self.lockstep.leads:
            self._stopping = True  # a follower has nothing left to follow

    def _after_turns(self) -> None:
        if self._leads and not self.broken:
            self.lockstep.share([{STOP: True}])  # the followers end with their leader
