"""A real local fleet for end-to-end tests: `mlx-fleet up` as a user runs it."""

from __future__ import annotations

import subprocess

import psutil

from cluster.fleet.processes import tagged
from cluster.fleet.spawned import SpawnedFleet
from cluster.fleet.state import fleet_tag, load_state


def route_of(headers) -> dict:
    """`x-fleet-route` as a dict: the policy, then its key=value pairs."""
    policy, *pairs = headers["x-fleet-route"].split()
    return {"policy": policy, **{k: v for k, v in (p.split("=", 1) for p in pairs)}}


def node_name(node_id: str) -> str:
    """node-0-1a2b3c4d -> node-0: the label part of a persistent node id."""
    return node_id.rsplit("-", 1)[0]


class LocalFleet(SpawnedFleet):
    """A SpawnedFleet plus what tests look into: its processes, state and replica pids."""

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run(*args, timeout=timeout)

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
