"""The fleet's supervisor: holds the data dir's lock for the fleet's lifetime and keeps its Redis alive.

    python -m cluster.fleet.supervisor --data-dir DIR --lock-fd N [--no-redis]

`up` starts it with the data dir's lock descriptor (lock.py) and exits; `down`
stops it with SIGTERM. Meanwhile it runs the fleet's own Redis (unless the
fleet uses an external one) and restarts it whenever it dies - on the same
port, so every client reconnects by itself - logging and counting each
restart. What it knows goes to `<data_dir>/supervisor.json` for `status`:

    {"pid", "create_time", "started", "redis": {"url" (redacted), "pid", "port", "running", "restarts", "last_restart"}}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

from cluster.fleet import redis_server
from cluster.ports import free_port
from cluster.status import SUPERVISOR_FILE as STATE_FILE

log = logging.getLogger("mlx-fleet.supervisor")

START_ATTEMPTS = 5
POLL_S = 0.5


def state_path(data_dir: Path) -> Path:
    return Path(data_dir) / STATE_FILE


def read_state(data_dir: Path) -> Optional[dict]:
    try:
        return json.loads(state_path(data_dir).read_text())
    except (OSError, ValueError):
        return None


class Supervisor:
    def __init__(self, data_dir: Path, own_redis: bool):
        self.data_dir = data_dir
        self.redis_dir = data_dir / "redis"
        self.own_redis = own_redis
        self.stopping = threading.Event()
        self.proc = None
        self.port: Optional[int] = None
        self.secret = redis_server.password(self.redis_dir) if own_redis else None
        # create_time: with the pid, which process this is (status tells a dead supervisor from a reused pid)
        self.state = {"pid": os.getpid(), "create_time": psutil.Process().create_time(), "started": time.time(),
                      "redis": None}

    def run(self) -> None:
        if self.own_redis:
            self._start_redis(fresh_port=True)
        self._save()
        while not self.stopping.wait(POLL_S):
            if self.own_redis and self.proc.poll() is not None and not self.stopping.is_set():
                self._restart()
        self._stop_redis()
        if self.own_redis:
            self._record(running=False)

    def _start_redis(self, fresh_port: bool, **record) -> None:
        """Start redis-server and check it is ours; retry on failure.

        The first start takes a fresh free port each attempt (another process may grab the one we
        picked before redis binds it); a restart keeps its port, since every client has its URL.
        `record`: fields saved in the same write as the new pid (a restart's count), so that no reader
        sees the new Redis running with the old count."""
        binary = redis_server.find_redis_server()
        for attempt in range(START_ATTEMPTS):
            if fresh_port or self.port is None:
                self.port = free_port()
            self.proc = redis_server.start(binary, self.port, self.redis_dir, self.secret,
                                           self.data_dir / "logs" / "redis.log", dict(os.environ))
            if self._came_up(redis_server.local_url(self.port, self.secret)):
                self._record(running=True, **record)
                return
            log.warning("redis did not come up on port %d (attempt %d); retrying", self.port, attempt + 1)
            self._kill(self.proc)
            time.sleep(0.2 * (attempt + 1))
        raise RuntimeError(f"redis-server would not start (see {self.data_dir / 'logs' / 'redis.log'})")

    def _came_up(self, url: str, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if redis_server.owned_by(url, self.proc.pid):
                return True
            time.sleep(0.05)
        return False

    def _restart(self) -> None:
        code = self.proc.returncode
        restarts = (self.state["redis"] or {}).get("restarts", 0) + 1
        log.warning("redis (pid %d) exited with %s; restarting it (restart #%d)", self.proc.pid, code, restarts)
        self._record(running=False)
        try:
            self._start_redis(fresh_port=False, restarts=restarts, last_restart=time.time())
        except RuntimeError as e:
            log.error("%s; will try again", e)

    def _record(self, running: bool, **fields) -> None:
        previous = self.state["redis"] or {"restarts": 0, "last_restart": None}
        self.state["redis"] = {**previous, "url": redis_server.redact(redis_server.local_url(self.port, self.secret)),
                               "port": self.port, "pid": self.proc.pid if self.proc else None, "running": running,
                               **fields}
        self._save()

    def _save(self) -> None:
        path = state_path(self.data_dir)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.state, indent=2))
        os.replace(tmp, path)

    def _stop_redis(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # no snapshot to save (redis_server.py: --save ""): it exits at once
            try:
                self.proc.wait(10)
            except Exception:
                self._kill(self.proc)

    @staticmethod
    def _kill(proc) -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="mlx-fleet-supervisor")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--lock-fd", type=int, required=True, help="the data dir's locked descriptor, inherited from up")
    p.add_argument("--no-redis", action="store_true", help="the fleet uses an external Redis")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sup = Supervisor(a.data_dir.resolve(), own_redis=not a.no_redis)
    signal.signal(signal.SIGTERM, lambda *_: sup.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: sup.stopping.set())
    try:
        sup.run()
    finally:
        os.close(a.lock_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
