"""Request authentication with real Ed25519 signatures: every bad request is refused and changes nothing.

Each refused request is checked against a snapshot of every key in the real
redis-server, taken just before it: a 401 must leave Redis byte-for-byte as it was.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import orjson
import pytest
import redis
from nacl.signing import SigningKey
from relayfleet_testing.localredis import LocalRedis, free_port

from relay.protocol import b64decode, b64encode, canonical, keypair, sign_headers
from tests.support.in_process_relay import RelayFactory, RunningRelay

Snapshot = dict[bytes, bytes | None]


def snapshot(r: redis.Redis) -> Snapshot:
    """Every key and its serialized value (DUMP): equal snapshots mean nothing changed."""
    return {k: r.dump(k) for k in sorted(r.scan_iter(count=1000))}


def header(
    private: bytes,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    ts: int | None = None,
    nonce: bytes | None = None,
    key: bytes | None = None,
) -> dict[str, str]:
    """An Authorization header built by hand, so each field can be made wrong on purpose."""
    sk = SigningKey(private)
    t = str(int(time.time()) if ts is None else ts)
    n = b64encode(nonce if nonce is not None else os.urandom(16))
    sig = sk.sign(canonical(method, path, t, n, body)).signature
    k = b64encode(key if key is not None else bytes(sk.verify_key))
    return {"Authorization": f"Relay-Ed25519 key={k}, ts={t}, nonce={n}, sig={b64encode(sig)}"}


@dataclass
class Setup:
    relay: RunningRelay
    http: aiohttp.ClientSession
    redis: redis.Redis
    public: bytes
    private: bytes

    def path(self, tail: str, recipient: bytes | None = None) -> str:
        return f"/v1/queues/{b64encode(recipient or self.public)}/{tail}"

    async def call(
        self, method: str, path: str, headers: dict[str, str], body: bytes = b""
    ) -> tuple[int, dict[str, object], dict[str, str]]:
        async with self.http.request(
            method, self.relay.base_url + path, data=body or None, headers=headers
        ) as resp:
            return resp.status, orjson.loads(await resp.read() or b"{}"), dict(resp.headers)

    async def refused(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> str:
        """Assert a 401 with WWW-Authenticate and an unchanged Redis; returns the error text."""
        before = snapshot(self.redis)
        status, doc, resp_headers = await self.call(method, path, headers, body)
        assert status == 401, doc
        assert doc["code"] == "unauthorized"
        assert resp_headers["WWW-Authenticate"] == "Relay-Ed25519"
        assert snapshot(self.redis) == before
        return str(doc["error"])


@pytest.fixture
def sync_redis(redis_server: LocalRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
async def setup(
    redis_server: LocalRedis, relay_factory: RelayFactory, sync_redis: redis.Redis
) -> AsyncIterator[Setup]:
    relay = await relay_factory(redis_server.url, auth="ed25519")
    public, private = keypair()
    async with aiohttp.ClientSession() as http:
        s = Setup(relay, http, sync_redis, public, private)
        for i in range(3):
            status, _, _ = await s.call("POST", s.path("messages"), {}, b"secret-%d" % i)
            assert status == 201
        yield s


async def test_valid_signatures_are_accepted(setup: Setup) -> None:
    s = setup
    for tail in ("messages", "messages?limit=2&fromSeq=1", "status"):
        path = s.path(tail)
        status, doc, _ = await s.call("GET", path, header(s.private, "GET", path))
        assert status == 200, doc
    body = b'{"upToSeq": 1}'
    path = s.path("ack")
    status, doc, _ = await s.call("POST", path, header(s.private, "POST", path, body), body)
    assert (status, doc) == (200, {"removed": 1})
    path = s.path("drain?limit=1")
    status, doc, _ = await s.call("POST", path, header(s.private, "POST", path))
    assert status == 200
    assert [m["seq"] for m in doc["messages"]] == [2]  # type: ignore[attr-defined]


async def test_wrong_key_is_refused(setup: Setup) -> None:
    s = setup
    _, other = keypair()
    path = s.path("messages")
    # the other key, saying so: not the queue's recipient
    assert "recipient" in await s.refused("GET", path, header(other, "GET", path))
    # the other key's signature, claiming to be the owner: does not verify
    assert "signature" in await s.refused("GET", path, header(other, "GET", path, key=s.public))
    # ack and drain are protected the same way
    body = b'{"upToSeq": 3}'
    ack = s.path("ack")
    await s.refused("POST", ack, header(other, "POST", ack, body, key=s.public), body)
    drain = s.path("drain")
    await s.refused("POST", drain, header(other, "POST", drain, key=s.public))
    assert (await s.call("GET", path, header(s.private, "GET", path)))[1]["messages"]


async def test_wrong_path_is_refused(setup: Setup) -> None:
    s = setup
    path = s.path("messages")
    assert "signature" in await s.refused("GET", path, header(s.private, "GET", s.path("status")))
    # the query is part of what is signed
    assert "signature" in await s.refused("GET", path + "?limit=1", header(s.private, "GET", path))
    # and so is the method
    drain = s.path("drain")
    assert "signature" in await s.refused("POST", drain, header(s.private, "GET", drain))


async def test_stale_or_future_ts_is_refused(setup: Setup) -> None:
    s = setup
    path = s.path("messages")
    # each ts taken just before its request, 10 s past the ±300 s window: a whole-second ts
    # taken once (up to 1 s behind) and a slow first request made now + 301 fall inside it
    assert "skew" in await s.refused("GET", path, header(s.private, "GET", path, ts=int(time.time()) - 310))
    assert "skew" in await s.refused("GET", path, header(s.private, "GET", path, ts=int(time.time()) + 310))
    status, _, _ = await s.call("GET", path, header(s.private, "GET", path, ts=int(time.time()) - 200))
    assert status == 200  # within ±300 s


async def test_replayed_nonce_is_refused(setup: Setup) -> None:
    s = setup
    path = s.path("messages")
    signed = header(s.private, "GET", path)
    status, _, _ = await s.call("GET", path, signed)
    assert status == 200
    assert "nonce" in await s.refused("GET", path, signed)
    # the same nonce in a fresh signature (another ts) is still a replay
    nonce = b64decode(signed["Authorization"].split("nonce=")[1].split(",")[0])
    again = header(s.private, "GET", path, ts=int(time.time()) - 1, nonce=nonce)
    assert "nonce" in await s.refused("GET", path, again)


async def test_tampered_body_is_refused(setup: Setup) -> None:
    s = setup
    path = s.path("ack")
    signed_body, sent_body = b'{"upToSeq": 1}', b'{"upToSeq": 3}'
    assert "signature" in await s.refused(
        "POST", path, header(s.private, "POST", path, signed_body), sent_body
    )
    status_path = s.path("status")
    status, doc, _ = await s.call("GET", status_path, header(s.private, "GET", status_path))
    assert (status, doc["message_count"]) == (200, 3)


async def test_malformed_headers_are_refused(setup: Setup) -> None:
    s = setup
    path = s.path("messages")
    good = header(s.private, "GET", path)["Authorization"]
    for bad in (
        None,
        "",
        "Bearer abc",
        good.replace("Relay-Ed25519", "Relay-Ed448"),
        good.replace("nonce=", "nonce=%%"),
        good + ", extra=1",
        good.split(", sig=")[0],
        good.replace("ts=", "ts=-"),
    ):
        await s.refused("GET", path, {} if bad is None else {"Authorization": bad})


async def test_pickup_signature_must_be_the_recipient_keys(setup: Setup) -> None:
    s = setup
    msg = orjson.dumps(
        {
            "@id": "123456781",
            "@type": "https://didcomm.org/messagepickup/2.0/status-request",
            "recipient_key": b64encode(s.public),
        }
    )
    path = "/v1/didcomm/pickup"
    _, other = keypair()
    await s.refused("POST", path, header(other, "POST", path, msg), msg)
    await s.refused("POST", path, {}, msg)
    status, doc, _ = await s.call("POST", path, header(s.private, "POST", path, msg), msg)
    assert (status, doc["message_count"]) == (200, 3)


async def test_live_upgrade_needs_the_signature(setup: Setup) -> None:
    s = setup
    path = s.path("live")
    url = "ws" + s.relay.base_url.removeprefix("http") + path
    _, other = keypair()
    before = snapshot(s.redis)
    for bad in ({}, header(other, "GET", path, key=s.public), header(s.private, "GET", s.path("status"))):
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await s.http.ws_connect(url, headers=bad)
        assert err.value.status == 401
    assert snapshot(s.redis) == before
    ws = await s.http.ws_connect(url, headers=header(s.private, "GET", path))
    assert orjson.loads((await ws.receive()).data)["type"] == "message"
    await ws.close()


async def test_enqueue_is_open_by_default_and_tokens_close_it(
    redis_server: LocalRedis, relay_factory: RelayFactory, sync_redis: redis.Redis
) -> None:
    relay = await relay_factory(redis_server.url, auth="ed25519", enqueue_tokens=("tok-1", "tok-2"))
    public, _ = keypair()
    url = f"{relay.base_url}/v1/queues/{b64encode(public)}/messages"
    fan = {"recipients": [b64encode(public)], "payload": b64encode(b"x")}
    async with aiohttp.ClientSession() as http:
        before = snapshot(sync_redis)
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "tok-1"}):
            async with http.post(url, data=b"x", headers=headers) as r:
                assert r.status == 401
                assert r.headers["WWW-Authenticate"] == "Bearer"
            async with http.post(relay.base_url + "/v1/messages", json=fan, headers=headers) as r:
                assert r.status == 401
        assert snapshot(sync_redis) == before
        async with http.post(url, data=b"x", headers={"Authorization": "Bearer tok-2"}) as r:
            assert r.status == 201
        async with http.post(
            relay.base_url + "/v1/messages", json=fan, headers={"Authorization": "Bearer tok-1"}
        ) as r:
            assert r.status == 200
            assert (await r.json())["results"][0]["status"] == 201


async def test_auth_none_needs_no_signature(redis_server: LocalRedis, relay_factory: RelayFactory) -> None:
    relay = await relay_factory(redis_server.url, auth="none")
    public, _ = keypair()
    url = f"{relay.base_url}/v1/queues/{b64encode(public)}/status"
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        assert r.status == 200


def test_keygen_prints_a_working_pair() -> None:
    relayfleet = os.path.join(os.path.dirname(sys.executable), "relayfleet")
    out = subprocess.run([relayfleet, "keygen"], capture_output=True, text=True, timeout=60, check=True)
    pair = json.loads(out.stdout)
    public, private = b64decode(pair["public"]), b64decode(pair["private"])
    assert len(public) == len(private) == 32
    assert bytes(SigningKey(private).verify_key) == public
    h = sign_headers(private, "GET", "/v1/queues/x/status")["Authorization"]
    assert f"key={pair['public']}," in h


async def test_relay_with_auth_none_logs_a_warning(redis_server: LocalRedis) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "relay",
        "--redis-url",
        redis_server.url,
        "--port",
        str(port),
        "--auth",
        "none",
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(60):
            while line := await proc.stderr.readline():
                if b"WARNING" in line and b"auth" in line:
                    break
            else:
                pytest.fail("no warning about --auth none")
    finally:
        proc.terminate()
        # read stderr to its end: asyncio closes a pipe only at EOF, and a pipe left open is a
        # ResourceWarning in whichever later test the garbage collector happens to run
        await proc.communicate()
