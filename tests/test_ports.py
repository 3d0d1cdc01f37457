"""Port checks: a bind says whether we may listen, a connect whether someone does."""

import socket

from cluster.ports import bind_error, free_port, is_listening


def test_listening_is_a_connect_not_a_bind():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert is_listening("127.0.0.1", port)
    assert not is_listening("127.0.0.1", port)
    assert bind_error("127.0.0.1", free_port()) is None
