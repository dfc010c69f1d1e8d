"""The fast path (relay/http/fastpath.py) over raw sockets, against a real redis-server: its own
edges (handoff, pipelining, split requests, timeouts, a client that leaves) and a differential
check that it and the aiohttp path (RELAY_HTTP_FASTPATH=0), which answer from the same handler
functions (relay/api/params, auth, queues, failures), answer alike: status, headers but Date,
and body."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay import metrics
from relay.api import bulk
from relay.app import begin_shutdown
from relay.http.fastpath import FastConnection, Reply, _Woken, ok_json_bytes, reply_bytes
from relay.http.serving import GuardedRequestHandler, GuardedServer
from relay.protocol import b64encode, keypair, sign_headers
from relay.storage.store import QueueLimits, ReadResult, ShardStore
from tests.support.in_process_relay import RelayFactory, RunningRelay


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def comparable(self) -> tuple[int, list[tuple[str, str]], bytes]:
        """All but Date, and the rate limit's retryAfterMs (it counts down between the two)."""
        body = re.sub(rb'"retryAfterMs":[0-9]{5}', b'"retryAfterMs":NNNNN', self.body)
        return self.status, [(k, v) for k, v in self.headers if k.lower() != "date"], body


def port_of(relay: RunningRelay) -> int:
    port = urlsplit(relay.base_url).port
    assert port is not None
    return port


def server_of(relay: RunningRelay) -> GuardedServer:
    runner = relay.server.runner
    assert runner is not None
    server = runner.server
    assert isinstance(server, GuardedServer)
    return server


def enqueue_request(recipient: bytes, body: bytes = b"hello", extra: str = "", query: str = "") -> bytes:
    head = (
        f"POST /v1/queues/{b64encode(recipient)}/messages{query} HTTP/1.1\r\nHost: relay\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head[:-4].decode().split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(k, v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
    length = int(next(v for k, v in headers if k.lower() == "content-length"))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    return Answer(status, headers, body)


async def closed(reader: asyncio.StreamReader, within: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except (TimeoutError, ConnectionResetError):
        return False


async def exchange(relay: RunningRelay, raw: bytes, answers: int = 1) -> tuple[list[Answer], bool]:
    """Send `raw`, read `answers` answers; and whether the relay then closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(raw)
        got = [await read_answer(reader) for _ in range(answers)]
        return got, await closed(reader, 0.3)
    finally:
        writer.close()


@pytest.fixture
async def both(redis_server: LocalRedis, relay_factory: RelayFactory) -> tuple[RunningRelay, RunningRelay]:
    limits = QueueLimits(rate_count=3, rate_window_ms=60_000)
    common = {"limits": limits, "max_payload": 1000, "enqueue_tokens": ("tok-1",), "body_timeout_s": 0.5}
    fast = await relay_factory(redis_server.url, http_fastpath=True, **common)
    slow = await relay_factory(redis_server.url, http_fastpath=False, **common)
    return fast, slow


BEARER = "Authorization: Bearer tok-1\r\n"

# name -> (request for a recipient, answers expected); each relay gets its own recipient
CASES: dict[str, Callable[[bytes], bytes]] = {
    "stored": lambda r: enqueue_request(r, extra=BEARER),
    "stored on a channel": lambda r: enqueue_request(r, extra=BEARER, query="?channel=" + b64encode(b"ch")),
    "empty channel": lambda r: enqueue_request(r, extra=BEARER, query="?channel="),
    "no token": lambda r: enqueue_request(r),
    "wrong token": lambda r: enqueue_request(r, extra="Authorization: Bearer nope\r\n"),
    "empty payload": lambda r: enqueue_request(r, b"", extra=BEARER),
    "too large": lambda r: enqueue_request(r, b"x" * 1001, extra=BEARER),
    "compressed": lambda r: enqueue_request(r, extra=BEARER + "Content-Encoding: gzip\r\n"),
    "bad recipient": lambda r: enqueue_request(r[:31], extra=BEARER),
    "bad channel": lambda r: enqueue_request(r, extra=BEARER, query="?channel=" + b64encode(b"c" * 65)),
    "bad idempotency key": lambda r: enqueue_request(r, extra=BEARER + "Idempotency-Key: a\tb\r\n"),
    "duplicate and conflict": lambda r: (
        enqueue_request(r, b"one", extra=BEARER + "Idempotency-Key: k1\r\n")
        + enqueue_request(r, b"one", extra=BEARER + "Idempotency-Key: k1\r\n")
        + enqueue_request(r, b"two", extra=BEARER + "Idempotency-Key: k1\r\n")
    ),
    "rate limited": lambda r: b"".join(enqueue_request(r, extra=BEARER) for _ in range(4)),
    "malformed header": lambda r: enqueue_request(r, extra=BEARER + "Bad Header: x\r\n"),
    "chunked": lambda r: (
        f"POST /v1/queues/{b64encode(r)}/messages HTTP/1.1\r\nHost: relay\r\n{BEARER}"
        "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    ).encode(),
    "connection close": lambda r: enqueue_request(r, extra=BEARER + "Connection: close\r\n"),
    "non-ASCII header value": lambda r: enqueue_request(r, extra=BEARER + "X-Note: caf\u00e9\r\n"),
    "65 header lines": lambda r: enqueue_request(
        r, extra=BEARER + "".join(f"X-{i}: v\r\n" for i in range(61))
    ),
}
ANSWERS = {"duplicate and conflict": 3, "rate limited": 4}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_fast_path_answers_as_aiohttp_does(both: tuple[RunningRelay, RunningRelay], case: str) -> None:
    fast, slow = both
    results = []
    for relay in (fast, slow):
        results.append(await exchange(relay, CASES[case](os.urandom(32)), ANSWERS.get(case, 1)))
    (fast_answers, fast_closed), (slow_answers, slow_closed) = results
    assert [a.comparable() for a in fast_answers] == [a.comparable() for a in slow_answers]
    assert fast_closed == slow_closed


async def test_body_timeout_answers_as_aiohttp_does(both: tuple[RunningRelay, RunningRelay]) -> None:
    results = []
    for relay in both:
        request = enqueue_request(os.urandom(32), b"0123456789", extra=BEARER)
        results.append(await exchange(relay, request[:-4]))
    (fast_answers, fast_closed), (slow_answers, _) = results
    assert fast_answers[0].status == 408
    assert [a.comparable() for a in fast_answers] == [a.comparable() for a in slow_answers]
    # both say Connection: close; aiohttp first lingers reading the announced body, this closes
    assert fast_closed


async def test_body_timeout_per_body_on_one_connection(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    """The body timer is one per connection, left armed after a body completes: a body that
    completes in time is served, a later body gets its own full timeout, and one that never
    completes still gets 408."""
    relay = await relay_factory(redis_server.url, body_timeout_s=0.6)
    r = os.urandom(32)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        first = enqueue_request(r, b"0123456789")
        writer.write(first[:-4])
        await asyncio.sleep(0.4)
        writer.write(first[-4:])  # completes within its timeout
        assert (await read_answer(reader)).status == 201
        second = enqueue_request(r, b"abcdefghij")
        writer.write(second[:-4])
        await asyncio.sleep(0.4)  # past the first body's deadline, within its own
        writer.write(second[-4:])
        assert (await read_answer(reader)).status == 201
        third = enqueue_request(r, b"never done")
        writer.write(third[:-4])
        started = time.monotonic()
        answer = await read_answer(reader)
        assert answer.status == 408
        assert 0.5 <= time.monotonic() - started < 3
        assert await closed(reader, 1.0)
    finally:
        writer.close()


def protocols(relay: RunningRelay) -> list[type]:
    return [type(c) for c in server_of(relay).guard.open]


@pytest.mark.parametrize(
    ("extra", "served_here"),
    [
        ("".join(f"X-{i}: v\r\n" for i in range(61)), True),  # 64 header lines with Host and the two
        ("".join(f"X-{i}: v\r\n" for i in range(62)), False),  # 65
        ("X-Note: caf\u00e9\r\n", False),  # a value outside ASCII
    ],
)
async def test_heads_past_the_line_cap_or_outside_ascii_go_to_aiohttp(
    relay: RunningRelay, extra: str, served_here: bool
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(enqueue_request(os.urandom(32), b"one", extra=extra))
        answer = await read_answer(reader)
        assert answer.status == 201
        assert protocols(relay) == [FastConnection if served_here else GuardedRequestHandler]
    finally:
        writer.close()


async def test_handoff_mid_keepalive(relay: RunningRelay) -> None:
    r = os.urandom(32)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(enqueue_request(r, b"one"))
        first = await read_answer(reader)
        assert (first.status, first.body) == (201, b'{"seq":1,"duplicate":false}')
        assert protocols(relay) == [FastConnection]
        path = f"/v1/queues/{b64encode(r)}/status"
        writer.write(f"GET {path} HTTP/1.1\r\nHost: relay\r\n\r\n".encode())
        status = await read_answer(reader)
        assert status.status == 200
        assert b'"message_count":1' in status.body
        assert protocols(relay) == [GuardedRequestHandler]  # handed over, for good
        writer.write(enqueue_request(r, b"two"))
        second = await read_answer(reader)
        assert (second.status, second.body) == (201, b'{"seq":2,"duplicate":false}')
    finally:
        writer.close()


async def test_pipelined_requests_answered_in_order(relay: RunningRelay) -> None:
    r = os.urandom(32)
    path = f"/v1/queues/{b64encode(r)}/messages"
    requests = b"".join(enqueue_request(r, b"m%d" % i) for i in range(20))
    requests += f"GET {path}?limit=100 HTTP/1.1\r\nHost: relay\r\n\r\n".encode()
    requests += enqueue_request(r, b"after")
    answers, was_closed = await exchange(relay, requests, 22)
    assert [a.body for a in answers[:20]] == [b'{"seq":%d,"duplicate":false}' % (i + 1) for i in range(20)]
    assert answers[20].status == 200
    assert answers[20].body.count(b'"seq"') == 20
    assert answers[21].body == b'{"seq":21,"duplicate":false}'
    assert not was_closed


async def test_request_split_byte_by_byte(relay: RunningRelay) -> None:
    r = os.urandom(32)
    raw = enqueue_request(r, b"dribbled", extra="Idempotency-Key: k\r\n") * 2
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        for i in range(len(raw)):
            writer.write(raw[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        answers = [await read_answer(reader) for _ in range(2)]
        assert [(a.status, a.body) for a in answers] == [
            (201, b'{"seq":1,"duplicate":false}'),
            (200, b'{"seq":1,"duplicate":true}'),
        ]
        assert protocols(relay) == [FastConnection]
    finally:
        writer.close()


async def test_header_timeout_on_the_fast_path(redis_server: LocalRedis, relay_factory: RelayFactory) -> None:
    relay = await relay_factory(redis_server.url, header_timeout_s=0.5)
    before = metrics.REGISTRY.get_sample_value("relayfleet_header_timeouts_total") or 0.0
    raw = enqueue_request(os.urandom(32))
    # at connect: a partial head never completed
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    writer.write(raw[:30])
    started = time.monotonic()
    assert await closed(reader, 3)
    assert 0.4 < time.monotonic() - started < 2
    writer.close()
    # at a new request's first byte, after an answered one, once the first timer went by
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    writer.write(raw)
    assert (await read_answer(reader)).status == 201
    await asyncio.sleep(0.7)
    writer.write(raw[:30])
    started = time.monotonic()
    assert await closed(reader, 3)
    assert 0.4 < time.monotonic() - started < 2
    writer.close()
    assert (metrics.REGISTRY.get_sample_value("relayfleet_header_timeouts_total") or 0.0) == before + 2


async def test_keepalive_timeout_on_the_fast_path(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url, keepalive_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(enqueue_request(os.urandom(32)))
        assert (await read_answer(reader)).status == 201
        started = time.monotonic()
        assert await closed(reader, 3)
        assert 0.4 < time.monotonic() - started < 2
    finally:
        writer.close()


def requests_counted(status: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "relayfleet_http_requests_total",
        {"route": "/v1/queues/{recipient}/messages", "method": "POST", "status": status},
    )
    return value or 0.0


async def test_client_leaving_before_redis_answers(relay: RunningRelay, redis_server: LocalRedis) -> None:
    r = os.urandom(32)
    enqueued = metrics.MESSAGES.labels("enqueued").value
    answered = requests_counted("201")
    admin = redis.Redis.from_url(redis_server.url)
    try:
        admin.client_pause(600, all=False)  # write commands (the enqueue) wait in Redis
        _reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
        writer.write(enqueue_request(r, b"orphan"))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()  # gone before Redis answered
        # the pause (0.6 s) ends and the script runs: counted once
        assert await wait_until(lambda: metrics.MESSAGES.labels("enqueued").value == enqueued + 1, 10.0)
    finally:
        admin.close()
    async with relay.client() as c:
        batch = await c.read(r)
    assert [(m.seq, m.payload) for m in batch.messages] == [(1, b"orphan")]  # stored once
    assert metrics.MESSAGES.labels("enqueued").value == enqueued + 1
    assert requests_counted("201") == answered + 1


async def test_switch_off_serves_everything_with_aiohttp(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url, http_fastpath=False)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(enqueue_request(os.urandom(32)))
        assert (await read_answer(reader)).status == 201
        assert protocols(relay) == [GuardedRequestHandler]
    finally:
        writer.close()


async def test_shutdown_writes_the_answers_owed(relay: RunningRelay, redis_server: LocalRedis) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    try:
        admin.client_pause(500, all=False)  # the enqueue is still in Redis when shutdown starts
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
        writer.write(enqueue_request(os.urandom(32), b"last"))
        await writer.drain()
        await asyncio.sleep(0.1)
        closing = asyncio.create_task(relay.server.close())
        answer = await read_answer(reader)
        assert (answer.status, answer.body) == (201, b'{"seq":1,"duplicate":false}')
        assert await closed(reader, 3)
        await closing
        writer.close()
    finally:
        admin.close()


# -- reads (long-polls) on the fast path ------------------------------------------------


def read_request(recipient: bytes, query: str = "", extra: str = "") -> bytes:
    path = f"/v1/queues/{b64encode(recipient)}/messages{query}"
    return f"GET {path} HTTP/1.1\r\nHost: relay\r\n{extra}\r\n".encode()


def seeded(n: int) -> Callable[[bytes], bytes]:
    """Enqueues of n messages, then (the caller adds) requests on the same connection."""
    return lambda r: b"".join(enqueue_request(r, b"m%d" % i, extra=BEARER) for i in range(n))


# name -> (requests for a recipient, answers expected)
READ_CASES: dict[str, tuple[Callable[[bytes], bytes], int]] = {
    "empty queue": (lambda r: read_request(r), 1),
    "backlog": (lambda r: seeded(3)(r) + read_request(r), 4),
    "limit and fromSeq": (lambda r: seeded(3)(r) + read_request(r, "?fromSeq=2&limit=1"), 4),
    "params in another order": (lambda r: seeded(2)(r) + read_request(r, "?limit=5&wait=0&fromSeq=0"), 3),
    "channel": (
        lambda r: (
            enqueue_request(r, b"c", extra=BEARER, query="?channel=" + b64encode(b"ch"))
            + read_request(r, "?channel=" + b64encode(b"ch"))
        ),
        2,
    ),
    "long-poll times out": (lambda r: read_request(r, "?wait=0.3"), 1),
    "long-poll then an enqueue behind it": (
        lambda r: read_request(r, "?wait=0.3") + enqueue_request(r, b"after", extra=BEARER),
        2,
    ),
    "bad fromSeq": (lambda r: read_request(r, "?fromSeq=-1"), 1),
    "bad limit": (lambda r: read_request(r, "?limit=0"), 1),
    "huge limit": (lambda r: seeded(1)(r) + read_request(r, "?limit=99999999999999999999999"), 2),
    "bad wait": (lambda r: read_request(r, "?wait=1e3"), 1),
    "bad recipient": (lambda r: read_request(r[:31]), 1),
    "bad channel": (lambda r: read_request(r, "?channel=" + b64encode(b"c" * 65)), 1),
    "empty values": (lambda r: read_request(r, "?fromSeq=&limit=&wait=&channel="), 1),
    "unknown parameter": (lambda r: read_request(r, "?wait=0&x=1"), 1),
    "parameter twice": (lambda r: seeded(2)(r) + read_request(r, "?limit=1&limit=2"), 3),
    "escaped value": (lambda r: read_request(r, "?wait=%30"), 1),
    "with a body": (lambda r: read_request(r, extra="Content-Length: 2\r\n") + b"{}", 1),
    "connection close": (lambda r: read_request(r, extra="Connection: close\r\n"), 1),
}


@pytest.mark.parametrize("case", sorted(READ_CASES))
async def test_fast_path_reads_as_aiohttp_does(both: tuple[RunningRelay, RunningRelay], case: str) -> None:
    fast, slow = both
    requests, count = READ_CASES[case]
    r = os.urandom(32)
    results = []
    for relay in (fast, slow):  # each its own queue: epochs and times differ, compared without
        results.append(await exchange(relay, requests(os.urandom(32) if relay is slow else r), count))
    (fast_answers, fast_closed), (slow_answers, slow_closed) = results

    def comparable(a: Answer) -> tuple[int, list[tuple[str, str]], bytes]:
        status, headers, body = a.comparable()
        body = re.sub(rb'"epoch":"[0-9a-f]+"', b'"epoch":"E"', body)
        body = re.sub(rb'"receivedAt":"[^"]+"', b'"receivedAt":"T"', body)
        return status, headers, body

    assert [comparable(a) for a in fast_answers] == [comparable(a) for a in slow_answers]
    assert fast_closed == slow_closed


def waiters() -> float:
    return metrics.REGISTRY.get_sample_value("relayfleet_waiters") or 0.0


async def wait_until(check: Callable[[], bool], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_long_poll_woken_on_the_fast_path(relay: RunningRelay) -> None:
    r = os.urandom(32)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        for seq in (1, 2, 3):
            writer.write(read_request(r, f"?wait=5&fromSeq={seq}"))
            assert await wait_until(lambda: waiters() == 1)
            answers, _ = await exchange(relay, enqueue_request(r, b"m%d" % seq))
            assert answers[0].status == 201
            got = await read_answer(reader)
            assert got.status == 200
            assert b'"seq":%d,"payload":"%s"' % (seq, b64encode(b"m%d" % seq).encode()) in got.body
            assert b'"nextSeq":%d' % (seq + 1) in got.body
            assert protocols(relay)[:1] == [FastConnection]  # served here, never handed over
        assert await wait_until(lambda: waiters() == 0)
    finally:
        writer.close()


async def test_woken_long_poll_answered_from_the_carried_message(
    relay: RunningRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the enqueue's wakeup carries the message to this process's long-poll, which returns it
    # from its task (one read of Redis: the one before it waited), then the enqueue is answered
    reads: list[int | None] = []
    read = ShardStore.read

    async def counted(store: ShardStore, keys: Any, from_seq: int | None, limit: int) -> ReadResult:
        reads.append(from_seq)
        return await read(store, keys, from_seq, limit)

    monkeypatch.setattr(ShardStore, "read", counted)
    r = os.urandom(32)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(read_request(r, "?wait=5"))
        assert await wait_until(lambda: waiters() == 1)
        answers, _ = await exchange(relay, enqueue_request(r, b"first"))
        assert answers[0].status == 201
        got = await read_answer(reader)
        assert b'"seq":1,"payload":"%s"' % b64encode(b"first").encode() in got.body
        assert reads == [None]
    finally:
        writer.close()


async def test_a_waiting_long_poll_holds_no_connection_timer(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    # 10,000 long-polls opened together used to fire their header timers in one loop turn
    relay = await relay_factory(redis_server.url, header_timeout_s=0.3)
    r = os.urandom(32)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(read_request(r, "?wait=5"))
        assert await wait_until(lambda: waiters() == 1)
        guard = server_of(relay).guard
        assert list(guard.pending) == []  # the header timer is off while it waits
        await asyncio.sleep(0.5)  # past the header timeout: the long-poll is not closed
        answers, _ = await exchange(relay, enqueue_request(r, b"late"))
        assert answers[0].status == 201
        got = await read_answer(reader)
        assert b'"seq":1' in got.body
        writer.write(b"GET /v1/queues/")  # the next request's first bytes arm it again
        assert await wait_until(lambda: len(guard.pending) == 1)
        assert await closed(reader, 2.0)  # and it fires: a head never completed is closed
    finally:
        writer.close()


async def test_woken_long_poll_answered_as_the_enqueue_reply_arrives(
    relay: RunningRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The long-poll's answer is written from inside the enqueue's Redis reply (FastConnection
    _Woken, before its task resumes), from its message's text made while Redis stored it
    (bulk.Prepared), with the bytes its task would have written."""
    woken: list[bool] = []
    matched: list[bool] = []
    original = _Woken.__call__
    matches = bulk.Prepared.matches

    def spy(self: _Woken, *args: Any) -> bool:
        answered = original(self, *args)
        woken.append(answered)
        return answered

    def spy_matches(self: bulk.Prepared, *args: Any) -> bool:
        matched.append(matches(self, *args))
        return matched[-1]

    monkeypatch.setattr(_Woken, "__call__", spy)
    monkeypatch.setattr(bulk.Prepared, "matches", spy_matches)
    r = os.urandom(32)
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(read_request(r, "?wait=10"))
        hub = next(iter(relay.fleet.hubs.values()))
        # parked: registered, read (empty), and sleeping in Waiter.wait
        assert await wait_until(lambda: any(w._fut for c in hub._channels.values() for w in c.waiters))
        answers, _ = await exchange(relay, enqueue_request(r, b"wake"))
        assert answers[0].status == 201
        got = await read_answer(reader)
        assert woken == [True]
        assert matched == [True]
        again, _ = await exchange(relay, read_request(r))  # what a plain read answers
        assert (got.status, got.body) == (200, again[0].body)
        assert b'"seq":1' in got.body
    finally:
        writer.close()


@pytest.mark.parametrize(
    "body", [b"", b"{}", b'{"messages":[],"nextSeq":1,"epoch":"e"}', bytes(range(256)) * 300]
)
def test_a_woken_long_polls_answer_is_reply_bytes(body: bytes) -> None:
    """ok_json_bytes (the woken long-poll's answer in one format) writes what reply_bytes
    writes for the same 200 JSON answer (the Date of the same second)."""
    for _ in range(3):  # a second may turn between the two: one of three calls is in one
        if ok_json_bytes(body) == reply_bytes(Reply(200, body)):
            return
    raise AssertionError(ok_json_bytes(body)[:200])


async def test_long_poll_whose_client_leaves_stops_waiting(relay: RunningRelay) -> None:
    # the gauge is the process's: a long-poll answered as its wakeup arrived leaves its wait (and
    # the gauge) when its task next runs, which may be after its client read the answer
    assert await wait_until(lambda: waiters() == 0)
    _reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    writer.write(read_request(os.urandom(32), "?wait=60"))
    assert await wait_until(lambda: waiters() == 1)
    writer.close()
    assert await wait_until(lambda: waiters() == 0, 2.0)  # at once, not after 60 s


async def test_shutdown_answers_long_polls(relay: RunningRelay) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(relay))
    try:
        writer.write(read_request(os.urandom(32), "?wait=60"))
        assert await wait_until(lambda: waiters() == 1)
        begin_shutdown(relay.app)  # what the relay does on SIGTERM, then it closes the server
        closing = asyncio.create_task(relay.server.close())
        answer = await read_answer(reader)
        assert answer.status == 200
        assert answer.body.startswith(b'{"messages":[],"nextSeq":1,')
        assert await closed(reader, 3)
        await closing
    finally:
        writer.close()


async def test_big_read_streamed_as_aiohttp_does(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    fast = await relay_factory(redis_server.url, http_fastpath=True, max_payload=200_000)
    slow = await relay_factory(redis_server.url, http_fastpath=False, max_payload=200_000)
    bodies = []
    for relay in (fast, slow):
        r = os.urandom(32)
        seed = b"".join(enqueue_request(r, bytes([65 + i]) * 150_000) for i in range(3))
        answers, _ = await exchange(relay, seed + read_request(r, "?limit=3"), 4)
        assert [a.status for a in answers] == [201, 201, 201, 200]
        body = re.sub(rb'"epoch":"[0-9a-f]+"', b"E", answers[3].body)
        bodies.append(re.sub(rb'"receivedAt":"[^"]+"', b"T", body))
    assert len(bodies[0]) > 3 * 200_000
    assert bodies[0] == bodies[1]


async def test_signed_reads_as_aiohttp_does(redis_server: LocalRedis, relay_factory: RelayFactory) -> None:
    fast = await relay_factory(redis_server.url, http_fastpath=True, auth="ed25519")
    slow = await relay_factory(redis_server.url, http_fastpath=False, auth="ed25519")
    outcomes = []
    for relay in (fast, slow):
        public, private = keypair()
        path = f"/v1/queues/{b64encode(public)}/messages?wait=0.1"
        signed = "".join(f"{k}: {v}\r\n" for k, v in sign_headers(private, "GET", path).items())
        other = "".join(f"{k}: {v}\r\n" for k, v in sign_headers(private, "GET", path + "&limit=1").items())
        requests = (
            f"GET {path} HTTP/1.1\r\nHost: relay\r\n{signed}\r\n"  # good
            f"GET {path} HTTP/1.1\r\nHost: relay\r\n{signed}\r\n"  # the same nonce again
            f"GET {path} HTTP/1.1\r\nHost: relay\r\n{other}\r\n"  # signed for another query
            f"GET {path} HTTP/1.1\r\nHost: relay\r\n\r\n"  # unsigned
        ).encode()
        answers, _ = await exchange(relay, requests, 4)
        outcomes.append([(a.status, re.sub(rb'"epoch":"[0-9a-f]+"', b"E", a.body)) for a in answers])
    assert [status for status, _ in outcomes[0]] == [200, 401, 401, 401]
    assert outcomes[0] == outcomes[1]


async def test_pipelined_read_waits_for_the_enqueues_before_it(
    redis_server: LocalRedis, relay_factory: RelayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read pipelined behind enqueues starts only once they are answered: reads go over the
    shard's bulk lane, another Redis connection than the enqueues' (a slow enqueue, here held
    back 0.3 s before it is written, would otherwise be overtaken: the read found nothing)."""
    relay = await relay_factory(redis_server.url)
    original = ShardStore.enqueue_to

    def slow_enqueue_to(self: ShardStore, *args: Any, **kwargs: Any) -> bytes:
        asyncio.get_running_loop().call_later(0.3, partial(original, self, *args, **kwargs))
        return b""

    monkeypatch.setattr(ShardStore, "enqueue_to", slow_enqueue_to)
    r = os.urandom(32)
    requests = seeded(2)(r) + read_request(r) + enqueue_request(r, b"after") + read_request(r, "?fromSeq=3")
    answers, _ = await exchange(relay, requests, 5)
    assert [a.status for a in answers] == [201, 201, 200, 201, 200]
    assert [m["payload"] for m in json.loads(answers[2].body)["messages"]] == ["bTA", "bTE"]
    assert [m["payload"] for m in json.loads(answers[4].body)["messages"]] == ["YWZ0ZXI"]


async def test_requests_wait_for_an_admitted_enqueue_as_aiohttp_does(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    """A non-default channel's enqueue takes its recipient's admit round trip first: the
    requests pipelined behind it start once it is answered, as on aiohttp's path (a default
    channel's enqueue behind it would take the recipient's one message a window first)."""
    limits = QueueLimits(recipient_rate_count=1, rate_window_ms=60_000)
    fast = await relay_factory(redis_server.url, http_fastpath=True, limits=limits)
    slow = await relay_factory(redis_server.url, http_fastpath=False, limits=limits)
    channel = "?channel=" + b64encode(b"ch")
    outcomes = []
    for relay in (fast, slow):
        r = os.urandom(32)
        requests = enqueue_request(r, b"first", query=channel) + enqueue_request(r, b"second")
        answers, _ = await exchange(relay, requests + read_request(r, channel), 3)
        outcomes.append(
            [(a.status, re.sub(rb'"(epoch|receivedAt)":"[^"]+"', b"X", a.comparable()[2])) for a in answers]
        )
    assert [status for status, _ in outcomes[0]] == [201, 429, 200]
    assert b"recipient_rate_limited" in outcomes[0][1][1]
    assert outcomes[0] == outcomes[1]


async def test_enqueue_then_client_quota_handoff_then_read(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    """An enqueue over the per-client quota is handed to aiohttp (which answers the 429) only
        once the answers owed before it are written (the fast path never answers that 429 itself):
    the read behind it sees the stored message."""
    quota = {"client_rate_messages": 1, "client_rate_window_ms": 60_000}
    fast = await relay_factory(redis_server.url, http_fastpath=True, **quota)
    slow = await relay_factory(redis_server.url, http_fastpath=False, **quota)
    channel = "?channel=" + b64encode(b"ch")
    outcomes = []
    for relay in (fast, slow):
        r = os.urandom(32)
        requests = enqueue_request(r, b"kept", query=channel) + enqueue_request(r, b"over", query=channel)
        answers, _ = await exchange(relay, requests + read_request(r, channel), 3)
        outcomes.append(
            [(a.status, re.sub(rb'"(epoch|receivedAt)":"[^"]+"', b"X", a.comparable()[2])) for a in answers]
        )
    assert [status for status, _ in outcomes[0]] == [201, 429, 200]
    assert b"client_rate_limited" in outcomes[0][1][1]
    assert b'"payload":"a2VwdA"' in outcomes[0][2][1]
    assert outcomes[0] == outcomes[1]
