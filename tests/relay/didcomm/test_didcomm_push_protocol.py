"""Push notifications 1.0 on the mediator (Aries RFC 0734 fcm, RFC 0699 apns), spoken by the
PyNaCl test agent over real sockets and a real redis-server: set → ack, get → device-info in
the get's thread, problem-reports, bounds, and the records' life with their connection."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import aiohttp
import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay.didcomm import keys as dk
from relay.fleet.sharding import slot_of
from relay.storage import keys as K
from tests.support.didcomm_test_agent import Agent, msg
from tests.support.in_process_relay import RelayFactory, RunningRelay

PUBLIC = "https://relay.example.test"
FCM = "push-notifications-fcm/1.0/"
APNS = "push-notifications-apns/1.0/"
FCM_TOKEN = "dXk3Fq0:APA91bH-ExampleToken_of.fcm-shape"
APNS_TOKEN = "ab" * 32


@pytest.fixture
async def relay(redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str) -> RunningRelay:
    return await relay_factory(redis_server.url, didcomm_seed_file=seed_file, public_url=PUBLIC)


@pytest.fixture
async def agent(relay: RunningRelay, http: aiohttp.ClientSession) -> Agent:
    a = Agent(relay.base_url, http)
    await a.connect()
    return a


async def answer(agent: Agent, doc: dict[str, Any]) -> dict[str, Any]:
    reply = await agent.send(doc)
    assert reply is not None
    return reply


async def test_fcm_get_before_set_then_set_get_round_trip_and_null_unregisters(agent: Agent) -> None:
    get = msg(FCM + "get-device-info")
    report = await answer(agent, get)
    assert report["@type"] == "https://didcomm.org/" + FCM + "problem-report"
    assert report["description"]["code"] == "not-registered-for-push-notifications"
    assert report["~thread"] == {"thid": get["@id"]}

    put = msg(FCM + "set-device-info", device_token=FCM_TOKEN, device_platform="android")
    ack = await answer(agent, put)
    assert ack["@type"] == "https://didcomm.org/notification/1.0/ack"
    assert ack["status"] == "OK"
    assert ack["~thread"] == {"thid": put["@id"]}

    get = msg(FCM + "get-device-info")
    info = await answer(agent, get)
    assert info["@type"] == "https://didcomm.org/" + FCM + "device-info"
    assert (info["device_token"], info["device_platform"]) == (FCM_TOKEN, "android")
    assert info["~thread"] == {"thid": get["@id"]}

    # apns is a separate registration on the same connection
    report = await answer(agent, msg(APNS + "get-device-info"))
    assert report["description"]["code"] == "not-registered-for-push-notifications"

    off = msg(FCM + "set-device-info", device_token=None, device_platform=None)
    assert (await answer(agent, off))["status"] == "OK"
    report = await answer(agent, msg(FCM + "get-device-info"))
    assert report["description"]["code"] == "not-registered-for-push-notifications"


async def test_apns_round_trip_with_the_legacy_prefix_and_a_thread(agent: Agent) -> None:
    legacy = "did:sov:BzCbsNYhMrjHiqZDTUASHg;spec/"
    put = {"@type": legacy + APNS + "set-device-info", "@id": "set-1", "device_token": APNS_TOKEN}
    ack = await answer(agent, put)
    assert ack["@type"] == legacy + "notification/1.0/ack"
    assert ack["~thread"] == {"thid": "set-1"}
    get = {"@type": legacy + APNS + "get-device-info", "@id": "get-1", "~thread": {"thid": "t-9"}}
    info = await answer(agent, get)
    assert info["@type"] == legacy + APNS + "device-info"
    assert info == {**info, "device_token": APNS_TOKEN, "~thread": {"thid": "t-9"}}
    assert "device_platform" not in info
    assert (await answer(agent, {**put, "device_token": None}))["status"] == "OK"
    report = await answer(agent, {**get, "@id": "get-2", "~thread": {"thid": "get-2"}})
    assert report["description"]["code"] == "not-registered-for-push-notifications"


async def test_one_null_is_missing_value_and_bad_values_are_400(agent: Agent) -> None:
    half = msg(FCM + "set-device-info", device_token=FCM_TOKEN, device_platform=None)
    report = await answer(agent, half)
    assert report["@type"].endswith(FCM + "problem-report")
    assert report["description"]["code"] == "missing-value"
    assert report["~thread"] == {"thid": half["@id"]}
    for bad in (
        {"device_token": "x" * 513, "device_platform": "android"},
        {"device_token": "has space", "device_platform": "android"},
        {"device_token": 7, "device_platform": "android"},
        {"device_token": FCM_TOKEN, "device_platform": "a" * 33},
        {"device_token": FCM_TOKEN, "device_platform": ["android"]},
    ):
        status, body = await agent.post(agent.packed(msg(FCM + "set-device-info", **bad)))
        assert (status, json.loads(body)["code"]) == (400, "bad_device_info"), bad
    for bad_apns in ("abc", "zz" * 32, "ab" * 257):
        status, body = await agent.post(agent.packed(msg(APNS + "set-device-info", device_token=bad_apns)))
        assert (status, json.loads(body)["code"]) == (400, "bad_device_info"), bad_apns
    report = await answer(agent, msg(FCM + "get-device-info"))  # nothing was stored
    assert report["description"]["code"] == "not-registered-for-push-notifications"
    status, body = await agent.post(agent.packed(msg(FCM + "unset-everything")))
    assert (status, json.loads(body)["code"]) == (400, "unsupported_message_type")


async def test_discover_features_lists_both_families(agent: Agent) -> None:
    reply = await answer(
        agent, msg("discover-features/1.0/query", query="https://didcomm.org/push-notifications-*")
    )
    pids = {p["pid"]: p["roles"] for p in reply["protocols"]}
    assert pids == {
        "https://didcomm.org/push-notifications-fcm/1.0": ["notification-sender"],
        "https://didcomm.org/push-notifications-apns/1.0": ["notification-sender"],
    }


async def test_an_unknown_sender_cannot_set_a_device(
    relay: RunningRelay, http: aiohttp.ClientSession
) -> None:
    stranger = Agent(relay.base_url, http)
    await stranger.connect()
    stranger.kp = dk.KeyPair.from_seed(os.urandom(32))  # packs from a key with no connection
    put = msg(FCM + "set-device-info", device_token=FCM_TOKEN, device_platform="android")
    status, body = await stranger.post(stranger.packed(put))
    assert (status, json.loads(body)["code"]) == (403, "unknown_connection")


async def test_devices_live_in_the_connections_slot_and_expire_with_it(
    redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str, http: aiohttp.ClientSession
) -> None:
    relay = await relay_factory(
        redis_server.url, didcomm_seed_file=seed_file, public_url=PUBLIC, didcomm_idle_expiry_s=1.0
    )
    first = Agent(relay.base_url, http)
    await first.connect()
    await answer(first, msg(APNS + "set-device-info", device_token=APNS_TOKEN))
    slot, field = slot_of(first.kp.verkey, b""), "p:" + dk.b64url(first.kp.verkey)
    r = redis.Redis.from_url(redis_server.url)
    assert json.loads(r.hget(K.slot_didcomm(slot), field) or b"") == {"apns": {"t": APNS_TOKEN}}
    await asyncio.sleep(1.2)
    second = Agent(relay.base_url, http)
    while slot_of(second.kp.verkey, b"") != slot:  # a write to the same slot sweeps the expired
        second.kp = dk.KeyPair.from_seed(os.urandom(32))
    second.did = dk.peer2_did(second.kp, ["didcomm:transport/queue"])
    await second.connect()
    assert not r.hexists(K.slot_didcomm(slot), field)
