"""Fixtures of the relay's tests that several files share: the DIDComm seed file, a private CA
with its server certificates, the operator's push webhook, the device-push world."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis

from tests.support.in_process_relay import RelayFactory
from tests.support.push_providers import Webhook, apns_server, fcm_server, webhook_server, write_credentials
from tests.support.push_world import COALESCE_S, PUBLIC, OpenPushWorld, World
from tests.support.tls_pki import Pki, make_pki


@pytest.fixture
def seed_file(tmp_path: Path) -> str:
    """A DIDComm seed file (RELAY_DIDCOMM_SEED_FILE): 32 random bytes in hex."""
    path = tmp_path / "seed"
    path.write_text(os.urandom(32).hex() + "\n")
    return str(path)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
async def webhook() -> AsyncIterator[Webhook]:
    """A webhook server on a real socket (tests/support/push_providers.py)."""
    async with webhook_server() as hook:
        yield hook


@pytest.fixture
def open_push_world(
    redis_server: LocalRedis,
    relay_factory: RelayFactory,
    seed_file: str,
    pki: Pki,
    webhook: Webhook,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> OpenPushWorld:
    """Opens the device-push world (tests/support/push_world.py): the local FCM and APNs servers
    and a relay pushing to them and to `webhook`, closed in order afterwards (World.close)."""

    @asynccontextmanager
    async def open_world(min_interval_s: float = 60.0) -> AsyncIterator[World]:
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

    return open_world
