from cluster.actors.request_metrics import prefix_decision
from cluster.engine.events import Started


def test_the_prefix_decision_is_what_the_replica_did():
    assert prefix_decision(Started(cached_tokens=192, prompt_tokens=300, fetched_tokens=128, fetched_from="b")) == "fetch"
    assert prefix_decision(Started(cached_tokens=192, prompt_tokens=300)) == "local"
    assert prefix_decision(Started(cached_tokens=0, prompt_tokens=300)) == "recompute"
    assert prefix_decision(None) == "recompute"  # ended before its first token
