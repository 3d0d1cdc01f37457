"""Keep Serve's per-replica gRPC server on loopback in a local fleet - the one Ray socket that needs a patch.

Everything else of a local fleet stays on 127.0.0.1 through configuration
(fleet/ray_env.py). But Ray Serve 2.60 binds each replica's inter-deployment
gRPC server to "[::]:0", every interface, with no setting to change it
(ray/serve/_private/replica.py, Replica._on_initialized). Under
MLX_FLEET_LOOPBACK=1 (set by `mlx-fleet up` for all its processes) the bind
address is rewritten to 127.0.0.1. Real multi-Mac fleets leave it alone.

The patch must not fail silently if Ray changes: `apply()` raises unless the
code it patches is still there, and `check_listeners()` (run by the
deployments' health checks, so a replica that listens elsewhere never becomes
healthy) verifies the result: every socket the process listens on is loopback.
"""

from __future__ import annotations

import inspect
import os

LOOPBACK_ENV = "MLX_FLEET_LOOPBACK"
PATCHED_CALL = 'add_port_to_grpc_server(self._server, "[::]:0")'


class LoopbackPatchBroken(RuntimeError):
    """Ray changed where it binds the replica's gRPC server; the local fleet would listen on the network."""


def enabled() -> bool:
    return os.environ.get(LOOPBACK_ENV) == "1"


def apply() -> None:
    """Call in a deployment's __init__ (it runs before the replica binds its gRPC server)."""
    if not enabled():
        return
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    if getattr(original, "_mlx_fleet", False):
        return
    if PATCHED_CALL not in inspect.getsource(replica.Replica._on_initialized):
        raise LoopbackPatchBroken(
            "ray.serve._private.replica no longer binds its gRPC server with "
            f"{PATCHED_CALL}; update cluster/actors/loopback.py for this Ray version")

    def loopback(server, address: str):
        return original(server, address.replace("[::]", "127.0.0.1"))

    loopback._mlx_fleet = True
    replica.add_port_to_grpc_server = loopback


def check_listeners() -> None:
    """Raise unless every socket this process listens on is loopback (local fleets only)."""
    if not enabled():
        return
    import psutil

    bad = [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
           if c.status == psutil.CONN_LISTEN and not _is_loopback(c.laddr.ip)]
    if bad:
        raise LoopbackPatchBroken(f"this replica listens beyond loopback on {', '.join(bad)}")


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1") or ip.startswith("::ffff:127.")
