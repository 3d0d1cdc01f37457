"""One fleet per data dir: an exclusive lock held for the fleet's whole lifetime.

`up` takes `<data_dir>/fleet.lock` (flock, non-blocking) before it starts
anything, and hands the open descriptor to the fleet's supervisor process,
which keeps it until `down` stops it. A flock belongs to the open file, so the
lock outlives `up` and is released by the kernel when the supervisor exits,
however it exits. A second `up` on the same data dir - at the same moment or
an hour later - fails at once with a message instead of sharing Ray's temp
dir, the node dirs and Redis with the first.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "fleet.lock"


class FleetLocked(RuntimeError):
    """Another fleet (or another `up`) holds this data dir."""


def acquire(data_dir: Path) -> int:
    """Take the data dir's lock; return its descriptor (inheritable, to pass to the supervisor)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FleetLocked(f"a fleet is already running or starting under {data_dir}; stop it with "
                          f"`mlx-fleet down --data-dir {data_dir}` or pick another --data-dir") from None
    os.set_inheritable(fd, True)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def is_held(data_dir: Path) -> bool:
    """Whether some process holds the lock right now."""
    path = data_dir / LOCK_FILE
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we may just have taken
    return False
