"""`mlx-fleet status` of a fleet that is not running: said at once, in JSON too with --json, exit 1."""

import json
import subprocess
import sys

import pytest

from cluster.ports import free_port
from cluster.fleet.ray_env import write_token
from cluster.fleet.state import FleetState, fleet_tag, load_state, save_state


def status(data_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--data-dir", str(data_dir), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("json_flag", [False, True])
def test_status_of_a_stopped_fleet_says_so_and_exits_1(tmp_path, json_flag):
    r = status(tmp_path, *(["--json"] if json_flag else []))
    why = f"no fleet is running under {tmp_path} (start one with `mlx-fleet up --data-dir {tmp_path}`)"
    assert r.returncode == 1 and r.stderr == f"mlx-fleet: {why}\n"
    assert (json.loads(r.stdout) if json_flag else r.stdout) == (
        {"running": False, "data_dir": str(tmp_path), "error": why} if json_flag else "")


def test_a_fleet_gone_without_down_is_said_at_once_and_down_clears_it(tmp_path):
    """A fleet's state after a reboot (or a kill -9 of everything): ray.init would wait minutes for its head."""
    head = f"127.0.0.1:{free_port()}"  # nothing listens there
    save_state(FleetState(data_dir=str(tmp_path), tag=fleet_tag(tmp_path), ray_temp_dir=str(tmp_path / "ray"),
                          ray_address=head, http_url="http://127.0.0.1:1", models=["tiny-dense"], ready=True))
    write_token(tmp_path)
    r = status(tmp_path, "--json")
    why = (f"the fleet under {tmp_path} is not running: its Ray head ({head}) does not answer; `mlx-fleet down "
           f"--data-dir {tmp_path}` clears what is left, `mlx-fleet up --data-dir {tmp_path}` starts it again")
    assert r.returncode == 1 and json.loads(r.stdout) == {"running": False, "data_dir": str(tmp_path), "error": why}
    assert r.stderr.splitlines()[-1] == f"mlx-fleet: {why}"
    down = subprocess.run([sys.executable, "-m", "cluster.cli", "down", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and load_state(tmp_path) is None
    assert down.stdout == (f"mlx-fleet: nothing was running under {tmp_path}; cleared the record of a fleet stopped "
                           "without `down` (after a reboot, say)\n")
