"""Who and where this process is in the fleet.

A fleet node is a Ray node started with the `mlx_fleet` resource. Its id and
data dir come from the environment its raylet was started with (`mlx-fleet up`
and the ray-up bootstrap set them; Ray workers inherit the raylet's
environment), falling back to the host name and <data_dir>/<node-id>.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

NODE_ID_ENV = "MLX_FLEET_NODE_ID"
NODE_DATA_DIR_ENV = "MLX_FLEET_NODE_DATA_DIR"


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    data_dir: Path


def current_node(base_data_dir: str | Path) -> NodeIdentity:
    node_id = os.environ.get(NODE_ID_ENV) or socket.gethostname().split(".")[0]
    base = Path(base_data_dir).expanduser()
    data_dir = Path(os.environ.get(NODE_DATA_DIR_ENV) or base / node_id).expanduser()
    return NodeIdentity(node_id=node_id, data_dir=data_dir)
