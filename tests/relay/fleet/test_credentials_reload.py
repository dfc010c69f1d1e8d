"""A shard's credentials file (a mounted Secret) is re-read when it appears or changes, and
when Redis refuses the login: a relay follows without a restart. Real redis-server with a
password, the relay's own credentials directory, files replaced by rename as the kubelet does."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay.client import RelayError
from relay.fleet.routing import single_shard_map
from tests.support.fleet_harness import DEBIAN_REDIS
from tests.support.in_process_relay import RelayFactory, RunningRelay


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[LocalRedis]:
    server = LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / "redis"), password="first").start()
    try:
        yield server
    finally:
        server.stop()


def publish(directory: Path, name: str, url: str) -> None:
    """As the kubelet updates a Secret volume: a new file swapped in by rename."""
    staged = directory / f".{name}.tmp"
    staged.write_text(url + "\n")
    os.replace(staged, directory / name)


async def enqueue_until_stored(
    relay: RunningRelay, recipient: bytes, payload: bytes, within_s: float
) -> float:
    """Seconds until an enqueue was stored (every earlier try refused with a 5xx)."""
    started = time.monotonic()
    async with relay.client() as c:
        while True:
            try:
                await c.enqueue(recipient, payload)
                return time.monotonic() - started
            except RelayError as exc:
                if exc.status < 500:
                    raise
            assert time.monotonic() - started < within_s, "the relay never picked up the credentials"
            await asyncio.sleep(0.2)


async def test_credentials_written_after_the_map_and_then_rotated_are_followed(
    locked: LocalRedis, tmp_path: Path, relay_factory: RelayFactory, http: aiohttp.ClientSession
) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir()
    public = f"redis://127.0.0.1:{locked.port}/0"  # the map never holds the password
    relay = await relay_factory(shard_map=single_shard_map(public), credentials_dir=str(creds))
    r = os.urandom(32)
    async with relay.client() as c:
        with pytest.raises(RelayError, match="503"):
            await c.enqueue(r, b"too early")
    async with http.get(relay.base_url + "/readyz") as resp:
        body = await resp.text()
    assert "NOAUTH" in body or "AuthenticationError" in body
    assert "first" not in body

    await asyncio.sleep(2)  # the Secret reaches the volume after the map
    publish(creds, "default", f"redis://:first@127.0.0.1:{locked.port}/0")
    assert await enqueue_until_stored(relay, r, b"one", within_s=5) < 5
    async with http.get(relay.base_url + "/readyz") as resp:
        assert resp.status == 200

    # Rotation: Redis takes the new password and drops its clients (a restart would); the
    # relay's reconnect is refused (WRONGPASS) until the new Secret is mounted.
    with redis.Redis(port=locked.port, password="first") as admin:
        admin.config_set("requirepass", "second")
        admin.client_kill_filter(_type="normal", skipme=True)
    locked.password = "second"
    await asyncio.sleep(1)
    publish(creds, "default", f"redis://:second@127.0.0.1:{locked.port}/0")
    assert await enqueue_until_stored(relay, r, b"two", within_s=5) < 5
    async with relay.client() as c:
        assert [m.payload for m in (await c.read(r)).messages] == [b"one", b"two"]


async def test_a_refused_login_rereads_a_file_the_watch_did_not_see_change(
    locked: LocalRedis, tmp_path: Path, relay_factory: RelayFactory
) -> None:
    """The file's (inode, mtime, size) can stay the same across a rewrite (same length, same
    clock tick, written in place): Redis refusing the login makes the relay read it anyway."""
    creds = tmp_path / "credentials"
    creds.mkdir()
    target = creds / "default"
    target.write_text(f"redis://:wrong@127.0.0.1:{locked.port}/0\n")
    relay = await relay_factory(
        shard_map=single_shard_map(f"redis://127.0.0.1:{locked.port}/0"), credentials_dir=str(creds)
    )
    st = target.stat()
    target.write_text(f"redis://:first@127.0.0.1:{locked.port}/0\n")  # in place, same size
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert await enqueue_until_stored(relay, os.urandom(32), b"x", within_s=5) < 5
