"""The Serve application: one Gateway plus one ModelReplica deployment per model.

`build_app` is the import path of deploy/serve.yaml (`cluster.actors.app:build_app`)
and what `mlx-fleet up` deploys, so both build the same graph from an AppConfig.

Placement: each fleet node advertises the custom resource `mlx_fleet`; a replica
asks for a sliver of it (so several models can share a node) and
`max_replicas_per_node=1` spreads one replica of each model per node. A sharded
model's replica spans `shards` nodes (`placement`).
"""

from __future__ import annotations

from typing import Optional

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.actors.gateway import Gateway
from cluster.actors.replica import ModelReplica
from cluster.actors.router import PlanRouter
from cluster.config import NODE_RESOURCE, AppConfig, ModelSpec, ranks_overflow, sharded_replicas

REPLICA_RESOURCE_SHARE = 0.001
SHARD_BUNDLE_SHARE = 0.6


def fleet_node_count() -> int:
    """Alive Ray nodes that carry the fleet resource (0 when not connected to Ray)."""
    import ray

    if not ray.is_initialized():
        return 0
    return sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(NODE_RESOURCE))


def placement(spec: ModelSpec, nodes: int, models: Optional[list[ModelSpec]] = None) -> dict:
    """How many replicas, and where: one per node, or, sharded, one per `shards` nodes, each in a placement group
    of one bundle per node (STRICT_SPREAD). A bundle takes over half a node's `mlx_fleet`, so a node holds one
    rank of a sharded replica at most, beside the slivers unsharded replicas take; the sharded models among
    `models` (the app's, default this one) share the nodes (config.sharded_replicas)."""
    if spec.shards == 1:
        replicas = spec.num_replicas if spec.num_replicas is not None else max(nodes, 1)
        return {"num_replicas": replicas, "max_replicas_per_node": 1}
    replicas = sharded_replicas(models or [spec], nodes)[spec.name]
    return {"num_replicas": replicas, "placement_group_bundles": [{NODE_RESOURCE: SHARD_BUNDLE_SHARE}] * spec.shards,
            "placement_group_strategy": "STRICT_SPREAD"}


# How often a stopping replica checks whether its requests are done; Serve's default (2 s) is also how long an
# idle one waits before its first check, which every `down` paid.
DRAIN_CHECK_S = 0.25


def replica_deployment(spec: ModelSpec, config: AppConfig, nodes: int):
    return serve.deployment(ModelReplica).options(
        name=spec.deployment,
        **placement(spec, nodes, config.models),
        max_ongoing_requests=spec.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0, "resources": {NODE_RESOURCE: REPLICA_RESOURCE_SHARE}},
        # The gateway's route plan rides in the request; this router honours it (router.py).
        request_router_config=RequestRouterConfig(request_router_class=PlanRouter),
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=30,
        graceful_shutdown_wait_loop_s=DRAIN_CHECK_S,
    )


def build_app(args: dict | AppConfig) -> Application:
    """Serve builder: `args` is an AppConfig or its dict form (from YAML)."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    nodes = fleet_node_count()
    overflow = ranks_overflow(config.models, nodes) if nodes else None
    if overflow:  # refused now, with the fix, rather than replicas that wait for nodes forever
        raise ValueError(overflow)
    handles = {spec.name: replica_deployment(spec, config, nodes).bind(spec, config) for spec in config.models}
    gateway = serve.deployment(Gateway).options(
        name="Gateway", num_replicas=config.gateway.replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1000, graceful_shutdown_wait_loop_s=DRAIN_CHECK_S,
    )
    return gateway.bind(config, handles)
