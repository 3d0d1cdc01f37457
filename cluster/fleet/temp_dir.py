"""The fleet's folder for Ray's files: private to its user, short enough for Ray's sockets, and pruned.

Ray makes the temp dir it is given readable and writable by every user (it expects a shared /tmp/ray),
and its name here is predictable (a hash of the user and the data dir). So Ray's dir sits inside a
folder of ours:
- made mode 0700, so no other user can read Ray's logs or reach its sockets (plasma's have no auth);
- refused if it exists as a symlink or belongs to another user, who could have made it first;
- emptied whole if it was open to others before (an older layout let Ray open it): whatever is in it
  may have been planted; otherwise pruned at each `up` to the last run's session (its logs, kept for
  a post-mortem), so it does not grow by a session per start.
Ray never writes to the folder itself, and workers and drivers find Ray's dir through the head, so
nothing else needs to get through it.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Optional

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
        _check_base(root.parent)
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(root)
        if not _ours(st):
            raise TempDirError(f"{root}, this fleet's folder for Ray's files, exists and is not a folder of yours "
                               f"(another user may have made it): remove it, or use another --data-dir")
        was_private = stat.S_IMODE(st.st_mode) & 0o077 == 0
        os.chmod(root, 0o700)
        for entry in root.iterdir():
            if entry != ray_dir or not was_private:
                _remove(entry)  # an older layout's, or anything in a folder that others could write to
        if ray_dir.is_symlink() or (ray_dir.exists() and not _ours(os.lstat(ray_dir))):
            _remove(ray_dir)
        ray_dir.mkdir(exist_ok=True)
        keep = _last_session(ray_dir)
        for old in ray_dir.iterdir():
            if old.name.startswith("session_") and old.name != "session_latest" and old != keep:
                _remove(old)
        _remove(ray_dir / "tmp")  # the fleet processes' TMPDIR: no process of this fleet runs now
    except OSError as e:
        raise TempDirError(f"cannot prepare {root}, this fleet's folder for Ray's files: {e}") from None
    return ray_dir


def remove(ray_dir: Path) -> None:
    """Remove the folder holding `ray_dir` (a fleet's recorded Ray dir), once the fleet is down and its logs
    are not wanted."""
    root = Path(ray_dir).parent
    try:
        if _ours(os.lstat(root)):
            shutil.rmtree(root, ignore_errors=True)
    except FileNotFoundError:
        pass


def _check_base(base: Path) -> None:
    """Checks by path are safe only where nobody else can rename what we checked: a sticky /tmp, or a base
    no other user can write to."""
    st = os.stat(base)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise TempDirError(f"{base} is writable by other users and not sticky; set RAY_TMPDIR to a folder "
                           f"only you can write to, or to /tmp")


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid()


def _last_session(ray_dir: Path) -> Optional[Path]:
    """The last run's session: what Ray's session_latest points to, else the newest by name (its start time)."""
    latest = ray_dir / "session_latest"
    if latest.is_symlink():
        target = Path(os.readlink(latest))
        target = target if target.is_absolute() else ray_dir / target
        if target.parent == ray_dir:
            return target
    sessions = sorted(p for p in ray_dir.glob("session_*") if p.name != "session_latest" and not p.is_symlink())
    return sessions[-1] if sessions else None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
