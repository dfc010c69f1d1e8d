"""Pickup Protocol 2.0 (Aries RFC 0685) end to end, using the RFC's own example messages.

The examples below are the RFC's, with "<key for messages>" replaced by a real
key; requests are signed for real and the relay talks to a real redis-server.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp
import orjson
import pytest
from relayfleet_testing.localredis import LocalRedis

from relay.client import RelayClient, RelayError
from relay.protocol import b64decode, b64encode, keypair, sign_headers
from tests.support.in_process_relay import RelayFactory, RunningRelay

KEY = "<key for messages>"
RFC_STATUS_REQUEST = {
    "@id": "123456781",
    "@type": "https://didcomm.org/messagepickup/2.0/status-request",
    "recipient_key": KEY,
}
RFC_STATUS = {
    "@id": "123456781",
    "@type": "https://didcomm.org/messagepickup/2.0/status",
    "recipient_key": KEY,
    "message_count": 7,
    "longest_waited_seconds": 3600,
    "newest_received_time": "2019-05-01 12:00:00Z",
    "oldest_received_time": "2019-05-01 12:00:01Z",
    "total_bytes": 8096,
    "live_delivery": False,
}
RFC_DELIVERY_REQUEST = {
    "@id": "123456781",
    "@type": "https://didcomm.org/messagepickup/2.0/delivery-request",
    "limit": 10,
    "recipient_key": KEY,
}
RFC_DELIVERY = {
    "@id": "123456781",
    "~thread": {"thid": "<message id of delivery-request message>"},
    "@type": "https://didcomm.org/messagepickup/2.0/delivery",
    "recipient_key": KEY,
    "~attach": [{"@id": "<messageid>", "data": {"base64": ""}}],
}
RFC_MESSAGES_RECEIVED = {
    "@type": "https://didcomm.org/messagepickup/2.0/messages-received",
    "message_id_list": ["123", "456"],
}
RFC_PROBLEM_REPORT = {
    "@type": "https://didcomm.org/notification/1.0/problem-report",
    "~thread": {"pthid": "<message id of offending live_delivery_change>"},
    "description": "Connection does not support Live Delivery",
}
LIVE_DELIVERY_CHANGE = {  # the RFC names it but shows no example; fields as its text says
    "@id": "abc-1",
    "@type": "https://didcomm.org/messagepickup/2.0/live-delivery-change",
    "live_delivery": True,
}


def with_key(example: dict[str, Any], key: str, **changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(example)
    if "recipient_key" in doc:
        doc["recipient_key"] = key
    doc.update(changes)
    return doc


def is_time(text: str) -> bool:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).tzinfo is not None


@pytest.fixture
async def relay(redis_server: LocalRedis, relay_factory: RelayFactory) -> RunningRelay:
    return await relay_factory(redis_server.url, auth="ed25519")


@pytest.fixture
async def agent(relay: RunningRelay) -> AsyncIterator[RelayClient]:
    _public, private = keypair()
    async with relay.client(private) as client:
        yield client


def me(agent: RelayClient) -> bytes:
    assert agent.public_key is not None
    return agent.public_key


async def test_status_request_gets_status_with_every_field(agent: RelayClient) -> None:
    payloads = [b"x" * n for n in (10, 20, 30, 40, 50, 60, 70)]
    for p in payloads:
        await agent.enqueue(me(agent), p)
    key = b64encode(me(agent))
    status = await agent.pickup(with_key(RFC_STATUS_REQUEST, key))
    assert set(status) == set(RFC_STATUS) | {"~thread"}  # every optional field, filled
    assert status["@type"] == RFC_STATUS["@type"]
    assert status["~thread"] == {"thid": "123456781"}
    assert status["recipient_key"] == key  # MUST match the request's
    assert status["message_count"] == 7
    assert status["total_bytes"] == sum(map(len, payloads))
    assert status["live_delivery"] is False
    assert isinstance(status["longest_waited_seconds"], int)
    assert status["longest_waited_seconds"] >= 0
    assert is_time(status["newest_received_time"])
    assert is_time(status["oldest_received_time"])
    assert status["oldest_received_time"] <= status["newest_received_time"]
    assert status["@id"] != "123456781"  # a new message of its own


async def test_delivery_then_messages_received_then_status(agent: RelayClient) -> None:
    key = b64encode(me(agent))
    for i in range(5):
        await agent.enqueue(me(agent), b"envelope-%d" % i)
    delivery = await agent.pickup(with_key(RFC_DELIVERY_REQUEST, key, limit=3))
    assert set(delivery) == set(RFC_DELIVERY)
    assert delivery["@type"] == RFC_DELIVERY["@type"]
    assert delivery["~thread"] == {"thid": "123456781"}  # the delivery-request's @id
    assert delivery["recipient_key"] == key
    attached = delivery["~attach"]
    assert [set(a) for a in attached] == [{"@id", "data"}] * 3
    assert [b64decode(a["data"]["base64"]) for a in attached] == [b"envelope-0", b"envelope-1", b"envelope-2"]
    ids = [a["@id"] for a in attached]
    # delivered messages are not deleted until messages-received
    assert (await agent.pickup(with_key(RFC_STATUS_REQUEST, key)))["message_count"] == 5
    again = await agent.pickup(with_key(RFC_DELIVERY_REQUEST, key, limit=3))
    assert [a["@id"] for a in again["~attach"]] == ids
    # the RFC's messages-received carries no recipient_key and no @id: the queue is the signer's
    received = await agent.pickup(with_key(RFC_MESSAGES_RECEIVED, key, message_id_list=ids))
    assert received["@type"] == RFC_STATUS["@type"]
    assert received["message_count"] == 2
    assert "recipient_key" not in received
    assert "~thread" not in received
    rest = await agent.pickup(with_key(RFC_DELIVERY_REQUEST, key))  # limit 10, as in the RFC
    assert [b64decode(a["data"]["base64"]) for a in rest["~attach"]] == [b"envelope-3", b"envelope-4"]
    # ids it never handed out name nothing: the RFC's own "123", "456" delete nothing here
    assert (await agent.pickup(RFC_MESSAGES_RECEIVED))["message_count"] == 2
    done = await agent.pickup(
        with_key(RFC_MESSAGES_RECEIVED, key, message_id_list=[a["@id"] for a in rest["~attach"]])
    )
    assert done["message_count"] == 0


async def test_delivery_request_on_an_empty_queue_answers_status(agent: RelayClient) -> None:
    key = b64encode(me(agent))
    status = await agent.pickup(with_key(RFC_DELIVERY_REQUEST, key))
    assert status["@type"] == RFC_STATUS["@type"]
    assert status["~thread"] == {"thid": "123456781"}
    assert (status["message_count"], status["total_bytes"], status["longest_waited_seconds"]) == (0, 0, 0)
    # no message, no received time: left out rather than null (agents validate them as strings)
    assert "oldest_received_time" not in status
    assert "newest_received_time" not in status


async def test_delivery_without_recipient_key_uses_the_signer(agent: RelayClient) -> None:
    await agent.enqueue(me(agent), b"one")
    request = {k: v for k, v in RFC_DELIVERY_REQUEST.items() if k != "recipient_key"}
    delivery = await agent.pickup(request)
    assert "recipient_key" not in delivery  # only when the request named one
    assert [b64decode(a["data"]["base64"]) for a in delivery["~attach"]] == [b"one"]


async def test_live_delivery_change_over_http_is_a_problem_report(agent: RelayClient) -> None:
    report = await agent.pickup(with_key(LIVE_DELIVERY_CHANGE, b64encode(me(agent))))
    assert {k: v for k, v in report.items() if k != "@id"} == {
        **RFC_PROBLEM_REPORT,
        "~thread": {"pthid": LIVE_DELIVERY_CHANGE["@id"]},
    }
    off = await agent.pickup({**LIVE_DELIVERY_CHANGE, "live_delivery": False})
    assert (off["@type"], off["live_delivery"]) == (RFC_STATUS["@type"], False)


async def test_thread_of_a_threaded_request_is_kept(agent: RelayClient) -> None:
    status = await agent.pickup(
        {**RFC_STATUS_REQUEST, "recipient_key": b64encode(me(agent)), "~thread": {"thid": "t-9"}}
    )
    assert status["~thread"] == {"thid": "t-9"}


async def test_transport_decorator_and_legacy_type_prefix(agent: RelayClient) -> None:
    legacy = "did:sov:BzCbsNYhMrjHiqZDTUASHg;spec/messagepickup/2.0/"
    status = await agent.pickup(
        {
            "@id": "1",
            "@type": legacy + "status-request",
            "~transport": {"return_route": "all"},
        }
    )
    assert status["@type"] == legacy + "status"


def did_key(public: bytes) -> str:
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    data = b"\xed\x01" + public
    n, out = int.from_bytes(data, "big"), ""
    while n:
        n, r = divmod(n, 58)
        out = alphabet[r] + out
    return "did:key:z" + "1" * (len(data) - len(data.lstrip(b"\0"))) + out


async def test_did_key_recipient_key_names_the_same_queue(agent: RelayClient) -> None:
    await agent.enqueue(me(agent), b"for-did")
    dk = did_key(me(agent))
    assert dk.startswith("did:key:z6Mk")
    status = await agent.pickup(with_key(RFC_STATUS_REQUEST, dk))
    assert (status["recipient_key"], status["message_count"]) == (dk, 1)


async def test_multiple_recipients_are_queued_independently(relay: RunningRelay) -> None:
    """RFC: a message for several recipients stays for the others when one acknowledges it."""
    (pa, sa), (pb, sb) = keypair(), keypair()
    async with relay.client(sa) as a, relay.client(sb) as b:
        results = await a.fanout([pa, pb], b"to-both")
        assert [r["status"] for r in results] == [201, 201]
        da = await a.pickup(with_key(RFC_DELIVERY_REQUEST, b64encode(pa)))
        ids = [x["@id"] for x in da["~attach"]]
        assert (await a.pickup(with_key(RFC_MESSAGES_RECEIVED, "", message_id_list=ids)))[
            "message_count"
        ] == 0
        db = await b.pickup(with_key(RFC_DELIVERY_REQUEST, b64encode(pb)))
        assert [b64decode(x["data"]["base64"]) for x in db["~attach"]] == [b"to-both"]


async def test_bad_pickup_messages_get_clear_400s(agent: RelayClient, relay: RunningRelay) -> None:
    key = b64encode(me(agent))
    cases: list[tuple[Any, str]] = [
        ({"@type": "https://didcomm.org/messagepickup/2.0/delivery"}, "unsupported_message_type"),
        ({"@type": "https://didcomm.org/trust_ping/1.0/ping"}, "unsupported_message_type"),
        (with_key(RFC_DELIVERY_REQUEST, key, limit=0), "bad_pickup_message"),
        (
            {k: v for k, v in with_key(RFC_DELIVERY_REQUEST, key).items() if k != "limit"},
            "bad_pickup_message",
        ),
        (with_key(RFC_MESSAGES_RECEIVED, key, message_id_list="1"), "bad_pickup_message"),
        (with_key(RFC_STATUS_REQUEST, "AAAA"), "bad_recipient"),
        (with_key(RFC_STATUS_REQUEST, "did:key:z6MkNope"), "bad_recipient"),
        ([1, 2], "bad_pickup_message"),
    ]
    for doc, code in cases:
        with pytest.raises(RelayError) as err:
            await agent.pickup(doc)
        assert (err.value.status, err.value.code) == (400, code), doc
    path = "/v1/didcomm/pickup"
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            relay.base_url + path,
            data=b"{nope",
            headers=sign_headers(agent.private_key or b"", "POST", path, b"{nope"),
        ) as r,
    ):
        assert (r.status, (await r.json())["code"]) == (400, "bad_json")


async def test_pickup_on_the_live_websocket(agent: RelayClient) -> None:
    key = b64encode(me(agent))
    await agent.enqueue(me(agent), b"ws-1")
    async with agent.live() as conn:

        async def reply(doc: dict[str, Any]) -> dict[str, Any]:
            await conn.ws.send_str(orjson.dumps(doc).decode())
            async with asyncio.timeout(5):
                while True:
                    frame = await conn.frame()
                    if "@type" in frame:
                        return frame

        status = await reply(with_key(RFC_STATUS_REQUEST, key))
        assert (status["message_count"], status["live_delivery"], status["recipient_key"]) == (1, True, key)
        delivery = await reply(with_key(RFC_DELIVERY_REQUEST, key))
        assert delivery["~thread"] == {"thid": "123456781"}
        assert [b64decode(a["data"]["base64"]) for a in delivery["~attach"]] == [b"ws-1"]
        # a persistent transport: live-delivery-change is honoured, not refused
        on = await reply(with_key(LIVE_DELIVERY_CHANGE, key))
        assert (on["@type"], on["live_delivery"], on["~thread"]) == (
            RFC_STATUS["@type"],
            True,
            {"thid": "abc-1"},
        )
        done = await reply(with_key(RFC_MESSAGES_RECEIVED, key, message_id_list=["1"]))
        assert done["message_count"] == 0
        bad = await reply({"@id": "q", "@type": "https://didcomm.org/messagepickup/2.0/delivery-request"})
        assert bad["@type"] == RFC_PROBLEM_REPORT["@type"]
        assert bad["~thread"] == {"pthid": "q"}
