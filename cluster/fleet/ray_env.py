"""How every Ray process of a local fleet is set up: loopback only, token auth, nothing sent off the machine.

Loopback, without patching Ray. Ray binds its servers to the node's IP, and
keeps 127.0.0.1 as the node IP only while its "cluster" mode is off
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as on a stock Mac). So:
- the head starts with that flag off and --node-ip-address=127.0.0.1;
- the other nodes must have it on (else `ray start --address` refuses), so they
  join through the name LOCALHOST: Ray rewrites only the exact strings
  127.0.0.1/localhost to the LAN address, while the name still resolves to
  127.0.0.1 (/etc/hosts; gRPC's native resolver, no DNS query), and a node's
  IP is then the source address of its route to the head: 127.0.0.1;
- drivers (the CLI, tests) connect the same way.
Every Ray process then agrees on one address that works, the dashboard's Serve
pages included. One socket remains that Ray binds to all interfaces with no
setting: Serve's per-replica gRPC server (actors/loopback.py keeps it local).

Token auth: every fleet runs Ray with RAY_AUTH_MODE=token and its own token,
made fresh by each `up` in <data_dir>/ray-token (mode 0600).

Serve's data plane: Ray's throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED,
`SERVE_ENV`): the proxy, the gateways and the replicas talk over direct gRPC,
and each deployment's code runs on its replica's own event loop, not on a
second loop one thread hop away. Every streamed message crosses two Serve hops
(replica to gateway, gateway to the HTTP proxy), so what a hop costs is what a
stream costs (docs/batching.md). The mode's direct ingress (each ingress
replica its own HTTP port, no proxy) stays off: a node keeps one front door,
Serve's proxy, with its OpenAI-format errors.

Nothing sent out: usage stats are off, the "usage disabled" notice goes to a
loopback discard address, and the dashboard's cloud-metadata probe (HTTP to
169.254.169.254 when no cluster config is found) is skipped by giving the head
a HOME holding the ray_bootstrap_config.yaml that `ray up` would have left.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from cluster.actors.loopback import LOOPBACK_ENV
from cluster.api import proxy_errors
from cluster.ports import is_listening
from cluster.fleet.processes import TAG_ENV
from cluster.fleet.state import FleetState

TOKEN_FILE = "ray-token"
# Ray's documented high-throughput Serve, minus direct ingress (above). deploy/bootstrap/fleet-env.sh
# exports the same for a fleet of Macs.
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
             "RAY_SERVE_PROXY_USE_GRPC": "1"}  # the mode leaves the proxy's hop on Ray actor calls
CLUSTER_FLAG = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class FleetGone(RuntimeError):
    """The fleet's state file is there but its Ray head is not."""


def token_path(data_dir: Path | str) -> Path:
    return Path(data_dir) / TOKEN_FILE


def write_token(data_dir: Path) -> Path:
    """A fresh Ray auth token for this fleet, readable by its owner only."""
    path = token_path(data_dir)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def auth_env(data_dir: Path | str) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path(data_dir)),
            "GRPC_DNS_RESOLVER": "native", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/"}


def base_env(state: FleetState) -> dict[str, str]:
    env = dict(os.environ)
    env.update(auth_env(state.data_dir))
    env.update({TAG_ENV: state.tag, "PYTHONUNBUFFERED": "1", LOOPBACK_ENV: "1",
                "TMPDIR": str(Path(state.ray_temp_dir) / "tmp"),
                proxy_errors.ENV: proxy_errors.IMPORT_PATH,  # Serve's proxy answers OpenAI errors too
                **SERVE_ENV})
    Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    return env


def head_env(state: FleetState) -> dict[str, str]:
    env = base_env(state)
    home = Path(state.data_dir) / "ray-home"
    home.mkdir(exist_ok=True)
    (home / "ray_bootstrap_config.yaml").write_text("# a local mlx-fleet: no cloud to probe\nprovider: {type: local}\n")
    # Hugging Face's cache stays where it was (it lives under HOME by default).
    env.setdefault("HF_HOME", str(Path("~/.cache/huggingface").expanduser()))
    env.update({CLUSTER_FLAG: "0", "HOME": str(home)})
    return env


def worker_env(state: FleetState) -> dict[str, str]:
    return {**base_env(state), CLUSTER_FLAG: "1"}


def head_address(state: FleetState) -> str:
    """How a driver or a worker node on this machine joins the head: by the name LOCALHOST, which Ray leaves as it is (above)."""
    return f"LOCALHOST:{state.ray_port()}"


def prepare_driver(state: FleetState) -> None:
    """Set this process up to drive the fleet. Call it before importing Ray, which reads these at import."""
    os.environ.update(auth_env(state.data_dir))


def connect(state: FleetState) -> None:
    """Attach this process to the fleet's Ray cluster as a driver."""
    import logging

    prepare_driver(state)
    import ray

    if not ray.is_initialized():
        if not is_listening("127.0.0.1", state.ray_port()):
            # ray.init would wait for it for minutes: the fleet was stopped without `down`, or the machine restarted
            raise FleetGone(f"the fleet under {state.data_dir} is not running: its Ray head "
                            f"({state.ray_address}) does not answer")
        ray.init(address=head_address(state), namespace="mlx-fleet", logging_level=logging.WARNING,
                 log_to_driver=False)
