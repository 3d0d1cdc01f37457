"""Start a local fleet's Ray nodes: a head, then one more node per extra fleet node.

Ports. Ray's servers take the ports we name on `ray start`. A port found free
now may be taken a moment later (another fleet starting at the same time), so
nothing here trusts a check: every start is verified - `ray start` exits 0,
and for the head, the dashboard answers *our* token (another fleet's dashboard
on a stolen port would refuse it) - and a failed start is stopped and retried
with fresh ports. The head's dashboard prefers port 8265, as users expect.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from cluster.config import NODE_LABEL, NODE_RESOURCE, FleetConfig
from cluster.fleet import processes
from cluster.ports import free_port, port_is_free
from cluster.fleet.ray_env import head_address, head_env, token_path, worker_env
from cluster.fleet.state import FleetState, NodeProcess, save_state
from cluster.node import NODE_DATA_DIR_ENV, NODE_NAME_ENV

ATTEMPTS = 4
OBJECT_STORE_BYTES = 512 << 20
START_TIMEOUT_S = 180.0
DASHBOARD = 8265


class NodeStartError(RuntimeError):
    """A Ray node would not start; the message has the tail of its log."""


def start_head(cfg: FleetConfig, state: FleetState) -> None:
    for attempt in range(ATTEMPTS):
        gcs = free_port()
        dash = DASHBOARD if attempt == 0 and port_is_free("127.0.0.1", DASHBOARD) else free_port()
        argv = ["--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", f"--temp-dir={state.ray_temp_dir}",
                f"--ray-client-server-port={free_port()}", "--dashboard-host=127.0.0.1",
                f"--include-dashboard={'true' if cfg.dashboard else 'false'}", f"--dashboard-port={dash}"]
        state.ray_address = f"127.0.0.1:{gcs}"
        state.dashboard_url = f"http://127.0.0.1:{dash}" if cfg.dashboard else None
        error = _start(state, "node-0", argv, head_env(state))
        if error is None and (not cfg.dashboard or _dashboard_is_ours(state)):
            return
        _undo_last(state)
        if attempt == ATTEMPTS - 1:
            raise NodeStartError(error or f"the dashboard on {state.dashboard_url} did not answer this fleet's token")
        time.sleep(0.5 * (attempt + 1))


def start_worker(state: FleetState, name: str) -> None:
    address = head_address(state)
    for attempt in range(ATTEMPTS):
        error = _start(state, name, [f"--address={address}"], worker_env(state))
        if error is None:
            return
        _undo_last(state)
        if attempt == ATTEMPTS - 1:
            raise NodeStartError(error)
        time.sleep(0.5 * (attempt + 1))


def _start(state: FleetState, name: str, extra: list[str], env: dict) -> str | None:
    """`ray start` for node `name`; None on success, else what went wrong."""
    node_dir = Path(state.data_dir) / name
    node_dir.mkdir(parents=True, exist_ok=True)
    # Each simulated Mac is named after its slot, unless MLX_FLEET_NODE_NAME names them all (Macs that
    # share a host name: their persistent node ids still tell them apart).
    label = os.environ.get(NODE_NAME_ENV) or name
    env = {**env, NODE_NAME_ENV: label, NODE_DATA_DIR_ENV: str(node_dir)}
    metrics_port = free_port()
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", *extra, f"--num-cpus={os.cpu_count() or 2}",
            f"--resources={json.dumps({NODE_RESOURCE: 1})}", f"--labels={json.dumps({NODE_LABEL: label})}",
            f"--object-store-memory={OBJECT_STORE_BYTES}", f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={metrics_port}", "--disable-usage-stats"]
    log = node_dir / "ray-start.log"
    proc = processes.spawn(argv, env, log)
    state.nodes.append(NodeProcess(node_id=name, session_id=proc.pid, data_dir=str(node_dir), log=str(log),
                                   metrics_port=metrics_port))
    save_state(state)
    try:
        code = proc.wait(timeout=START_TIMEOUT_S)
    except Exception:
        code = None
    if code == 0:
        return None
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return f"ray start for {name} failed (see {log}): {' | '.join(tail)}"


def _undo_last(state: FleetState) -> None:
    """Stop what the last, failed `ray start` left running."""
    node = state.nodes.pop()
    processes.kill_sessions([node.session_id], signal.SIGKILL)
    save_state(state)


def _dashboard_is_ours(state: FleetState, timeout_s: float = 60.0) -> bool:
    """The dashboard answers an authenticated request with this fleet's token (another fleet's would refuse it)."""
    token = token_path(state.data_dir).read_text().strip()
    request = urllib.request.Request(f"{state.dashboard_url}/api/version",
                                     headers={"Authorization": f"Bearer {token}"})
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with direct.open(request, timeout=2) as r:
                if r.status == 200:
                    return True
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                return False  # someone else's dashboard
        except OSError:
            pass
        time.sleep(0.5)
    return False
