"""Fault: a slot migration whose source shard's primary is SIGKILLed halfway resumes on the
promoted replica and finishes, while history-checked traffic runs through two relays.

Real processes on loopback: the source shard is a Sentinel service (a primary, two
replicas, three Sentinels; minReplicas 1, so the fences and copies the migrator wrote
are on the replica Sentinel promotes), the target is a plain redis-server; two relay
processes read the shard-map file the migrator publishes to; producers (retrying with
their Idempotency-Key), read+ack consumers and drainers record every answer.

The migration moves every workload slot in batches of two; its progress callback kills
the source's primary at a chosen step of the middle batch (the slots fenced and copied,
about to be flipped; or mid-copy), so the failure lands at the same point on every run.
The run must resume (`MigrationReport.resumes >= 1`), finish with every slot on the
target and nothing of them left on the source, and the history must be clean: nothing
acknowledged lost, nothing delivered again after its ack or drain, order kept, no epoch
change.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.migration import MigrationReport, Progress, file_publisher, migrate_slots, write_map_file
from relay.fleet.routing import load_file
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange
from relay.storage import keys as K
from tests.support.faults import report
from tests.support.fleet_harness import (
    RelayProc,
    Workload,
    make_queues,
    relay_logs,
    spawn_relay,
    stop_relays,
    wait_ready,
)
from tests.support.sentinel_shard import DEBIAN_REDIS, ReplicatedShard, needs_sentinel

pytestmark = [pytest.mark.faults, needs_sentinel, pytest.mark.timeout(240)]


class _KillAt:
    """A migration progress callback that SIGKILLs the source's primary once, the first
    time the run reports `phase` with at least `after_slots` slots done."""

    def __init__(self, shard: ReplicatedShard, phase: str, after_slots: int) -> None:
        self.shard = shard
        self.phase = phase
        self.after_slots = after_slots
        self.killed: LocalRedis | None = None
        self.at: float = 0.0
        self.seen: list[tuple[str, int]] = []

    def __call__(self, p: Progress) -> None:
        self.seen.append((p.phase, p.slots_done))
        if self.killed is None and p.phase == self.phase and p.slots_done >= self.after_slots:
            self.at = time.monotonic()
            port = self.shard.primary_port()
            assert port is not None
            node = self.shard.node(port)
            assert node.proc is not None
            node.proc.send_signal(signal.SIGKILL)  # the wait for it happens off the loop
            self.killed = node


async def _source_leftovers(url: str, slots: list[int]) -> list[str]:
    client = aioredis.Redis.from_url(url)
    problems = []
    try:
        for s in slots:
            raw = await client.get(K.slot_state(s))
            state = raw.decode() if isinstance(raw, bytes) else raw
            keys = [k async for k in client.scan_iter(match=K.slot_key_pattern(s), count=1000)]
            if state is not None and not state.startswith("moved b "):
                problems.append(f"slot {s}: source state {state!r}")
            if len(keys) - (state is not None) > 0:
                problems.append(f"slot {s}: source still holds {len(keys)} key(s)")
    finally:
        await client.aclose()
    return problems


async def _migrate_with_failover(tmp_path: Path, phase: str) -> None:
    shard = await asyncio.to_thread(ReplicatedShard(tmp_path / "source").start)
    target = await asyncio.to_thread(LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / "target")).start)
    relays: list[RelayProc] = []
    map_path = str(tmp_path / "shardmap.json")
    try:
        urls = {"a": shard.url(min_replicas=1), "b": target.url}
        write_map_file(map_path, ShardMap("test", 1, urls, (SlotRange(0, SLOT_COUNT - 1, "a"),)))
        relays = [spawn_relay(["--shard-map", map_path], tmp_path) for _ in range(2)]
        for r in relays:
            await asyncio.to_thread(wait_ready, r)
        queues = make_queues(16, seed=53)
        slots = sorted({q.slot for q in queues})
        work = Workload([r.url for r in relays], queues, producers=6, seed=53, max_wait_s=2.0)
        kill = _KillAt(shard, phase, after_slots=len(slots) // 2)
        migration: MigrationReport | None = None
        async with work.running():
            await work.until_stored(100)  # queues with history on the source before it moves
            t0 = time.monotonic()
            migration = await migrate_slots(
                load_file(map_path), slots, "b", file_publisher(map_path), kill, max_batch_slots=2
            )
            took = time.monotonic() - t0
            assert kill.killed is not None, f"the kill point was never reached: {kill.seen}"
            killed = kill.killed
            await asyncio.to_thread(killed.stop, signal.SIGKILL)  # reaps it
            new_port = await asyncio.to_thread(shard.wait_failover, killed.port)
            await asyncio.to_thread(shard.rejoin, killed, new_port)
            await work.until_stored(60)  # traffic on the target after the run
        verdict = work.verdict(tmp_path, allow_unanswered=True)
        assert migration is not None
        report(
            f"migration-source-failover-{phase}",
            verdict,
            slots=len(slots),
            resumes=migration.resumes,
            slots_resumed=migration.slots_resumed,
            migration_s=round(took, 2),
            kill_to_done_s=round(t0 + took - kill.at, 2),
        )
        logs = relay_logs(relays)
        assert verdict.ok, f"{verdict.render()}\n{logs}"
        assert verdict.counts["messages_acknowledged"] > 100
        assert migration.resumes >= 1, migration
        assert migration.slots_moved + migration.slots_already == len(slots), migration
        final = load_file(map_path)
        assert {final.shard_for_slot(s) for s in slots} == {"b"}
        primary = shard.primary_port()
        assert primary is not None
        assert not await _source_leftovers(f"redis://127.0.0.1:{primary}/0", slots)
    finally:
        stop_relays(relays)
        await asyncio.to_thread(shard.stop)
        await asyncio.to_thread(target.stop)


async def test_source_primary_killed_before_the_flip_resumes_and_finishes(tmp_path: Path) -> None:
    await _migrate_with_failover(tmp_path, phase="flip")


async def test_source_primary_killed_mid_copy_resumes_and_finishes(tmp_path: Path) -> None:
    await _migrate_with_failover(tmp_path, phase="copy")
