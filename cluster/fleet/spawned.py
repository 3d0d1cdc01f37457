"""A fleet started as a child of this process, for benchmarks, load tests and the end-to-end tests.

It goes through the same `mlx-fleet up` / `status` / `down` a user types (in a
subprocess, with its own data dir and a free loopback port), so what is measured
is the product as shipped. `down` always runs, even when `up` fails halfway, so
nothing is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from cluster.fleet import temp_dir
from cluster.ports import free_port
from cluster.fleet.state import load_state


class SpawnedFleet:
    def __init__(self, data_dir: Path, nodes: int = 2, models: tuple[str, ...] = ("tiny-dense",),
                 routing: Optional[str] = None, extra: tuple[str, ...] = (), dashboard: bool = False,
                 env: Optional[dict] = None):
        self.data_dir = Path(data_dir)
        self.nodes = nodes
        self.models = models
        self.routing = routing
        self.extra = extra
        self.dashboard = dashboard
        self.env = env or {}
        self.port = free_port()
        self.up_output = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        """`mlx-fleet <args> --data-dir <ours>`; with `check`, a failure raises with everything it printed."""
        r = subprocess.run([sys.executable, "-m", "cluster.cli", *args, "--data-dir", str(self.data_dir)],
                           capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env})
        if check and r.returncode != 0:
            raise RuntimeError(f"mlx-fleet {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def up_args(self) -> list[str]:
        args = ["up", "--nodes", str(self.nodes), "--port", str(self.port), *self.extra]
        if not self.dashboard:
            args.append("--no-dashboard")
        for m in self.models:
            args += ["--model", m]
        if self.routing:
            args += ["--routing", self.routing]
        return args

    def up(self) -> "SpawnedFleet":
        self.up_output = self.run(*self.up_args()).stdout
        return self

    def status(self) -> dict:
        return json.loads(self.run("status", "--json").stdout)

    def down(self, remove_ray_files: bool = True) -> None:
        """Stop the fleet; then, unless asked to keep them, remove Ray's files (this fleet's data dir is
        thrown away, and they would pile up in /tmp)."""
        state = load_state(self.data_dir)
        self.run("down", timeout=300)
        if remove_ray_files and state is not None:
            temp_dir.remove(Path(state.ray_temp_dir))

    def __enter__(self) -> "SpawnedFleet":
        try:
            return self.up()
        except BaseException:
            self.down(remove_ray_files=False)  # the error names the logs in there
            raise

    def __exit__(self, exc_type, *exc) -> None:
        self.down(remove_ray_files=exc_type is None)
