"""TLS to Redis end to end, against Debian's redis-server serving TLS only, with a private CA
made per test: the relay's hot path and wakeup subscriber, readiness when TLS fails, a
migration between two TLS shards (MIGRATE runs over TLS too), and a Spark retention run."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.migration import file_publisher, file_reader, migrate_slots, write_map_file
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange
from relay.storage import keys as K
from relay.storage.maintenance import ShardMaintenance
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore
from relay.storage.wakeups import WakeupHub
from tests.support.in_process_relay import RelayFactory
from tests.support.tls_pki import Pki, tls_redis

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PASSWORD = "tls-secret-pw"


@pytest.fixture
def mutual(pki: Pki) -> Iterator[LocalRedis]:
    """TLS only, a password, and a client certificate of the CA required."""
    server = tls_redis(pki, auth_clients="yes", password=PASSWORD)
    try:
        yield server
    finally:
        server.stop()


def with_client_cert(server: LocalRedis, pki: Pki) -> str:
    return server.url + pki.client_query()


async def test_relay_enqueue_read_and_long_poll_wakeup_over_mutual_tls(
    mutual: LocalRedis, pki: Pki, relay_factory: RelayFactory, http: aiohttp.ClientSession
) -> None:
    relay = await relay_factory(with_client_cert(mutual, pki))
    async with http.get(relay.base_url + "/readyz") as resp:
        assert resp.status == 200, await resp.text()
    assert relay.fleet.hubs["default"].healthy  # the wakeup subscriber is on TLS too
    r = os.urandom(32)
    async with relay.client() as c:
        assert await c.enqueue(r, b"one") == (1, False)
        assert [m.payload for m in (await c.read(r)).messages] == [b"one"]
        waiting = asyncio.create_task(c.read(r, from_seq=2, wait=10))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        started = time.monotonic()
        await c.enqueue(r, b"two")
        batch = await asyncio.wait_for(waiting, 5)
        woke_s = time.monotonic() - started
        assert [m.payload for m in batch.messages] == [b"two"]
        assert woke_s < 1.0  # a wakeup over the TLS subscriber, not the polling fallback
    with redis.Redis.from_url(with_client_cert(mutual, pki)) as admin:
        clients = admin.client_list()
    assert len(clients) >= 3  # hot path, wakeups, admin: all over TLS (no plaintext port exists)


async def test_wrong_ca_fails_readiness_with_a_clear_reason_and_no_secret(
    mutual: LocalRedis, pki: Pki, relay_factory: RelayFactory, http: aiohttp.ClientSession
) -> None:
    url = with_client_cert(mutual, pki).replace(str(pki.ca), str(pki.other_ca))
    relay = await relay_factory(url)
    async with http.get(relay.base_url + "/readyz") as resp:
        assert resp.status == 503
        body = await resp.text()
        doc = await resp.json()
    assert doc["shardsDown"] == ["default"]
    reason = doc["reasons"]["default"]
    assert reason.startswith(f"TLS handshake with 127.0.0.1:{mutual.port} failed: certificate verification")
    assert PASSWORD not in body
    assert "ssl_" not in body  # nor the URL's options (file paths)
    async with relay.client() as c:
        with pytest.raises(Exception, match="503"):
            await c.enqueue(os.urandom(32), b"x")


async def test_client_certificate_required(mutual: LocalRedis, pki: Pki) -> None:
    store = ShardStore("s", mutual.url, QueueLimits())  # CA given, no client certificate
    hub = WakeupHub(mutual.url, "s")
    try:
        assert not await store.ping()
        assert "client certificate" in store.last_error
        assert PASSWORD not in store.last_error
        await hub.start(wait_connected=1.0)
        assert not hub.healthy
        assert "client certificate" in hub.last_error
    finally:
        await hub.stop()
        await store.close()
    good = ShardStore("s", with_client_cert(mutual, pki), QueueLimits())
    try:
        assert await good.ping()
    finally:
        await good.close()


async def test_hostname_verification_and_its_opt_out(pki: Pki) -> None:
    server = tls_redis(pki)  # the certificate names 127.0.0.1 only
    try:
        other_name = server.url.replace("127.0.0.1", "localhost")  # resolves, not in the certificate
        store = ShardStore("s", other_name, QueueLimits())
        try:
            assert not await store.ping()
            assert "certificate verification failed" in store.last_error
        finally:
            await store.close()
        lax = ShardStore("s", other_name + "&ssl_check_hostname=false", QueueLimits())
        try:
            assert await lax.ping()
        finally:
            await lax.close()
    finally:
        server.stop()


async def test_migration_between_two_tls_shards(pki: Pki, tmp_path: Path) -> None:
    servers = {n: tls_redis(pki, auth_clients="yes", password=PASSWORD) for n in ("a", "b")}
    try:
        urls = {n: with_client_cert(s, pki) for n, s in servers.items()}
        path = str(tmp_path / "map.json")
        shard_map = ShardMap("t", 1, urls, (SlotRange(0, SLOT_COUNT - 1, "a"),))
        write_map_file(path, shard_map)
        recipients = [os.urandom(32) for _ in range(60)]
        source = ShardStore("a", urls["a"], QueueLimits(rate_count=10**6))
        await source.start()
        try:
            for i, r in enumerate(recipients):
                assert (
                    await source.enqueue(K.queue_keys(r, b""), EnqueueRequest(r, b"", b"m%d" % i), 1000)
                ).seq == 1
        finally:
            await source.close()
        moved = range(0, SLOT_COUNT // 4)
        report = await migrate_slots(
            shard_map, moved, "b", file_publisher(path), current_map=file_reader(path)
        )
        assert report.slots_moved == len(moved)
        assert report.keys > 0  # MIGRATE carried them, source Redis to target Redis, over TLS
        target = ShardStore("b", urls["b"], QueueLimits())
        await target.start()
        on_b = [(i, r) for i, r in enumerate(recipients) if K.queue_keys(r, b"").slot in moved]
        assert on_b  # 60 random queues: some land in the moved quarter
        try:
            for i, r in on_b:
                read = await target.read(K.queue_keys(r, b""), None, 10)
                assert [m.payload for m in read.messages] == [b"m%d" % i]
        finally:
            await target.close()
    finally:
        for s in servers.values():
            s.stop()


@pytest.mark.spark
def test_spark_retention_against_tls_shards(spark: SparkSession, pki: Pki) -> None:
    from spark_jobs import retention
    from spark_jobs.retention import RetentionPolicy
    from spark_jobs.shard_io import split_tasks
    from tests.support.spark_session import Seed, seed

    servers = [tls_redis(pki, auth_clients="yes", password=PASSWORD) for _ in range(2)]
    try:
        urls = {"a": with_client_cert(servers[0], pki), "b": with_client_cert(servers[1], pki)}
        half = SLOT_COUNT // 2
        fleet = ShardMap("t", 1, urls, (SlotRange(0, half - 1, "a"), SlotRange(half, SLOT_COUNT - 1, "b")))
        now = int(time.time() * 1000)
        old = now - 2 * 3600 * 1000
        recipients = [os.urandom(32) for _ in range(20)]
        seed(fleet, [Seed(r, b"", b"x" * 10, old) for r in recipients])
        policy = RetentionPolicy(max_age_s=3600, max_messages=100, idle_s=3600)
        rows = retention.run_sweep(spark, split_tasks(fleet, 4096), {"a": policy, "b": policy}, now)
        assert sum(int(r["messages_removed"]) for r in rows) == 20
        assert sum(int(r["queues_deleted"]) for r in rows) == 20
        for url in urls.values():
            with ShardMaintenance(url) as m:
                assert not m.client.keys("rf:*:m")  # no queue is left on either TLS shard
    finally:
        for s in servers:
            s.stop()
