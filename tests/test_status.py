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
