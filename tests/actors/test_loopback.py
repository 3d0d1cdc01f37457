"""The one patch a local fleet needs (Serve's replica gRPC bind) still applies to this Ray, or fails loudly."""

import pytest
from ray.serve._private import replica

from cluster.actors import loopback


class Server:
    def __init__(self):
        self.addresses = []

    def add_insecure_port(self, address):
        self.addresses.append(address)
        return 4242


@pytest.fixture
def restore():
    original = replica.add_port_to_grpc_server
    yield
    replica.add_port_to_grpc_server = original


def test_the_patch_applies_to_the_installed_ray_and_binds_loopback(monkeypatch, restore):
    monkeypatch.setenv(loopback.LOOPBACK_ENV, "1")
    loopback.apply()
    server = Server()
    assert replica.add_port_to_grpc_server(server, "[::]:0") == 4242
    assert server.addresses == ["127.0.0.1:0"]


def test_without_a_local_fleet_nothing_is_patched(monkeypatch, restore):
    monkeypatch.delenv(loopback.LOOPBACK_ENV, raising=False)
    before = replica.add_port_to_grpc_server
    loopback.apply()
    assert replica.add_port_to_grpc_server is before


def test_a_ray_that_binds_elsewhere_breaks_the_patch_loudly(monkeypatch, restore):
    monkeypatch.setenv(loopback.LOOPBACK_ENV, "1")
    monkeypatch.setattr(loopback.inspect, "getsource", lambda fn: "def _on_initialized(self): bind_somewhere()")
    with pytest.raises(loopback.LoopbackPatchBroken, match="update cluster/actors/loopback.py"):
        loopback.apply()


def test_the_health_check_refuses_a_listener_beyond_loopback(monkeypatch):
    import psutil

    monkeypatch.setenv(loopback.LOOPBACK_ENV, "1")
    loopback.check_listeners()  # this test process listens on nothing beyond loopback

    Addr = type("Addr", (), {})

    def listening(ip):
        c = type("Conn", (), {})()
        c.status, c.laddr = psutil.CONN_LISTEN, Addr()
        c.laddr.ip, c.laddr.port = ip, 5000
        return c

    # A fault we must not create for real (a socket open to the network): fake the process's listeners.
    monkeypatch.setattr(psutil.Process, "net_connections",
                        lambda self, kind="inet": [listening("127.0.0.1"), listening("::ffff:127.0.0.1"), listening("::")])
    with pytest.raises(loopback.LoopbackPatchBroken, match="listens beyond loopback on :::5000"):
        loopback.check_listeners()
