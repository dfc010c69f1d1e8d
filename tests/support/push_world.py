"""The device-push world the push tests share: a real relay over a real redis-server with the
three providers (the webhook, local FCM HTTP v1 and APNs servers from
tests/support/push_providers.py), opened by the `open_push_world` fixture of tests/relay/conftest.py,
and a wallet (the PyNaCl test agent) whose devices are set."""

from __future__ import annotations

import asyncio
import os
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from relay.devicepush.wiring import DEVICE_NOTIFIER
from relay.didcomm import keys as dk
from tests.support.didcomm_test_agent import Agent, msg
from tests.support.in_process_relay import RunningRelay
from tests.support.push_providers import (
    ApnsServer,
    FcmServer,
    Webhook,
)
from tests.support.waiting import until

PUBLIC = "https://relay.example.test"
FCM_TOKEN = "fcm-device-1:APA91bH-relayfleet_test.token"
APNS_TOKEN = "0f" * 32
COALESCE_S = 0.3


@dataclass
class World:
    relay: RunningRelay
    webhook: Webhook
    fcm: FcmServer
    apns: ApnsServer
    http: aiohttp.ClientSession

    async def close(self) -> None:
        """The relay's provider connections closed before the servers stop (the servers
        would otherwise wait out their graceful timeout on them)."""
        await self.relay.app[DEVICE_NOTIFIER].stop()

    def sent(self) -> tuple[int, int, int]:
        return len(self.webhook.calls), len(self.fcm.notifications), len(self.apns.notifications)

    async def quiet(self) -> None:
        """Every pending burst handled (its window closed and its sends answered)."""
        notifier = self.relay.app[DEVICE_NOTIFIER]
        await until("it", lambda: notifier.pending() == 0)
        await asyncio.sleep(COALESCE_S + 0.3)  # a send in flight when the map emptied


class OpenPushWorld(Protocol):
    """Opens a World on a test's fixtures: the `open_push_world` fixture (tests/relay/conftest.py)."""

    def __call__(self, min_interval_s: float = 60.0) -> AbstractAsyncContextManager[World]: ...


async def phone(
    world: World, fcm_token: str | None = FCM_TOKEN, apns_token: str | None = APNS_TOKEN
) -> tuple[Agent, bytes]:
    """A wallet: connected, mediated, one key registered, its devices set."""
    agent = Agent(world.relay.base_url, world.http)
    await agent.connect()
    await agent.mediate()
    key = dk.KeyPair.from_seed(os.urandom(32)).verkey
    assert (await agent.register(key))["updated"][0]["result"] == "success"
    if fcm_token is not None:
        put = msg(
            "push-notifications-fcm/1.0/set-device-info", device_token=fcm_token, device_platform="android"
        )
        assert (await agent.send(put) or {}).get("status") == "OK"
    if apns_token is not None:
        put = msg("push-notifications-apns/1.0/set-device-info", device_token=apns_token)
        assert (await agent.send(put) or {}).get("status") == "OK"
    return agent, key
