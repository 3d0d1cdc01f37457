"""Keep Serve's per-replica gRPC server on loopback in a local fleet.

Ray Serve 2.60 binds each replica's inter-deployment gRPC server to [::]:0,
every interface, with no setting to change it. A fleet simulated on one machine
(`mlx-fleet up`, which sets MLX_FLEET_LOOPBACK=1 for all its processes) must
listen on loopback only, so the bind address is rewritten to 127.0.0.1 before
the replica starts that server. Real multi-Mac fleets leave it alone.
"""

from __future__ import annotations

import os

LOOPBACK_ENV = "MLX_FLEET_LOOPBACK"


def apply() -> None:
    if os.environ.get(LOOPBACK_ENV) != "1":
        return
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    if getattr(original, "_mlx_fleet", False):
        return

    def loopback(server, address: str):
        return original(server, address.replace("[::]", "127.0.0.1"))

    loopback._mlx_fleet = True
    replica.add_port_to_grpc_server = loopback
