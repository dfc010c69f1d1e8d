"""The raw RESP batcher against a real redis-server: what redis-py used to give us for free."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from relayfleet_testing.localredis import LocalRedis

from relay.storage import keys as K
from relay.storage import pipeline
from relay.storage import store as store_module
from relay.storage.pipeline import ScriptBatcher, StoreOutcomeUnknown, StoreUnavailable, bulk_str
from relay.storage.scripts import STATUS
from relay.storage.store import EnqueueOutcome, EnqueueRequest, QueueLimits, ShardStore, SlotMoved
from tests.support.waiting import until

REDIS = "/usr/bin/redis-server"


@pytest.fixture
async def secured() -> AsyncIterator[LocalRedis]:
    server = LocalRedis(binary=REDIS, password="pw-test").start()
    try:
        yield server
    finally:
        server.stop()


def queue() -> K.QueueKeys:
    return K.queue_keys(os.urandom(32), b"")


async def test_password_url_noscript_and_many_in_flight(secured: LocalRedis) -> None:
    store = ShardStore("t", secured.url, QueueLimits(rate_count=10**6))
    await store.start()
    try:
        q = queue()
        assert (await store.enqueue(q, EnqueueRequest(b"", b"", b"a"), 1000)).seq == 1
        await store.client.script_flush()  # Redis forgets the scripts: load once, resend once
        outcomes = await asyncio.gather(
            *(store.enqueue(q, EnqueueRequest(b"", b"", b"m%d" % i), 1001) for i in range(300))
        )
        assert sorted(o.seq for o in outcomes) == list(range(2, 302))
        read = await store.read(q, None, 1000)
        assert [m.payload for m in read.messages][:2] == [b"a", b"m0"]
        assert read.last_seq == 301
    finally:
        await store.close()


async def test_wrong_password_is_unavailable(secured: LocalRedis) -> None:
    store = ShardStore("t", secured.url.replace("pw-test", "wrong"), QueueLimits())
    try:
        with pytest.raises(StoreUnavailable):
            await store.enqueue(queue(), EnqueueRequest(b"", b"", b"x"), 1)
    finally:
        await store.close()


async def test_restart_fails_fast_then_reconnects() -> None:
    server = LocalRedis(binary=REDIS).start()
    store = ShardStore("t", server.url, QueueLimits())
    try:
        await store.start()
        q = queue()
        await store.enqueue(q, EnqueueRequest(b"", b"", b"before"), 1)
        server.stop()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.enqueue(q, EnqueueRequest(b"", b"", b"during"), 2)
        assert time.monotonic() - started < 2.5
        server.start()
        for _ in range(50):  # the first calls may still meet the old connection
            try:
                await store.enqueue(q, EnqueueRequest(b"", b"", b"after"), 3)
                break
            except StoreUnavailable:
                await asyncio.sleep(0.1)
        assert (await store.status(q)).count >= 1
    finally:
        await store.close()
        server.stop()


async def test_silent_link_times_out() -> None:
    """A peer that accepts and never answers must not hang callers past the reply timeout."""

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(1 << 16):  # swallow everything until the client gives up
                pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    client = aioredis.Redis.from_url(url)
    batcher = ScriptBatcher(client, url, connect_timeout=0.5, reply_timeout=0.5)
    try:
        q = queue()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await batcher.call(STATUS, (q.state, q.meta, q.msgs, q.index), (q.qid, "e", 1))
        assert time.monotonic() - started < 2.0
    finally:
        await batcher.close()
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_an_enqueue_on_an_idle_connection_is_sent_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No batch answered for IDLE_SEND_S: an enqueue is written to Redis before the loop turns
    (the rest of its tick gathers into the next call); on a busy connection it waits for the
    loop turn, gathering with its tick."""
    server = LocalRedis(binary=REDIS).start()
    store = ShardStore("t", server.url, QueueLimits())
    loop = asyncio.get_running_loop()
    try:
        await store.start()
        monkeypatch.setattr(pipeline, "IDLE_SEND_S", 0.0)  # idle since any answer
        sink: asyncio.Future[list[object]] = loop.create_future()
        store.enqueue_to(sink, queue(), EnqueueRequest(b"", b"", b"one"), 1000)
        assert store._batcher._inflight == 1  # written already
        assert (await sink)[:2] == [b"ok", 1]
        # written at once after Redis lost its scripts: loaded and sent again, answered once
        await store.client.script_flush()
        sink = loop.create_future()
        q = queue()
        store.enqueue_to(sink, q, EnqueueRequest(b"", b"", b"again", "", "mid"), 1000)
        assert store._batcher._inflight == 1
        assert (await sink)[:2] == [b"ok", 1]
        got = await store.read(q, None, 10)
        assert [(m.payload, m.message_id) for m in got.messages] == [(b"again", "mid")]
        # a sink built from the token, after the write when the enqueue is written at once
        events: list[object] = []
        write_now = store._batcher.write_now

        def spy(command: bytes) -> bool:
            written = write_now(command)
            if written:
                events.append("write")
            return written

        monkeypatch.setattr(store._batcher, "write_now", spy)
        for idle_s, order in ((0.0, ["write", "make"]), (3600.0, ["make"])):
            monkeypatch.setattr(pipeline, "IDLE_SEND_S", idle_s)
            events.clear()
            late: asyncio.Future[list[object]] = loop.create_future()

            def make(token: bytes, late: asyncio.Future[list[object]] = late) -> asyncio.Future[list[object]]:
                events.append(token)
                return late

            token = store.enqueue_to(None, q, EnqueueRequest(b"", b"", b"late"), 1000, make_sink=make)
            assert events == [token if e == "make" else e for e in order]
            assert (await late)[0] == b"ok"
        monkeypatch.setattr(pipeline, "IDLE_SEND_S", 3600.0)  # busy: never idle that long
        sink = loop.create_future()
        store.enqueue_to(sink, queue(), EnqueueRequest(b"", b"", b"two"), 1000)
        assert store._batcher._inflight == 0  # waits for its tick's batch
        assert (await sink)[:2] == [b"ok", 1]
    finally:
        await store.close()
        server.stop()


# Lua that keeps Redis busy for 0.2 s (TIME is allowed in scripts since Redis 5)
_BUSY_LUA = (
    "local t = redis.call('TIME') local start = t[1] * 1000000 + t[2] "
    "repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start > 200000 return 1"
)


async def test_only_an_enqueue_answered_makes_the_connection_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another command in flight or just answered (a status, a presence lease) does not hold the
    next lone enqueue for a loop turn; an enqueue answered within IDLE_SEND_S does."""
    server = LocalRedis(binary=REDIS).start()
    store = ShardStore("t", server.url, QueueLimits())
    loop = asyncio.get_running_loop()
    try:
        await store.start()
        monkeypatch.setattr(pipeline, "IDLE_SEND_S", 0.5)
        q = queue()
        await store.status(q)  # answered just now, on the same (hot) connection
        # a command that keeps Redis busy for 0.2 s: in flight while the enqueue comes
        slow = store._batcher.submit(pipeline.encode("EVAL", _BUSY_LUA, 0))
        await until("the busy command sent", lambda: store._batcher._inflight == 1, interval=0.005)
        sink: asyncio.Future[list[object]] = loop.create_future()
        store.enqueue_to(sink, q, EnqueueRequest(b"", b"", b"one"), 1000)
        assert store._batcher._inflight == 2  # written at once, behind it
        assert (await sink)[:2] == [b"ok", 1]
        assert slow.done()  # answered first: each its own reply, in order
        assert slow.result() == 1
        sink = loop.create_future()
        store.enqueue_to(sink, q, EnqueueRequest(b"", b"", b"two"), 1001)
        assert store._batcher._inflight == 0  # an enqueue was answered within 0.5 s: its tick's
        assert (await sink)[:2] == [b"ok", 2]
    finally:
        await store.close()
        server.stop()


async def test_one_script_call_carries_a_ticks_enqueues_each_with_its_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pipeline, "IDLE_SEND_S", 3600.0)  # a busy connection (see the next test)
    server = LocalRedis(binary=REDIS).start()
    store = ShardStore("t", server.url, QueueLimits(rate_count=2))
    try:
        await store.start()
        a, b, moved = queue(), queue(), queue()
        await store.client.set(moved.state, "moved s2 4")
        first = await store.enqueue(a, EnqueueRequest(b"", b"", b"one", "k"), 1000)
        await store.client.config_resetstat()
        # sent in one loop tick: one EVALSHA, every item answered on its own
        outcomes = await asyncio.gather(
            store.enqueue(a, EnqueueRequest(b"", b"", b"one", "k"), 1000),  # duplicate
            store.enqueue(a, EnqueueRequest(b"", b"", b"two"), 1001),  # stored
            store.enqueue(a, EnqueueRequest(b"", b"", b"three"), 1002),  # rate limited (2 per window)
            store.enqueue(b, EnqueueRequest(b"", b"", b"x" * 100), 1003),  # stored
            store.enqueue(moved, EnqueueRequest(b"", b"", b"y"), 1004),  # fenced
            return_exceptions=True,
        )
        epoch_a: bytes = await store.client.hget(a.meta, "epoch")  # type: ignore[assignment]
        epoch_b: bytes = await store.client.hget(b.meta, "epoch")  # type: ignore[assignment]
        assert list(outcomes[:4]) == [
            EnqueueOutcome("duplicate", seq=first.seq),
            EnqueueOutcome("stored", seq=2, epoch=epoch_a),
            EnqueueOutcome("rate_limited", retry_after_ms=4998),
            EnqueueOutcome("stored", seq=1, epoch=epoch_b),
        ]
        assert isinstance(outcomes[4], SlotMoved)
        assert outcomes[4].shard == "s2"
        calls = (await store.client.info("commandstats"))["cmdstat_evalsha"]["calls"]
        assert calls == 1
        # a resend of a stored attempt (its reply lost) answers that attempt's seq
        z = EnqueueRequest(b"", b"", b"z")
        token = store.enqueue_to(asyncio.get_running_loop().create_future(), b, z, 2000)
        await asyncio.sleep(0.1)
        again = await store.enqueue(b, z, 2000, token=token, resend=True)
        assert again.seq == 2
        assert (await store.status(b)).last_seq == 2
    finally:
        await store.close()
        server.stop()


async def test_large_payloads_are_written_as_parts_and_stored_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call holding payloads past the split size is written as parts (the payload not copied
    into one buffer), in the same batch as plain commands; Redis stores every byte in order."""
    monkeypatch.setattr(pipeline, "IDLE_SEND_S", 3600.0)  # busy: the tick's enqueues gather
    sent: list[list[type]] = []
    send = pipeline._Resp.send

    def spy(conn: pipeline._Resp, batch: pipeline._Batch, timeout: float | None = None) -> None:
        sent.append([type(command) for command, _ in batch.items])
        send(conn, batch, timeout)

    server = LocalRedis(binary=REDIS).start()
    store = ShardStore("t", server.url, QueueLimits(rate_count=100))
    try:
        await store.start()
        q, other = queue(), queue()
        payloads = [os.urandom(64 * 1024), os.urandom(16 * 1024 - 1), b"small", os.urandom(16 * 1024)]
        await store.enqueue(queue(), EnqueueRequest(b"", b"", b"first"), 999)  # an enqueue answered: busy
        await store.client.config_resetstat()
        monkeypatch.setattr(pipeline._Resp, "send", spy)
        # started in one loop tick: one batch
        stored = [
            asyncio.ensure_future(store.enqueue(q, EnqueueRequest(b"", b"", p, "", f"m{i}"), 1000 + i))
            for i, p in enumerate(payloads)
        ]
        status = asyncio.ensure_future(store.status(other))  # a plain command in the same batch
        outcomes = [await t for t in stored]
        await status
        assert [o.seq for o in outcomes] == [1, 2, 3, 4]
        monkeypatch.setattr(pipeline._Resp, "send", send)
        assert (await store.client.info("commandstats"))["cmdstat_evalsha"]["calls"] == 2
        got = await store.read(q, None, 10)
        assert [(m.payload, m.message_id) for m in got.messages] == [
            (p, f"m{i}") for i, p in enumerate(payloads)
        ]
        assert sent == [[list, bytes]]  # the enqueue call as parts, the status as bytes
    finally:
        await store.close()
        server.stop()


async def test_a_stalled_redis_times_out_each_batch_at_its_own_deadline() -> None:
    """One reply timer per connection: left armed after the first batch's answer, it must still
    fail a later batch at that batch's deadline (not earlier, at the first one's, nor never)."""
    server = LocalRedis(binary=REDIS).start()
    store = ShardStore("t", server.url, QueueLimits(write_timeout_s=0.6))
    loop = asyncio.get_running_loop()
    try:
        await store.start()
        q = queue()
        assert (await store.enqueue(q, EnqueueRequest(b"", b"", b"one"), 1000)).seq == 1
        await asyncio.sleep(0.3)  # the timer armed for that batch is due in ~0.3 s
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        try:
            sent = loop.time()
            with pytest.raises(StoreOutcomeUnknown):
                async with asyncio.timeout(5):  # (a timer never re-armed: no answer at all)
                    await store.enqueue(q, EnqueueRequest(b"", b"", b"two"), 1001)
            assert 0.55 <= loop.time() - sent < 2.0
        finally:
            server.proc.send_signal(signal.SIGCONT)
        # the next connection works ("two" may have run once Redis went on: its outcome is unknown)
        assert (await store.enqueue(q, EnqueueRequest(b"", b"", b"three"), 1002)).seq in (2, 3)
    finally:
        await store.close()
        server.stop()


def test_a_full_enqueue_parts_cache_drops_its_oldest_entry_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "_ENQUEUE_PARTS_MAX", 3)
    store = ShardStore("t", "redis://127.0.0.1:1/0", QueueLimits())  # never connected
    queues = [queue() for _ in range(5)]
    parts = [store._encode_enqueue_parts(q) for q in queues]
    assert list(store._enqueue_parts) == [q.qid for q in queues[2:]]
    assert [store._enqueue_parts[q.qid] for q in queues[2:]] == parts[2:]


@pytest.mark.parametrize("slot", [0, 7, 42, 512, 16383])
def test_an_enqueue_item_s_fixed_parts_are_its_key_names_encoded(slot: int) -> None:
    store = ShardStore("t", "redis://127.0.0.1:1/0", QueueLimits())  # never connected
    q = K.QueueKeys(slot, K.queue_id(b"r" * 32, b"chan"))
    # lua/enqueue.lua's order
    names = (q.state, q.meta, q.msgs, q.idem, q.idemx, q.rate, q.index, q.stats, K.slot_recipients(slot))
    assert store._encode_enqueue_parts(q) == (
        b"".join([bulk_str(name) for name in names]),
        bulk_str(q.qid) + bulk_str(q.wake),
    )
