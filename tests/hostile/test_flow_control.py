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
import time

import pytest

from tests.hostile.harness import Relay, RelayWith, http, recipient, request_answer

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
    """One connection writes pipelined enqueues for 8 s and never reads: the relay stops
    reading it once its answers back up, so RSS stays far under RELAY_MAX_RSS_MB."""
    relay = relay_with({"RELAY_MAX_RSS_MB": "256", "RELAY_RATE_LIMIT": "1000000"})
    batch = _enqueues(1000)
    sent = 0
    _reader, writer = await asyncio.open_connection(relay.host, relay.port)
    async with _Peak(relay) as peak:
        deadline = time.monotonic() + 8.0
        stalled_at: float | None = None
        while time.monotonic() < deadline:
            writer.write(batch)
            try:
                await asyncio.wait_for(writer.drain(), max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                stalled_at = stalled_at or time.monotonic()
                break
            sent += 1000
        await asyncio.sleep(1.0)  # what was read is answered (or buffered) by now
    writer.transport.abort()
    print(
        f"HOSTILE never-reads: {sent} enqueues written in 8 s, "
        f"rss {peak.start >> 20} -> peak {peak.peak >> 20} MiB (+{peak.growth_mb:.0f})"
    )
    assert stalled_at is not None, "the relay read everything a non-reading client sent"
    assert peak.growth_mb < GROWTH_BOUND_MB, f"RSS grew {peak.growth_mb:.0f} MiB"
    await _still_serves(relay)
    relay.assert_log_clean()


async def test_pipelined_enqueues_cost_bounded_memory_and_return_it(relay_with: RelayWith) -> None:
    """40,000 pipelined 1-byte enqueues (4.4 MB) on one connection whose answers are read
    only after it has sent them all: bounded growth meanwhile, and the memory goes back."""
    relay = relay_with({"RELAY_RATE_LIMIT": "1000000"})
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
    print(
        f"HOSTILE 40k-pipelined: {answers} answered ({stored} stored), "
        f"growth while unread +{stalled_growth:.0f} MiB, "
        f"peak +{peak.growth_mb:.0f} MiB, held after the client left +{left:.0f} MiB"
    )
    assert answers == stored == 40_000
    assert peak.growth_mb < GROWTH_BOUND_MB, f"RSS grew {peak.growth_mb:.0f} MiB"
    assert left < GROWTH_BOUND_MB / 2, f"{left:.0f} MiB still held after the client left"
    await _still_serves(relay)
    relay.assert_log_clean()
