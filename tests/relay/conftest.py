"""Fixtures of the relay's tests that several files share: the DIDComm seed file, a private CA
with its server certificates, the operator's push webhook, the device-push world."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis

from tests.support.in_process_relay import RelayFactory
from tests.support.push_providers import Webhook, webhook_server
from tests.support.push_world import OpenPushWorld, World, push_world
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
    """Opens the device-push world (tests/support/push_world.py) on this test's fixtures."""

    def open_world(min_interval_s: float = 60.0) -> AbstractAsyncContextManager[World]:
        return push_world(
            redis_server, relay_factory, seed_file, pki, webhook, http, tmp_path, min_interval_s
        )

    return open_world
