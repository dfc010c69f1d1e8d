"""Slow and oversize input: slowloris bodies, huge request lines and headers.

Shows: a body that trickles in is cut off with 408 once RELAY_BODY_TIMEOUT_S passes
(nothing stored); oversize request lines and headers get 4xx from aiohttp's parser
limits before any handler runs; a crowd of slow senders leaves the relay serving
others promptly, and its memory stays bounded.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis

from tests.support.faults import call, report, start_relay, stop_relay
from tests.support.fleet_harness import DEBIAN_REDIS, make_queues

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

BODY_TIMEOUT_S = 2.0
SLOW_SENDERS = 60


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _status_line(reader: asyncio.StreamReader, limit_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    line = await asyncio.wait_for(reader.readline(), limit_s)
    parts = line.split()
    return (int(parts[1]) if len(parts) > 1 else 0), time.monotonic() - t0


async def _slow_sender(port: int, path: str, declared: int, stop: asyncio.Event) -> tuple[int, float]:
    """Headers, then one body byte every 0.3 s; returns (status, seconds until answered)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {declared}\r\n\r\n".encode()
        )
        await writer.drain()
        answer = asyncio.ensure_future(_status_line(reader, BODY_TIMEOUT_S + 10))
        while not answer.done() and not stop.is_set():
            try:
                writer.write(b"x")
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.wait([answer], timeout=0.3)
        return await answer
    finally:
        writer.close()


async def test_slow_bodies_and_oversize_headers_are_rejected(tmp_path: Path) -> None:
    redis = LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / "redis")).start()
    # every slow sender announces 1 MB from 127.0.0.1: the client quota (charged by
    # Content-Length at the head) would refuse some before their bodies time out, and this
    # test is about the body timeout
    relay = start_relay(
        tmp_path, redis.url, {"RELAY_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S), "RELAY_CLIENT_RATE_BYTES": "0"}
    )
    q = make_queues(1, seed=61)[0]
    try:
        async with aiohttp.ClientSession() as http:
            status, doc, _h, _t = await call(http, "POST", relay.url + q.path("messages"), b"warm")
            assert status == 201, doc
            rss0 = _rss_kib(relay.proc.pid)
            stop = asyncio.Event()
            slow = [
                asyncio.ensure_future(_slow_sender(relay.port, q.path("messages"), 1_000_000, stop))
                for _ in range(SLOW_SENDERS)
            ]
            await asyncio.sleep(0.5)
            # others are served promptly meanwhile
            status, doc, _h, took = await call(http, "POST", relay.url + q.path("messages"), b"fast")
            assert status == 201, doc
            assert took < 1.0, took
            results = await asyncio.gather(*slow)
            stop.set()
            rss1 = _rss_kib(relay.proc.pid)
            codes = {s for s, _ in results}
            assert codes == {408}, codes
            worst = max(t for _, t in results)
            assert worst < BODY_TIMEOUT_S + 3.0, worst
            # oversize request line and header: rejected by the parser (aiohttp limit 8190 bytes)
            big_line = await _raw(relay.port, f"GET /{'a' * 20000} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            big_header = await _raw(
                relay.port,
                f"GET {q.path('status')} HTTP/1.1\r\nHost: x\r\nX-Big: {'b' * 100_000}\r\n\r\n".encode(),
            )
            many = "".join(f"X-H{i}: v\r\n" for i in range(5000))
            many_headers = await _raw(
                relay.port, f"GET {q.path('status')} HTTP/1.1\r\nHost: x\r\n{many}\r\n".encode()
            )
            for name, st in (("line", big_line), ("header", big_header)):
                assert 400 <= st < 500, (name, st)
            assert many_headers < 500, many_headers
            # nothing from the slow senders was stored: the queue holds exactly the two fast ones
            status, doc, _h, _t = await call(http, "GET", relay.url + q.path("messages"))
            assert [m["seq"] for m in doc["messages"]] == [1, 2], doc
            assert relay.proc.poll() is None
        report(
            "slow-input",
            None,
            slow_senders=SLOW_SENDERS,
            body_timeout_s=BODY_TIMEOUT_S,
            slowest_408_s=round(worst, 2),
            rss_growth_kib=rss1 - rss0,
            oversize_line=big_line,
            oversize_header=big_header,
            many_headers=many_headers,
        )
        assert rss1 - rss0 < 64 * 1024, f"relay RSS grew {rss1 - rss0} KiB"
    finally:
        stop_relay(relay)
        redis.stop()


async def _raw(port: int, data: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        status, _t = await _status_line(reader, 10)
        return status
    finally:
        writer.close()
