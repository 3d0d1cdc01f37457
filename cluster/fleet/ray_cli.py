"""Ray's own `ray` CLI, kept on loopback for a fleet simulated on one machine.

Ray turns 127.0.0.1 into the machine's external address wherever it parses a
node or bootstrap address, so a plain `ray start --node-ip-address=127.0.0.1`
still listens on the LAN. A local fleet must not. This entry point makes that
conversion the identity and then hands over to Ray's CLI unchanged:

    python -m cluster.fleet.ray_cli start --head --node-ip-address=127.0.0.1 ...

`keep_on_loopback()` does the same for a driver (the launcher, tests) that
connects to such a fleet. Real multi-Mac fleets use plain `ray start`.
"""

from __future__ import annotations

import sys


def keep_on_loopback() -> None:
    from ray._private import services

    services.resolve_ip_for_localhost = lambda host: host


def main() -> int:
    keep_on_loopback()
    from ray.scripts.scripts import main as ray_main

    return ray_main()


if __name__ == "__main__":
    sys.exit(main())
