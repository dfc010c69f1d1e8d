"""relay.shard_health against real Redis: per-shard totals from the slot statistics, INFO
memory/persistence, and shard_up going to 0 when the shard's redis-server stops."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace

import aiohttp
import pytest
import redis
from prometheus_client import Gauge
from relayfleet_testing.localredis import LocalRedis

from relay import metrics
from relay.fleet.sharding import even_split
from relay.shard_health import MONITOR, ShardHealth, read_load
from relay.storage import keys as K
from tests.support.in_process_relay import RunningRelay


@pytest.fixture(autouse=True)
def quiet_background_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's own loop ticks once at start-up, then leaves the gauges to this test."""
    monkeypatch.setenv("RELAY_SHARD_HEALTH_INTERVAL_S", "3600")


async def scrape(relay: RunningRelay) -> None:
    async with aiohttp.ClientSession() as http, http.get(relay.base_url + "/metrics") as resp:
        assert resp.status == 200


def gauge(g: Gauge, shard: str) -> float:
    """The shard's series of `g`, read as a scrape would (the metric's own collect())."""
    return next(s.value for f in g.collect() for s in f.samples if s.labels == {"shard": shard})


async def test_totals_memory_and_down(redis_server: LocalRedis, relay: RunningRelay) -> None:
    (shard,) = relay.fleet.stores
    # The relay's own first round must not overwrite what this test reads.
    await asyncio.wait_for(relay.app[MONITOR].first_round.wait(), 10)
    with redis.Redis.from_url(redis_server.url) as r:
        r.config_set("maxmemory", str(64 << 20))
    async with relay.client() as c:
        recipients = [os.urandom(32) for _ in range(20)]
        for rcpt in recipients:
            for _ in range(3):
                await c.enqueue(rcpt, b"p" * 50)
    monitor = ShardHealth(relay.fleet, health_s=1.0, stats_s=0.0)
    metrics.SHARD_MESSAGES.labels(shard).set(-1)  # the registry is process-wide: a marker
    await monitor.tick()
    assert gauge(metrics.SHARD_UP, shard) == 1
    assert gauge(metrics.SHARD_MESSAGES, shard) == -1  # slot statistics wait for a scrape
    await scrape(relay)
    await monitor.tick()
    assert gauge(metrics.SHARD_UP, shard) == 1
    assert gauge(metrics.SHARD_MESSAGES, shard) == 60
    assert gauge(metrics.SHARD_BYTES, shard) == 60 * 50
    assert gauge(metrics.SHARD_QUEUES, shard) == 20
    assert gauge(metrics.SHARD_SLOTS, shard) == 16384
    assert gauge(metrics.SHARD_SLOTS_MIGRATING, shard) == 0
    assert gauge(metrics.SHARD_ENQUEUE_RATE, shard) >= 60
    assert gauge(metrics.SHARD_MEMORY_MAX, shard) == 64 << 20
    assert 0 < gauge(metrics.SHARD_MEMORY_USED, shard) < 64 << 20
    assert gauge(metrics.SHARD_AOF_ENABLED, shard) == 1
    assert gauge(metrics.SHARD_PERSISTENCE_OK, shard) == 1

    # A slot being moved away counts as migrating; a slot already moved counts for nothing.
    with redis.Redis.from_url(redis_server.url) as r:
        r.set(K.slot_state(7), "migrating")
        r.hset(K.slot_stats(8), mapping={"msgs": 1000, "bytes": 1000})
        r.set(K.slot_state(8), "moved other 2")
    await monitor.tick()
    assert gauge(metrics.SHARD_SLOTS_MIGRATING, shard) == 0  # nobody scraped: slot stats not re-read
    await scrape(relay)
    await monitor.tick()
    assert gauge(metrics.SHARD_SLOTS_MIGRATING, shard) == 1
    assert gauge(metrics.SHARD_MESSAGES, shard) == 60

    redis_server.stop()
    await monitor.tick()
    assert gauge(metrics.SHARD_UP, shard) == 0


async def test_slot_count_follows_the_map_within_a_health_round(
    redis_server: LocalRedis, relay: RunningRelay
) -> None:
    """The shard's slot count comes from the map on every health round (not the load sweep,
    30 s apart): right seconds after a migration, with no scrape in between."""
    (shard,) = relay.fleet.stores
    await asyncio.wait_for(relay.app[MONITOR].first_round.wait(), 10)
    monitor = ShardHealth(relay.fleet, health_s=1.0, stats_s=3600.0)
    await scrape(relay)
    await monitor.tick()
    assert gauge(metrics.SHARD_SLOTS, shard) == 16384
    halved = replace(
        even_split(relay.fleet.map.fleet, {shard: redis_server.url, "other": redis_server.url}),
        epoch=relay.fleet.map.epoch + 1,
    )
    assert await relay.fleet.install(halved)
    await monitor.tick()  # no scrape, no load sweep due
    assert gauge(metrics.SHARD_SLOTS, shard) == len(halved.slots_of(shard)) == 8192


LEASE_S = 3.0  # at least; well above one sweep of 16384 slots on an idle machine (~0.5 s)


async def lease_for_this_machine(relay: RunningRelay, shard: str) -> float:
    """A lease far longer than one tick here and now: a sweep of all the shard's slots can
    take seconds on a loaded machine, and the lease must outlive a tick plus a scrape."""
    started = time.perf_counter()
    await read_load(relay.fleet.stores[shard], relay.fleet.map.slots_of(shard), int(time.time() * 1000))
    return max(LEASE_S, 10 * (time.perf_counter() - started))


def exported(g: object, shard: str) -> bool:
    return any(s.labels.get("shard") == shard for m in g.collect() for s in m.samples)  # type: ignore[attr-defined]


async def test_one_relay_at_a_time_reads_a_shards_load(redis_server: LocalRedis, relay: RunningRelay) -> None:
    (shard,) = relay.fleet.stores
    await asyncio.wait_for(relay.app[MONITOR].first_round.wait(), 10)
    async with relay.client() as c:
        await c.enqueue(os.urandom(32), b"x" * 10)
    lease_s = await lease_for_this_machine(relay, shard)
    first = ShardHealth(relay.fleet, health_s=1.0, stats_s=0.0, lease_s=lease_s)
    second = ShardHealth(relay.fleet, health_s=1.0, stats_s=0.0, lease_s=lease_s)
    await scrape(relay)
    await first.tick()
    assert gauge(metrics.SHARD_MESSAGES, shard) == 1
    with redis.Redis.from_url(redis_server.url) as r:
        assert r.get(K.SHARD_STATS_LEASE) == first.holder.encode()
        assert 0 < r.pttl(K.SHARD_STATS_LEASE) <= lease_s * 1000

    # The other relay does not sweep the shard while the lease is held, and drops its series.
    await scrape(relay)
    await second.tick()
    assert not exported(metrics.SHARD_MESSAGES, shard)
    assert gauge(metrics.SHARD_UP, shard) == 1  # health is every relay's own view

    # The holder renews by reading; when it stops, the lease runs out and the other takes over.
    await scrape(relay)
    await first.tick()
    assert gauge(metrics.SHARD_MESSAGES, shard) == 1
    with redis.Redis.from_url(redis_server.url) as r:
        assert r.get(K.SHARD_STATS_LEASE) == first.holder.encode()
        left_ms = r.pttl(K.SHARD_STATS_LEASE)
        assert 0 < left_ms <= lease_s * 1000
    await asyncio.sleep(left_ms / 1000 + 0.1)
    await scrape(relay)
    await second.tick()
    assert gauge(metrics.SHARD_MESSAGES, shard) == 1
    with redis.Redis.from_url(redis_server.url) as r:
        assert r.get(K.SHARD_STATS_LEASE) == second.holder.encode()
