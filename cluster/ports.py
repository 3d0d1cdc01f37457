"""Port checks for the processes a fleet binds, and for the ranks of a sharded replica."""

from __future__ import annotations

import random
import socket

# Below the ephemeral ranges (Linux 32768-60999, macOS 49152-65535) and above Ray's worker ports
# (10002-19999). A port from the ephemeral range can be free when picked and taken a few seconds later by
# any process binding port 0 (Ray starts dozens of gRPC servers so) before our server binds it.
PICK_RANGE = (20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that nobody asking the OS for any port will be given."""
    for _ in range(256):
        port = random.randrange(*PICK_RANGE)
        if port_is_free(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is full: whatever the OS gives
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    return bind_error(host, port) is None


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on host:port now (taken, an address this machine does not have, a
    privileged port), or None if it could."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def is_listening(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a server accepts connections on host:port now. A connect, not a bind: on macOS a bind to
    127.0.0.1 succeeds next to a server listening on 0.0.0.0, which a bind test would call free."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
