"""The device-push world the push tests share: a real relay over a real redis-server with the
three providers (the webhook, local FCM HTTP v1 and APNs servers from
tests/support/push_providers.py) and a wallet (the PyNaCl test agent) whose devices are set."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp
from relayfleet_testing.localredis import LocalRedis

from relay.devicepush.wiring import DEVICE_NOTIFIER
from relay.didcomm import keys as dk
from tests.support.didcomm_test_agent import Agent, msg
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.push_providers import (
    ApnsServer,
    FcmServer,
    Webhook,
    apns_server,
    fcm_server,
    write_credentials,
)
from tests.support.tls_pki import Pki
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
    """push_world() of a test's fixtures (the `open_push_world` fixture, tests/relay/conftest.py)."""

    def __call__(self, min_interval_s: float = 60.0) -> AbstractAsyncContextManager[World]: ...


@asynccontextmanager
async def push_world(
    redis_server: LocalRedis,
    relay_factory: RelayFactory,
    seed_file: str,
    pki: Pki,
    webhook: Webhook,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    min_interval_s: float = 60.0,
) -> AsyncIterator[World]:
    """The local FCM and APNs servers and a relay pushing to them and to `webhook` (the fixtures
    of tests/relay/conftest.py); closed in order afterwards (World.close)."""
    async with fcm_server(pki) as fcm, apns_server(pki) as apns:
        creds = write_credentials(tmp_path / "push-secret", fcm, apns)
        relay = await relay_factory(
            redis_server.url,
            didcomm_seed_file=seed_file,
            public_url=PUBLIC,
            push_webhook=webhook.url,
            push_credentials_dir=str(creds),
            push_fcm_url=fcm.url,
            push_apns_url=apns.url,
            push_ca_file=str(pki.ca),
            push_coalesce_s=COALESCE_S,
            push_min_interval_s=min_interval_s,
        )
        world = World(relay, webhook, fcm, apns, http)
        try:
            yield world
        finally:
            await world.close()


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
