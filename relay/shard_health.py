"""Per-shard health and load gauges, read by each relay in the background.

Two cadences:
- health (every RELAY_SHARD_HEALTH_INTERVAL_S s, default 5): PING, then INFO memory
  and persistence of every shard that answered: three round trips per shard.
- load (at most every RELAY_SHARD_STATS_INTERVAL_S s, default 30, and only when
  /metrics was scraped since the last read, so an unscraped relay costs the shards
  nothing): the slots the map gives the shard, read by lua/slot_sweep.lua LOAD_SLOTS
  (32) slots a call, one call a round trip on the store's bulk lane (its own connection,
  packed as the hot path packs; not redis-py, whose Python packer cost ~0.4 ms a call):
  Redis sums the slots' statistics and queue counts and answers only the totals, so the
  relay does nothing per slot, and the loop serves requests between two calls. A shard
  of 16,384 slots holding 10,000 queues costs the relay ~0.08-0.11 s of CPU in pieces
  under ~0.5 ms, and Redis ~0.12-0.17 s in calls of ~0.2-0.3 ms (docs/benchmarks.md,
  "Pacing the shard load sweep": pauses between smaller calls cost 1.5-3x the CPU, every
  call finding Redis and the relay cold, for no wake gain). Only the relay holding the
  shard's stats lease (a key on the shard, 3 intervals long, renewed by each read) does
  it: N relays sweep a shard once per interval, not N times, and the load gauges of a
  shard come from one relay at a time (others drop theirs).

Gauges carry a `shard` label only: shards are few, queues and slots never become labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from relay import metrics
from relay.api.context import CTX
from relay.fleet.rounds import every
from relay.fleet.routing import ShardRouter
from relay.storage import keys as K
from relay.storage.maintenance import SweepMismatch
from relay.storage.store import ShardStore, StoreRejected, StoreUnavailable

log = logging.getLogger("relay.shard_health")


_PROBE_TIMEOUT_S = 3.0


class _ScrapeMarker(Collector):
    """Notes when /metrics was last rendered; exports nothing."""

    def __init__(self) -> None:
        self.last = 0.0

    def collect(self) -> Iterable[Metric]:
        self.last = time.monotonic()
        return iter(())

    def describe(self) -> Iterable[Metric]:
        return iter(())  # keeps auto_describe from calling collect() at registration


SCRAPES = _ScrapeMarker()
metrics.REGISTRY.register(SCRAPES)


@dataclass(frozen=True, slots=True)
class ShardLoad:
    messages: int
    bytes: int
    queues: int
    enqueues_per_minute: float
    slots: int
    migrating: int


def _num(value: Any) -> int:
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


async def read_health(store: ShardStore) -> dict[str, float]:
    """INFO memory + persistence of one shard, reduced to the gauges' values."""
    info: dict[str, Any] = {}
    for section in ("memory", "persistence"):
        info.update(await store.client.info(section))
    ok = all(
        str(info.get(field, "ok")) == "ok"
        for field in ("aof_last_write_status", "aof_last_bgrewrite_status", "rdb_last_bgsave_status")
    )
    return {
        "used": float(_num(info.get("used_memory"))),
        "max": float(_num(info.get("maxmemory"))),
        "aof": float(_num(info.get("aof_enabled"))),
        "persistence_ok": 1.0 if ok else 0.0,
    }


# Slots a read_load call: ~0.2-0.3 ms of Redis, a few tens of µs of the relay's loop
# (docs/benchmarks.md); the batch readers (maintenance) keep SWEEP_SLOTS.
LOAD_SLOTS = 32


async def read_load(store: ShardStore, slots: list[int], now_ms: int) -> ShardLoad:
    """Totals over the given slots (the ones the map gives this shard); moved slots count for nothing.
    One slot_sweep.lua call of LOAD_SLOTS slots a round trip, answering only its totals: the
    loop serves requests between two, and Redis serves the other connections."""
    messages = size = queues = migrating = 0
    rate = 0.0
    for i in range(0, len(slots), LOAD_SLOTS):
        chunk_messages, chunk_bytes, chunk_queues, chunk_rate, chunk_migrating = await store.sweep_totals(
            slots[i : i + LOAD_SLOTS], now_ms
        )
        messages += chunk_messages
        size += chunk_bytes
        queues += chunk_queues
        rate += chunk_rate
        migrating += chunk_migrating
    return ShardLoad(messages, size, queues, rate, len(slots), migrating)


class ShardHealth:
    """The background loop of one relay process."""

    def __init__(
        self, fleet: ShardRouter, health_s: float, stats_s: float, lease_s: float | None = None
    ) -> None:
        self.fleet = fleet
        self.health_s = health_s
        self.stats_s = stats_s
        self.lease_ms = int(1000 * (lease_s if lease_s is not None else max(1.0, 3 * stats_s)))
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        # Not at start-up: the first read waits for the first scrape (a relay nobody scrapes
        # never pays for it, and a starting relay serves traffic first).
        self._stats_at = time.monotonic() - stats_s
        self._scraped_at = time.monotonic()
        self._known: set[str] = set()
        self._exporting: set[str] = set()  # shards whose load gauges this relay exports
        self.first_round = asyncio.Event()  # set once a tick completed (tests wait on it)

    async def run(self) -> None:
        await every(self.health_s, self.tick, "shard health")

    async def tick(self) -> None:
        now = time.monotonic()
        stores = dict(self.fleet.stores)
        self._forget(set(stores))
        want_load = now - self._stats_at >= self.stats_s and SCRAPES.last > self._scraped_at
        await asyncio.gather(*(self._probe(name, store, want_load) for name, store in stores.items()))
        if want_load:
            self._stats_at = self._scraped_at = now
        self.first_round.set()

    async def _probe(self, name: str, store: ShardStore, want_load: bool) -> None:
        started = time.perf_counter()
        # PING over the store's own connection first: INFO goes through redis-py, whose connect
        # on uvloop leaves a future behind when cut short while DNS does not answer.
        if not await store.ping():
            metrics.SHARD_UP.labels(name).set(0)
            return
        try:
            health = await asyncio.wait_for(read_health(store), _PROBE_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError):
            metrics.SHARD_UP.labels(name).set(0)
            return
        metrics.SHARD_UP.labels(name).set(1)
        metrics.SHARD_MEMORY_USED.labels(name).set(health["used"])
        metrics.SHARD_MEMORY_MAX.labels(name).set(health["max"])
        metrics.SHARD_AOF_ENABLED.labels(name).set(health["aof"])
        metrics.SHARD_PERSISTENCE_OK.labels(name).set(health["persistence_ok"])
        if name in self._exporting:
            # the map's count, every health round: right seconds after a migration, not a
            # load interval later (the map is in memory; the sweep below reads Redis)
            metrics.SHARD_SLOTS.labels(name).set(len(self.fleet.map.slots_of(name)))
        if not want_load:
            return
        try:
            if not await self._hold_lease(store):
                self._drop(name, _LOAD_GAUGES)  # another relay exports this shard's load
                self._exporting.discard(name)
                return
            slots = self.fleet.map.slots_of(name)
            load = await read_load(store, slots, int(time.time() * 1000))
        except SweepMismatch as exc:  # a defect (the script and this relay out of step): said in full
            log.error("shard %s: reading slot statistics failed: %s", name, exc)
            return
        except (RedisError, OSError, StoreUnavailable, StoreRejected) as exc:
            log.warning("shard %s: reading slot statistics failed: %s", name, type(exc).__name__)
            return
        metrics.SHARD_MESSAGES.labels(name).set(load.messages)
        metrics.SHARD_BYTES.labels(name).set(load.bytes)
        metrics.SHARD_QUEUES.labels(name).set(load.queues)
        metrics.SHARD_ENQUEUE_RATE.labels(name).set(load.enqueues_per_minute)
        metrics.SHARD_SLOTS.labels(name).set(load.slots)
        metrics.SHARD_SLOTS_MIGRATING.labels(name).set(load.migrating)
        metrics.SHARD_STATS_TIMESTAMP.labels(name).set(time.time())
        self._exporting.add(name)
        metrics.SHARD_STATS_SECONDS.observe(time.perf_counter() - started)

    async def _hold_lease(self, store: ShardStore) -> bool:
        """Take the shard's stats lease, or renew it if this relay holds it already.
        (Two commands, not atomic: at worst two relays both read one round.)"""
        client = store.client
        if await client.set(K.SHARD_STATS_LEASE, self.holder, nx=True, px=self.lease_ms):
            return True
        current = await client.get(K.SHARD_STATS_LEASE)
        if isinstance(current, bytes) and current.decode("utf-8", "replace") == self.holder:
            await client.pexpire(K.SHARD_STATS_LEASE, self.lease_ms)
            return True
        return False

    @staticmethod
    def _drop(shard: str, gauges: tuple[Any, ...]) -> None:
        for gauge in gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(shard)

    def _forget(self, current: set[str]) -> None:
        """Drop the series of shards that left the map, so they don't alert as stale."""
        for gone in self._known - current:
            self._drop(gone, _HEALTH_GAUGES + _LOAD_GAUGES)
            self._exporting.discard(gone)
        self._known = current


_HEALTH_GAUGES = (
    metrics.SHARD_UP,
    metrics.SHARD_MEMORY_USED,
    metrics.SHARD_MEMORY_MAX,
    metrics.SHARD_AOF_ENABLED,
    metrics.SHARD_PERSISTENCE_OK,
)
_LOAD_GAUGES = (
    metrics.SHARD_MESSAGES,
    metrics.SHARD_BYTES,
    metrics.SHARD_QUEUES,
    metrics.SHARD_ENQUEUE_RATE,
    metrics.SHARD_SLOTS,
    metrics.SHARD_SLOTS_MIGRATING,
    metrics.SHARD_STATS_TIMESTAMP,
)


# How often the shard reserve reads each shard's memory.
RESERVE_INTERVAL_S = 1.0


def in_reserve(used: int, maxmemory: int, fraction: float) -> bool:
    """Whether a shard using `used` of `maxmemory` bytes is within its reserve (the last
    `fraction` of it). A shard without maxmemory has none."""
    return maxmemory > 0 and fraction > 0 and used >= maxmemory * (1.0 - fraction)


class ReserveWatch:
    """The shard reserve (docs/design-decisions.md, "Shard reserve"): reads every shard's
    used_memory and maxmemory about once a second and tells its store whether it is within
    RELAY_SHARD_RESERVE_FRACTION of its maxmemory; the store passes that to enqueue.lua as an
    argument of the calls it already makes. A shard that does not answer keeps its last state."""

    def __init__(self, fleet: ShardRouter, fraction: float, interval_s: float = RESERVE_INTERVAL_S) -> None:
        self.fleet = fleet
        self.fraction = fraction
        self.interval_s = interval_s

    async def run(self) -> None:
        await every(self.interval_s, self.tick, "shard reserve")

    async def tick(self) -> None:
        await asyncio.gather(*(self._probe(store) for store in list(self.fleet.stores.values())))

    async def _probe(self, store: ShardStore) -> None:
        try:
            used, maxmemory = await store.memory()
        except (StoreUnavailable, StoreRejected, OSError, TimeoutError, ValueError):
            return
        store.set_reserve(in_reserve(used, maxmemory, self.fraction))


MONITOR = web.AppKey("relayfleet_shard_health", ShardHealth)
RESERVE = web.AppKey("relayfleet_shard_reserve", ReserveWatch)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(app[MONITOR].run())]
    watch = app[RESERVE]
    if watch.fraction > 0:
        tasks.append(loop.create_task(watch.run()))
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def setup(app: web.Application) -> None:
    settings = app[CTX].settings
    app[MONITOR] = ShardHealth(
        app[CTX].service.fleet, settings.shard_health_interval_s, settings.shard_stats_interval_s
    )
    limits = settings.limits
    app[RESERVE] = ReserveWatch(
        app[CTX].service.fleet,
        limits.shard_reserve_fraction if limits.shard_reserve_queue_bytes > 0 else 0.0,
    )
    app.cleanup_ctx.append(_lifecycle)
