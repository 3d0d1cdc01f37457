from cluster.actors.dispatch import coalesce
from cluster.engine.events import Delta, Finished, Started
from cluster.engine.logprobs import TokenLogprob
from cluster.engine.tool_calls import ToolCall


def test_the_tokens_a_replica_sent_together_become_one_delta():
    lp = [TokenLogprob(t, -0.5) for t in (7, 8, 9)]
    call = ToolCall(id="call_1", name="f", arguments="{}")
    started = Started(cached_tokens=0, prompt_tokens=5)
    done = Finished("stop", 5, 4, 0)
    events = [started, Delta(" a", (7,), (lp[0],)), Delta("b", (8,), (lp[1],)), Delta("", (9,), (lp[2],)),
              Delta("", (10,), (), (call,)), done]
    assert coalesce(events) == [started, Delta(" ab", (7, 8, 9), tuple(lp)), Delta("", (10,), (), (call,)), done]
    assert coalesce([]) == []


def test_a_requests_queued_tokens_follow_it_to_the_node_that_accepts_it():
    """The router moved it (or the plan named no node): its prompt still waits in the queue of the replica
    that took it, and is counted there, once, until its first token."""
    from cluster.actors.dispatch import _Held
    from cluster.actors.routing import Affinity
    from cluster.config import RoutingConfig

    router = Affinity(None, None, RoutingConfig())
    queued = _Held(router.track_queued, "n0", 300)
    assert dict(router.queued) == {"n0": 300}
    queued.move("n2")  # accepted by n2
    queued.move("n2")
    assert dict(router.queued) == {"n2": 300}
    queued.release()
    queued.release()  # a close and an error path both release
    assert dict(router.queued) == {}
    unplanned = _Held(router.track_queued, None, 120)  # a fallback plan: no node until one accepts it
    assert dict(router.queued) == {}
    unplanned.move("n1")
    assert dict(router.queued) == {"n1": 120}
