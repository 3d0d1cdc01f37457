"""The ModelReplica router's ranks: the plan's order, a stale-load guard, pow2 and round robin."""

from dataclasses import dataclass

from cluster.actors.plan import RoutePlan
from cluster.actors.router import rank


@dataclass(frozen=True)
class Replica:
    node_id: str
    replica_id: str


R = [Replica(f"ray{i}", f"r{i}") for i in range(3)]


def test_affinity_follows_the_plan_one_replica_per_rank():
    plan = RoutePlan(policy="affinity", reason="hit", node_id="n2", ranked=("ray2", "ray0", "ray1"))
    assert rank(R, plan, lambda r: 0, 0) == [[R[2]], [R[0]], [R[1]]]


def test_a_plan_made_on_stale_load_is_corrected_by_serves_queue_lengths():
    plan = RoutePlan(policy="affinity", reason="hit", node_id="n2", ranked=("ray2", "ray0", "ray1"))
    queues = {"r2": 6, "r0": 1, "r1": 0}
    assert rank(R, plan, lambda r: queues[r.replica_id], 0)[0] == [R[1]]
    queues["r2"] = 3  # within the slack: the plan stands
    assert rank(R, plan, lambda r: queues[r.replica_id], 0)[0] == [R[2]]


def test_replicas_the_plan_does_not_know_come_last_together():
    plan = RoutePlan(policy="affinity", reason="hit", node_id="n0", ranked=("ray0",))
    assert rank(R, plan, lambda r: None, 0) == [[R[0]], [R[1], R[2]]]


def test_pow2_and_no_plan_offer_two_random_replicas():
    for plan in (None, RoutePlan(policy="pow2", reason="policy"), RoutePlan(policy="affinity", reason="fallback")):
        (two,) = rank(R, plan, lambda r: 0, 0)
        assert len(two) == 2 and len(set(two)) == 2


def test_round_robin_takes_turns():
    plan = RoutePlan(policy="round_robin", reason="policy")
    assert [rank(R, plan, lambda r: 0, t)[0][0].node_id for t in range(4)] == ["ray0", "ray1", "ray2", "ray0"]
