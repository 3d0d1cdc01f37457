"""The fleet's folder for Ray's files: private to its user, short enough for Ray's sockets, and pruned.

Ray makes the temp dir it is given readable and writable by every user (it expects a shared /tmp/ray),
and its name here is predictable (a hash of the data dir). So Ray's dir sits inside a folder of ours:
- made mode 0700, so no other user can read Ray's logs or reach its sockets;
- refused if it exists as a symlink or belongs to another user, who could have made it first;
- pruned at each `up`: every Ray session but the newest (the logs of the last run, kept for a
  post-mortem), so the folder does not grow by a session per start.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

from cluster.fleet.state import ray_temp_dir, temp_root

# The longest socket Ray makes under its temp dir, past it (a session's name has a date, time and pid)
# (a second node on one machine may get a numbered one), with room to spare.
LONGEST_SOCKET = "/session_2026-12-02_04-27-11_148352_4194304/sockets/plasma_store.99"
SOCKET_LIMIT = (104 if sys.platform == "darwin" else 108) - 1  # sun_path, its NUL included


class TempDirError(RuntimeError):
    pass


def prepare(data_dir: Path) -> Path:
    """Make the fleet's folder ready for Ray (called with the data dir's lock held); return Ray's temp dir."""
    root, ray_dir = temp_root(data_dir), ray_temp_dir(data_dir)
    longest = len(str(ray_dir).encode()) + len(LONGEST_SOCKET)
    if longest > SOCKET_LIMIT:
        raise TempDirError(f"Ray's socket paths under {ray_dir} would be {longest} bytes, over this system's "
                           f"{SOCKET_LIMIT}; set RAY_TMPDIR to a shorter folder (/tmp)")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise TempDirError(f"{root}, this fleet's folder for Ray's files, exists and is not a folder of yours "
                           f"(another user may have made it): remove it, or use another --data-dir")
    os.chmod(root, 0o700)
    for entry in root.iterdir():  # anything but Ray's dir is left from an older layout
        if entry != ray_dir:
            _remove(entry)
    ray_dir.mkdir(exist_ok=True)
    # a session's name starts with its start time (session_2026-12-02_04-27-11_...): by name is by age
    sessions = sorted(p for p in ray_dir.glob("session_*") if p.is_dir() and not p.is_symlink())
    for old in sessions[:-1]:
        _remove(old)
    return ray_dir


def remove(data_dir: Path) -> None:
    """Remove the fleet's folder for Ray's files, once the fleet is down and its logs are not wanted."""
    root = temp_root(data_dir)
    st = os.lstat(root) if root.exists() or root.is_symlink() else None
    if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        shutil.rmtree(root, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
