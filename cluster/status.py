"""Fleet status: nodes from Ray, disk tiers from their node stores, replicas from their leases.

The same JSON backs `mlx-fleet status --json` and `GET /v1/fleet/status`. The
calling process must be connected to Ray (the CLI is a driver, the gateway a
replica). Sources, and what happens when one is away:
- nodes: Ray's node table;
- disk tiers: each node store's live counters (an actor call, 2 s deadline),
  else the copy it publishes to Redis every few seconds;
- replicas: their Redis leases; with Redis away, Serve's own replica counts
  (`replicas_source: "serve"`), so status never says "0 replicas" while they serve;
- redis: reachable or not, its error, and for a local fleet how often the
  supervisor restarted it, and whether that supervisor still runs (if it died,
  a Redis crash would stay down). No URL is ever shown with its password.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import json

from cluster.config import NODE_LABEL, NODE_RESOURCE
from cluster.node import RAY_NAMESPACE

STORE_DEADLINE_S = 2.0
SUPERVISOR_FILE = "supervisor.json"  # written by a local fleet's supervisor (fleet/supervisor.py)


def ray_nodes() -> list[dict]:
    """Fleet nodes as Ray sees them."""
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Resources", {}).get(NODE_RESOURCE) and not n.get("Labels", {}).get(NODE_LABEL):
            continue
        nodes.append({
            "name": n.get("Labels", {}).get(NODE_LABEL) or n.get("NodeManagerHostname"),
            "ray_node_id": n["NodeID"],
            "alive": bool(n.get("Alive")),
            "address": n.get("NodeManagerAddress"),
            # where Prometheus scrapes the node: Ray's metrics agent, which serves the fleet's metrics too
            "metrics_port": n.get("MetricsExportPort"),
        })
    return sorted(nodes, key=lambda d: (not d["alive"], d["name"]))


def live_store_stats() -> list[dict]:
    """Every node store's counters right now (stores that do not answer in time are left out)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == RAY_NAMESPACE and a["name"].startswith("node-store:")]
    refs = []
    for name in names:
        try:
            refs.append(ray.get_actor(name, namespace=RAY_NAMESPACE).stats.remote())
        except ValueError:  # listed, then gone: its node died in between (the list is not a snapshot)
            continue
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=STORE_DEADLINE_S) if refs else ([], [])
    out = []
    for ref in ready:
        try:
            out.append(ray.get(ref))
        except Exception:  # a store on a lost node: it answers with an error, not with stats
            continue
    return out


def published_store_stats(client) -> list[dict]:
    """The copies node stores publish to Redis (mlxf:node:<id>)."""
    import msgpack

    from cluster.store.keys import node_stats_pattern

    keys = sorted(client.scan_iter(match=node_stats_pattern(), count=1000))
    return [msgpack.unpackb(raw, strict_map_key=False) for raw in (client.mget(keys) if keys else []) if raw]


def serve_replicas(models: list[str]) -> dict[str, int]:
    """Running replicas per model, from the Serve controller."""
    from ray import serve

    from cluster.config import ModelSpec

    out = {m: 0 for m in models}
    for app in serve.status().applications.values():
        for m in models:
            dep = app.deployments.get(ModelSpec(name=m, source=m).deployment)
            if dep is not None:
                out[m] += dep.replica_states.get("RUNNING", 0)
    return out


def fleet_status(redis_url: Optional[str], models: list[str], data_dir: Optional[str] = None,
                 redis_settings=None) -> dict:
    """`redis_settings`: the app's RedisConfig (password, TLS CA, timeouts), as the replicas connect."""
    replicas, published, redis_state = from_redis(redis_url, redis_settings)
    redis_state.update(_supervised(data_dir))
    stores = {s["ray_node_id"]: s for s in published if s.get("ray_node_id")}
    stores.update({s["ray_node_id"]: s for s in live_store_stats() if s.get("ray_node_id")})
    nodes = ray_nodes()
    for n in nodes:
        disk = stores.get(n["ray_node_id"])
        n["node_id"] = disk.get("node_id") if disk else None
        n["disk"] = disk
    out = {"nodes": nodes, "replicas": replicas, "redis": redis_state,
           "fleet": fleet_numbers(replicas, _gateways(redis_url, redis_settings),
                                  _index_size(redis_url, replicas, redis_settings))}
    if redis_state["reachable"]:
        out["replicas_source"] = "leases"
        per_model = {m: sorted(r["node_id"] for r in replicas if r.get("model") == m) for m in models}
        out["models"] = [{"name": m, "replicas": len(ids), "nodes": ids} for m, ids in per_model.items()]
    else:
        out["replicas_source"] = "serve"
        counts = serve_replicas(models)
        out["models"] = [{"name": m, "replicas": counts[m], "nodes": None} for m in models]
    return out


def from_redis(redis_url: Optional[str], settings=None) -> tuple[list[dict], list[dict], dict]:
    """(replica leases, node stores' published stats, Redis's state); empty lists when Redis is away."""
    from cluster.store.leases import read_leases
    from cluster.store.redis_client import connect, redact

    state = {"url": redact(redis_url), "reachable": False, "error": None}
    if not redis_url:
        return [], [], state
    try:
        client = connect(redis_url, settings)
        replicas, published = read_leases(client), published_store_stats(client)
        client.close()
        state["reachable"] = True
        return replicas, published, state
    except Exception as e:  # status must still answer when Redis is down
        state["error"] = redact(f"{type(e).__name__}: {e}")
        return [], [], state


def fleet_numbers(replicas: list[dict], gateways: list[dict], index: dict) -> dict:
    """Fleet-level numbers: reuse (per node and fleet-wide), routes by reason, migration, index, cost model."""
    prompt = sum(r.get("prompt_tokens", 0) for r in replicas)
    cached = sum(r.get("cached_tokens", 0) for r in replicas)
    per_node: dict[str, list[int]] = {}
    for r in replicas:
        acc = per_node.setdefault(r["node_id"], [0, 0])
        acc[0] += r.get("cached_tokens", 0)
        acc[1] += r.get("prompt_tokens", 0)
    reasons: dict[str, int] = {}
    for g in gateways:
        for k, v in (g.get("reasons") or {}).items():
            reasons[k] = reasons.get(k, 0) + v
    migration = [(r.get("cache") or {}).get("migration") or {} for r in replicas]
    p99 = [g["lookup_ms_p99"] for g in gateways if g.get("lookup_ms_p99") is not None]
    p50 = [g["lookup_ms_p50"] for g in gateways if g.get("lookup_ms_p50") is not None]
    return {
        "reuse": round(cached / prompt, 4) if prompt else None,
        "reuse_per_node": {n: round(c / p, 4) if p else None for n, (c, p) in sorted(per_node.items())},
        "fetched_tokens": sum(r.get("fetched_tokens", 0) for r in replicas),
        "routes": reasons,
        "lookup_ms_p50": max(p50) if p50 else None, "lookup_ms_p99": max(p99) if p99 else None,
        "migrated_blocks": sum(m.get("blocks", 0) for m in migration),
        "migrated_bytes": sum(m.get("bytes", 0) for m in migration),
        "migration_failures": sum(m.get("failures", 0) for m in migration),
        "index_entries": index,
        "cost_model": {r["node_id"]: {"model": r.get("model"), "prefill_tps": r.get("prefill_tps"),
                                      "link_bytes_per_s": ((r.get("cache") or {}).get("migration") or {})
                                      .get("link_bytes_per_s", {}),
                                      # the replica's own restore-or-recompute choices and the speeds behind them
                                      **{k: v for k, v in ((r.get("cache") or {}).get("costs") or {}).items()
                                         if k != "prefill_tps"}} for r in replicas},
    }


def _gateways(redis_url: Optional[str], settings=None) -> list[dict]:
    if not redis_url:
        return []
    import msgpack

    from cluster.store.keys import gateway_pattern
    from cluster.store.redis_client import connect

    try:
        client = connect(redis_url, settings)
        keys = sorted(client.scan_iter(match=gateway_pattern(), count=1000))
        out = [msgpack.unpackb(raw, strict_map_key=False) for raw in (client.mget(keys) if keys else []) if raw]
        client.close()
        return out
    except Exception:
        return []


def _index_size(redis_url: Optional[str], replicas: list[dict], settings=None) -> dict:
    """Index entries per model namespace and node."""
    namespaces = {(r.get("cache") or {}).get("namespace_hex") for r in replicas} - {None}
    if not redis_url or not namespaces:
        return {}
    from cluster.store.fleet_index import FleetIndex
    from cluster.store.redis_client import connect

    try:
        index = FleetIndex(connect(redis_url, settings))
        return {ns[:16]: index.size(bytes.fromhex(ns)) for ns in sorted(namespaces)}
    except Exception:
        return {}


def _supervised(data_dir: Optional[str]) -> dict:
    """A local fleet's supervisor knows whether it runs Redis and how often it restarted it."""
    if not data_dir:
        return {}
    try:
        known = json.loads((Path(data_dir).expanduser() / SUPERVISOR_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not known.get("redis"):
        return {}
    r = known["redis"]
    return {"supervised": True, "running": r.get("running"), "restarts": r.get("restarts", 0),
            "last_restart": r.get("last_restart"), "supervisor_running": _running(known.get("pid"), known.get("create_time"))}


def _running(pid, create_time) -> Optional[bool]:
    """Whether the process `pid` made at `create_time` (psutil's, epoch seconds) still runs: the time tells a
    reused pid apart. None: the file does not say (a supervisor from before it did)."""
    import psutil

    if not isinstance(pid, int) or not isinstance(create_time, (int, float)):
        return None
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 0.5 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
