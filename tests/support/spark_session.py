"""Pytest plugin for the Spark job tests: one local SparkSession per test run, and
small fleets of real redis-server shards.

Registered from tests/conftest.py (``pytest_plugins``). Starting the JVM takes
seconds, so `spark` is session-scoped and shared by every test that asks.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.sharding import ShardMap, SlotRange
from relay.storage import keys as K
from relay.storage.store import EnqueueOutcome, EnqueueRequest, QueueLimits, ShardStore

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEBIAN_REDIS = "/usr/bin/redis-server"

# Every JVM the tests start (the session below, and `python -m spark_jobs.…` in a subprocess,
# which inherits this) runs for seconds on a few rows: compiling with C2 and a parallel
# collector costs more CPU than it saves. C1 only and the serial collector halve a local
# session's CPU (start and a few small jobs: 45 s -> 21 s, docs/design-decisions.md, "The suite
# in parallel"). spark-submit adds SPARK_SUBMIT_OPTS to the driver's command line.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A local[2] SparkSession (no UI, loopback only), shared by the whole run."""
    pytest.importorskip("pyspark", reason="the [spark] extra is not installed")
    from spark_jobs.session import get_session

    session = get_session("relayfleet-tests", "local[2]")
    try:
        yield session
    finally:
        session.stop()


FleetFactory = Callable[..., ShardMap]


@pytest.fixture
def redis_fleet() -> Iterator[FleetFactory]:
    """Start shards on free ports and return their shard map.

    ``redis_fleet(["a", "b", "c"])`` splits the slots evenly in that order;
    ``redis_fleet(["a", "b"], ranges=[(0, 99, "a"), (100, 16383, "b")])`` sets them.
    Every server is stopped by its own pid afterwards.
    """
    servers: list[LocalRedis] = []
    binary = DEBIAN_REDIS if os.path.exists(DEBIAN_REDIS) else ""

    def start(names: list[str], ranges: list[tuple[int, int, str]] | None = None, epoch: int = 1) -> ShardMap:
        urls = {}
        for name in names:
            server = LocalRedis(binary=binary, appendfsync="no").start()
            servers.append(server)
            urls[name] = server.url
        if ranges is None:
            n = len(names)
            ranges = [(16384 * i // n, 16384 * (i + 1) // n - 1, name) for i, name in enumerate(names)]
        return ShardMap("test", epoch, urls, tuple(SlotRange(a, b, s) for a, b, s in ranges))

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)


# --- seeding shards through the real enqueue script -------------------------


@dataclass(frozen=True)
class Seed:
    recipient: bytes
    channel: bytes
    payload: bytes
    at_ms: int
    idem_key: str = ""


def recipient_on(shard_map: ShardMap, shard: str, rng: random.Random, channel: bytes = b"") -> bytes:
    """A random 32-byte recipient whose queue (with `channel`) lands on `shard`."""
    while True:
        recipient = rng.randbytes(32)
        if shard_map.shard_for(recipient, channel) == shard:
            return recipient


async def _seed(shard_map: ShardMap, seeds: list[Seed], limits: QueueLimits) -> list[EnqueueOutcome]:
    stores = {name: ShardStore(name, url, limits) for name, url in shard_map.shards.items()}
    try:
        for store in stores.values():
            await store.start()
        out = []
        for s in seeds:
            store = stores[shard_map.shard_for(s.recipient, s.channel)]
            q = K.queue_keys(s.recipient, s.channel)
            out.append(
                await store.enqueue(q, EnqueueRequest(s.recipient, s.channel, s.payload, s.idem_key), s.at_ms)
            )
        return out
    finally:
        for store in stores.values():
            await store.close()


def seed(shard_map: ShardMap, seeds: list[Seed], limits: QueueLimits | None = None) -> list[EnqueueOutcome]:
    """Enqueue every seed on its shard through ShardStore (rate limit off unless given)."""
    lim = limits or QueueLimits(rate_count=10**9)
    outcomes = asyncio.run(_seed(shard_map, seeds, lim))
    assert all(o.kind == "stored" for o in outcomes), outcomes
    return outcomes


async def _ack(shard_map: ShardMap, recipient: bytes, up_to: int) -> int:
    name = shard_map.shard_for(recipient)
    store = ShardStore(name, shard_map.shards[name], QueueLimits())
    try:
        await store.start()
        return await store.ack_upto(K.queue_keys(recipient, b""), up_to)
    finally:
        await store.close()


def ack_upto(shard_map: ShardMap, recipient: bytes, up_to: int) -> int:
    """Acknowledge a queue's messages through the real ack script."""
    return asyncio.run(_ack(shard_map, recipient, up_to))
