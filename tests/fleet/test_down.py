"""`down` stops the fleet's Redis even when nothing tagged leads to it (its supervisor killed), and only its."""

import subprocess
import time

import psutil

from cluster.fleet import launcher, redis_server
from cluster.ports import free_port


def start_redis(data_dir, tag: str) -> subprocess.Popen:
    """The fleet's Redis as its supervisor starts it (own session, the fleet's tag in its environment)."""
    redis_dir = data_dir / "redis"
    redis_dir.mkdir(parents=True)
    port = free_port()
    proc = redis_server.start(redis_server.find_redis_server(), port, redis_dir, "pw", data_dir / "redis.log",
                              {"MLX_FLEET_TAG": tag, "PATH": "/usr/bin:/bin"})
    url = redis_server.local_url(port, "pw")
    deadline = time.monotonic() + 10
    while not redis_server.owned_by(url, proc.pid):
        assert time.monotonic() < deadline and proc.poll() is None, (data_dir / "redis.log").read_text()
        time.sleep(0.05)
    return proc


def test_down_stops_a_redis_whose_supervisor_died_and_leaves_another_fleets_alone(tmp_path):
    ours = start_redis(tmp_path / "ours", str(tmp_path / "ours"))
    theirs = start_redis(tmp_path / "theirs", str(tmp_path / "theirs"))
    try:
        assert redis_server.running_in(tmp_path / "ours" / "redis") == [ours.pid]
        assert launcher.down(tmp_path / "ours") == 1
        assert ours.wait(timeout=10) is not None
        assert theirs.poll() is None and psutil.pid_exists(theirs.pid)
        assert redis_server.running_in(tmp_path / "ours" / "redis") == []
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
