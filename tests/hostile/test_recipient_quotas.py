"""Per-recipient quotas across channels and the shard reserve (attack A4), attacked as an
outsider would: raw HTTP against `relayfleet relay` subprocesses on a real /usr/bin/redis-server.

A4: one recipient, many channels. The per-queue rate limit multiplied by the channels (12 x 500
stored in a blast); now the recipient's rate holds across all its channels. Measured figures
are printed as `HOSTILE <attack>: ...` lines (docs/reliability.md, hostile table).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from nacl.signing import SigningKey

from relay.protocol import authorization, b64encode, canonical
from relay.storage import keys as K
from tests.hostile.harness import (
    Relay,
    RelayWith,
    http,
    metric,
    read_response,
    recipient,
    report,
    request_answer,
    start_redis,
    start_relay,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

ENQUEUE_ROUTE = "/v1/queues/{recipient}/messages"


def _enqueue(r: str, channel: bytes, payload: bytes) -> bytes:
    query = f"?channel={b64encode(channel)}" if channel else ""
    return http(
        "POST", f"/v1/queues/{r}/messages{query}", payload, {"Content-Type": "application/octet-stream"}
    )


async def _blast(relay: Relay, r: str, channels: list[bytes], each: int) -> tuple[dict[int, int], list[Any]]:
    """`each` pipelined enqueues per channel, one keep-alive connection per channel, all at once:
    the answers' statuses counted, and the 429 answers' (Retry-After, body)."""

    async def one(channel: bytes) -> tuple[dict[int, int], list[Any]]:
        reader, writer = await asyncio.open_connection(relay.host, relay.port)
        writer.write(_enqueue(r, channel, b"a4" * 32) * each)
        await writer.drain()
        counts: dict[int, int] = {}
        limited: list[Any] = []
        for _ in range(each):
            answer = await read_response(reader)
            counts[answer.status] = counts.get(answer.status, 0) + 1
            if answer.status == 429 and len(limited) < 3:
                limited.append((answer.headers.get("retry-after"), answer.json()))
        writer.close()
        return counts, limited

    total: dict[int, int] = {}
    refusals: list[Any] = []
    for counts, limited in await asyncio.gather(*(one(c) for c in channels)):
        for status, n in counts.items():
            total[status] = total.get(status, 0) + n
        refusals += limited
    return total, refusals


def test_a4_one_recipient_many_channels_is_held_to_the_recipient_rate(relay_with: RelayWith) -> None:
    # a window longer than the blast, so "per window" is the whole blast: 500 per queue,
    # 1000 (the default, twice the queue's) per recipient across its channels
    relay = relay_with({"RELAY_RATE_WINDOW_MS": "60000"})
    r = recipient(4)
    channels = [bytes([65 + i]) for i in range(12)]
    started = time.perf_counter()
    counts, refusals = asyncio.run(_blast(relay, r, channels, 250))
    elapsed = time.perf_counter() - started
    report("A4 one recipient, 12 channels", attempts=3000, stored=counts.get(201, 0),
           refused_429=counts.get(429, 0), seconds=f"{elapsed:.2f}")  # fmt: skip
    assert counts.get(201, 0) == 1000, counts  # was 12 x 250 = 3000 (6000 with 500 each)
    assert counts.get(429, 0) == 2000, counts
    assert set(counts) == {201, 429}, counts
    for retry_after, body in refusals:
        assert body["code"] == "recipient_rate_limited"
        assert int(retry_after) >= 1
        assert body["retryAfterMs"] >= 1
    # the default channel counts too, and a new channel changes nothing
    for channel in (b"", b"new"):
        answer = asyncio.run(request_answer(relay, _enqueue(r, channel, b"x")))
        assert answer.status == 429
        assert answer.json()["code"] == "recipient_rate_limited"
        assert "retry-after" in answer.headers
    # another recipient is not affected
    assert asyncio.run(request_answer(relay, _enqueue(recipient(5), b"A", b"x"))).status == 201
    refused = asyncio.run(
        metric(relay, f'relayfleet_quota_refusals_total{{reason="recipient_rate",route="{ENQUEUE_ROUTE}"}}')
    )
    assert refused >= 2000
    relay.assert_log_clean()


# -- signed reads, by hand: the contract's canonical string and an Ed25519 key (no client) ---------
class Owner:
    def __init__(self) -> None:
        self.sk = SigningKey(os.urandom(32))
        self.key = b64encode(bytes(self.sk.verify_key))

    def signed(self, method: str, path: str, body: bytes = b"", as_key: SigningKey | None = None) -> bytes:
        sk = as_key or self.sk
        ts, nonce = str(int(time.time())), b64encode(os.urandom(16))
        sig = sk.sign(canonical(method, path, ts, nonce, body)).signature
        headers = {"Authorization": authorization(bytes(sk.verify_key), ts, nonce, sig)}
        if body:
            headers["Content-Type"] = "application/json"
        return http(method, path, body, headers)


def _call(relay: Relay, data: bytes) -> tuple[int, Any]:
    answer = asyncio.run(request_answer(relay, data))
    return answer.status, (answer.json() if answer.body else None)


@pytest.fixture
def signed_relay(tmp_path: Path) -> Iterator[Relay]:
    server = start_redis()
    env = {
        "RELAY_RECIPIENT_MAX_CHANNELS": "3",
        "RELAY_RECIPIENT_MAX_MESSAGES": "10",
        "RELAY_RECIPIENT_MAX_BYTES": "100000",
    }
    relay = start_relay(server, tmp_path, env, args=("--auth", "ed25519"))
    try:
        yield relay
    finally:
        relay.stop()
        server.stop()
    relay.assert_log_clean()


def test_recipient_caps_across_channels_refunds_and_the_signed_listing(signed_relay: Relay) -> None:
    relay, owner = signed_relay, Owner()
    r = owner.key
    plan = {b"A": 3, b"B": 3, b"C": 2, b"": 2}
    for channel, n in plan.items():
        for _ in range(n):
            status, body = _call(relay, _enqueue(r, channel, b"m" * 10))
            assert status == 201, body
    # the channel cap (3 non-default channels) and the held cap (10 across channels)
    status, body = _call(relay, _enqueue(r, b"D", b"x"))
    assert (status, body["code"]) == (507, "too_many_channels")
    for channel in (b"A", b""):
        status, body = _call(relay, _enqueue(r, channel, b"x"))
        assert (status, body["code"]) == (507, "recipient_full"), channel
    # the listing: signed like every queue read; unsigned or another key's signature is 401
    path = f"/v1/queues/{r}/channels"
    status, doc = _call(relay, owner.signed("GET", path))
    assert status == 200, doc
    listed = [(b"", 2), (b"A", 3), (b"B", 3), (b"C", 2)]  # the default channel first
    assert doc == {
        "channels": [
            {"channel": b64encode(ch), "message_count": n, "total_bytes": 10 * n, "mediated": False}
            for ch, n in listed
        ],
        "message_count": 10,
        "total_bytes": 100,
    }
    assert _call(relay, http("GET", path))[0] == 401
    assert _call(relay, owner.signed("GET", path, as_key=Owner().sk))[0] == 401
    # an ack and a drain on non-default channels give their messages back
    status, body = _call(relay, owner.signed("POST", f"/v1/queues/{r}/ack?channel=QQ", b'{"upToSeq": 3}'))
    assert (status, body) == (200, {"removed": 3})
    status, body = _call(relay, owner.signed("POST", f"/v1/queues/{r}/drain?channel=Qg&limit=10", b""))
    assert status == 200
    assert len(body["messages"]) == 3
    for _ in range(6):  # 10 - 6 held: six more fit, the seventh does not
        assert _call(relay, _enqueue(r, b"A", b"m" * 10))[0] == 201
    status, body = _call(relay, _enqueue(r, b"A", b"x"))
    assert (status, body["code"]) == (507, "recipient_full")
    status, doc = _call(relay, owner.signed("GET", path))
    assert (doc["message_count"], doc["total_bytes"]) == (10, 100)
    # a listing of a recipient nobody wrote to answers the default channel, empty, and
    # writes nothing to Redis
    client = redis.Redis.from_url(relay.redis.url)
    before = set(client.keys("*"))
    stranger = Owner()
    status, doc = _call(relay, stranger.signed("GET", f"/v1/queues/{stranger.key}/channels"))
    assert (status, doc) == (
        200,
        {
            "channels": [{"channel": "", "message_count": 0, "total_bytes": 0, "mediated": False}],
            "message_count": 0,
            "total_bytes": 0,
        },
    )
    keys = {k for k in client.keys("*") if isinstance(k, bytes)}
    assert {k for k in keys - before if not k.endswith(b":nonces")} == set()  # the signature's nonce only
    prefix = K.recipient_field(bytes(stranger.sk.verify_key)).encode()
    fields = [f for k in keys if k.endswith(b":rcpt") for f in client.hkeys(k) if isinstance(f, bytes)]
    assert not any(f.startswith(prefix) for f in fields)


def test_retention_trim_drift_is_reconciled_by_the_listing(signed_relay: Relay) -> None:
    """Messages removed behind the relay's back (the retention job's trim) leave the counters
    high: the recipient is refused early, never late, until its listing (or a refusal)
    recomputes them from the queues."""
    relay, owner = signed_relay, Owner()
    r = owner.key
    for _ in range(10):
        assert _call(relay, _enqueue(r, b"A", b"m" * 10))[0] == 201
    client = redis.Redis.from_url(relay.redis.url)
    qa = K.queue_keys(bytes(owner.sk.verify_key), b"A")
    client.xtrim(qa.msgs, maxlen=0)  # as trim.lua would, minus the refund
    client.hset(qa.meta, "bytes", 0)
    status, body = _call(relay, _enqueue(r, b"A", b"x"))
    assert (status, body["code"]) == (507, "recipient_full")  # early, the counters still say 10

    def reconciled() -> bool:
        _status, doc = _call(relay, owner.signed("GET", f"/v1/queues/{r}/channels"))
        assert doc["message_count"] == 0  # what the queues hold, read from them
        return _call(relay, _enqueue(r, b"A", b"x"))[0] == 201

    # the reconciliation waits until no admitted enqueue can still be on its way (~7 s)
    wait_for("the listing to reconcile the counters", reconciled, timeout=30, interval=0.5)


def _big_enqueue(relay: Relay, big: str) -> tuple[int, str]:
    """(status, error code or "") of a 1 KiB enqueue to the big tenant's queue."""
    answer = asyncio.run(request_answer(relay, _enqueue(big, b"", b"b" * 1024)))
    return answer.status, (str(answer.json().get("code", "")) if answer.status >= 400 else "")


def test_shard_reserve_stops_the_big_tenant_while_small_ones_store(relay_with: RelayWith) -> None:
    relay = relay_with({"RELAY_SHARD_RESERVE_FRACTION": "0.5", "RELAY_SHARD_RESERVE_QUEUE_BYTES": "65536"})
    big, small = recipient(7), recipient(8)
    for _ in range(2):  # the big tenant's queue holds 100 KiB before the shard fills
        assert asyncio.run(request_answer(relay, _enqueue(big, b"", b"b" * 51200))).status == 201
    client = redis.Redis.from_url(relay.redis.url)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(int(used * 1.6)))  # within the last half of maxmemory
    try:
        # the relay reads each shard's memory about once a second: the big tenant is refused
        # from its next read on (until then its enqueues store, as they may)
        wait_for(
            "the big tenant refused for the shard reserve",
            lambda: _big_enqueue(relay, big) == (507, "storage_reserve"),
            timeout=30,
            interval=0.2,
        )
        started = time.perf_counter()
        stored = sum(
            asyncio.run(request_answer(relay, _enqueue(recipient(100 + i), b"", b"s" * 1024))).status == 201
            for i in range(20)
        )
        report("shard reserve", big_tenant="507 storage_reserve", small_tenants_stored=f"{stored}/20",
               seconds=f"{time.perf_counter() - started:.2f}")  # fmt: skip
        assert stored == 20
        assert asyncio.run(request_answer(relay, _enqueue(small, b"", b"s" * 1024))).status == 201
        refused = asyncio.run(
            metric(
                relay, f'relayfleet_quota_refusals_total{{reason="shard_reserve",route="{ENQUEUE_ROUTE}"}}'
            )
        )
        assert refused >= 1
    finally:
        client.config_set("maxmemory", "0")
    wait_for(
        "the big tenant stored again", lambda: _big_enqueue(relay, big)[0] == 201, timeout=30, interval=0.2
    )
    relay.assert_log_clean()
