"""What a running local fleet looks like on disk: <data_dir>/fleet.json.

`up` writes it as it starts each piece, so `down` can stop exactly what was
started even if `up` died halfway.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

STATE_FILE = "fleet.json"


class NodeProcess(BaseModel):
    model_config = ConfigDict(extra="forbid")
    node_id: str = Field(description="Fleet node id (node-0 is the Ray head).")
    session_id: int = Field(description="Process session of the node's Ray daemons.")
    data_dir: str = Field(description="The node's own data dir.")
    log: str = Field(description="Log file of `ray start` for this node.")
    metrics_port: int = Field(0, description="Port of the node's Prometheus endpoint (Ray's metrics agent), "
                                             "where the fleet's metrics are scraped; 0 if unknown.")


class FleetState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data_dir: str
    tag: str = Field(description="MLX_FLEET_TAG value carried by every process of this fleet.")
    ray_temp_dir: str
    ray_address: Optional[str] = None
    dashboard_url: Optional[str] = None
    redis_url: Optional[str] = None
    supervisor_session_id: Optional[int] = Field(None, description="Session of the supervisor (and the Redis it runs).")
    http_url: Optional[str] = None
    nodes: list[NodeProcess] = Field(default_factory=list)
    models: list[str] = Field(default_factory=list)
    started: float = 0.0
    ready: bool = False

    def ray_port(self) -> Optional[int]:
        """The head's GCS port: what a driver or a worker joins (on LOCALHOST) and what tells a live head from a dead one."""
        return int(self.ray_address.rsplit(":", 1)[1]) if self.ray_address else None

    def session_ids(self) -> list[int]:
        ids = [n.session_id for n in self.nodes]
        if self.supervisor_session_id:
            ids.append(self.supervisor_session_id)
        return ids


def fleet_tag(data_dir: Path) -> str:
    return str(Path(data_dir).expanduser().resolve())


def temp_root(data_dir: Path) -> Path:
    """The fleet's private folder for Ray's files (fleet/temp_dir.py), one per data dir.

    Short, because Ray's unix socket paths under it must fit in 104 bytes on macOS. So, as Ray's own
    default: $RAY_TMPDIR if set, else /tmp on macOS, whose $TMPDIR (/var/folders/...) is too long for
    them, and $TMPDIR or /tmp on Linux."""
    base = os.environ.get("RAY_TMPDIR") or ("/tmp" if sys.platform == "darwin" else tempfile.gettempdir())
    # the user too: two users' fleets on the same data dir path never share one
    digest = hashlib.sha1(f"{os.getuid()}:{fleet_tag(data_dir)}".encode()).hexdigest()[:10]
    return Path(base) / f"mlxf-{digest}"


def ray_temp_dir(data_dir: Path) -> Path:
    """Ray's --temp-dir: inside the private folder, since Ray makes its temp dir writable by every user."""
    return temp_root(data_dir) / "ray"


def state_path(data_dir: Path) -> Path:
    return Path(data_dir).expanduser() / STATE_FILE


def load_state(data_dir: Path) -> Optional[FleetState]:
    path = state_path(data_dir)
    if not path.is_file():
        return None
    return FleetState.model_validate_json(path.read_text())


def save_state(state: FleetState) -> None:
    path = state_path(Path(state.data_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the Redis URL and its password
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(state.model_dump(), indent=2))
    os.replace(tmp, path)


def clear_state(data_dir: Path) -> None:
    state_path(data_dir).unlink(missing_ok=True)
