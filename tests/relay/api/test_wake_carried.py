"""Long-polls answered from what woke them (relay/storage/wakeups.py), against real Redis.

An enqueue this process sent hands its stored message to this process's waiters, and the
enqueue script's wakeup carries small messages to every other relay's: a waiter answers
from them without reading the queue back, and only when they are exactly what a read
would have returned. These tests check the answers and that the contract holds on the
new path: no lost wakeup, FIFO when the local hand-over and the published wakeup race,
nothing delivered again after its ack, waiters of other relays still woken.
"""

from __future__ import annotations

import asyncio
import os
import random

from relayfleet_testing.localredis import LocalRedis

from relay.client import RelayClient, received
from relay.protocol import keypair
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.live_steps import counted_reads


def rkey() -> bytes:
    return os.urandom(32)


async def parked(task: asyncio.Task[object], relay: RunningRelay, waiting: int = 1) -> None:
    """Until `waiting` long-polls wait on `relay` (each registered, read, and parked)."""
    for _ in range(400):
        if _waiters(relay) >= waiting:
            await asyncio.sleep(0.02)  # its first read is done once it waits
            return
        assert not task.done(), task
        await asyncio.sleep(0.005)
    raise AssertionError("the long-poll never parked")


def _waiters(relay: RunningRelay) -> int:
    return sum(len(c.waiters) for hub in relay.fleet.hubs.values() for c in hub._channels.values())


async def test_waiter_answered_from_this_process_enqueue_without_reading_back(relay: RunningRelay) -> None:
    r = rkey()
    async with relay.client() as reader, relay.client() as writer:
        with counted_reads(relay) as reads:
            task = asyncio.create_task(reader.read(r, wait=10))
            await parked(task, relay)
            assert reads[0] == 1  # the long-poll's own read, empty
            sent = await writer.fanout([r], b"hello", message_id="m-1")  # an enqueue with a messageId
            assert [(x["status"], x["seq"]) for x in sent] == [(201, 1)]
            batch = await asyncio.wait_for(task, 5)
            assert reads[0] == 1  # answered from the enqueue, not read back
        again = await reader.read(r)  # what a read answers: the same, byte for byte
    assert [(m.seq, m.payload, m.message_id, m.received_at) for m in batch.messages] == [
        (m.seq, m.payload, m.message_id, m.received_at) for m in again.messages
    ]
    assert batch.next_seq == again.next_seq == 2
    assert batch.epoch == again.epoch


async def test_waiter_of_another_relay_answered_from_the_published_wakeup(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    a = await relay_factory(redis_server.url)
    b = await relay_factory(redis_server.url)
    r = rkey()
    async with a.client() as writer, b.client() as reader:
        await writer.enqueue(r, b"first")
        with counted_reads(b) as reads:
            task = asyncio.create_task(reader.read(r, from_seq=2, wait=10))
            await parked(task, b)
            await writer.fanout([r], b"second", message_id="x")
            batch = await asyncio.wait_for(task, 5)
            assert reads[0] == 1  # woken by the wakeup a's enqueue published, which carried it
            # a message too big to ride in the wakeup: b reads it back, and answers the same
            task = asyncio.create_task(reader.read(r, from_seq=3, wait=10))
            await parked(task, b)
            await writer.enqueue(r, b"z" * 9000)
            big = await asyncio.wait_for(task, 5)
            assert reads[0] == 3
        held = await reader.read(r, from_seq=2)
    assert [(m.seq, m.payload, m.message_id) for m in batch.messages] == [(2, b"second", "x")]
    assert batch.messages[0].received_at == held.messages[0].received_at
    assert batch.epoch == held.epoch
    assert batch.next_seq == 3
    assert [(m.seq, m.payload) for m in big.messages] == [(3, b"z" * 9000)]


async def test_no_lost_wakeup_when_waiters_register_while_enqueues_land(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    """Waiters registering at any moment around an enqueue, on its relay and on another:
    each is answered with the message, none waits out its timeout."""
    a = await relay_factory(redis_server.url)
    b = await relay_factory(redis_server.url)
    rng = random.Random(7)
    async with a.client() as writer, a.client() as local, b.client() as remote:

        async def one(i: int) -> None:
            r = rkey()
            reader = local if i % 2 else remote
            delay = rng.random() * 0.004

            async def late_enqueue() -> None:
                await asyncio.sleep(delay)
                await writer.enqueue(r, b"m%d" % i)

            got, _ = await asyncio.wait_for(
                asyncio.gather(reader.read(r, from_seq=1, wait=8), late_enqueue()), 6
            )
            assert [(m.seq, m.payload) for m in got.messages] == [(1, b"m%d" % i)]

        for i in range(60):
            await one(i)


async def test_fifo_when_local_handover_and_published_wakeups_race(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    """Producers on the waiter's relay (handed over at once) and on another (woken through
    Redis) write one queue together; a reader long-polling from nextSeq gets every seq once,
    in order, each with the payload its enqueue was answered for."""
    a = await relay_factory(redis_server.url)
    b = await relay_factory(redis_server.url)
    r = rkey()
    per_producer = 40
    sent: dict[int, bytes] = {}

    async def produce(client: RelayClient, name: str) -> None:
        for i in range(per_producer):
            payload = b"%s-%d" % (name.encode(), i)
            seq, _ = await client.enqueue(r, payload)
            sent[seq] = payload
            await asyncio.sleep(random.random() * 0.003)

    got: list[tuple[int, bytes]] = []

    async def consume(client: RelayClient) -> None:
        next_seq = 1
        while len(got) < 4 * per_producer:
            batch = await client.read(r, from_seq=next_seq, wait=5)
            assert batch.messages, "timed out: a wakeup was lost"
            got.extend((m.seq, m.payload) for m in batch.messages)
            next_seq = batch.next_seq

    async with a.client() as pa, a.client() as pa2, b.client() as pb, b.client() as pb2, a.client() as reader:
        await asyncio.wait_for(
            asyncio.gather(
                consume(reader), produce(pa, "a"), produce(pa2, "A"), produce(pb, "b"), produce(pb2, "B")
            ),
            60,
        )
    assert [s for s, _ in got] == list(range(1, 4 * per_producer + 1))
    assert dict(got) == sent


async def test_carried_message_not_delivered_again_after_its_ack(relay: RunningRelay) -> None:
    r = rkey()
    async with relay.client() as reader, relay.client() as writer:
        task = asyncio.create_task(reader.read(r, wait=10))
        await parked(task, relay)
        await writer.enqueue(r, b"one")
        first = await asyncio.wait_for(task, 5)
        assert [m.seq for m in first.messages] == [1]
        assert await reader.ack(r, up_to_seq=1) == 1
        # from the oldest held again: the acked message is gone, the next one is what wakes it
        task = asyncio.create_task(reader.read(r, wait=10))
        await parked(task, relay)
        await writer.enqueue(r, b"two")
        second = await asyncio.wait_for(task, 5)
    assert [(m.seq, m.payload) for m in second.messages] == [(2, b"two")]


async def test_waiter_reads_when_the_carried_message_is_not_next(relay: RunningRelay) -> None:
    """A long-poll past the queue's end (fromSeq beyond the next seq) is not answered with a
    message a read from its fromSeq would not return."""
    r = rkey()
    async with relay.client() as reader, relay.client() as writer:
        task = asyncio.create_task(reader.read(r, from_seq=3, wait=0.6))
        await parked(task, relay)
        await writer.enqueue(r, b"one")  # seq 1 < fromSeq 3
        await writer.enqueue(r, b"two")
        await asyncio.sleep(0.1)
        assert not task.done()
        await writer.enqueue(r, b"three")
        batch = await asyncio.wait_for(task, 5)
    assert [(m.seq, m.payload) for m in batch.messages] == [(3, b"three")]


async def test_live_socket_sent_from_wakeups_without_reading_back(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    """A caught-up live socket sends what wakeups carry (its relay's own enqueues and other
    relays' alike) in seq order, reading only what did not ride along; acked, it is gone."""
    a = await relay_factory(redis_server.url)
    b = await relay_factory(redis_server.url)
    public, private = keypair()
    async with a.client(private) as owner, a.client() as via_a, b.client() as via_b:
        conn = await owner.live()
        try:
            assert await asyncio.wait_for(conn.frame(), 5) == {"type": "empty"}
            with counted_reads(a) as reads:
                frames = []
                for i in range(6):
                    await (via_a if i % 2 else via_b).enqueue(public, b"live-%d" % i)
                    frames.append(received(await asyncio.wait_for(conn.frame(), 5)))
                assert reads[0] == 0  # every one carried: by a's enqueue or by b's wakeup
                await via_b.enqueue(public, b"y" * 9000)  # too big to ride: read back
                frames.append(received(await asyncio.wait_for(conn.frame(), 5)))
                assert reads[0] == 1
            assert [(f.seq, f.payload) for f in frames] == [(i + 1, b"live-%d" % i) for i in range(6)] + [
                (7, b"y" * 9000)
            ]
            held = await owner.read()
            assert [f.received_at for f in frames] == [m.received_at for m in held.messages]
            await conn.ack(7)
            for _ in range(100):
                if (await owner.status())["message_count"] == 0:
                    break
                await asyncio.sleep(0.02)
        finally:
            await conn.close()
        again = await owner.live()  # nothing acked comes back
        try:
            assert await asyncio.wait_for(again.frame(), 5) == {"type": "empty"}
        finally:
            await again.close()
