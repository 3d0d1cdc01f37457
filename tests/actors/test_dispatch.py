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
