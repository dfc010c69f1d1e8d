"""Live frames written from the wakeup itself (relay/api/live.py LiveSession._send_woken),
against real redis-server: a parked live socket's next frames go out as the wakeup that
carried them is processed, before the socket's task resumes; everything else (a full window,
a read in flight, a take-over, shutdown) takes the task's way, and the contract holds on both:
the next seq and no other, acked as usual, no duplicate, no gap."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay import metrics
from relay.api import bulk
from relay.api.live import CLOSE_DISPLACED, frame_with_seq, message_frame, text_frame
from relay.app import begin_shutdown
from relay.client import LiveClosed, LiveConnection, RelayClient, received
from relay.protocol import keypair
from relay.storage import keys as K
from relay.storage.message import Message
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.live_steps import count_held as held
from tests.support.live_steps import counted_reads, frame, silent

# relayfleet_live_frames_total{sent_by}: which way each frame went
WOKEN = metrics.LIVE_FRAMES.labels("wakeup")
BY_TASK = metrics.LIVE_FRAMES.labels("task")


Two = tuple[RunningRelay, bytes, RelayClient, RelayClient, RelayClient]


@pytest.fixture
async def two(redis_server: LocalRedis, relay_factory: RelayFactory) -> AsyncIterator[Two]:
    """Relay a (the owner's, its live socket's) and relay b over one Redis: (a, the owner's
    key, the owner's client on a, a client on a, a client on b)."""
    a = await relay_factory(redis_server.url)
    b = await relay_factory(redis_server.url)
    public, private = keypair()
    async with a.client(private) as owner, a.client() as via_a, b.client() as via_b:
        yield a, public, owner, via_a, via_b


class Counts:
    """Frames written each way since it was made."""

    def __init__(self) -> None:
        self.woken0, self.task0 = WOKEN.value, BY_TASK.value

    @property
    def woken(self) -> float:
        return WOKEN.value - self.woken0

    @property
    def task(self) -> float:
        return BY_TASK.value - self.task0


@asynccontextmanager
async def parked_live(owner: RelayClient) -> AsyncIterator[LiveConnection]:
    """A live socket of `owner`'s queue past its "empty", its task parked in its wait."""
    conn = await owner.live()
    try:
        await parked_after(conn)
        yield conn
    finally:
        await conn.close()


async def parked_after(conn: LiveConnection) -> None:
    """The "empty" marker, then until the socket's task waits (its waiter registered)."""
    assert await frame(conn) == {"type": "empty"}
    await asyncio.sleep(0.05)  # "empty" goes out just before the task parks


def test_text_frame_is_rfc6455_server_text_frame() -> None:
    for n in (0, 1, 125):
        assert text_frame(b"x" * n) == bytes((0x81, n)) + b"x" * n
    for n in (126, 65535):
        assert text_frame(b"y" * n) == struct.pack("!BBH", 0x81, 126, n) + b"y" * n
    for n in (65536, 70000):
        assert text_frame(b"z" * n) == struct.pack("!BBQ", 0x81, 127, n) + b"z" * n


def test_a_frame_made_while_redis_stores_is_the_frame() -> None:
    """The frame prepared before Redis assigns the seq (bulk.after_seq) is message_frame's."""
    for mid in (None, 'id-\u00e9"x'):
        m = Message(77, b"\x00\xffpayload" * 9, 1_795_000_000_123, mid)
        assert frame_with_seq(77, bulk.after_seq(m.payload, m.received_ms, mid)) == message_frame(m)


async def test_frames_from_the_wakeup_have_the_next_seqs_and_are_acked_as_usual(two: Two) -> None:
    """relayfleet_live_frames_total counts them: this relay's own enqueues (the local
    hand-over) and another relay's (the published wakeup) alike, none read back."""
    a, public, owner, via_a, via_b = two
    async with parked_live(owner) as conn:
        counts = Counts()
        frames = []
        with counted_reads(a) as reads:
            for i in range(6):
                via = via_a if i % 2 else via_b
                await via.fanout([public], b"w-%d" % i, message_id=f"id-{i}")
                frames.append(received(await frame(conn)))
            assert reads[0] == 0
        assert (counts.woken, counts.task) == (6, 0)
        assert [(f.seq, f.payload, f.message_id) for f in frames] == [
            (i + 1, b"w-%d" % i, f"id-{i}") for i in range(6)
        ]
        read = await owner.read()  # the same messages a read answers, field for field
        assert [(m.seq, m.payload, m.message_id, m.received_at) for m in read.messages] == [
            (f.seq, f.payload, f.message_id, f.received_at) for f in frames
        ]
        await conn.ack(4)
        assert await held(owner, 2) == 2
        await conn.send({"type": "ack", "seqs": [6]})
        assert await held(owner, 1) == 1
        assert await silent(conn, 0.2)  # an ack sends nothing again
    async with owner.live() as again:  # only the unacked one comes back
        assert [m.seq for m in await again.messages()] == [5]


async def test_a_full_window_is_not_sent_from_the_wakeup(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url, live_queue_max=2)
    public, private = keypair()
    async with relay.client(private) as owner, parked_live(owner) as conn:
        counts = Counts()
        for i in range(2):
            await owner.enqueue(public, b"f%d" % i)
            assert (await frame(conn))["seq"] == i + 1
        assert (counts.woken, counts.task) == (2, 0)
        await owner.enqueue(public, b"f2")  # the window is full: held back
        assert await silent(conn, 0.4)
        assert (counts.woken, counts.task) == (2, 0)
        await conn.ack(1)  # room: the task reads it and sends it
        assert (await frame(conn))["seq"] == 3
        assert (counts.woken, counts.task) == (2, 1)
        await conn.ack(3)  # room again, and the task parked: the next goes from its wakeup
        await asyncio.sleep(0.1)
        await owner.enqueue(public, b"f3")
        assert (await frame(conn))["seq"] == 4
        assert (counts.woken, counts.task) == (3, 1)
        assert await silent(conn, 0.2)


async def test_paused_delivery_is_not_sent_from_the_wakeup(relay: RunningRelay) -> None:
    public, private = keypair()
    pickup = "https://didcomm.org/messagepickup/2.0/"
    async with relay.client(private) as owner, parked_live(owner) as conn:
        counts = Counts()
        await conn.send({"@type": pickup + "live-delivery-change", "@id": "p1", "live_delivery": False})
        assert (await frame(conn))["live_delivery"] is False
        await owner.enqueue(public, b"paused")
        assert await silent(conn, 0.4)
        assert counts.woken == 0
        await conn.send({"@type": pickup + "live-delivery-change", "@id": "p2", "live_delivery": True})
        got = [await frame(conn) for _ in range(2)]
        assert [f.get("seq") for f in got if f.get("type") == "message"] == [1]
        assert counts.woken == 0


@contextmanager
def read_held(relay: RunningRelay, answer_first: bool) -> Iterator[tuple[asyncio.Event, asyncio.Event]]:
    """Each read of the queue, once armed, waits for `release` — before asking Redis, or
    with Redis's answer in hand (`answer_first`) — and sets `started`: a read in flight."""
    store = next(iter(relay.fleet.stores.values()))
    original = store.read
    started, release = asyncio.Event(), asyncio.Event()

    async def held_read(q: K.QueueKeys, from_seq: int | None, limit: int) -> object:
        started.set()
        if not answer_first:
            await release.wait()
        result = await original(q, from_seq, limit)
        await release.wait()
        return result

    store.read = held_read  # type: ignore[method-assign,assignment]
    try:
        yield started, release
    finally:
        store.read = original  # type: ignore[method-assign]


@pytest.mark.parametrize("answer_first", [False, True], ids=["before-redis", "after-redis"])
async def test_wakeups_during_a_read_in_flight_no_duplicate_no_gap(two: Two, answer_first: bool) -> None:
    """Wakeups that carry messages while the socket's task is reading (the read may or may
    not see them) are not sent from the wakeup: the task sends each once, in seq order."""
    a, public, owner, via_a, via_b = two
    async with parked_live(owner) as conn:
        counts = Counts()
        with read_held(a, answer_first) as (started, release):
            await via_b.enqueue(public, b"big" * 3000)  # too big to ride: the task reads
            await asyncio.wait_for(started.wait(), 5)
            for i in range(3):  # carried, each: by a's hand-over or b's wakeup
                await (via_a if i % 2 else via_b).enqueue(public, b"during-%d" % i)
            await asyncio.sleep(0.05)  # their wakeups arrive while the read is held
            assert counts.woken == 0
            release.set()
            got = [received(await frame(conn)) for _ in range(4)]
        assert [(m.seq, m.payload) for m in got] == [(1, b"big" * 3000)] + [
            (i + 2, b"during-%d" % i) for i in range(3)
        ]
        assert counts.woken == 0
        assert await silent(conn, 0.3)  # nothing twice
        await asyncio.sleep(0.05)
        await via_a.enqueue(public, b"after")  # parked again: from the wakeup
        assert received(await frame(conn)).seq == 5
        assert counts.woken == 1


async def test_an_epoch_reset_is_read_not_sent_from_the_wakeup(
    redis_server: LocalRedis, relay: RunningRelay
) -> None:
    """A wakeup of another epoch (the queue's history was reset: here Redis's run changed
    under it, lua/_prelude.lua check_boot) is not sent from the wakeup: the socket reads from
    the oldest held again, and wakes from the new epoch after that."""
    public, private = keypair()
    async with relay.client(private) as owner, parked_live(owner) as conn:
        counts = Counts()
        await owner.enqueue(public, b"old")
        assert received(await frame(conn)).seq == 1
        r = redis.Redis.from_url(redis_server.url)
        try:
            r.set(K.SHARD_BOOT, "another-run:1")  # the next enqueue finds its tail lost
        finally:
            r.close()
        seq, _ = await owner.enqueue(public, b"new")
        assert seq > 2  # the new epoch's seqs jump
        again = [received(await frame(conn)) for _ in range(2)]
        assert [(m.seq, m.payload) for m in again] == [(1, b"old"), (seq, b"new")]  # unacked: resent
        assert counts.woken == 1
        await asyncio.sleep(0.05)
        await owner.enqueue(public, b"next")
        assert (received(await frame(conn)).seq, counts.woken) == (seq + 1, 2)
        assert await silent(conn, 0.2)


async def test_take_over_sends_to_the_newest_connection_only(relay: RunningRelay) -> None:
    public, private = keypair()
    async with relay.client(private) as owner:
        first = await owner.live()
        second: LiveConnection | None = None
        try:
            await parked_after(first)
            await owner.enqueue(public, b"to-first")
            assert received(await frame(first)).seq == 1
            second = await owner.live()
            assert [m.seq for m in await second.messages()] == [1]  # unacked: the backlog again
            with pytest.raises(LiveClosed) as closed:
                await frame(first)  # nothing else before the close
            assert closed.value.code == CLOSE_DISPLACED
            await asyncio.sleep(0.05)
            counts = Counts()
            await owner.enqueue(public, b"to-second")
            assert received(await frame(second)).seq == 2
            assert counts.woken == 1
        finally:
            await first.close()
            if second is not None:
                await second.close()


async def test_shutdown_sends_nothing_from_a_wakeup(relay: RunningRelay) -> None:
    public, private = keypair()
    async with relay.client(private) as owner, parked_live(owner) as conn:
        await owner.enqueue(public, b"before")
        assert received(await frame(conn)).seq == 1
        counts = Counts()
        begin_shutdown(relay.app)
        enqueued = asyncio.ensure_future(owner.enqueue(public, b"during"))
        try:
            with pytest.raises(LiveClosed) as closed:
                await frame(conn)  # the close, no message frame before it
            assert closed.value.code == 1001  # going away
        finally:
            with contextlib.suppress(Exception):  # stored or refused: only the socket is tested
                await asyncio.wait_for(enqueued, 5)
        assert counts.woken == 0
