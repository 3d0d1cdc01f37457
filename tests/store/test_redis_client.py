"""Redis connection settings: password, TLS, timeouts; and URLs never shown with their credentials."""

import redis

from cluster.config import RedisConfig
from cluster.store.redis_client import connect, options, redact


def test_settings_become_client_options():
    cfg = RedisConfig(password="s3cret", tls_ca_file="/etc/ca.pem", connect_timeout_s=1.5, socket_timeout_s=0.5)
    assert options(cfg) == {"socket_timeout": 0.5, "socket_connect_timeout": 1.5, "password": "s3cret",
                            "ssl_ca_certs": "/etc/ca.pem"}
    assert options(None, timeout_s=0.25)["socket_timeout"] == 0.25


def test_a_rediss_url_means_tls():
    client = connect("rediss://:pw@127.0.0.1:6390/0", RedisConfig())
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert connect("redis://127.0.0.1:6390/0").connection_pool.connection_class is redis.Connection


def test_credentials_are_redacted_wherever_the_url_appears():
    assert redact("redis://:hunter2@10.0.0.1:6380/0") == "redis://***@10.0.0.1:6380/0"
    assert redact("rediss://user:pw@host/1") == "rediss://***@host/1"
    assert redact("cannot reach redis://:pw@h:1/0 (timeout).") == "cannot reach redis://***@h:1/0 (timeout)."
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
