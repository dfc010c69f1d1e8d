"""Flow control on the enqueue fast path: a client that pipelines enqueues and never reads
the answers is stopped being read (TCP pushes back on it), so it cannot grow the relay.

Bounds (relay/http/fastpath.py): at most MAX_OWED answers owed per connection before it
stops reading; reading also stops while the transport's write buffer is above its
high-water mark (pause_writing/resume_writing), and while the memory guard is over.
The figures each test measures are printed (HOSTILE ...) and listed in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from tests.hostile.harness import (
    NO_CLIENT_QUOTA,
    Relay,
    RelayWith,
    http,
    metric,
    read_response,
    recipient,
    report,
    request_answer,
)

pytestmark = pytest.mark.hostile

# Under attack RSS may grow by this much at most (the figure measured is ~+10 MiB: the
# bounded buffers of one connection, Redis replies in flight, allocator slack).
GROWTH_BOUND_MB = 40


def _enqueues(count: int, first: int = 0) -> bytes:
    """`count` pipelined 1-byte enqueues over 1,000 queues."""
    return b"".join(
        http("POST", f"/v1/queues/{recipient(first + i % 1000)}/messages", b"x") for i in range(count)
    )


class _Peak:
    """The relay's peak RSS, sampled every 20 ms while the attack runs."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.start = self.peak = relay.rss_bytes()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.relay.rss_bytes())
            await asyncio.sleep(0.02)

    async def __aenter__(self) -> _Peak:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.start) / (1 << 20)


async def _still_serves(relay: Relay) -> None:
    answer = await request_answer(relay, http("POST", f"/v1/queues/{recipient(999_999)}/messages", b"ok"))
    assert answer.status == 201, answer


async def test_a_client_that_never_reads_answers_is_stopped_being_read(relay_with: RelayWith) -> None:
    """One connection keeps writing pipelined enqueues and never reads: once its answers fill
    the socket buffers and the transport passes its write high-water mark, the relay stops
    reading it (nothing more is stored), and RSS stays far under RELAY_MAX_RSS_MB."""
    relay = relay_with({"RELAY_MAX_RSS_MB": "256", "RELAY_RATE_LIMIT": "1000000", **NO_CLIENT_QUOTA})
    batch = _enqueues(1000)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small, as a stalled reader's window
    sock.connect((relay.host, relay.port))
    _reader, writer = await asyncio.open_connection(sock=sock)

    async def write_forever() -> None:
        while True:
            writer.write(batch)
            await writer.drain()

    stored = 'relayfleet_messages_total{op="enqueued"}'
    async with _Peak(relay) as peak:
        writing = asyncio.create_task(write_forever())
        started = time.monotonic()
        before = -1.0
        while time.monotonic() - started < 40:
            await asyncio.sleep(1.0)
            now = await metric(relay, stored)
            if now == before:  # nothing stored for a second: no longer read
                break
            before = now
        stalled_after = time.monotonic() - started
        await asyncio.sleep(1.0)
        after = await metric(relay, stored)
        writing.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await writing
    writer.transport.abort()
    owed_pauses = await metric(relay, 'relayfleet_http_read_pauses_total{reason="answers_owed"}')
    write_pauses = await metric(relay, 'relayfleet_http_read_pauses_total{reason="write_buffer"}')
    report(
        "never-reads",
        stored_before_reads_stopped=int(before),
        stopped_after_s=round(stalled_after, 1),
        rss_mib=f"{peak.start >> 20}->{peak.peak >> 20}",
        growth_mib=round(peak.growth_mb, 1),
        pauses_answers_owed=owed_pauses,
        pauses_write_buffer=write_pauses,
    )
    assert after == before, "the relay kept reading a client that reads nothing"
    assert write_pauses >= 1, "never paused on the write buffer's high-water mark"
    assert peak.growth_mb < GROWTH_BOUND_MB, f"RSS grew {peak.growth_mb:.0f} MiB"
    await _still_serves(relay)
    relay.assert_log_clean()


async def test_pipelined_enqueues_cost_bounded_memory_and_return_it(relay_with: RelayWith) -> None:
    """40,000 pipelined 1-byte enqueues (4.4 MB) on one connection whose answers are read
    only after it has sent them all: bounded growth meanwhile, and the memory goes back."""
    relay = relay_with({"RELAY_RATE_LIMIT": "1000000", **NO_CLIENT_QUOTA})
    data = _enqueues(40_000, first=5000)
    reader, writer = await asyncio.open_connection(relay.host, relay.port, limit=1 << 20)
    async with _Peak(relay) as peak:
        writer.write(data)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(writer.drain(), 6.0)  # stalls while the relay stops reading
        await asyncio.sleep(1.0)
        stalled_growth = peak.growth_mb
        received = bytearray()
        started = time.monotonic()
        while received.count(b"HTTP/1.1 ") < 40_000 and time.monotonic() - started < 60:
            chunk = await asyncio.wait_for(reader.read(1 << 20), 10)
            if not chunk:
                break
            received += chunk
        answers = received.count(b"HTTP/1.1 ")
        stored = received.count(b"HTTP/1.1 201 ")
    writer.close()
    await asyncio.sleep(1.5)
    left = (relay.rss_bytes() - peak.start) / (1 << 20)
    pauses = await metric(relay, 'relayfleet_http_read_pauses_total{reason="answers_owed"}')
    report(
        "40k-pipelined",
        answered=answers,
        stored=stored,
        growth_while_unread_mib=round(stalled_growth, 1),
        peak_growth_mib=round(peak.growth_mb, 1),
        held_after_client_left_mib=round(left, 1),
        answers_owed_pauses=pauses,
    )
    assert answers == stored == 40_000
    assert pauses >= 1, "never paused at the answers owed bound"
    assert peak.growth_mb < GROWTH_BOUND_MB, f"RSS grew {peak.growth_mb:.0f} MiB"
    assert left < GROWTH_BOUND_MB / 2, f"{left:.0f} MiB still held after the client left"
    await _still_serves(relay)
    relay.assert_log_clean()


async def test_refusals_over_the_ceiling_let_go_of_held_bytes(relay_with: RelayWith) -> None:
    """Over the memory ceiling 2,000 pipelined enqueues are each refused 503 in order; the
    request bytes the memory guard counts (a half-sent body here) are held while they are
    and all let go afterwards."""
    relay = relay_with({"RELAY_MAX_RSS_MB": "30"})  # below a relay's ~50 MiB at rest: over at once
    await asyncio.sleep(0.5)
    half_sent_reader, half_sent = await asyncio.open_connection(relay.host, relay.port)
    body = b"y" * 100_000  # under the claim size: the fast path holds it
    head = http("POST", f"/v1/queues/{recipient(8999)}/messages", body)[: -len(body)]
    half_sent.write(head + body[:50_000])
    reader, writer = await asyncio.open_connection(relay.host, relay.port)
    writer.write(_enqueues(2000, first=9000))
    received = bytearray()
    while received.count(b"HTTP/1.1 ") < 2000:
        chunk = await asyncio.wait_for(reader.read(1 << 20), 10)
        assert chunk, "closed before every answer"
        received += chunk
    writer.close()
    await asyncio.sleep(0.5)  # the guard's gauge is sampled every 200 ms
    held_during = await metric(relay, "relayfleet_http_held_bytes")
    half_sent.write(body[50_000:])
    assert (await asyncio.wait_for(read_response(half_sent_reader), 10)).status == 503
    half_sent.close()
    await asyncio.sleep(0.5)
    held_after = await metric(relay, "relayfleet_http_held_bytes")
    report(
        "memory-over-pipelined",
        refused=received.count(b"HTTP/1.1 503 "),
        held_with_half_a_body=held_during,
        held_after=held_after,
    )
    assert received.count(b"HTTP/1.1 503 ") == 2000
    assert held_during >= 50_000
    assert held_after == 0
    relay.assert_log_clean()
