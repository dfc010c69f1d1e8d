"""Routing: the map in use, reloads from a file, MOVED handling (real redis-servers, in process)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.migration import file_publisher, migrate_slots, write_map_file
from relay.fleet.routing import MapSource, ShardRouter, file_source, load_file
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange, even_split, slot_of
from relay.service import QueueService
from relay.settings import Settings
from relay.storage.store import EnqueueRequest, QueueLimits

DEBIAN_REDIS = "/usr/bin/redis-server"


@pytest.fixture
def two_redis() -> Iterator[tuple[LocalRedis, LocalRedis]]:
    a = LocalRedis(binary=DEBIAN_REDIS).start()
    try:
        b = LocalRedis(binary=DEBIAN_REDIS).start()
        try:
            yield a, b
        finally:
            b.stop()
    finally:
        a.stop()


def _all_on(name: str, urls: dict[str, str], epoch: int = 1) -> ShardMap:
    return ShardMap("t", epoch, urls, (SlotRange(0, SLOT_COUNT - 1, name),))


@pytest.fixture
def map_path(tmp_path: Path) -> str:
    return str(tmp_path / "map.json")


@pytest.fixture
async def fleet(two_redis: tuple[LocalRedis, LocalRedis], map_path: str) -> AsyncIterator[ShardRouter]:
    a, b = two_redis
    write_map_file(map_path, _all_on("a", {"a": a.url, "b": b.url}))
    f = ShardRouter(load_file(map_path), QueueLimits())
    await f.start(file_source(map_path), poll_s=3600)  # reloads only when asked: the tests drive them
    try:
        yield f
    finally:
        await f.close()


async def test_a_full_route_cache_drops_its_oldest_entry_only(
    fleet: ShardRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet._routes, "most", 3)
    queues = [(os.urandom(32), b"") for _ in range(5)]
    routes = [fleet.route(*q) for q in queues]
    assert len(fleet._routes) == 3  # bounded
    assert all(fleet.route(*q) is r for q, r in zip(queues[2:], routes[2:], strict=True))  # kept
    again = fleet.route(*queues[0])  # dropped: computed afresh (the same route), one more dropped
    assert again == routes[0]
    assert again is not routes[0]
    assert len(fleet._routes) == 3
    assert list(fleet._routes) == [queues[3], queues[4], queues[0]]


async def test_file_source_sees_every_rewrite_even_within_one_clock_tick(tmp_path: Path) -> None:
    path = str(tmp_path / "map.json")
    urls = {"a": "redis://127.0.0.1:1/0"}
    write_map_file(path, _all_on("a", urls, epoch=1))
    source = file_source(path)
    first = await source()
    assert first is not None
    assert first.epoch == 1
    assert await source() is None  # unchanged: not re-read
    for epoch in range(2, 12):  # back-to-back writes, faster than mtime granularity
        write_map_file(path, _all_on("a", urls, epoch=epoch))
        seen = await source()
        assert seen is not None
        assert seen.epoch == epoch
    stamp = os.stat(path)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # a touch that changes nothing
    assert await source() is None


async def test_install_takes_newer_maps_only(fleet: ShardRouter) -> None:
    m = fleet.map
    assert not await fleet.install(m)  # same map
    newer = m.with_slots(range(10), "b")
    assert await fleet.install(newer)
    assert fleet.map.epoch == m.epoch + 1
    older = ShardMap(m.fleet, m.epoch, dict(m.shards), m.ranges)
    assert not await fleet.install(older)  # a stale map never moves queues back
    assert fleet.map == newer


async def test_concurrent_refreshes_share_one_read(fleet: ShardRouter, map_path: str) -> None:
    calls = 0
    inner = fleet._source
    assert inner is not None

    async def counting() -> ShardMap | None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return await inner()

    slow: MapSource = counting
    fleet._source = slow
    write_map_file(map_path, fleet.map.with_slots([1], "b"))
    results = await asyncio.gather(*(fleet.refresh() for _ in range(50)))
    assert calls == 1
    assert all(results)
    assert fleet.map.shard_for_slot(1) == "b"


async def test_stale_map_meets_moved_then_reloads_and_retries(fleet: ShardRouter, map_path: str) -> None:
    """A relay whose map still names the old owner gets MOVED, reloads the file and succeeds."""
    service = QueueService(fleet, Settings(auth="none"))
    recipient, channel = os.urandom(32), b""
    first = await service.enqueue(EnqueueRequest(recipient, channel, b"one", "k1"))
    assert first.kind == "stored"
    assert first.seq == 1
    slot = slot_of(recipient, channel)
    # migrate with another map view, as another process would: this fleet is not told
    # (it misses the source's map-moved announcement, as one that was reconnecting would)
    for hub in fleet.hubs.values():
        hub.on_map_moved = None
    report = await migrate_slots(load_file(map_path), [slot], "b", file_publisher(map_path))
    assert report.slots_moved == 1
    assert fleet.map.shard_for_slot(slot) == "a"  # still stale
    second = await service.enqueue(EnqueueRequest(recipient, channel, b"two", "k2"))
    assert second.kind == "stored"
    assert second.seq == 2  # seq continued on the new shard
    assert fleet.map.shard_for_slot(slot) == "b"
    # the idempotency key moved too
    again = await service.enqueue(EnqueueRequest(recipient, channel, b"one", "k1"))
    assert again.kind == "duplicate"
    assert again.seq == 1
    got = await service.read(recipient, channel, None, 10, 0)
    assert [m.payload for m in got.messages] == [b"one", b"two"]


async def test_waiter_follows_its_queue_to_the_new_shard(fleet: ShardRouter, map_path: str) -> None:
    service = QueueService(fleet, Settings(auth="none"))
    recipient, channel = os.urandom(32), b"c"
    slot = slot_of(recipient, channel)
    waiting = asyncio.get_running_loop().create_task(service.read(recipient, channel, None, 10, 20.0))
    await asyncio.sleep(0.2)
    await migrate_slots(load_file(map_path), [slot], "b", file_publisher(map_path))
    # the queue was never written (no Redis state, so not in the slot index): the source's
    # map-moved announcement made the relay reload the map, and the waiter re-waits on b
    await asyncio.sleep(0.3)
    assert fleet.map.shard_for_slot(slot) == "b"
    assert not waiting.done()
    loop = asyncio.get_running_loop()
    t = loop.time()
    stored = await service.enqueue(EnqueueRequest(recipient, channel, b"hello"))
    result = await asyncio.wait_for(waiting, 5)
    assert [m.seq for m in result.messages] == [stored.seq]
    assert loop.time() - t < 2.0  # woken by b's publish, not by a timeout


async def test_new_shard_in_the_map_gets_a_store_and_hub(fleet: ShardRouter) -> None:
    c = LocalRedis(binary=DEBIAN_REDIS).start()
    try:
        m = fleet.map
        grown = ShardMap(m.fleet, m.epoch + 1, {**m.shards, "c": c.url}, m.ranges)
        assert await fleet.install(grown)
        assert set(fleet.stores) == {"a", "b", "c"}
        assert await fleet.stores["c"].ping()
        shrunk = ShardMap(m.fleet, m.epoch + 2, dict(m.shards), m.ranges)
        assert await fleet.install(shrunk)
        assert set(fleet.stores) == {"a", "b"}
    finally:
        c.stop()


def test_even_split_map_routes_every_slot() -> None:
    m = even_split("t", {"a": "redis://h:1/0", "b": "redis://h:2/0", "c": "redis://h:3/0"})
    assert {m.shard_for_slot(s) for s in range(SLOT_COUNT)} == {"a", "b", "c"}
