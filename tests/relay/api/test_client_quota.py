"""The per-client quota (relay/api/quota.py; docs/api.md "Client quota") and enqueue tokens on
every storing route, driven over raw HTTP against an in-process relay on a real redis-server:
both HTTP paths (the fast path and aiohttp's), every storing route, source addresses
(127.0.0.1 and 127.0.0.2 are two clients), X-Forwarded-For only from a trusted proxy."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis

from relay import metrics
from relay.api.quota import ClientQuota, address_key, parse_address
from relay.settings import BY_ENV, ConfigError, Settings
from tests.support.in_process_relay import RelayFactory, RunningRelay


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def refusals(route: str, reason: str) -> float:
    return float(metrics.QUOTA_REFUSALS.labels(route, reason)._value.get())


@pytest.fixture
async def session_from() -> AsyncIterator[Any]:
    """aiohttp sessions whose sockets are bound to a given source address (another client)."""
    opened: list[aiohttp.ClientSession] = []

    def make(source: str = "127.0.0.1") -> aiohttp.ClientSession:
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(source, 0)))
        opened.append(s)
        return s

    yield make
    for s in opened:
        await s.close()


async def enqueue(http: aiohttp.ClientSession, relay: RunningRelay, body: bytes, **headers: str) -> Any:
    url = f"{relay.base_url}/v1/queues/{b64(os.urandom(32))}/messages"
    async with http.post(url, data=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


@pytest.mark.parametrize("fastpath", [True, False])
async def test_bytes_quota_refuses_one_client_not_another(
    redis_server: LocalRedis, relay_factory: RelayFactory, session_from: Any, fastpath: bool
) -> None:
    relay = await relay_factory(
        redis_server.url,
        http_fastpath=fastpath,
        client_rate_bytes=100_000,
        client_rate_messages=1000,
        client_rate_window_ms=60_000,
    )
    route = "/v1/queues/{recipient}/messages"
    before = refusals(route, "client_bytes")  # relayfleet_quota_refusals_total
    a, b = session_from("127.0.0.1"), session_from("127.0.0.2")
    answers = [await enqueue(a, relay, b"x" * 30_000) for _ in range(5)]
    assert [s for s, _, _ in answers] == [201, 201, 201, 429, 429]
    _status, headers, body = answers[3]
    assert body["code"] == "client_rate_limited"
    assert int(headers["Retry-After"]) >= 1
    assert body["retryAfterMs"] >= 1
    # 20,000 bytes short at 100,000 per 60 s: 12 s
    assert 11_000 <= body["retryAfterMs"] <= 13_000
    assert headers["Retry-After"] in ("12", "13")
    assert refusals(route, "client_bytes") - before == 2
    # another source address is another client; small messages still fit for the first one
    assert [(await enqueue(b, relay, b"y" * 30_000))[0] for _ in range(3)] == [201] * 3
    assert (await enqueue(a, relay, b"z" * 100))[0] == 201


@pytest.mark.serial  # measures a refill over 2.5 s: no neighbour test takes the CPU meanwhile
async def test_messages_quota_and_refill(redis_server: LocalRedis, relay_factory: RelayFactory) -> None:
    # 5 per 10 s: one back every 2 s, so the refill's check has 1.5 s of slack either side (at
    # 5 per 1 s a loaded machine's 0.15 s late wake-up gave a third back)
    relay = await relay_factory(
        redis_server.url, client_rate_messages=5, client_rate_bytes=0, client_rate_window_ms=10_000
    )
    async with aiohttp.ClientSession() as http:
        got = [(await enqueue(http, relay, b"m"))[0] for _ in range(7)]
        assert got == [201] * 5 + [429] * 2
        _, headers, body = await enqueue(http, relay, b"m")
        assert body["code"] == "client_rate_limited"
        assert headers["Retry-After"] in ("1", "2")
        assert 0 < body["retryAfterMs"] <= 2_000
        await asyncio.sleep(2.5)  # one back at 2 s, the next not before 4 s
        assert [(await enqueue(http, relay, b"m"))[0] for _ in range(2)] == [201, 429]


async def test_fanout_counts_every_recipient_and_inbox_appends_count(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(
        redis_server.url, client_rate_messages=10, client_rate_bytes=0, client_rate_window_ms=60_000
    )
    before = refusals("/v1/messages", "client_messages")
    async with aiohttp.ClientSession() as http:
        doc = {"recipients": [b64(os.urandom(32)) for _ in range(8)], "payload": b64(b"hi")}
        async with http.post(relay.base_url + "/v1/messages", json=doc) as resp:
            assert resp.status == 200
            assert {r["status"] for r in (await resp.json())["results"]} == {201}
        async with http.post(relay.base_url + "/v1/messages", json=doc) as resp:  # 8 more: over 10
            assert resp.status == 429
            assert (await resp.json())["code"] == "client_rate_limited"
        assert refusals("/v1/messages", "client_messages") - before == 1
        append = {"messageId": "m1", "ciphertext": b64(b"c")}
        for want in (201, 201, 429):  # 8 + 2 = 10
            headers = {"X-Inbox-ID": f"inbox-{os.urandom(4).hex()}"}
            async with http.post(relay.base_url + "/v1/inbox/append", json=append, headers=headers) as resp:
                assert resp.status == want, await resp.text()
                if want == 429:
                    assert resp.headers["Retry-After"]
                    assert (await resp.json())["code"] == "client_rate_limited"


@pytest.mark.parametrize("fastpath", [True, False])
async def test_forwarded_for_only_from_a_trusted_proxy(
    redis_server: LocalRedis, relay_factory: RelayFactory, session_from: Any, fastpath: bool
) -> None:
    limits: dict[str, Any] = {
        "client_rate_messages": 2,
        "client_rate_bytes": 0,
        "client_rate_window_ms": 60_000,
        "http_fastpath": fastpath,
    }
    untrusted = await relay_factory(redis_server.url, **limits)
    trusting = await relay_factory(redis_server.url, trusted_proxies=("127.0.0.2/32",), **limits)
    direct, proxy = session_from("127.0.0.1"), session_from("127.0.0.2")

    async def three(relay: RunningRelay, http: aiohttp.ClientSession, client: str) -> list[int]:
        return [(await enqueue(http, relay, b"m", **{"X-Forwarded-For": client}))[0] for _ in range(3)]

    # a header from an untrusted peer names nobody: one address, one quota
    assert await three(untrusted, direct, "10.0.0.1") == [201, 201, 429]
    assert await three(untrusted, direct, "10.0.0.2") == [429] * 3
    # through the trusted proxy each forwarded client has its own (the rightmost untrusted hop)
    assert await three(trusting, proxy, "10.0.0.1") == [201, 201, 429]
    assert await three(trusting, proxy, "192.0.2.9, 10.0.0.2") == [201, 201, 429]
    assert await three(trusting, proxy, "10.0.0.3, 127.0.0.2") == [201, 201, 429]  # a proxy chain
    # IPv6: one /64 is one client
    assert await three(trusting, proxy, "2001:db8:1:2::1") == [201, 201, 429]
    assert await three(trusting, proxy, "2001:db8:1:2::ffff") == [429] * 3
    # not trusted on the other relay: the direct peer is the client whatever the header says
    assert await three(trusting, direct, "10.0.0.9") == [201, 201, 429]


async def test_a_token_is_its_own_client(redis_server: LocalRedis, relay_factory: RelayFactory) -> None:
    relay = await relay_factory(
        redis_server.url,
        enqueue_tokens=("alpha", "beta"),
        client_rate_messages=2,
        client_rate_bytes=0,
        client_rate_window_ms=60_000,
    )
    async with aiohttp.ClientSession() as http:
        for token in ("alpha", "beta"):
            got = [(await enqueue(http, relay, b"m", Authorization=f"Bearer {token}"))[0] for _ in range(3)]
            assert got == [201, 201, 429], token


async def test_enqueue_tokens_on_every_storing_route_raw_http(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    """A5: with RELAY_ENQUEUE_TOKENS on, inbox append needs the token as enqueue and fan-out do;
    inbox reads stay authorised by X-Inbox-ID alone."""
    relay = await relay_factory(redis_server.url, enqueue_tokens=("s3cret",))
    host, port = relay.base_url.removeprefix("http://").split(":")
    body = b'{"messageId":"m1","ciphertext":"aGk"}'
    inbox = f"invented-{os.urandom(6).hex()}"

    async def raw(head: str, payload: bytes = b"") -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head.encode() + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            got = await asyncio.wait_for(reader.read(65536), 10)
        finally:
            writer.close()
        return int(got.split(b" ", 2)[1]), got

    before = refusals("/v1/inbox/append", "enqueue_token")
    append = (
        f"POST /v1/inbox/append HTTP/1.1\r\nHost: t\r\nX-Inbox-ID: {inbox}\r\n"
        "Content-Type: application/json\r\n"
    )
    status, got = await raw(append, body)
    assert status == 401
    assert b"WWW-Authenticate: Bearer" in got
    assert b'"code":"unauthorized"' in got
    status, got = await raw(append + "Authorization: Bearer wrong\r\n", body)
    assert status == 401
    assert refusals("/v1/inbox/append", "enqueue_token") - before == 2
    reading = f"GET /v1/inbox/messages HTTP/1.1\r\nHost: t\r\nX-Inbox-ID: {inbox}\r\n"
    status, got = await raw(reading)
    assert status == 200
    assert b'"messages":[]' in got
    status, got = await raw(append + "Authorization: Bearer s3cret\r\n", body)
    assert status == 201, got
    status, got = await raw(reading)
    assert status == 200
    assert b'"messageId":"m1"' in got
    # enqueue and fan-out, for the record (both paths of enqueue)
    path = f"/v1/queues/{b64(os.urandom(32))}/messages"
    status, got = await raw(f"POST {path} HTTP/1.1\r\nHost: t\r\n", b"x")
    assert status == 401
    assert b"WWW-Authenticate: Bearer" in got
    fan = b'{"recipients":["%s"],"payload":"aGk"}' % b64(os.urandom(32)).encode()
    status, got = await raw(
        "POST /v1/messages HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n", fan
    )
    assert status == 401
    assert b"WWW-Authenticate: Bearer" in got


# --- the limiter itself ------------------------------------------------------------------------


def quota(**overrides: Any) -> ClientQuota:
    return ClientQuota(replace(Settings(), **overrides))


def test_a_cost_over_a_whole_bucket_needs_a_full_one() -> None:
    q = quota(client_rate_messages=0, client_rate_bytes=1000, client_rate_window_ms=1000)
    assert q.take(1, 1, 5000) is None  # a full bucket admits it (never refused forever)
    refusal = q.take(1, 1, 5000)
    assert refusal is not None
    assert refusal.reason == "client_bytes"
    assert 900 <= refusal.retry_after_ms <= 1000
    assert q.take(2, 10**9, 10) is None  # messages off: any count
    assert not quota(client_rate_messages=0, client_rate_bytes=0).enabled


@pytest.mark.serial  # measures the time of a call: no neighbour test takes the CPU meanwhile
def test_the_client_table_stays_bounded() -> None:
    q = ClientQuota(replace(Settings(), client_rate_window_ms=60_000), max_clients=1000)
    start = time.perf_counter()
    for i in range(100_000):  # a flood of addresses
        assert q.take(i, 1, 100) is None
    per_call = (time.perf_counter() - start) / 100_000
    assert len(q) <= 1000
    assert per_call < 20e-6, per_call  # O(1) amortised (~1 µs here)
    # spent buckets of recent clients survive a prune of idle ones
    q2 = ClientQuota(replace(Settings(), client_rate_messages=1, client_rate_window_ms=1), max_clients=4)
    assert q2.take("a", 1, 1) is None
    time.sleep(0.01)
    for c in "bcde":
        q2.take(c, 1, 1)
    assert len(q2) <= 4


def test_addresses_and_settings() -> None:
    v4, v6a, v6b = (parse_address(t) for t in ("192.0.2.1", "2001:db8::1", "2001:db8::2"))
    assert v4 is not None
    assert v6a is not None
    assert v6b is not None
    assert address_key(v6a) == address_key(v6b) != address_key(v4)
    mapped = parse_address("::ffff:192.0.2.1")
    assert mapped is not None
    assert address_key(mapped) == address_key(v4)
    assert parse_address("not an address") is None
    q = quota(trusted_proxies=("10.0.0.0/8",))
    assert q.peer_key(("10.1.2.3", 1))[1] is None  # a trusted proxy: per request
    assert q.peer_key(("192.0.2.1", 1))[1] == address_key(v4)
    assert q.forwarded_key(parse_address("10.1.2.3"), "junk, 192.0.2.1") == address_key(v4)
    assert q.forwarded_key(parse_address("10.1.2.3"), "192.0.2.1, junk") == q.forwarded_key(
        parse_address("10.1.2.3"), None
    )  # a hop the proxies did not write: the proxy itself


def test_trusted_proxies_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TRUSTED_PROXIES", "10.0.0.0/8, 2001:db8::/32 192.168.1.7")
    assert BY_ENV["RELAY_TRUSTED_PROXIES"].read() == ("10.0.0.0/8", "2001:db8::/32", "192.168.1.7/32")
    monkeypatch.setenv("RELAY_TRUSTED_PROXIES", "10.0.0.0/8,bogus")
    with pytest.raises(ConfigError, match="RELAY_TRUSTED_PROXIES"):
        BY_ENV["RELAY_TRUSTED_PROXIES"].read()
