"""The client library as a user meets it, against a real relay on a real redis-server: keys as
`relayfleet keygen` prints them, the public key derived, decoded payloads, typed errors and the
opt-in retry that waits what the relay asked."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay import cli
from relay.client import RateLimited, RelayClient, RelayClientError, RelayError, RelayUnreachable
from relay.protocol import b64encode, keypair
from relay.storage.limits import QueueLimits
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.prometheus import free_port


@pytest.fixture
async def relay(redis_server: LocalRedis, relay_factory: RelayFactory) -> RunningRelay:
    return await relay_factory(redis_server.url, auth="ed25519")


def keygen(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    assert cli.main(["keygen"]) == 0
    keys: dict[str, str] = json.loads(capsys.readouterr().out)
    return keys


async def test_keygen_text_is_a_key_and_the_public_half_is_derived(
    relay: RunningRelay, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = keygen(capsys)
    async with RelayClient(relay.base_url, keys["private"]) as me:
        assert me.public_key is not None
        assert b64encode(me.public_key) == keys["public"]
        await me.enqueue(keys["public"], b"to myself")  # a recipient as text, too
        batch = await me.read()
        assert [m.payload for m in batch.messages] == [b"to myself"]
        async with me.live() as conn:  # no extra await
            assert (await conn.receive()).payload == b"to myself"
        assert await me.ack(up_to_seq=batch.next_seq - 1) == 1


async def test_channels_lists_what_the_recipient_holds(relay: RunningRelay) -> None:
    async with RelayClient(relay.base_url, keypair().private) as me:
        assert me.public_key is not None
        await me.enqueue(me.public_key, b"abc", channel=b"chat")
        await me.enqueue(me.public_key, b"de")
        assert await me.channels() == {
            "channels": [
                {"channel": "", "message_count": 1, "total_bytes": 2, "mediated": False},
                {"channel": b64encode(b"chat"), "message_count": 1, "total_bytes": 3, "mediated": False},
            ],
            "message_count": 2,
            "total_bytes": 5,
        }


async def test_keypair_and_the_client_agree(relay: RunningRelay) -> None:
    pair = keypair()
    public, private = pair  # the order keygen prints: public, private
    assert (pair.public, pair.private) == (public, private)
    for key in (pair, private, b64encode(private)):
        async with RelayClient(relay.base_url, key) as c:
            assert c.public_key == public
    with pytest.raises(ValueError, match="not the public half"):
        RelayClient(relay.base_url, public, public_key=private)  # the halves swapped: said so
    with pytest.raises(ValueError, match="base64url text"):
        RelayClient(relay.base_url, "not a key")
    with pytest.raises(ValueError, match=r"not an http\(s\) URL"):
        RelayClient("127.0.0.1:8080", private)


async def test_a_relay_that_is_down_is_relay_unreachable() -> None:
    async with RelayClient(f"http://127.0.0.1:{free_port()}") as c:
        with pytest.raises(RelayUnreachable) as caught:
            await c.enqueue(keypair().public, b"x")
    assert isinstance(caught.value, RelayClientError)
    assert isinstance(caught.value, ConnectionError)


async def test_a_refusal_carries_status_and_code(relay: RunningRelay) -> None:
    public, _ = keypair()
    async with RelayClient(relay.base_url) as anonymous:
        with pytest.raises(RelayError) as caught:
            await anonymous.read(public)  # unsigned read of a queue: 401
    assert (caught.value.status, caught.value.code) == (401, "unauthorized")
    assert not isinstance(caught.value, RateLimited)


async def test_rate_limited_carries_retry_after_and_retries_honour_it(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    window_ms = 1500
    relay = await relay_factory(redis_server.url, limits=QueueLimits(rate_count=1, rate_window_ms=window_ms))
    public, _ = keypair()
    async with RelayClient(relay.base_url) as plain, RelayClient(relay.base_url, retries=2) as patient:
        await plain.enqueue(public, b"first")
        with pytest.raises(RateLimited) as caught:
            await plain.enqueue(public, b"second")
        assert caught.value.status == 429
        assert 0 < caught.value.retry_after <= window_ms / 1000
        start = time.monotonic()
        seq, _ = await patient.enqueue(public, b"second")  # waits what the relay asked, then stored
        assert time.monotonic() - start >= caught.value.retry_after - 0.2
        assert seq == 2


async def test_retries_give_up_after_the_count(redis_server: LocalRedis, relay_factory: RelayFactory) -> None:
    relay = await relay_factory(redis_server.url, limits=QueueLimits(rate_count=1, rate_window_ms=60_000))
    public, _ = keypair()
    async with RelayClient(relay.base_url, retries=3, max_retry_wait=5) as c:
        await c.enqueue(public, b"first")
        async with asyncio.timeout(10):
            with pytest.raises(RateLimited):  # asked to wait 60 s, more than max_retry_wait: at once
                await c.enqueue(public, b"second")
