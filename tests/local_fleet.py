"""A real local fleet for end-to-end tests: `mlx-fleet up` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cluster.fleet.ports import free_port
from cluster.fleet.processes import tagged
from cluster.fleet.state import fleet_tag, load_state


class LocalFleet:
    def __init__(self, data_dir: Path, nodes: int = 2, models: tuple[str, ...] = ("tiny-dense",), extra: tuple[str, ...] = ()):
        self.data_dir = Path(data_dir)
        self.port = free_port()
        self.nodes = nodes
        self.models = models
        self.extra = extra
        self.up_output = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "cluster.cli", *args, "--data-dir", str(self.data_dir)],
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"mlx-fleet {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def up(self) -> "LocalFleet":
        args = ["up", "--nodes", str(self.nodes), "--port", str(self.port), "--no-dashboard", *self.extra]
        for m in self.models:
            args += ["--model", m]
        self.up_output = self.cli(*args).stdout
        return self

    def down(self) -> None:
        self.cli("down", timeout=120)

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def state(self):
        return load_state(self.data_dir)

    def processes(self) -> list:
        return tagged(fleet_tag(self.data_dir))

    def __enter__(self) -> "LocalFleet":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
