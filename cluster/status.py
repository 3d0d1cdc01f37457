"""Fleet status: nodes from Ray, replicas from their Redis leases.

The same JSON backs `mlx-fleet status --json` and `GET /v1/fleet/status`.
"""

from __future__ import annotations

from typing import Optional

from cluster.config import NODE_LABEL, NODE_RESOURCE


def ray_nodes() -> list[dict]:
    """Fleet nodes as Ray sees them (the calling process must be connected to Ray)."""
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Resources", {}).get(NODE_RESOURCE) and not n.get("Labels", {}).get(NODE_LABEL):
            continue
        nodes.append({
            "node_id": n.get("Labels", {}).get(NODE_LABEL) or n.get("NodeManagerHostname"),
            "ray_node_id": n["NodeID"],
            "alive": bool(n.get("Alive")),
            "address": n.get("NodeManagerAddress"),
        })
    return sorted(nodes, key=lambda d: (not d["alive"], d["node_id"]))


def node_stats(client) -> dict[str, dict]:
    """Disk-tier stats each node's store publishes (mlxf:node:<id>)."""
    import msgpack

    from cluster.store.keys import node_stats_pattern

    keys = sorted(client.scan_iter(match=node_stats_pattern(), count=1000))
    out = {}
    for raw in client.mget(keys) if keys else []:
        if raw is not None:
            d = msgpack.unpackb(raw, strict_map_key=False)
            out[d["node_id"]] = d
    return out


def fleet_status(redis_url: Optional[str], models: list[str]) -> dict:
    from cluster.store.leases import connect, read_leases

    replicas: list[dict] = []
    disks: dict[str, dict] = {}
    redis_error = None
    if redis_url:
        try:
            client = connect(redis_url)
            replicas = read_leases(client)
            disks = node_stats(client)
            client.close()
        except Exception as e:  # status must still answer when Redis is down
            redis_error = f"{type(e).__name__}: {e}"
    per_model = {m: [r["node_id"] for r in replicas if r.get("model") == m] for m in models}
    nodes = ray_nodes()
    for n in nodes:
        n["disk"] = disks.get(n["node_id"])
    return {
        "nodes": nodes,
        "replicas": replicas,
        "models": [{"name": m, "replicas": len(nodes), "nodes": nodes} for m, nodes in per_model.items()],
        "redis": {"url": redis_url, "error": redis_error},
    }
