"""Push hook: offline queues get a webhook call ({recipient, channel, seq}, never the payload).

The webhook is a real HTTP server on a real socket (the `webhook` fixture of
tests/relay/conftest.py); the relay a real aiohttp app over a real redis-server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from relayfleet_testing.localredis import LocalRedis, free_port

from relay import metrics
from relay.api.context import CTX
from relay.protocol import b64encode, keypair
from relay.push import NOTIFIER, PushNotifier
from relay.retrying import PUSH_WEBHOOK
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.push_providers import Webhook

FAST = dataclasses.replace(PUSH_WEBHOOK, first_s=0.01, cap_s=0.04, jitter_s=0.0)
ATTEMPTS = PUSH_WEBHOOK.attempts or 0


def pushes(outcome: str) -> float:
    value = metrics.REGISTRY.get_sample_value("relayfleet_push_notifications_total", {"outcome": outcome})
    return value or 0.0


async def fast_relay(factory: RelayFactory, redis_url: str, url: str) -> RunningRelay:
    relay = await factory(redis_url, push_webhook=url)
    notifier = relay.app[NOTIFIER]
    notifier.policy = FAST  # keep retry tests short
    return relay


async def test_offline_queue_is_notified_without_the_payload(
    redis_server: LocalRedis, relay_factory: RelayFactory, webhook: Webhook
) -> None:
    relay = await fast_relay(relay_factory, redis_server.url, webhook.url)
    recipient, _ = keypair()
    async with relay.client() as c:
        seq, _ = await c.enqueue(recipient, b"TOP-SECRET-PAYLOAD", channel=b"ch")
    await webhook.wait_for(1)
    assert webhook.calls == [{"recipient": b64encode(recipient), "channel": b64encode(b"ch"), "seq": seq}]
    assert b"TOP-SECRET" not in webhook.raw[0]
    assert b64encode(b"TOP-SECRET-PAYLOAD").encode() not in webhook.raw[0]


async def test_no_push_while_a_client_waits_or_is_live(
    redis_server: LocalRedis, relay_factory: RelayFactory, webhook: Webhook
) -> None:
    relay = await fast_relay(relay_factory, redis_server.url, webhook.url)
    waiting, live_one, offline = keypair()[0], keypair()[0], keypair()[0]
    async with relay.client() as c:
        poll = asyncio.ensure_future(c.read(waiting, wait=5))
        await asyncio.sleep(0.2)  # the long-poll is registered and subscribed
        await c.enqueue(waiting, b"a")
        assert len((await poll).messages) == 1
        conn = await c.live(live_one)
        assert (await conn.frame())["type"] == "empty"
        await c.enqueue(live_one, b"b")
        assert (await conn.frame())["type"] == "message"
        await conn.close()
        await c.enqueue(offline, b"c")  # the marker: once it is pushed, the others would have been
    await webhook.wait_for(1)
    await asyncio.sleep(0.2)
    assert [call["recipient"] for call in webhook.calls] == [b64encode(offline)]


async def test_a_slow_webhook_never_slows_enqueue(
    redis_server: LocalRedis, relay_factory: RelayFactory, webhook: Webhook
) -> None:
    relay = await fast_relay(relay_factory, redis_server.url, webhook.url)
    webhook.delay_s = 4.0
    async with relay.client() as c:
        await c.enqueue(keypair()[0], b"x")
        await webhook.wait_for(1)
        slowest = 0.0
        for _ in range(20):
            start = time.perf_counter()
            await c.enqueue(keypair()[0], b"x")
            slowest = max(slowest, time.perf_counter() - start)
        # every enqueue was answered while the webhook still sat on its first call
        assert webhook.answered == 0
        assert slowest < 2.0
    await webhook.wait_for(4)  # the workers are busy with the first few


async def test_failures_are_retried_a_bounded_number_of_times(
    redis_server: LocalRedis, relay_factory: RelayFactory, webhook: Webhook
) -> None:
    relay = await fast_relay(relay_factory, redis_server.url, webhook.url)
    before_retried, before_failed = pushes("retried"), pushes("failed")
    webhook.answers = [503, 500]  # two failures, then success
    async with relay.client() as c:
        await c.enqueue(keypair()[0], b"x")
        await webhook.wait_for(3)
        assert pushes("retried") - before_retried == 2
        webhook.answers = [500] * 10  # never succeeds: gives up after the bound
        await c.enqueue(keypair()[0], b"y")
        await webhook.wait_for(3 + ATTEMPTS)
        await asyncio.sleep(0.1)
        assert len(webhook.calls) == 3 + ATTEMPTS
        assert pushes("failed") - before_failed == 1
        webhook.answers = [400]  # refused: not retried
        await c.enqueue(keypair()[0], b"z")
        await webhook.wait_for(4 + ATTEMPTS)
        await asyncio.sleep(0.1)
        assert len(webhook.calls) == 4 + ATTEMPTS


async def test_pending_notifications_are_bounded_and_coalesced(webhook: Webhook) -> None:
    notifier = PushNotifier(webhook.url, max_pending=3, workers=1, policy=FAST)
    before = pushes("dropped")
    webhook.delay_s = 0.3
    await notifier.start()
    try:
        a, b, c, d = (keypair()[0] for _ in range(4))
        notifier.offer(a, b"", 1)
        await webhook.wait_for(1)  # the single worker is now busy with a
        for seq in range(1, 6):
            notifier.offer(b, b"", seq)  # a burst for one queue: one pending entry, latest seq
        notifier.offer(c, b"", 1)
        notifier.offer(d, b"", 1)
        notifier.offer(keypair()[0], b"", 1)  # over the bound of 3 pending queues
        assert notifier.pending() == 3
        assert pushes("dropped") - before == 1
        await webhook.wait_for(4)
        assert [(call["recipient"], call["seq"]) for call in webhook.calls[1:]] == [
            (b64encode(b), 5),
            (b64encode(c), 1),
            (b64encode(d), 1),
        ]
    finally:
        await notifier.stop()


async def test_unreachable_webhook_costs_enqueue_nothing(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await fast_relay(relay_factory, redis_server.url, f"http://127.0.0.1:{free_port()}/nobody")
    before = pushes("failed")
    async with relay.client() as c:
        start = time.perf_counter()
        await c.enqueue(keypair()[0], b"x")
        assert time.perf_counter() - start < 0.5
        for _ in range(500):  # connection refused, retried with backoff: well under 10 s
            if pushes("failed") > before:
                break
            await asyncio.sleep(0.02)
        assert pushes("failed") == before + 1


async def test_no_webhook_no_notifier(relay: RunningRelay) -> None:
    assert NOTIFIER not in relay.app
    assert relay.app[CTX].service.on_stored is None


async def test_a_bad_webhook_url_is_a_clear_error(
    redis_server: LocalRedis, relay_factory: RelayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    relay = await relay_factory(redis_server.url, push_webhook="ftp://token@example/x")
    assert NOTIFIER not in relay.app
    assert "RELAY_PUSH_WEBHOOK must be an http(s) URL" in caplog.text
    assert "token" not in caplog.text
