"""Every Redis key the fleet uses, in one place.

    mlxf:lease:<model>:<node id>   a replica's lease: msgpack {node_id, model, stats...}, expires
    mlxf:node:<node id>            a node store's disk-tier stats: msgpack, expires
    mlxf:gateway:<gateway id>      a gateway replica's routing stats: msgpack, expires
    mlxf:{<ns>}:...                the fleet prefix index, one hash tag per model namespace (fleet_index.py)

Writers and readers (replicas, node stores, `status`, the gateway) build keys
only through these functions, so the schema cannot drift between them.
"""

from __future__ import annotations

LEASE_PREFIX = "mlxf:lease:"
NODE_PREFIX = "mlxf:node:"


def lease_key(model: str, node_id: str) -> str:
    return f"{LEASE_PREFIX}{model}:{node_id}"


def lease_pattern(model: str | None = None) -> str:
    return f"{LEASE_PREFIX}{model}:*" if model else f"{LEASE_PREFIX}*"


def node_stats_key(node_id: str) -> str:
    return f"{NODE_PREFIX}{node_id}"


def node_stats_pattern() -> str:
    return f"{NODE_PREFIX}*"


GATEWAY_PREFIX = "mlxf:gateway:"


def gateway_key(gateway_id: str) -> str:
    return f"{GATEWAY_PREFIX}{gateway_id}"


def gateway_pattern() -> str:
    return f"{GATEWAY_PREFIX}*"
