"""Storage-side attacks: huge reads beside small writes, the response byte budget, reads of
queues that do not exist, and a Redis reply that never comes for a stored message.

Each attack runs against `relayfleet relay` subprocesses on a real /usr/bin/redis-server
(tests/hostile/harness.py). Measured figures are printed as `HOSTILE <attack>: ...` lines
(docs/reliability.md, hostile table).
"""

from __future__ import annotations

import asyncio
import copy
import io
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis

from relay.protocol import b64decode
from tests.hostile.harness import (
    NO_CLIENT_QUOTA,
    Relay,
    RelayWith,
    recipient,
    report,
    start_redis,
    start_relay,
)
from tests.support.tcp_proxy import tcp_proxy

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
BUDGET = 8 * MiB  # RELAY_MAX_RESPONSE_BYTES default (docs/api.md)


async def _enqueue(
    s: aiohttp.ClientSession, relay: Relay, r: str, payload: bytes, **headers: str
) -> tuple[int, dict[str, Any]]:
    body = io.BytesIO(payload)  # aiohttp warns about large raw bytes bodies
    async with s.post(f"{relay.url}/v1/queues/{r}/messages", data=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def _get(s: aiohttp.ClientSession, url: str, method: str = "GET", **kw: Any) -> tuple[int, Any]:
    async with s.request(method, url, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


def _payloads(doc: dict[str, Any]) -> list[int]:
    return [len(b64decode(m["payload"])) for m in doc["messages"]]


def _fill(n: int, size: int, tag: int) -> bytes:
    return bytes([tag % 256]) * size


@asynccontextmanager
async def rss_peak(relay: Relay, every_s: float = 0.02) -> AsyncIterator[list[int]]:
    """Samples the relay's RSS while the block runs: [baseline, peak] in bytes."""
    out = [relay.rss_bytes(), relay.rss_bytes()]

    async def sample() -> None:
        while True:
            out[1] = max(out[1], relay.rss_bytes())
            await asyncio.sleep(every_s)

    task = asyncio.get_running_loop().create_task(sample())
    try:
        yield out
    finally:
        task.cancel()
        out[1] = max(out[1], relay.rss_bytes())


# -- isolation: huge reads beside small writes -------------------------------------------


def _get_blocking(sock: socket.socket, path: str) -> tuple[int, bytes]:
    """One keep-alive GET on a blocking socket: (status, body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: relay\r\n\r\n".encode())
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(1 << 16)
        assert chunk, "connection closed"
        buf += chunk
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in lines[1:])
    length = next(int(v) for k, _, v in fields if k.lower() == "content-length")
    out = bytearray(length)
    out[: len(body)] = body
    view, got = memoryview(out), len(body)
    while got < length:
        n = sock.recv_into(view[got:], length - got)
        assert n, "connection closed"
        got += n
    return int(lines[0].split()[1]), bytes(out)


async def test_concurrent_big_reads_do_not_delay_a_victims_small_enqueues(relay_with: RelayWith) -> None:
    """Three readers loop over a queue of 24 x 5 MiB (default limit) while a victim enqueues
    small messages to its own queue: the victim's p99 stays under 250 ms, no 5xx anywhere,
    and no read carries more than 8 MiB of payload."""
    relay = relay_with(NO_CLIENT_QUOTA)
    big, victim = recipient(1401), recipient(1402)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for i in range(24):
            status, doc = await _enqueue(s, relay, big, _fill(1, 5 * MiB, i))
            assert status == 201, doc
        stop = threading.Event()
        read_statuses: list[int] = []
        read_bytes: list[int] = []

        def reader() -> None:
            # a thread on blocking sockets (the GIL is free while it waits): the attacker's
            # work must not slow the test's own loop, which times the victim
            first = True
            with socket.create_connection((relay.host, relay.port)) as sock:
                while not stop.is_set():
                    status, body = _get_blocking(sock, f"/v1/queues/{big}/messages")
                    read_statuses.append(status)
                    if first:
                        read_bytes.append(sum(_payloads(orjson.loads(body))))
                        first = False

        latencies: list[float] = []
        statuses: list[int] = []
        async with rss_peak(relay) as rss:
            readers = [threading.Thread(target=reader, daemon=True) for _ in range(3)]
            for t in readers:
                t.start()
            await asyncio.sleep(0.3)  # the readers are in full swing
            for i in range(200):
                t0 = time.monotonic()
                status, _doc = await _enqueue(s, relay, victim, b"victim-%d" % i)
                latencies.append(time.monotonic() - t0)
                statuses.append(status)
                await asyncio.sleep(0.01)
            stop.set()
            for t in readers:
                t.join(30)
    overload = os.getloadavg()[0] / (os.cpu_count() or 1)
    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99) - 1]
    report(
        "big-reads-vs-small-writes",
        reads=len(read_statuses),
        victim_p50_ms=round(p50 * 1000, 1),
        victim_p99_ms=round(p99 * 1000, 1),
        victim_max_ms=round(latencies[-1] * 1000, 1),
        read_payload_mib=[round(b / MiB, 1) for b in read_bytes],
        rss_growth_mib=round((rss[1] - rss[0]) / MiB, 1),
        load_per_core=round(overload, 1),
    )
    assert statuses == [201] * len(statuses)
    assert read_statuses
    assert all(st == 200 for st in read_statuses)
    assert read_bytes
    assert all(0 < b <= BUDGET for b in read_bytes)
    # The target is 250 ms. On a machine running more than twice as many runnable tasks
    # as it has cores, Redis itself gets a fraction of a core and every script stalls
    # several-fold; the bound is then 1 s, which still catches the failure this test
    # was written for (5.4 s waits and 503s behind one shared connection).
    bound = 0.25 if overload < 2 else 1.0
    assert p99 < bound, f"victim p99 {p99 * 1000:.0f} ms (load per core {overload:.1f})"


# -- the response payload budget ----------------------------------------------------------

# Mixed sizes: each page is at most 8 MiB, at least one message, and ends where the rest
# of the budget is below the sizes Redis expects next (_prelude.lua read_budget).
SIZES = [5 * MiB, 5 * MiB, MiB, MiB, MiB, 5 * MiB]
PAGES = [[1], [2, 3], [4, 5, 6]]  # the reads' pages (a drain's depend on what is left)


async def test_read_and_drain_carry_at_most_8_mib_and_continue_by_next_seq(relay_with: RelayWith) -> None:
    relay = relay_with(NO_CLIENT_QUOTA)
    r = recipient(1411)
    async with aiohttp.ClientSession() as s:
        for i, size in enumerate(SIZES):
            assert (await _enqueue(s, relay, r, _fill(1, size, i)))[0] == 201
        base = f"{relay.url}/v1/queues/{r}"
        pages: list[list[int]] = []
        next_seq: int | None = None
        while True:
            url = f"{base}/messages" + (f"?fromSeq={next_seq}" if next_seq else "")
            status, doc = await _get(s, url)
            assert status == 200, doc
            if not doc["messages"]:
                break
            assert sum(_payloads(doc)) <= BUDGET
            pages.append([m["seq"] for m in doc["messages"]])
            assert doc["nextSeq"] == pages[-1][-1] + 1
            next_seq = doc["nextSeq"]
        assert pages == PAGES
        # limit still applies inside the budget
        status, doc = await _get(s, f"{base}/messages?fromSeq=3&limit=2")
        assert [m["seq"] for m in doc["messages"]] == [3, 4]

        drained: list[list[int]] = []
        left: list[int] = []
        while True:
            status, doc = await _get(s, f"{base}/drain", method="POST")
            assert status == 200, doc
            assert sum(_payloads(doc)) <= BUDGET
            drained.append([m["seq"] for m in doc["messages"]])
            _st, st = await _get(s, f"{base}/status")
            left.append(st["message_count"])
            if not doc["more"]:
                break
        # drain removes exactly what it returned: the rest stays
        assert [seq for page in drained for seq in page] == [1, 2, 3, 4, 5, 6]
        assert all(drained)
        assert drained[0] == [1]  # 5 MiB + 5 MiB would pass the budget
        assert left == [6 - sum(len(p) for p in drained[: i + 1]) for i in range(len(drained))]
        report("response-budget", read_pages=pages, drain_pages=drained, left_after_each_drain=left)


async def test_a_message_larger_than_the_budget_is_still_returned_alone(relay_with: RelayWith) -> None:
    relay = relay_with({"RELAY_MAX_RESPONSE_BYTES": str(MiB), **NO_CLIENT_QUOTA})
    r = recipient(1412)
    async with aiohttp.ClientSession() as s:
        for i in range(3):
            assert (await _enqueue(s, relay, r, _fill(1, 2 * MiB, i)))[0] == 201
        _status, doc = await _get(s, f"{relay.url}/v1/queues/{r}/messages")
        assert [m["seq"] for m in doc["messages"]] == [1]
        assert doc["nextSeq"] == 2
        _status, doc = await _get(s, f"{relay.url}/v1/queues/{r}/drain?limit=100", method="POST")
        assert [m["seq"] for m in doc["messages"]] == [1]
        assert doc["more"] is True
        _st, st = await _get(s, f"{relay.url}/v1/queues/{r}/status")
        assert st["message_count"] == 2


async def test_live_backlog_of_big_messages_is_sent_in_budgeted_batches(relay_with: RelayWith) -> None:
    """12 x 5 MiB through a live WebSocket: all arrive in order and the relay never holds
    more than a budget's batch (before: 16 messages per batch, ~80 MiB + their copies)."""
    relay = relay_with(NO_CLIENT_QUOTA)
    r = recipient(1413)
    async with aiohttp.ClientSession() as s:
        for i in range(12):
            assert (await _enqueue(s, relay, r, _fill(1, 5 * MiB, i)))[0] == 201
        seqs: list[int] = []
        async with (
            rss_peak(relay) as rss,
            s.ws_connect(f"{relay.url.replace('http', 'ws')}/v1/queues/{r}/live", max_msg_size=0) as ws,
        ):
            while True:
                msg = await ws.receive_json(timeout=30)
                if msg["type"] == "empty":
                    break
                assert msg["type"] == "message"
                assert len(b64decode(msg["payload"])) == 5 * MiB
                seqs.append(msg["seq"])
    growth = rss[1] - rss[0]
    report("live-big-backlog", messages=len(seqs), rss_growth_mib=round(growth / MiB, 1))
    assert seqs == list(range(1, 13))
    assert growth < 64 * MiB, f"relay RSS grew {growth / MiB:.0f} MiB"


# -- unknown queues create nothing -------------------------------------------------------


async def test_reads_of_unknown_queues_create_no_redis_state(relay_with: RelayWith) -> None:
    relay = relay_with(NO_CLIENT_QUOTA)
    db = redis.Redis.from_url(relay.redis.url)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=50)) as s:
            # the relay's own keys (boot record, ...) exist before the attack
            assert (await _enqueue(s, relay, recipient(1420), b"warm-up"))[0] == 201
            before = set(db.scan_iter(count=1000))
            # keys with a TTL (the warm-up's rate-limit window, 5 s) may expire on a slow run
            expiring = {k for k in before if db.pttl(k) > 0}

            async def attack(i: int) -> list[int]:
                r = recipient(1_000_000 + i)
                base = f"{relay.url}/v1/queues/{r}"
                inbox = {"X-Inbox-ID": f"unknown-inbox-{i}"}
                calls = [
                    _get(s, f"{base}/messages"),
                    _get(s, f"{base}/messages?fromSeq=7&limit=5"),
                    _get(s, f"{base}/messages?wait=0.05"),
                    _get(s, f"{base}/status"),
                    _get(s, f"{base}/drain", method="POST"),
                    _get(s, f"{base}/ack", method="POST", json={"upToSeq": 9}),
                    _get(s, f"{relay.url}/v1/inbox/messages", headers=inbox),
                ]
                return [status for status, _doc in await asyncio.gather(*calls)]

            statuses = [st for sts in await asyncio.gather(*[attack(i) for i in range(200)]) for st in sts]
            after = set(db.scan_iter(count=1000))
            # an unknown queue answers one epoch everywhere, and its first message keeps it
            r = recipient(1421)
            _st, read = await _get(s, f"{relay.url}/v1/queues/{r}/messages")
            _st, status = await _get(s, f"{relay.url}/v1/queues/{r}/status")
            assert read["epoch"]
            assert read["epoch"] == status["epoch"]
            assert (read["nextSeq"], status["nextSeq"], status["message_count"]) == (1, 1, 0)
            assert (await _enqueue(s, relay, r, b"first"))[0] == 201
            _st, again = await _get(s, f"{relay.url}/v1/queues/{r}/messages")
            assert again["epoch"] == read["epoch"]
    finally:
        db.close()
    report("unknown-queue-reads", requests=len(statuses), keys_before=len(before), keys_after=len(after))
    assert set(statuses) == {200}
    assert after - before == set(), "reads of unknown queues created keys"
    assert before - after <= expiring, "keys without a TTL vanished"


# -- a reply that never comes for a stored message ---------------------------------------


@contextmanager
def _relay_behind_proxy(tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[Relay, Any, Any]]:
    server = start_redis()
    try:
        with tcp_proxy(server.port) as proxy:
            via = copy.copy(server)
            via.port = proxy.port  # the relay's Redis URL points at the proxy
            relay = start_relay(via, tmp_path / "relay", env)
            try:
                yield relay, proxy, server
            finally:
                relay.stop()
    finally:
        server.stop()


def _held(server: Any, r: str) -> list[bytes]:
    from relay.protocol import b64decode as dec
    from relay.storage import keys as K

    db = redis.Redis.from_url(server.url)
    try:
        q = K.queue_keys(dec(r), b"")
        entries: list[tuple[bytes, dict[bytes, bytes]]] = db.xrange(q.msgs)  # type: ignore[assignment]
        return [fields[b"p"] for _id, fields in entries]
    finally:
        db.close()


async def test_lost_reply_of_a_stored_enqueue_answers_its_seq_once(tmp_path: Path) -> None:
    """Redis stores the message but its reply is held past the write deadline (the
    connection is then aborted): the relay resends with the attempt's token and answers
    201 with the seq Redis gave the first time; the queue holds it once."""
    env = {"RELAY_REDIS_WRITE_TIMEOUT_S": "0.5"}
    with _relay_behind_proxy(tmp_path, env) as (relay, proxy, server):
        r = recipient(1431)
        async with aiohttp.ClientSession() as s:
            assert (await _enqueue(s, relay, r, b"before"))[0] == 201
            proxy.cut("mute")
            t0 = time.monotonic()
            task = asyncio.get_running_loop().create_task(_enqueue(s, relay, r, b"lost-reply"))
            await asyncio.sleep(1.5)  # past the 0.5 s deadline: the first connection is gone
            assert _held(server, r) == [b"before", b"lost-reply"]  # Redis did store it
            proxy.restore()
            status, doc = await task
            took = time.monotonic() - t0
            assert (status, doc) == (201, {"seq": 2, "duplicate": False})
            assert (await _enqueue(s, relay, r, b"after"))[0] == 201
        assert _held(server, r) == [b"before", b"lost-reply", b"after"]
    report("lost-enqueue-reply", status=status, seq=doc["seq"], answered_after_s=round(took, 2), copies=1)


async def test_lost_reply_past_the_window_is_503_and_a_keyed_retry_is_a_duplicate(tmp_path: Path) -> None:
    """Redis unreachable past the resend window: the sender gets 503 (the outcome is
    unknown), and its retry with the same Idempotency-Key answers 200 with the first seq:
    retry-safe, never a second copy (docs/reliability.md)."""
    env = {"RELAY_REDIS_WRITE_TIMEOUT_S": "0.5", "RELAY_RATE_WINDOW_MS": "2000"}
    with _relay_behind_proxy(tmp_path, env) as (relay, proxy, server):
        r = recipient(1432)
        async with aiohttp.ClientSession() as s:
            assert (await _enqueue(s, relay, r, b"before"))[0] == 201
            proxy.cut("mute")
            status, doc = await _enqueue(s, relay, r, b"keyed", **{"Idempotency-Key": "k-1432"})
            assert status == 503, doc
            assert _held(server, r) == [b"before", b"keyed"]
            proxy.restore()
            deadline = time.monotonic() + 10
            while True:
                status, doc = await _enqueue(s, relay, r, b"keyed", **{"Idempotency-Key": "k-1432"})
                if status != 503 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert (status, doc) == (200, {"seq": 2, "duplicate": True})
        assert _held(server, r) == [b"before", b"keyed"]
    report("lost-enqueue-reply-past-window", first_status=503, retry_status=status, copies=1)
