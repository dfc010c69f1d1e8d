"""Shard-map reloads in real relay processes never drop in-flight requests or waiters.

Two relays serve long-polls parked on thirty queues plus steady enqueue traffic while
the map file changes under them: a pure epoch bump, a new shard joining, the parked
queues' slots migrating (twice), the new shard taking slots, and the new shard leaving
again. Afterwards every long-poll is still waiting and answers as soon as its queue
gets a message; every enqueue meanwhile got 201.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import aiohttp
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.migration import file_publisher, migrate_slots, write_map_file
from relay.fleet.sharding import ShardMap
from tests.support.fleet_harness import (
    DEBIAN_REDIS,
    FleetProcs,
    QueueSpec,
    delivered_items,
    fleet_procs,
    make_queues,
)


def _epochs(fleet: FleetProcs) -> list[float]:
    out = []
    for r in fleet.relays:
        with urllib.request.urlopen(r.url + "/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("relayfleet_shard_map_epoch "):
                    out.append(float(line.split()[1]))
    return out


async def _until_epoch(fleet: FleetProcs, epoch: int, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(e == epoch for e in await asyncio.to_thread(_epochs, fleet)):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"relays did not load epoch {epoch}: {await asyncio.to_thread(_epochs, fleet)}")


async def test_reloads_keep_waiters_and_in_flight_requests(tmp_path: Path) -> None:
    with fleet_procs(tmp_path, shards=3, relays=2) as fleet:
        parked = make_queues(30, seed=41, drain_share=0.0)
        busy = make_queues(6, seed=42)
        statuses: list[int] = []
        stop = asyncio.Event()
        extra = LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / "redis-d")).start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:

            async def long_poll(i: int, q: QueueSpec) -> tuple[int, list[tuple[int, str]], float]:
                url = fleet.urls[i % 2] + q.path("messages") + ("&" if q.channel else "?") + "wait=45"
                async with http.get(url) as resp:
                    doc = await resp.json()
                    return resp.status, delivered_items(doc) if resp.status == 200 else [], time.monotonic()

            async def traffic() -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    q = busy[n % len(busy)]
                    url = fleet.urls[n % 2] + q.path("messages")
                    async with http.post(url, data=f"t{n} x".encode()) as resp:
                        statuses.append(resp.status)
                    await asyncio.sleep(0.005)

            loop = asyncio.get_running_loop()
            waiters = [loop.create_task(long_poll(i, q)) for i, q in enumerate(parked)]
            load = loop.create_task(traffic())
            try:
                await asyncio.sleep(1.0)
                m = fleet.shard_map()
                # 1. the same assignment, a newer epoch
                write_map_file(fleet.map_path, ShardMap(m.fleet, m.epoch + 1, dict(m.shards), m.ranges))
                await _until_epoch(fleet, m.epoch + 1)
                # 2. a new shard joins with no slots
                m = fleet.shard_map()
                write_map_file(
                    fleet.map_path, ShardMap(m.fleet, m.epoch + 1, {**m.shards, "d": extra.url}, m.ranges)
                )
                await _until_epoch(fleet, m.epoch + 1)
                # 3. the parked queues move while their long-polls wait: to b, then to the new shard
                slots = sorted({q.slot for q in parked})
                publish = file_publisher(fleet.map_path)
                for target in ("b", "d"):
                    report = await migrate_slots(fleet.shard_map(), slots, target, publish)
                    assert report.slots_moved > 0
                    await _until_epoch(fleet, report.map_epoch)
                # 4. and back off the new shard, which then leaves the map
                report = await migrate_slots(fleet.shard_map(), slots, "c", publish)
                await _until_epoch(fleet, report.map_epoch)
                m = fleet.shard_map()
                assert "d" not in {r.shard for r in m.ranges}
                write_map_file(
                    fleet.map_path,
                    ShardMap(m.fleet, m.epoch + 1, {k: v for k, v in m.shards.items() if k != "d"}, m.ranges),
                )
                await _until_epoch(fleet, m.epoch + 1)
                await asyncio.sleep(0.5)
                assert not any(w.done() for w in waiters), [w.result() for w in waiters if w.done()]
                # every parked long-poll answers as soon as its queue gets a message
                # each waiter is timed from its own message: 30 sequential POSTs on a loaded
                # machine can take longer than the bound, which is about a wait=45 timeout
                sent_at: list[float] = []
                for i, q in enumerate(parked):
                    sent_at.append(time.monotonic())
                    async with http.post(
                        fleet.urls[(i + 1) % 2] + q.path("messages"), data=f"w{i} x".encode()
                    ) as r:
                        assert r.status == 201
                results = await asyncio.wait_for(asyncio.gather(*waiters), 10)
            finally:
                stop.set()
                await load
                for w in waiters:
                    w.cancel()
                extra.stop()
        for i, (status, items, at) in enumerate(results):
            assert status == 200
            assert [msg_id for _, msg_id in items] == [f"w{i}"]
            assert at - sent_at[i] < 3.0, f"waiter {i} answered late: woken by a timeout, not its message"
        assert len(statuses) > 100
        assert set(statuses) == {201}, {s: statuses.count(s) for s in set(statuses)}
