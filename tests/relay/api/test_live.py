"""Live WebSocket delivery against a real relay and a real redis-server, with real signatures."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from relayfleet_testing.localredis import LocalRedis

from relay import metrics
from relay.api import live as live_module
from relay.api.live import CLOSE_DISPLACED, message_frame
from relay.api.queues import message_json
from relay.client import LiveClosed, RelayClient, RelayError, received
from relay.protocol import b64encode, keypair, sign_headers
from relay.storage.message import Message
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.live_steps import count_held, frame, silent
from tests.support.waiting import until

PICKUP = "https://didcomm.org/messagepickup/2.0/"


@pytest.fixture
async def relay(redis_server: LocalRedis, relay_factory: RelayFactory) -> RunningRelay:
    return await relay_factory(redis_server.url, auth="ed25519")


@pytest.fixture
async def owner(relay: RunningRelay) -> AsyncIterator[RelayClient]:
    _public, private = keypair()
    async with relay.client(private) as client:
        yield client


async def test_backlog_then_empty_then_live_in_order(owner: RelayClient) -> None:
    me = owner.public_key
    assert me is not None
    for i in range(3):
        await owner.enqueue(me, f"old-{i}".encode())
    async with owner.live() as conn:
        backlog = [await frame(conn) for _ in range(3)]
        assert [f["type"] for f in backlog] == ["message"] * 3
        assert [received(f).payload for f in backlog] == [b"old-0", b"old-1", b"old-2"]
        assert [f["seq"] for f in backlog] == [1, 2, 3]
        assert set(backlog[0]) == {"type", "seq", "payload", "receivedAt", "messageId"}
        assert await frame(conn) == {"type": "empty"}
        for i in range(3):
            await owner.enqueue(me, f"new-{i}".encode())
        live = [received(await frame(conn)) for _ in range(3)]
        assert [(m.seq, m.payload) for m in live] == [(4, b"new-0"), (5, b"new-1"), (6, b"new-2")]


async def test_empty_queue_sends_empty_marker_first(owner: RelayClient) -> None:
    async with owner.live() as conn:
        assert await frame(conn) == {"type": "empty"}
        assert owner.public_key is not None
        seq, _ = await owner.enqueue(owner.public_key, b"hello", idempotency_key="k-1")
        f = await frame(conn)
        assert (f["type"], f["seq"], f["messageId"]) == ("message", seq, None)


async def test_ack_deletes_and_nothing_is_deleted_without_ack(owner: RelayClient) -> None:
    me = owner.public_key
    assert me is not None
    for i in range(4):
        await owner.enqueue(me, b"m%d" % i)
    async with owner.live() as conn:
        assert len(await conn.messages()) == 4
        assert (await owner.status())["message_count"] == 4  # delivered, not deleted
        await conn.ack(2)
        assert await count_held(owner, 2) == 2
        await conn.send({"type": "ack", "seqs": [4]})
        assert await count_held(owner, 1) == 1
    left = await owner.read()
    assert [m.seq for m in left.messages] == [3]


async def test_disconnect_without_ack_keeps_messages(owner: RelayClient) -> None:
    me = owner.public_key
    assert me is not None
    for i in range(3):
        await owner.enqueue(me, b"keep%d" % i)
    conn = await owner.live()
    assert [m.payload for m in await conn.messages()] == [b"keep0", b"keep1", b"keep2"]
    await conn.close()
    assert (await owner.status())["message_count"] == 3
    async with owner.live() as again:  # the same backlog, again
        assert [m.seq for m in await again.messages()] == [1, 2, 3]


async def test_from_seq_and_channels_are_separate(owner: RelayClient) -> None:
    me = owner.public_key
    assert me is not None
    for i in range(5):
        await owner.enqueue(me, b"d%d" % i)
    await owner.enqueue(me, b"other", channel=b"chan-b")
    async with owner.live(from_seq=4) as conn:
        assert [m.seq for m in await conn.messages()] == [4, 5]
    async with owner.live(channel=b"chan-b") as conn:
        assert [m.payload for m in await conn.messages()] == [b"other"]
        await owner.enqueue(me, b"default-only")
        assert await silent(conn, 0.3)


async def test_newer_connection_displaces_older_with_4409(owner: RelayClient) -> None:
    first = await owner.live()
    assert await frame(first) == {"type": "empty"}
    assert (await owner.status())["live_delivery"] is True
    second = await owner.live()
    assert await frame(second) == {"type": "empty"}
    with pytest.raises(LiveClosed) as closed:
        await frame(first)
    assert closed.value.code == CLOSE_DISPLACED == 4409
    assert owner.public_key is not None
    await owner.enqueue(owner.public_key, b"to-the-newest")
    assert received(await frame(second)).payload == b"to-the-newest"
    assert (await owner.status())["live_delivery"] is True
    await second.close()
    for _ in range(50):
        if not (await owner.status())["live_delivery"]:
            break
        await asyncio.sleep(0.02)
    assert (await owner.status())["live_delivery"] is False


async def test_other_channel_is_not_displaced(owner: RelayClient) -> None:
    a = await owner.live()
    b = await owner.live(channel=b"x")
    assert await frame(a) == {"type": "empty"}
    assert await frame(b) == {"type": "empty"}
    assert await silent(a, 0.2)
    assert not a.ws.closed
    await a.close()
    await b.close()


async def test_backpressure_window_bounds_unacked_frames(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url, auth="ed25519", live_queue_max=4)
    public, private = keypair()
    async with relay.client(private) as owner:
        await _backpressure(owner, public)


async def _backpressure(owner: RelayClient, public: bytes) -> None:
    for i in range(10):
        await owner.enqueue(public, b"w%d" % i)
    delivered = metrics.MESSAGES.labels("delivered")
    before = delivered.value
    async with owner.live() as conn:
        got = [await frame(conn) for _ in range(4)]
        assert [f["seq"] for f in got] == [1, 2, 3, 4]
        assert await silent(conn, 0.4)  # window full: nothing more, not even "empty"
        # and nothing more was read from Redis for this slow client
        assert delivered.value - before == 4
        await conn.ack(2)
        assert [(await frame(conn))["seq"] for _ in range(2)] == [5, 6]
        assert await silent(conn, 0.3)
        await conn.ack(6)
        assert [(await frame(conn))["seq"] for _ in range(4)] == [7, 8, 9, 10]
        assert await silent(conn, 0.3)  # full again: even "empty" waits, it needs a read
        await conn.ack(10)
        assert await frame(conn) == {"type": "empty"}
        assert delivered.value - before == 10


async def test_window_frees_when_messages_are_acked_over_http(
    redis_server: LocalRedis, relay_factory: RelayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_module, "PRUNE_S", 0.2)
    relay = await relay_factory(redis_server.url, auth="ed25519", live_queue_max=2)
    public, private = keypair()
    async with relay.client(private) as owner:
        for i in range(3):
            await owner.enqueue(public, b"h%d" % i)
        async with owner.live() as conn:
            assert [(await frame(conn))["seq"] for _ in range(2)] == [1, 2]
            assert await owner.ack(up_to_seq=2) == 2  # acked another way: the socket notices
            assert (await frame(conn))["seq"] == 3


async def test_unsigned_or_wrongly_signed_upgrade_is_refused(relay: RunningRelay, owner: RelayClient) -> None:
    assert owner.public_key is not None
    path = f"/v1/queues/{b64encode(owner.public_key)}/live"
    ws_url = "ws" + relay.base_url.removeprefix("http") + path
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as no_sig:
            await s.ws_connect(ws_url)
        assert no_sig.value.status == 401
        _, other = keypair()
        with pytest.raises(aiohttp.WSServerHandshakeError) as wrong:
            await s.ws_connect(ws_url, headers=sign_headers(other, "GET", path))
        assert wrong.value.status == 401
        signed = sign_headers(owner.private_key or b"", "GET", path)
        async with s.get(relay.base_url + path, headers=signed) as r:
            assert r.status == 426
            assert (await r.json())["code"] == "websocket_required"
    stranger = RelayClient(relay.base_url)
    with pytest.raises(RelayError) as err:
        await stranger.live(owner.public_key)
    assert err.value.status == 401
    await stranger.close()


async def test_bad_frames_get_error_frames_and_the_connection_stays(owner: RelayClient) -> None:
    async with owner.live() as conn:
        assert await frame(conn) == {"type": "empty"}
        await conn.ws.send_str("not json")
        assert (await frame(conn))["code"] == "bad_json"
        await conn.send({"type": "ack"})
        assert (await frame(conn))["type"] == "error"
        await conn.send({"type": "ack", "upToSeq": -1})
        assert (await frame(conn))["code"] == "bad_request"
        await conn.ws.send_bytes(b"\x00")
        assert (await frame(conn))["code"] == "bad_frame"
        assert owner.public_key is not None
        await owner.enqueue(owner.public_key, b"still-alive")
        assert received(await frame(conn)).payload == b"still-alive"


async def test_pickup_frames_on_the_live_socket(owner: RelayClient) -> None:
    me = owner.public_key
    assert me is not None
    await owner.enqueue(me, b"queued")
    async with owner.live() as conn:
        assert len(await conn.messages()) == 1
        await conn.send({"@id": "123456781", "@type": "https://didcomm.org/messagepickup/2.0/status-request"})
        status = await frame(conn)
        assert status["@type"] == "https://didcomm.org/messagepickup/2.0/status"
        assert status["~thread"] == {"thid": "123456781"}
        assert (status["message_count"], status["live_delivery"]) == (1, True)
        # live delivery off: new messages wait in the queue until it is on again
        await conn.send({"@id": "c1", "@type": PICKUP + "live-delivery-change", "live_delivery": False})
        assert (await frame(conn))["live_delivery"] is False
        await owner.enqueue(me, b"later")
        assert await silent(conn, 0.3)
        await conn.send({"@id": "c2", "@type": PICKUP + "live-delivery-change", "live_delivery": True})
        # the stream resumes as the answer is made: either may come first
        two = [await frame(conn), await frame(conn)]
        assert [f["live_delivery"] for f in two if "@type" in f] == [True]
        assert [received(f).payload for f in two if f.get("type") == "message"] == [b"later"]
        # messages-received on the socket acks too
        await conn.send({"@type": PICKUP + "messages-received", "message_id_list": ["1", "2"]})
        after = await frame(conn)
        assert after["message_count"] == 0
        assert "~thread" not in after  # the RFC's messages-received has no @id to thread on
        # a key other than the one this connection proved: problem-report
        _, other_public = keypair()
        await conn.send(
            {
                "@id": "x1",
                "@type": "https://didcomm.org/messagepickup/2.0/status-request",
                "recipient_key": b64encode(other_public),
            }
        )
        report = await frame(conn)
        assert report["@type"] == "https://didcomm.org/notification/1.0/problem-report"
        assert report["~thread"] == {"pthid": "x1"}


async def test_shutdown_closes_live_connections(owner: RelayClient, relay: RunningRelay) -> None:
    async with owner.live() as conn:
        assert await frame(conn) == {"type": "empty"}
        from relay.app import begin_shutdown

        begin_shutdown(relay.app)
        with pytest.raises(LiveClosed) as closed:
            await frame(conn)
        assert closed.value.code == aiohttp.WSCloseCode.GOING_AWAY


async def test_a_client_that_stops_answering_pings_is_dropped(
    relay: RunningRelay, owner: RelayClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_module, "HEARTBEAT_S", 0.2)
    assert owner.public_key is not None
    assert owner.private_key is not None
    path = f"/v1/queues/{b64encode(owner.public_key)}/live"
    url = "ws" + relay.base_url.removeprefix("http") + path
    async with aiohttp.ClientSession() as s:
        # autoping off and never reading: pings go unanswered, as with a stuck client
        ws = await s.ws_connect(url, headers=sign_headers(owner.private_key, "GET", path), autoping=False)

        async def dropped() -> bool:
            return (await owner.status())["live_delivery"] is False

        await until("the server to let go of it (pings unanswered)", dropped)
        await ws.close()


async def test_displacement_across_relay_processes(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    """Two relays on one Redis: the newest connection wins wherever it landed."""
    a = await relay_factory(redis_server.url, auth="ed25519")
    b = await relay_factory(redis_server.url, auth="ed25519")
    public, private = keypair()
    async with a.client(private) as via_a, b.client(private) as via_b:
        first = await via_a.live()
        assert await frame(first) == {"type": "empty"}
        second = await via_b.live()
        assert await frame(second) == {"type": "empty"}
        with pytest.raises(LiveClosed) as closed:
            await frame(first)
        assert closed.value.code == CLOSE_DISPLACED
        await via_a.enqueue(public, b"only-to-second")
        assert received(await frame(second)).payload == b"only-to-second"
        third = await via_a.live()  # and back: the one on b is displaced now
        assert received(await frame(third)).payload == b"only-to-second"
        assert await frame(third) == {"type": "empty"}
        with pytest.raises(LiveClosed) as closed_b:
            await frame(second)
        assert closed_b.value.code == CLOSE_DISPLACED
        await third.close()


@pytest.mark.parametrize(
    "message",
    [
        Message(1, b"x" * 256, 1_764_201_600_123, None),
        Message(2**53, bytes(range(256)) * 3, 0, 'id "quoted" \\ back\nslash é \u2028 😀'),
        Message(7, b"", 253_402_300_799_999, ""),
        Message(8, b"\xff\xfe" * 40_000, 1_764_201_600_000, "m-8"),
    ],
)
def test_message_frames_are_what_orjson_writes(message: Message) -> None:
    assert message_frame(message) == orjson.dumps({"type": "message", **message_json(message)})


async def test_heartbeats_are_spread_not_rounded_to_whole_seconds(
    relay: RunningRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp rounds a timer longer than its ceil threshold (5 s by default) up to a whole
    second: every socket whose ping falls due within that second would ping in one loop turn.
    With a 6 s heartbeat, four sockets opened 0.1 s apart must not all be pinged just after
    a whole second of the loop's clock, nor all at the same interval."""
    monkeypatch.setattr(live_module, "HEARTBEAT_S", 6.0)
    loop = asyncio.get_running_loop()

    async def first_ping(s: aiohttp.ClientSession) -> tuple[float, float]:
        public, private = keypair()
        path = f"/v1/queues/{b64encode(public)}/live"
        url = "ws" + relay.base_url.removeprefix("http") + path
        async with s.ws_connect(url, headers=sign_headers(private, "GET", path), autoping=False) as ws:
            opened = loop.time()
            async with asyncio.timeout(15):
                while (msg := await ws.receive()).type is not aiohttp.WSMsgType.PING:
                    assert msg.type is aiohttp.WSMsgType.TEXT, msg  # "empty", then the ping
            return opened, loop.time()

    async with aiohttp.ClientSession() as s:
        tasks = []
        for _ in range(4):
            tasks.append(asyncio.ensure_future(first_ping(s)))
            await asyncio.sleep(0.1)
        pings = await asyncio.gather(*tasks)
    fractions = [at - math.floor(at) for _, at in pings]
    intervals = [at - opened for opened, at in pings]
    assert not all(f < 0.05 for f in fractions), fractions
    assert max(intervals) - min(intervals) > 0.01, intervals
    assert all(5.0 < i < 7.0 for i in intervals), intervals
