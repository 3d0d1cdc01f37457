"""Start and stop the fleet's processes, and only those.

Every process `mlx-fleet up` starts gets the environment variable
MLX_FLEET_TAG=<data dir> and its own session (setsid). Children inherit both:
Ray's raylet passes its environment to the workers it spawns. A Ray worker
renames itself (setproctitle), which can wipe the environment /proc shows, so
a fleet's processes are the tagged ones *and all their descendants*. `down`
signals each recorded session, then sweeps for the fleet's processes, so
nothing is left behind and nothing of another fleet (another tag) is touched.
`ray stop` is never used: it kills every Ray process on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

import psutil

TAG_ENV = "MLX_FLEET_TAG"


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start `argv` in its own session with output to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def run(argv: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> int:
    """Run `argv` to completion in its own session (its daemons keep that session id)."""
    proc = spawn(argv, env, log_path)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_sessions([proc.pid])
        raise


def tagged(tag: str) -> list[psutil.Process]:
    """The fleet's processes: those whose environment carries MLX_FLEET_TAG=tag, and their descendants."""
    found: dict[int, psutil.Process] = {}
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(TAG_ENV) == tag:
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
            continue
    found.pop(me, None)
    return [found[pid] for pid in sorted(found)]


def kill_sessions(session_ids: Iterable[int], sig: int = signal.SIGTERM) -> None:
    for sid in session_ids:
        try:
            os.killpg(sid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_tagged(tag: str, session_ids: Iterable[int] = (), grace_s: float = 10.0, leaders: Iterable[int] = (),
                patient: Iterable[int] = (), brief_s: float | None = None) -> int:
    """SIGTERM the sessions and every tagged process, SIGKILL what is left; return how many were found.
    `leaders`: processes that lead sessions of their own and carry no tag /proc can show (the fleet's Redis):
    their sessions are signalled too, and they count as found.
    `patient` and `brief_s`: when given, only the `patient` pids (and the leaders) get `grace_s` to exit (the
    supervisor, which stops its Redis and records that); the rest get `brief_s` (Ray's daemons linger for
    seconds on SIGTERM and hold nothing to save)."""
    leaders = list(leaders)
    session_ids = list(session_ids) + leaders
    kill_sessions(session_ids)
    procs = tagged(tag)
    extra = len(set(leaders) - {p.pid for p in procs})
    for p in procs:
        _signal(p, signal.SIGTERM)
    start = time.monotonic()
    waited = set(patient) | set(leaders)
    untagged = _existing(leaders)  # made once: psutil then tells a reused pid from the process it was
    while time.monotonic() < start + grace_s:
        alive = [p for p in tagged(tag) if _alive(p)] + [p for p in untagged if _alive(p)]
        if brief_s is not None and time.monotonic() >= start + brief_s:
            alive = [p for p in alive if p.pid in waited]
        if not alive:
            break
        time.sleep(0.1)
    kill_sessions(session_ids, signal.SIGKILL)
    left = tagged(tag)
    for p in left:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(left, timeout=5)
    return len(procs) + extra


def _existing(pids: Iterable[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return out


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
