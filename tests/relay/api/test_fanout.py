"""Multi-recipient fan-out: one payload, each recipient queued (and refused) independently."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis

from relay.client import RelayClient
from relay.protocol import b64encode, keypair
from relay.storage.store import QueueLimits
from tests.support.in_process_relay import RelayFactory, RunningRelay


def keys(n: int) -> list[bytes]:
    return [keypair()[0] for _ in range(n)]


@pytest.fixture
async def client(relay: RunningRelay) -> AsyncIterator[RelayClient]:
    async with relay.client() as c:
        yield c


async def post(relay: RunningRelay, body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(relay.base_url + "/v1/messages", json=body) as r:
        return r.status, await r.json()


async def test_each_recipient_gets_the_message_in_request_order(client: RelayClient) -> None:
    recipients = keys(5)
    random.shuffle(recipients)
    results = await client.fanout(recipients, b"group-message", channel=b"grp")
    assert [r["recipient"] for r in results] == [b64encode(k) for k in recipients]
    assert [(r["status"], r["seq"], r["duplicate"]) for r in results] == [(201, 1, False)] * 5
    for k in recipients:
        batch = await client.read(k, channel=b"grp")
        assert [m.payload for m in batch.messages] == [b"group-message"]
        assert (await client.read(k)).messages == []  # the default channel is another queue


async def test_one_rate_limited_while_others_succeed(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url, limits=QueueLimits(rate_count=2))
    a, b, c = keys(3)
    async with relay.client() as client:
        for _ in range(2):
            await client.enqueue(b, b"fill")
        results = await client.fanout([a, b, c], b"hi")
    assert [r["status"] for r in results] == [201, 429, 201]
    limited = results[1]
    assert limited["code"] == "rate_limited"
    assert limited["retryAfterMs"] > 0
    assert "seq" not in limited


async def test_message_id_makes_fanout_idempotent(client: RelayClient) -> None:
    recipients = keys(3)
    first = await client.fanout(recipients, b"once", message_id="msg-42")
    again = await client.fanout(recipients, b"once", message_id="msg-42")
    assert [(r["status"], r["duplicate"]) for r in again] == [(200, True)] * 3
    assert [r["seq"] for r in again] == [r["seq"] for r in first]
    conflict = await client.fanout(recipients, b"changed", message_id="msg-42")
    assert [(r["status"], r["code"]) for r in conflict] == [(409, "idempotency_conflict")] * 3
    batch = await client.read(recipients[0])
    assert [(m.payload, m.message_id) for m in batch.messages] == [(b"once", "msg-42")]


async def test_bad_recipient_entries_fail_alone(relay: RunningRelay) -> None:
    good = b64encode(keypair()[0])
    status, doc = await post(
        relay, {"recipients": [good, b64encode(b"short"), 7, good], "payload": b64encode(b"p")}
    )
    assert status == 200
    assert [r["status"] for r in doc["results"]] == [201, 400, 400, 201]
    assert doc["results"][1] == {
        "recipient": b64encode(b"short"),
        "status": 400,
        "error": "recipientKey must be exactly 32 bytes, got 5",
        "code": "bad_recipient",
    }
    assert doc["results"][2]["recipient"] == 7
    assert doc["results"][3]["seq"] == 2  # the same recipient twice: two messages, in order


async def test_full_queue_is_507_for_that_recipient(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url, limits=QueueLimits(max_messages=1))
    a, b = keys(2)
    async with relay.client() as client:
        await client.enqueue(a, b"fill")
        results = await client.fanout([a, b], b"x")
    assert [(r["status"], r.get("code")) for r in results] == [(507, "queue_full"), (201, None)]


async def test_malformed_requests_are_refused_whole(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url, max_payload=100)
    k = b64encode(keypair()[0])
    cases: list[tuple[Any, int, str]] = [
        ([k], 400, "bad_request"),
        ({"payload": "eA"}, 400, "bad_recipients"),
        ({"recipients": [], "payload": "eA"}, 400, "bad_recipients"),
        ({"recipients": [k] * 1001, "payload": "eA"}, 400, "bad_recipients"),
        ({"recipients": [k]}, 400, "bad_payload"),
        ({"recipients": [k], "payload": "e+A="}, 400, "bad_payload"),
        ({"recipients": [k], "payload": ""}, 400, "empty_payload"),
        ({"recipients": [k], "payload": b64encode(b"x" * 101)}, 413, "payload_too_large"),
        ({"recipients": [k], "payload": "eA", "channel": "!"}, 400, "bad_channel"),
        ({"recipients": [k], "payload": "eA", "channel": 5}, 400, "bad_channel"),
        ({"recipients": [k], "payload": "eA", "messageId": "\n"}, 400, "bad_message_id"),
        ({"recipients": [k], "payload": "eA", "messageId": 5}, 400, "bad_message_id"),
    ]
    for body, status, code in cases:
        got = await post(relay, body)
        assert (got[0], got[1]["code"]) == (status, code), body
    async with relay.client() as client:
        assert (await client.status(keypair()[0]))["message_count"] == 0
