"""Fixtures of the relay's tests that several folders share: the DIDComm seed file, a private
CA with its server certificates, the operator's push webhook."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.push_providers import Webhook, webhook_server
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
