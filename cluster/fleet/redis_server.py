"""The fleet's own Redis: a redis-server on a free loopback port under the data dir."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import redis

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


def redis_argv(binary: str, port: int, data_dir: Path) -> list[str]:
    """Loopback only, persistence in `data_dir` so the index survives a restart."""
    return [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
        "--daemonize", "no", "--protected-mode", "yes", "--save", "60 1",
        "--appendonly", "no", "--dbfilename", "index.rdb", "--loglevel", "warning",
    ]


def ping(url: str, timeout_s: float = 2.0) -> None:
    """Raise RedisUnavailable with the reason if `url` does not answer PING."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        client.ping()
        client.close()
    except (redis.RedisError, ValueError) as e:
        raise RedisUnavailable(
            f"cannot reach Redis at {url} ({type(e).__name__}: {e}); check the URL and that the server is up, "
            "or leave out --redis-url to let mlx-fleet start its own"
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
