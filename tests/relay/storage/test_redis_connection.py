"""relay/storage/connection.py: URLs read once, by redis-py; relay/storage/pipeline.py: the one
hand-written connection's login path."""

from __future__ import annotations

import asyncio
import socket
import ssl

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay.storage.connection import RedisConnectError, RedisTarget, RedisURLError
from relay.storage.pipeline import Conn, encode, open_connection

REDIS = "/usr/bin/redis-server"


def test_plain_url_with_credentials_and_db() -> None:
    t = RedisTarget.from_url("redis://app%40x:p%2Fw@db.example:6390/3")
    assert (t.host, t.port, t.db, t.tls) == ("db.example", 6390, 3, False)
    assert (t.username, t.password) == ("app@x", "p/w")
    assert "p/w" not in repr(t)
    assert t.address == "db.example:6390"


def test_rediss_options_are_redis_pys() -> None:
    plain = RedisTarget.from_url("rediss://h")
    ctx = plain.ssl_context()  # redis-py's defaults: certificate required, hostname checked
    assert plain.tls
    assert ctx is not None
    assert (ctx.verify_mode, ctx.check_hostname) == (ssl.CERT_REQUIRED, True)
    t = RedisTarget.from_url(
        "rediss://h:6380/0?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
        "&ssl_cert_reqs=optional&ssl_check_hostname=false&socket_timeout=3"
    )
    opts = {k: v for k, v in t.options.items() if k.startswith(("ssl_", "socket_"))}
    assert opts == {
        "ssl_ca_certs": "/ca.pem",
        "ssl_certfile": "/c.pem",
        "ssl_keyfile": "/k.pem",
        "ssl_cert_reqs": "optional",
        "ssl_check_hostname": False,
        "socket_timeout": 3.0,
    }
    # a value redis-py does not read as false leaves the check on (never quietly off)
    vague = RedisTarget.from_url("rediss://h?ssl_check_hostname=perhaps").ssl_context()
    assert vague is not None
    assert vague.check_hostname
    unix = RedisTarget.from_url("unix:///run/redis.sock?db=2")
    assert (unix.unix_path, unix.db, unix.tls) == ("/run/redis.sock", 2, False)
    assert unix.address == "/run/redis.sock"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://h", "must specify one of the following schemes"),
        ("redis://h:notaport", "Port could not be cast"),
        ("redis://h/x", "must be a number"),
        ("redis://h?db=x", "Invalid value for 'db'"),
        ("redis://h?ssl_ca_certs=/ca.pem", "ssl_ca_certs needs a rediss:// URL"),
        ("rediss://h?ssl_ca_cert=/ca.pem", "unknown Redis URL option 'ssl_ca_cert'"),
        ("rediss://h?ssl_cert_reqs=maybe", "Invalid SSL Certificate Requirements Flag"),
    ],
)
def test_bad_urls_name_the_problem_not_the_secret(url: str, problem: str) -> None:
    with pytest.raises(RedisURLError, match=problem) as err:
        RedisTarget.from_url(url.replace("//h", "//u:s3cret@h"))
    assert "s3cret" not in str(err.value)


def test_missing_ca_file_is_a_clear_error() -> None:
    with pytest.raises(RedisConnectError, match="does not exist"):
        RedisTarget.from_url("rediss://h?ssl_ca_certs=/nonexistent/ca.pem").ssl_context()
    with pytest.raises(RedisConnectError, match="TLS setup failed"):
        RedisTarget.from_url("rediss://h?ssl_keyfile=/nonexistent/k.pem").ssl_context()


def test_no_verification_switches_hostname_check_off() -> None:
    ctx = RedisTarget.from_url("rediss://h?ssl_cert_reqs=none").ssl_context()
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_NONE
    assert not ctx.check_hostname


async def test_login_with_user_password_and_db_on_a_real_redis() -> None:
    server = LocalRedis(binary=REDIS, password="pw-test").start()
    try:
        target = RedisTarget.from_url(f"redis://default:pw-test@127.0.0.1:{server.port}/5")
        reader, writer = await open_connection(target, 2.0)
        writer.write(encode("CLIENT", "INFO"))
        info = await reader.readuntil(b"\n\r\n")
        assert b" db=5 " in info
        writer.close()
        await writer.wait_closed()
        wrong = RedisTarget.from_url(f"redis://default:nope@127.0.0.1:{server.port}/0")
        with pytest.raises(RedisConnectError, match=r"AUTH on 127\.0\.0\.1:\d+ refused: WRONGPASS") as err:
            await open_connection(wrong, 2.0)
        assert "nope" not in str(err.value)
        server.stop()
        with pytest.raises(RedisConnectError, match=r"cannot connect to 127\.0\.0\.1"):
            await open_connection(target, 2.0)
    finally:
        server.stop()


async def test_connect_timeout_is_a_timeout() -> None:
    # a listener that accepts and never answers: login waits for PONG until the deadline
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(TimeoutError):
            await open_connection(RedisTarget.from_url(f"redis://127.0.0.1:{port}"), 0.3)
    finally:
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_reply_wait_cancelled_as_the_reply_arrives_ends_cancelled() -> None:
    # Python 3.11's wait_for returned the data when the cancellation landed in the loop turn
    # its read completed: the cancelled task went on with the connection open (a stopped
    # Sentinel watcher kept its subscription). Every turn of the read is tried here.
    outcomes = set()
    for turns in range(8):
        ours, peer = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        conn = Conn(reader, writer)
        try:
            task = asyncio.create_task(conn.reply(idle=5.0))
            await asyncio.sleep(0)  # the task waits for the server
            peer.sendall(b"+PONG\r\n")
            for _ in range(turns):
                await asyncio.sleep(0)
            if task.cancel():
                with pytest.raises(asyncio.CancelledError):
                    await task
                outcomes.add("cancelled")
            else:
                assert task.result() == b"PONG"
                outcomes.add("answered")
        finally:
            conn.close()
            peer.close()
    assert outcomes == {"cancelled", "answered"}  # the cancellation met the read before and after its end
