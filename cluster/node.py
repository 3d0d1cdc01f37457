"""Who and where this process is in the fleet.

A fleet node is a Ray node started with the `mlx_fleet` resource. It has:
- a **name**, a label for people: MLX_FLEET_NODE_NAME if its raylet was started
  with it (`mlx-fleet up` names its nodes node-0, node-1, ...), else the host name;
- a **data dir**: MLX_FLEET_NODE_DATA_DIR, else <data_dir>/node;
- a **node id**, unique and persistent: `<name>-<8 hex>`, made once and kept in
  `<node data dir>/node-id`. Block stores, leases and routes are keyed by it, so
  two Macs that share a host name never share a store or read each other's
  files, and a restarted node is still the same node.
Ray workers inherit their raylet's environment, so every process of a node
agrees on all three.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

RAY_NAMESPACE = "mlx-fleet"  # where the fleet's named actors live
NODE_NAME_ENV = "MLX_FLEET_NODE_NAME"
NODE_DATA_DIR_ENV = "MLX_FLEET_NODE_DATA_DIR"
ID_FILE = "node-id"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,80}-[0-9a-f]{8}$")


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    name: str
    data_dir: Path


def store_actor_name(node_id: str) -> str:
    """The name of a node's NodeStore actor."""
    return f"node-store:{node_id}"


def node_name() -> str:
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname().split(".")[0] or "node"


def current_node(base_data_dir: str | Path) -> NodeIdentity:
    base = Path(base_data_dir).expanduser()
    data_dir = Path(os.environ.get(NODE_DATA_DIR_ENV) or base / "node").expanduser()
    name = node_name()
    return NodeIdentity(node_id=persistent_id(data_dir, name), name=name, data_dir=data_dir)


def persistent_id(data_dir: Path, name: str) -> str:
    """The id stored in `data_dir`, created on first use (atomically: concurrent first uses agree)."""
    path = Path(data_dir) / ID_FILE
    existing = _read(path)
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:80] or "node"
    candidate = f"{slug}-{os.urandom(4).hex()}"
    tmp = path.with_name(f".{ID_FILE}.{os.getpid()}.{os.urandom(4).hex()}")
    tmp.write_text(candidate + "\n")
    try:
        os.link(tmp, path)  # fails if another process won the race: then its id is the id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read(path) or candidate


def _read(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not _ID_RE.match(text):
        raise ValueError(f"{path} holds {text!r}, not a node id; delete the file to let mlx-fleet make a new one")
    return text
