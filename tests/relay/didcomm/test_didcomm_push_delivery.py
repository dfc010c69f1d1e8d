"""Device push for mediated keys, end to end: a real relay over a real redis-server, the PyNaCl
test agent as the phone's wallet, anonymous forwards as any sender's, and the three providers
as real servers on real sockets: the operator's webhook (HTTP), and local servers following
FCM HTTP v1 with its OAuth2 exchange (HTTPS) and APNs (TLS + HTTP/2, token auth) from
tests/support/push_providers.py. The real FCM and APNs are out of reach here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay import metrics
from relay.devicepush.wiring import DEVICE_NOTIFIER
from relay.didcomm import keys as dk
from tests.support.didcomm_test_agent import Agent, forward_envelope, inner_message, msg
from tests.support.in_process_relay import RelayFactory
from tests.support.push_providers import apns_server, fcm_server
from tests.support.push_world import APNS_TOKEN, FCM_TOKEN, PUBLIC, OpenPushWorld, World, phone
from tests.support.tls_pki import Pki
from tests.support.waiting import until


def device_push(provider: str, outcome: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "relayfleet_device_push_total", {"provider": provider, "outcome": outcome}
    )
    return value or 0.0


def bursts(result: str) -> float:
    return metrics.REGISTRY.get_sample_value("relayfleet_device_push_bursts_total", {"result": result}) or 0.0


@pytest.fixture
async def world(open_push_world: OpenPushWorld) -> AsyncIterator[World]:
    async with open_push_world() as w:
        yield w


async def burst(agent: Agent, key: bytes, n: int, tag: str) -> list[dict[str, Any]]:
    """`n` forwards for `key` at once, as a sender's agent posts them; the packed messages."""
    routing = dk.verkey_from(agent.grant["routing_keys"][0])
    inners = [inner_message(key, f"{tag}-{i}") for i in range(n)]
    ids = [f"{tag}-forward-{i}" for i in range(n)]
    results = await asyncio.gather(
        *(
            agent.post(forward_envelope(routing, key, inner, fid))
            for inner, fid in zip(inners, ids, strict=True)
        )
    )
    assert [status for status, _ in results] == [202] * n
    return inners


def assert_no_payload(raw: bytes, inners: list[dict[str, Any]], tag: str) -> None:
    for inner in inners:
        for secret in (inner["ciphertext"], inner["iv"], inner["tag"], inner["protected"]):
            assert secret.encode() not in raw
    assert tag.encode() not in raw  # neither the forwards' ids nor anything derived from them


async def test_a_burst_of_five_makes_one_notification_per_provider_without_the_payload(world: World) -> None:
    agent, key = await phone(world)
    sent_before = device_push("fcm", "sent")
    notified = metrics.REGISTRY.get_sample_value(
        "relayfleet_device_push_bursts_total", {"result": "notified"}
    )
    inners = await burst(agent, key, 5, "burst-a")
    await world.fcm.wait_for(1)
    await world.apns.wait_for(1)
    await until("it", lambda: len(world.webhook.calls) >= 1)
    await world.quiet()
    assert world.sent() == (1, 1, 1)

    hook = world.webhook.calls[0]
    assert hook == {
        "type": "didcomm-devices",
        "count": 5,
        "devices": [
            {"service": "fcm", "device_token": FCM_TOKEN, "device_platform": "android"},
            {"service": "apns", "device_token": APNS_TOKEN, "device_platform": None},
        ],
    }
    fcm = world.fcm.notifications[0]
    assert fcm["token"] == FCM_TOKEN
    assert fcm["message"]["data"] == {
        "@type": "https://didcomm.org/push-notifications-fcm",
        "message_count": "5",
    }
    apns = world.apns.notifications[0]
    assert apns["token"] == APNS_TOKEN
    assert apns["headers"]["apns-topic"] == world.apns.topic
    assert apns["headers"]["apns-push-type"] == "alert"
    assert apns["payload"]["@type"] == "https://didcomm.org/push-notifications-apns"
    assert apns["payload"]["message_count"] == 5
    for raw in (world.webhook.raw[0], fcm["raw"], apns["raw"]):
        assert_no_payload(raw, inners, "burst-a")
        assert dk.b64url(key).encode() not in raw
        assert dk.b58encode(key).encode() not in raw
    assert world.fcm.token_grants == 1  # one OAuth2 exchange, its access token reused
    assert device_push("fcm", "sent") == sent_before + 1  # relayfleet_device_push_total
    assert (
        metrics.REGISTRY.get_sample_value("relayfleet_device_push_bursts_total", {"result": "notified"})
        == (notified or 0.0) + 1
    )
    assert world.fcm.refusals == []
    assert world.apns.refusals == []

    # a second burst inside the minimum interval: counted, nothing sent
    coalesced = device_push("apns", "coalesced")
    await burst(agent, key, 3, "burst-b")
    await until("it", lambda: device_push("apns", "coalesced") == coalesced + 1)
    await world.quiet()
    assert world.sent() == (1, 1, 1)


async def test_a_live_socket_means_no_notification(world: World) -> None:
    agent, key = await phone(world)
    online = bursts("online") + bursts("merged")
    async with world.http.ws_connect(world.relay.base_url + "/v1/didcomm/ws") as ws:
        change = msg("messagepickup/2.0/live-delivery-change", live_delivery=True)
        change["~transport"] = {"return_route": "all"}
        await ws.send_bytes(agent.packed(change))
        status, _ = agent.open(await ws.receive_bytes(timeout=5))
        assert status["live_delivery"] is True
        await burst(agent, key, 5, "live")
        deliveries = 0
        while deliveries < 5:
            delivery, _ = agent.open(await ws.receive_bytes(timeout=5))
            deliveries += len(delivery["~attach"])
        await world.quiet()
    assert world.sent() == (0, 0, 0)
    assert bursts("online") + bursts("merged") == online  # not even offered: the socket was subscribed


async def test_a_null_token_means_no_notification(world: World) -> None:
    agent, key = await phone(world)
    for family, body in (
        ("push-notifications-fcm/1.0", {"device_token": None, "device_platform": None}),
        ("push-notifications-apns/1.0", {"device_token": None}),
    ):
        assert (await agent.send(msg(family + "/set-device-info", **body)) or {}).get("status") == "OK"
    no_device = bursts("no_device")
    await burst(agent, key, 5, "unset")
    await until("it", lambda: bursts("no_device") == no_device + 1)
    await world.quiet()
    assert world.sent() == (0, 0, 0)


async def test_dead_tokens_unregister_their_devices(world: World) -> None:
    world.fcm.unregistered.add(FCM_TOKEN)
    short = "ab" * 16  # hex, but not a token APNs knows the shape of: BadDeviceToken
    agent, key = await phone(world, apns_token=short)
    await burst(agent, key, 2, "dead")
    await until("it", lambda: len(world.fcm.refusals) == 1 and len(world.apns.refusals) == 1)
    await world.quiet()
    assert world.fcm.refusals == [(404, "unregistered")]
    assert world.apns.refusals == [(400, "bad token")]
    for family in ("push-notifications-fcm/1.0", "push-notifications-apns/1.0"):
        report = await agent.send(msg(family + "/get-device-info"))
        assert report is not None
        assert report["description"]["code"] == "not-registered-for-push-notifications"
    assert len(world.webhook.calls) == 1  # the gateway got its one call before


async def test_apns_410_unregisters_and_fcm_invalid_token_too(open_push_world: OpenPushWorld) -> None:
    async with open_push_world(min_interval_s=0.0) as w:
        fcm, apns = w.fcm, w.apns
        apns.unregistered.add(APNS_TOKEN)
        agent, key = await phone(w, fcm_token="no-colon-token")  # FCM: INVALID_ARGUMENT on message.token
        await burst(agent, key, 1, "gone")
        await until("it", lambda: len(fcm.refusals) == 1 and len(apns.refusals) == 1)
        await w.quiet()
        assert fcm.refusals == [(400, "invalid token")]
        assert apns.refusals == [(410, "unregistered")]
        assert device_push("apns", "unregistered") >= 1
        assert device_push("fcm", "unregistered") >= 1
        for family in ("push-notifications-fcm/1.0", "push-notifications-apns/1.0"):
            report = await agent.send(msg(family + "/get-device-info"))
            assert report is not None
            assert report["description"]["code"] == "not-registered-for-push-notifications"


async def test_a_live_socket_on_another_relay_means_no_notification(
    world: World, redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str
) -> None:
    """The push decision is the fleet's presence (relay/presence.py): a live lease held by
    another relay answers `online` to this relay's notifier, and the burst is not sent."""
    from relay.api.context import CTX
    from relay.didcomm.records import QUEUE_CHANNEL

    _, key = await phone(world)
    other = await relay_factory(redis_server.url, didcomm_seed_file=seed_file, public_url=PUBLIC)
    await other.app[CTX].presence.take(key, QUEUE_CHANNEL, "socket-on-b", lambda: None)
    notifier = world.relay.app[DEVICE_NOTIFIER]
    online = bursts("online")
    await notifier.notify(key, 5)
    assert bursts("online") == online + 1
    assert world.sent() == (0, 0, 0)
    other.app[CTX].presence.drop(key, QUEUE_CHANNEL, "socket-on-b")

    async def released() -> bool:
        return not await world.relay.app[CTX].presence.online(key, QUEUE_CHANNEL)

    await until("the lease released", released)
    await notifier.notify(key, 5)  # gone: the next burst goes out
    await world.fcm.wait_for(1)
    await world.apns.wait_for(1)
    await until("the webhook's call", lambda: len(world.webhook.calls) == 1)


async def test_the_local_providers_check_signatures_and_http2(pki: Pki) -> None:
    """The stand-ins refuse what the real services refuse: an assertion or provider token
    signed by another key, and APNs over HTTP/1.1."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    from relay.devicepush.providers import (
        ApnsCredentials,
        ApnsProvider,
        FcmCredentials,
        FcmProvider,
        Outcome,
        http_client,
    )
    from relay.didcomm.records import Device

    def pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> str:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()

    async with fcm_server(pki) as fcm, apns_server(pki) as apns:
        account = {**fcm.service_account(), "private_key": pem(rsa.generate_private_key(65537, 2048))}
        forged = FcmProvider(
            FcmCredentials.parse(json.dumps(account).encode()), fcm.url, http_client(str(pki.ca))
        )
        assert await forged.send((Device("fcm", FCM_TOKEN, "android"),), 1) is Outcome.REJECTED
        assert fcm.refusals == [(400, "token: BadSignatureError")]
        await forged.close()
        stranger = ApnsCredentials(
            pem(ec.generate_private_key(ec.SECP256R1())), apns.key_id, apns.team_id, apns.topic
        )
        wrong = ApnsProvider(stranger, apns.url, http_client(str(pki.ca), http2=True))
        assert await wrong.send((Device("apns", APNS_TOKEN),), 1) is Outcome.REJECTED
        await wrong.close()
        right = ApnsCredentials(apns.auth_key_p8(), apns.key_id, apns.team_id, apns.topic)
        h1 = ApnsProvider(right, apns.url, http_client(str(pki.ca), http2=False))
        assert await h1.send((Device("apns", APNS_TOKEN),), 1) is not Outcome.SENT
        await h1.close()
        assert apns.refusals[0] == (403, "InvalidProviderToken")
        assert apns.notifications == []
