"""The link-cutting proxy (tests/support/tcp_proxy.py) checked on its own: stopping it ends
every connection and every task on its loop, also one held by a blackhole, so nothing of it
is left for a later test's garbage collection to report."""

from __future__ import annotations

import gc
import logging
import socket

import pytest

from tests.support.tcp_proxy import tcp_proxy


def _cut_and_stop(upstream: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A connection through a proxy, blackholed with bytes in flight, then the proxy stopped;
    the two ends of that connection (the proxy itself is garbage once this returns)."""
    with tcp_proxy(upstream.getsockname()[1]) as proxy:
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        server_side, _ = upstream.accept()
        client.sendall(b"ping")
        assert server_side.recv(4) == b"ping"
        proxy.cut("blackhole")
        client.sendall(b"held")  # the pump now waits for the link to come back
    return client, server_side


def test_stop_ends_a_blackholed_connection_and_leaves_no_task_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        upstream.settimeout(10)
        client, server_side = _cut_and_stop(upstream)
        with client, server_side:
            # both ends see the proxy close them, not a connection left half-open
            assert client.recv(1) == b""
            assert server_side.recv(1) == b""
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()  # a pump task still pending would be destroyed here, and logged
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
