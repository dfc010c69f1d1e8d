"""tunnl3d inbox API, mirroring the examples of its data-plane document, against real Redis."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay.api.inbox import inbox_recipient
from relay.client import RelayClient
from relay.protocol import b64decode, b64encode
from relay.storage import keys as K
from relay.storage.maintenance import ShardMaintenance, TrimPolicy
from relay.storage.store import QueueLimits
from tests.support.in_process_relay import RelayFactory, RunningRelay

ROOM_INBOX = "tenant-123:room-456"  # the inbox id of the document's R2 key example


def derived_inbox_id(room_key: bytes) -> str:
    """As the document's client derivation: base64(hmacSha256(inboxKey, "inbox-id"))."""
    return base64.b64encode(hmac.new(room_key, b"inbox-id", hashlib.sha256).digest()).decode()


@pytest.fixture
async def relay(redis_server: LocalRedis, relay_factory: RelayFactory) -> RunningRelay:
    return await relay_factory(redis_server.url, auth="ed25519")


@pytest.fixture
async def http(relay: RunningRelay) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(relay.base_url) as session:
        yield session


@pytest.fixture
async def client(relay: RunningRelay) -> AsyncIterator[RelayClient]:
    async with relay.client() as c:
        yield c


async def append(
    http: aiohttp.ClientSession, inbox: str | None, body: Any
) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"X-Inbox-ID": inbox} if inbox is not None else {}
    async with http.post("/v1/inbox/append", json=body, headers=headers) as r:
        return r.status, await r.json(), dict(r.headers)


async def fetch(http: aiohttp.ClientSession, inbox: str, query: str = "") -> dict[str, Any]:
    async with http.get("/v1/inbox/messages" + query, headers={"X-Inbox-ID": inbox}) as r:
        assert r.status == 200
        doc: dict[str, Any] = await r.json()
        return doc


async def test_append_and_fetch_like_the_document(http: aiohttp.ClientSession) -> None:
    ciphertext = b64encode(os.urandom(48))
    status, doc, _ = await append(http, ROOM_INBOX, {"messageId": "msg-abc123", "ciphertext": ciphertext})
    assert status == 201
    assert set(doc) == {"seq", "storedAt"}
    assert doc["storedAt"].endswith("Z")
    seq = doc["seq"]
    # immediate availability: readable as soon as the append was answered
    got = await fetch(http, ROOM_INBOX)
    assert got == {
        "messages": [
            {
                "seq": seq,
                "messageId": "msg-abc123",
                "ciphertext": ciphertext,
                "createdAt": got["messages"][0]["createdAt"],
            }
        ],
        "nextSeq": seq + 1,
    }
    assert abs(_ms(got["messages"][0]["createdAt"]) - _ms(doc["storedAt"])) < 1000


def _ms(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1000


async def test_repeated_message_id_returns_the_existing_seq(http: aiohttp.ClientSession) -> None:
    first = await append(http, ROOM_INBOX, {"messageId": "msg-1", "ciphertext": b64encode(b"a")})
    assert first[0] == 201
    # same id, any payload: the existing seq (tunnl3d /deliver semantics), stored once
    for ciphertext in (b64encode(b"a"), b64encode(b"different")):
        again = await append(http, ROOM_INBOX, {"messageId": "msg-1", "ciphertext": ciphertext})
        assert again[0] == 200
        assert again[1]["seq"] == first[1]["seq"]
        # the original storedAt (the first answer's is taken just after storing: within a moment)
        assert abs(_ms(again[1]["storedAt"]) - _ms(first[1]["storedAt"])) < 1000
    got = await fetch(http, ROOM_INBOX)
    assert [m["messageId"] for m in got["messages"]] == ["msg-1"]


async def test_concurrent_retries_store_once(client: RelayClient) -> None:
    results = await asyncio.gather(
        *(client.inbox_append(ROOM_INBOX, "msg-race", b"payload") for _ in range(20))
    )
    assert len({seq for seq, _, _ in results}) == 1
    assert sum(1 for _, _, dup in results if not dup) == 1
    assert len((await client.inbox_read(ROOM_INBOX))["messages"]) == 1


async def test_reads_do_not_delete_and_page_with_from_seq(client: RelayClient) -> None:
    inbox = derived_inbox_id(os.urandom(32))
    for i in range(5):
        seq, _, dup = await client.inbox_append(inbox, f"msg-{i}", b"c%d" % i)
        assert (seq, dup) == (i + 1, False)
    page = await client.inbox_read(inbox, limit=2)
    assert [m["seq"] for m in page["messages"]] == [1, 2]
    assert page["nextSeq"] == 3
    page2 = await client.inbox_read(inbox, from_seq=page["nextSeq"], limit=2)
    assert [m["seq"] for m in page2["messages"]] == [3, 4]
    tail = await client.inbox_read(inbox, from_seq=6)
    assert tail == {"messages": [], "nextSeq": 6}
    everything = await client.inbox_read(inbox, from_seq=0)  # the default, spelled out
    assert [b64decode(m["ciphertext"]) for m in everything["messages"]] == [b"c%d" % i for i in range(5)]
    assert (await client.inbox_read(inbox)) == everything  # still all there


async def test_inboxes_are_separate(client: RelayClient) -> None:
    await client.inbox_append("inbox-a", "m", b"for-a")
    await client.inbox_append("inbox-b", "m", b"for-b")
    a, b = await client.inbox_read("inbox-a"), await client.inbox_read("inbox-b")
    assert [b64decode(m["ciphertext"]) for m in a["messages"]] == [b"for-a"]
    assert [b64decode(m["ciphertext"]) for m in b["messages"]] == [b"for-b"]
    assert (await client.inbox_read("inbox-c")) == {"messages": [], "nextSeq": 1}


async def test_padded_ciphertext_is_accepted(http: aiohttp.ClientSession) -> None:
    padded = base64.urlsafe_b64encode(b"ab").decode()
    assert padded.endswith("=")
    status, _, _ = await append(http, "pad", {"messageId": "p", "ciphertext": padded})
    assert status == 201
    assert (await fetch(http, "pad"))["messages"][0]["ciphertext"] == padded.rstrip("=")


async def test_bad_requests(http: aiohttp.ClientSession, redis_server: LocalRedis) -> None:
    good = {"messageId": "m", "ciphertext": b64encode(b"x")}
    cases: list[tuple[str | None, Any, int, str]] = [
        (None, good, 400, "bad_inbox_id"),
        ("", good, 400, "bad_inbox_id"),
        ("has space", good, 400, "bad_inbox_id"),
        ("ok", [1], 400, "bad_request"),
        ("ok", {"ciphertext": b64encode(b"x")}, 400, "bad_message_id"),
        ("ok", {"messageId": "", "ciphertext": b64encode(b"x")}, 400, "bad_message_id"),
        ("ok", {"messageId": "m"}, 400, "bad_ciphertext"),
        ("ok", {"messageId": "m", "ciphertext": "a+b/"}, 400, "bad_ciphertext"),
        ("ok", {"messageId": "m", "ciphertext": "abc=="}, 400, "bad_ciphertext"),
        ("ok", {"messageId": "m", "ciphertext": ""}, 400, "empty_payload"),
    ]
    r = redis.Redis.from_url(redis_server.url)
    try:
        # the relay's own start writes shard-level keys (the boot mark): compare with those
        before = set(r.keys())
        for inbox, body, status, code in cases:
            got = await append(http, inbox, body)
            assert (got[0], got[1]["code"]) == (status, code), (inbox, body)
        assert set(r.keys()) == before  # nothing stored by any of them
    finally:
        r.close()
    async with http.get("/v1/inbox/messages") as resp:
        assert (resp.status, (await resp.json())["code"]) == (400, "bad_inbox_id")
    async with http.get("/v1/inbox/messages?limit=0", headers={"X-Inbox-ID": "ok"}) as resp:
        assert resp.status == 400


async def test_oversized_and_rate_limited(redis_server: LocalRedis, relay_factory: RelayFactory) -> None:
    relay = await relay_factory(
        redis_server.url, max_payload=1000, limits=QueueLimits(rate_count=3, rate_window_ms=5000)
    )
    async with aiohttp.ClientSession(relay.base_url) as http:
        big = {"messageId": "big", "ciphertext": b64encode(b"x" * 1001)}
        status, doc, _ = await append(http, "room", big)
        assert (status, doc["code"]) == (413, "payload_too_large")
        for i in range(3):
            assert (await append(http, "room", {"messageId": f"m{i}", "ciphertext": "eA"}))[0] == 201
        status, doc, headers = await append(http, "room", {"messageId": "m3", "ciphertext": "eA"})
        # tunnl3d's answer: 429, Retry-After in whole seconds, precise retryAfterMs
        assert (status, doc["code"]) == (429, "rate_limited")
        assert 1 <= int(headers["Retry-After"]) <= 5
        assert 0 < doc["retryAfterMs"] <= 5000
        # a retry of something already stored is a duplicate, not rate limited
        assert (await append(http, "room", {"messageId": "m0", "ciphertext": "eA"}))[0] == 200


async def test_retention_removes_inbox_messages(
    http: aiohttp.ClientSession, redis_server: LocalRedis
) -> None:
    for i in range(3):
        assert (await append(http, ROOM_INBOX, {"messageId": f"old-{i}", "ciphertext": "eA"}))[0] == 201
    q = K.queue_keys(inbox_recipient(ROOM_INBOX), b"")
    now = int(time.time() * 1000)
    with ShardMaintenance(redis_server.url) as shard:
        # the retention job's own trim, with every message past its maximum age
        outcome = shard.trim([(q.slot, q.qid)], TrimPolicy(now_ms=now, cutoff_ms=now + 1))
    assert outcome[0].removed == 3
    assert (await fetch(http, ROOM_INBOX))["messages"] == []
    # seqs go on from where they were: a client's fromSeq stays meaningful
    status, doc, _ = await append(http, ROOM_INBOX, {"messageId": "new", "ciphertext": "eA"})
    assert (status, doc["seq"]) == (201, 4)


async def test_inbox_id_is_never_stored_or_logged(
    http: aiohttp.ClientSession, redis_server: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    secret = derived_inbox_id(b"k" * 32)
    caplog.set_level(logging.DEBUG)
    await append(http, secret, {"messageId": "m", "ciphertext": "eA"})
    await append(http, secret, {"messageId": "m", "ciphertext": "!!"})  # an error path too
    await fetch(http, secret)
    assert secret not in caplog.text
    r = redis.Redis.from_url(redis_server.url)
    try:
        for key in r.scan_iter():
            assert secret.encode() not in key
            assert secret.encode() not in (r.dump(key) or b"")
    finally:
        r.close()
