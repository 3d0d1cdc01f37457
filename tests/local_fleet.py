"""A real local fleet for end-to-end tests: `mlx-fleet up` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import psutil

from cluster.fleet.ports import free_port
from cluster.fleet.processes import tagged
from cluster.fleet.state import fleet_tag, load_state


def route_of(headers) -> dict:
    """`x-fleet-route` as a dict: the policy, then its key=value pairs."""
    policy, *pairs = headers["x-fleet-route"].split()
    return {"policy": policy, **{k: v for k, v in (p.split("=", 1) for p in pairs)}}


def node_name(node_id: str) -> str:
    """node-0-1a2b3c4d -> node-0: the label part of a persistent node id."""
    return node_id.rsplit("-", 1)[0]


class LocalFleet:
    def __init__(self, data_dir: Path, nodes: int = 2, models: tuple[str, ...] = ("tiny-dense",),
                 extra: tuple[str, ...] = (), dashboard: bool = False, env: Optional[dict] = None):
        self.data_dir = Path(data_dir)
        self.port = free_port()
        self.nodes = nodes
        self.models = models
        self.extra = extra
        self.dashboard = dashboard
        self.env = env or {}
        self.up_output = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "cluster.cli", *args, "--data-dir", str(self.data_dir)],
                           capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env})
        if check and r.returncode != 0:
            raise AssertionError(f"mlx-fleet {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def up_args(self) -> list[str]:
        args = ["up", "--nodes", str(self.nodes), "--port", str(self.port), *self.extra]
        if not self.dashboard:
            args.append("--no-dashboard")
        for m in self.models:
            args += ["--model", m]
        return args

    def up(self) -> "LocalFleet":
        self.up_output = self.cli(*self.up_args()).stdout
        return self

    def down(self) -> None:
        self.cli("down", timeout=120)

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def state(self):
        return load_state(self.data_dir)

    def processes(self) -> list[psutil.Process]:
        return tagged(fleet_tag(self.data_dir))

    def replica_pids(self, deployment: str) -> list[int]:
        """Pids of the Serve replicas of one deployment (e.g. "Gateway")."""
        out = []
        for p in self.processes():
            try:
                if p.name().startswith("ray::ServeRepl") and f":{deployment}" in " ".join(p.cmdline()):
                    out.append(p.pid)
            except psutil.Error:
                continue
        return out

    def __enter__(self) -> "LocalFleet":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
