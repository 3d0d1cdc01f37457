"""The fleet's own Redis: a redis-server on a free loopback port under the data dir, with a password.

The supervisor (supervisor.py) runs it and restarts it if it dies. Every URL
that is shown anywhere goes through `redact`, so its password never reaches
status, logs or errors.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

import psutil
import redis

from cluster.store.redis_client import redact

_CANDIDATES = ("/opt/homebrew/bin/redis-server", "/usr/local/bin/redis-server",
               "/usr/bin/redis-server", "/usr/sbin/redis-server")


class RedisUnavailable(RuntimeError):
    """No usable Redis: missing binary or an unreachable URL."""


def find_redis_server() -> str:
    found = shutil.which("redis-server") or next((c for c in _CANDIDATES if Path(c).is_file()), None)
    if not found:
        raise RedisUnavailable(
            "redis-server is not installed; run `make up` (it installs it: apt on Debian/Ubuntu, "
            "brew on macOS) or install it yourself, or pass --redis-url to use an existing Redis"
        )
    return found


def redis_argv(binary: str, port: int, data_dir: Path, password: Optional[str] = None) -> list[str]:
    """Loopback only, and no persistence: everything in it (leases, the fleet index) is rebuilt by the
    nodes within seconds of a restart, and a snapshot would only bring back entries that are no longer
    true. The config file (written by `start`) holds the password: on the command line `ps` would show it."""
    return [
        binary, str(data_dir / "redis.conf"), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
        "--daemonize", "no", "--protected-mode", "yes", "--save", "", "--appendonly", "no", "--loglevel", "warning",
    ]


def password(redis_dir: Path) -> str:
    """The fleet Redis's password, made once per data dir and kept in a 0600 file."""
    path = redis_dir / "password"
    if not path.exists():
        redis_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def local_url(port: int, secret: str) -> str:
    return f"redis://:{secret}@127.0.0.1:{port}/0"


def start(binary: str, port: int, redis_dir: Path, secret: str, log: Path, env: dict) -> subprocess.Popen:
    """Start redis-server; its password goes in a 0600 config file, not on the command line."""
    conf = redis_dir / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"requirepass {secret}\n")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(redis_argv(binary, port, redis_dir), env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def running_in(redis_dir: Path) -> list[int]:
    """The pids of every redis-server working in `redis_dir` (a fleet's, by its data dir).

    `down` finds the fleet's processes by the tag in their environment, but redis-server rewrites its
    process title, which blanks the environment /proc shows, and it runs in a session of its own. So a
    Redis whose supervisor died (kill -9) was left running by `down`, and the next `up` started a second
    one beside it. Its working directory (`--dir`) says whose it is."""
    want = Path(redis_dir).resolve()
    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if "redis" in (proc.info["name"] or "") and Path(proc.cwd()).resolve() == want:
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
            continue
    return found


def owned_by(redis_url: str, pid: int) -> bool:
    """Whether the Redis answering at `redis_url` is process `pid` (not another fleet's on a reused port)."""
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1)
        info = client.info("server")
        client.close()
        return int(info.get("process_id", -1)) == pid
    except (redis.RedisError, ValueError):
        return False


def ping(url: str, timeout_s: float = 2.0) -> None:
    """Raise RedisUnavailable with the reason if `url` does not answer PING."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        client.ping()
        client.close()
    except (redis.RedisError, ValueError) as e:
        raise RedisUnavailable(
            f"cannot reach Redis at {redact(url)} ({type(e).__name__}: {redact(str(e))}); check the URL and that the "
            "server is up, or leave out --redis-url to let mlx-fleet start its own"
        ) from None


def wait_ready(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ping(url, timeout_s=0.5)
            return
        except RedisUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
