"""Live WebSocket attacks: a burst of hundreds of connects then a mass disconnect, and a
client that opens a live connection on a big backlog and never reads.

Against `relayfleet relay` subprocesses on a real /usr/bin/redis-server; figures are
printed as `HOSTILE <attack>: ...` lines (docs/reliability.md, hostile table).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import struct
import time

import aiohttp
import pytest

from tests.hostile.harness import NO_CLIENT_QUOTA, Relay, RelayWith, recipient, report

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
UNHANDLED = (b"Traceback", b"Error handling request", b"exception was never retrieved", b"Unhandled")


async def _metric(s: aiohttp.ClientSession, relay: Relay, name: str) -> float:
    async with s.get(f"{relay.url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _live_flags(s: aiohttp.ClientSession, relay: Relay, queues: list[str]) -> set[bool]:
    async def one(r: str) -> bool:
        async with s.get(f"{relay.url}/v1/queues/{r}/status") as resp:
            return bool((await resp.json())["live_delivery"])

    return set(await asyncio.gather(*[one(r) for r in queues]))


def _assert_no_unhandled(relay: Relay) -> None:
    log = relay.log_bytes()
    found = [u.decode() for u in UNHANDLED if u in log]
    assert not found, f"unhandled errors in the relay log: {found}"


def _upgrade_request(r: str) -> bytes:
    """The WebSocket upgrade of a live connection on queue `r` (RFC 6455 section 4.1)."""
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET /v1/queues/{r}/live HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


async def _frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One frame from the server (RFC 6455 section 5.2: unmasked, unfragmented here): its opcode
    and payload."""
    first, second = await reader.readexactly(2)
    assert not second & 0x80, "a server frame is never masked"
    size = second & 0x7F
    if size == 126:
        size = int.from_bytes(await reader.readexactly(2), "big")
    elif size == 127:
        size = int.from_bytes(await reader.readexactly(8), "big")
    return first & 0x0F, await reader.readexactly(size)


async def _live_until_empty(relay: Relay, r: str) -> tuple[asyncio.StreamWriter, str]:
    """A live connection on queue `r`, spoken by hand, read up to its "empty" marker: its writer
    and "empty", or what the relay answered instead (a refusal's status line, a close frame)."""
    reader, writer = await asyncio.open_connection(relay.host, relay.port)
    writer.write(_upgrade_request(r))
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 101"):
        return writer, head.split(b"\r\n", 1)[0].decode()
    while True:
        opcode, payload = await asyncio.wait_for(_frame(reader), 60)
        if opcode == 0x8:
            return writer, f"closed {int.from_bytes(payload[:2], 'big') if payload else None}"
        if opcode == 0x1 and b'"empty"' in payload:
            return writer, "empty"
        if opcode not in (0x1, 0x9, 0xA):  # text before the marker (the backlog), ping, pong
            return writer, f"opcode {opcode}"


def _reset(writer: asyncio.StreamWriter) -> None:
    """Drop the connection with a TCP reset, no close handshake (SO_LINGER 0, then close)."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_500_live_connects_at_once_then_a_mass_disconnect(relay_with: RelayWith) -> None:
    relay = relay_with()
    queues = [recipient(2_000_000 + i) for i in range(500)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await (await s.post(f"{relay.url}/v1/queues/{queues[0]}/messages", data=b"backlog")).release()
        t0 = time.monotonic()
        opened = await asyncio.gather(*[_live_until_empty(relay, r) for r in queues])
        accept_s = time.monotonic() - t0
        outcomes = [o for _w, o in opened]
        gauge_open = await _metric(s, relay, "relayfleet_live_connections")
        flags_open = await _live_flags(s, relay, queues[:50])
        # the clients drop (a TCP reset each, not a close handshake), one with unread backlog
        for writer, _o in opened:
            _reset(writer)
        t1 = time.monotonic()
        while True:
            gauge = await _metric(s, relay, "relayfleet_live_connections")
            if gauge == 0 or time.monotonic() - t1 > 5:
                break
            await asyncio.sleep(0.05)
        cleaned_s = time.monotonic() - t1
        flags_after = await _live_flags(s, relay, queues)
    report(
        "live-burst-500",
        accepted=outcomes.count("empty"),
        refused=len(outcomes) - outcomes.count("empty"),
        accept_all_s=round(accept_s, 2),
        cleanup_s=round(cleaned_s, 2),
        gauge_after=gauge,
    )
    assert outcomes == ["empty"] * 500, {o for o in outcomes if o != "empty"}
    assert gauge_open == 500
    assert flags_open == {True}
    assert gauge == 0
    assert cleaned_s < 2.0
    assert flags_after == {False}
    _assert_no_unhandled(relay)


def _never_reading_socket(relay: Relay, r: str) -> socket.socket:
    """A live connection on queue `r` whose owner reads the 101 and then never another byte."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((relay.host, relay.port))
    sock.sendall(_upgrade_request(r))
    head = sock.recv(256)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


async def _until_dropped(s: aiohttp.ClientSession, relay: Relay, within_s: float) -> tuple[float | None, int]:
    """(seconds until relayfleet_live_dropped_total counted a drop, peak RSS) while waiting
    for the drop and for the live connection to be gone, at most `within_s`."""
    t0 = time.monotonic()
    dropped_at = None
    peak = relay.rss_bytes()
    while time.monotonic() - t0 < within_s:
        peak = max(peak, relay.rss_bytes())
        if dropped_at is None and await _metric(s, relay, "relayfleet_live_dropped_total") >= 1:
            dropped_at = time.monotonic() - t0
        if dropped_at is not None and await _metric(s, relay, "relayfleet_live_connections") == 0:
            break
        await asyncio.sleep(0.1)
    return dropped_at, peak


async def test_a_live_client_that_never_reads_is_dropped_with_bounded_memory(relay_with: RelayWith) -> None:
    """24 x 5 MiB of backlog to a socket whose owner never reads: the relay holds about
    one budget's batch plus one frame (before: 16 x 5 MiB per socket, forever) and drops
    the client after RELAY_LIVE_SEND_TIMEOUT_S."""
    timeout_s = 3.0
    relay = relay_with({"RELAY_LIVE_SEND_TIMEOUT_S": str(timeout_s), **NO_CLIENT_QUOTA})  # a big backlog
    r = recipient(2100)
    async with aiohttp.ClientSession() as s:
        for i in range(24):
            body = io.BytesIO(bytes([i]) * (5 * MiB))
            async with s.post(f"{relay.url}/v1/queues/{r}/messages", data=body) as resp:
                assert resp.status == 201
        baseline = relay.rss_bytes()
        sock = _never_reading_socket(relay, r)
        dropped_at, peak = await _until_dropped(s, relay, timeout_s + 8)
        gauge = await _metric(s, relay, "relayfleet_live_connections")
        flags = await _live_flags(s, relay, [r])
        sock.close()
    growth = peak - baseline
    report(
        "live-slow-consumer",
        rss_growth_mib=round(growth / MiB, 1),
        dropped_after_s=None if dropped_at is None else round(dropped_at, 1),
        gauge_after=gauge,
    )
    assert dropped_at is not None, "the blocked consumer was never dropped"
    assert dropped_at < timeout_s + 5
    assert gauge == 0
    assert flags == {False}
    assert growth < 48 * MiB, f"relay RSS grew {growth / MiB:.0f} MiB for one blocked socket"
    _assert_no_unhandled(relay)


async def test_a_live_client_that_stops_reading_small_frames_is_dropped(relay_with: RelayWith) -> None:
    """Frames under the transport's high-water mark are written without a send deadline
    while nothing is buffered: once the client stops reading and the kernel's buffers are
    full, the next frames wait for the socket under RELAY_LIVE_SEND_TIMEOUT_S and the
    client is still dropped (a window of 256 x 48 KiB = 12 MiB, more than loopback buffers)."""
    timeout_s = 2.0
    relay = relay_with({"RELAY_LIVE_SEND_TIMEOUT_S": str(timeout_s), **NO_CLIENT_QUOTA})  # a big backlog
    r = recipient(2101)
    async with aiohttp.ClientSession() as s:

        async def store(i: int) -> None:
            async with s.post(
                f"{relay.url}/v1/queues/{r}/messages", data=bytes([i % 256]) * (48 << 10)
            ) as resp:
                assert resp.status == 201

        for start in range(0, 256, 32):
            await asyncio.gather(*[store(i) for i in range(start, start + 32)])
        sock = _never_reading_socket(relay, r)
        dropped_at, _ = await _until_dropped(s, relay, timeout_s + 8)
        gauge = await _metric(s, relay, "relayfleet_live_connections")
        sock.close()
    report(
        "live-slow-consumer-small-frames",
        dropped_after_s=None if dropped_at is None else round(dropped_at, 1),
        gauge_after=gauge,
    )
    assert dropped_at is not None, "the blocked consumer was never dropped"
    assert dropped_at < timeout_s + 5
    assert gauge == 0
    _assert_no_unhandled(relay)
