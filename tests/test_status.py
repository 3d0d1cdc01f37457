"""Status reads Redis with the app's own connection settings, and says so when it cannot."""

import msgpack
import redis

from cluster.config import RedisConfig
from cluster.status import from_redis
from cluster.store.keys import lease_key


def test_a_password_given_in_the_settings_not_the_url_is_used(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.set(lease_key("tiny-dense", "node-0-1"), msgpack.packb({"model": "tiny-dense", "node_id": "node-0-1"}))
    client.config_set("requirepass", "s3cret-pw")
    try:
        replicas, _, state = from_redis(redis_url, RedisConfig(password="s3cret-pw"))
        assert state == {"url": redis_url, "reachable": True, "error": None}
        assert [r["node_id"] for r in replicas] == ["node-0-1"]
        replicas, published, state = from_redis(redis_url)  # no password: unreachable, said, and not shown
        assert (replicas, published, state["reachable"]) == ([], [], False)
        assert "Authentication" in state["error"] and "s3cret" not in state["error"]
    finally:
        redis.Redis.from_url(redis_url, password="s3cret-pw").config_set("requirepass", "")


def test_a_dead_or_replaced_supervisor_is_told_apart_from_a_running_one(tmp_path):
    import json
    import subprocess
    import sys

    import psutil

    from cluster.fleet.status_text import _redis_line
    from cluster.status import SUPERVISOR_FILE, _supervised

    def write(pid, create_time):
        (tmp_path / SUPERVISOR_FILE).write_text(json.dumps(
            {"pid": pid, "create_time": create_time, "started": 0.0,
             "redis": {"pid": 1, "running": True, "restarts": 2, "last_restart": 5.0}}))
        return _supervised(str(tmp_path))

    me = psutil.Process()
    assert write(me.pid, me.create_time()) == {"supervised": True, "running": True, "restarts": 2,
                                               "last_restart": 5.0, "supervisor_running": True}
    assert write(me.pid, me.create_time() - 60)["supervisor_running"] is False  # the pid now is another process
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert write(gone.pid, 0.0)["supervisor_running"] is False
    assert write(me.pid, None)["supervisor_running"] is None  # a file from before create_time was written
    line = _redis_line({"url": "redis://127.0.0.1:1", "reachable": True, **write(gone.pid, 0.0)})
    assert line == ("redis:     redis://127.0.0.1:1 reachable, restarted 2 time(s) by the supervisor, but the "
                    "supervisor is NOT running: a Redis that stops stays down (`mlx-fleet down`, then `up`, "
                    "starts a new one)")
