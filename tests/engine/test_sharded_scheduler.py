"""A sharded replica's scheduler abandoned from outside its model thread (the leader's watch on its followers).

MLX's ring can wait forever in a collective whose peer died before it began, and nothing interrupts a
collective: so when the watch sees a rank die, the requests must end without the model thread. Here the
model thread is held on a gate, the stand-in for a collective that never returns (the real hang comes
and goes with the timing of the kill: tests/e2e/test_fleet_shards.py kills real ranks).
"""

import threading
import time

from cluster.engine.cold_session import ColdSession
from cluster.engine.events import Failed
from cluster.engine.request import GenerationParams
from cluster.engine.sequence import Sequence
from cluster.engine.sharded_scheduler import ShardedScheduler

WHY = "rank 1 of this sharded replica (node node-1-5e6f7a8b) was lost (ActorDiedError)"


def test_abandon_fails_open_and_later_requests_while_the_model_thread_is_stuck(load_builtin):
    scheduler = ShardedScheduler(name="mlx-fleet-test")
    model, tok = scheduler.run(lambda: load_builtin("tiny-dense"))
    gate = threading.Event()
    got: dict[str, list] = {"open": [], "later": []}
    try:
        scheduler.call(gate.wait)  # the model thread is stuck from here on
        seq = Sequence([3, 5, 7, 11], GenerationParams(max_tokens=4), model, tok, ColdSession(model), 32)
        scheduler.submit("open", seq, got["open"].extend)
        scheduler.abandon(WHY)
        assert [(type(e), e.status) for e in got["open"]] == [(Failed, 503)]
        assert got["open"][0].message == WHY and scheduler.broken == WHY and scheduler.abandoned
        later = Sequence([3, 5], GenerationParams(max_tokens=4), model, tok, ColdSession(model), 32)
        scheduler.submit("later", later, got["later"].extend)
        assert [(type(e), e.message, e.status) for e in got["later"]] == [(Failed, WHY, 503)]
        gate.set()  # the thread comes back: what it makes for the abandoned request goes nowhere
        deadline = time.monotonic() + 60
        while (scheduler.active or len(seq.generated) < 4) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.active == 0 and len(seq.generated) == 4  # it ran to its end, unheard
        assert len(got["open"]) == 1 and len(got["later"]) == 1
    finally:
        gate.set()
        scheduler.stop()
