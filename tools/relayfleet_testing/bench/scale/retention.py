"""Retention phase: the Spark retention job over M messages in Q queues on one shard, against the
floor of the same retention done by one SCAN pass in one process, without Spark.

Seeded once through ShardStore.enqueue (enqueue.lua), each queue's messages spread over the last
10 days so a 7-day max age empties some queues, trims others and leaves the rest; the shard is
snapshotted (RDB) and restored before each of the two runs, so both trim the same data, and
they must remove exactly the same messages and delete the same queues. Redis runs the chart's
settings without AOF (a restart loads the snapshot).

- floor: one Python thread, SCAN over every queue's metadata key, each page's queues trimmed by
  trim.lua in one pipeline (ShardMaintenance.trim, the job's own trimming);
- Spark: spark_jobs.retention.run_sweep over the job's own task split, local[E] (E executor
  cores; on the real node the job runs Spark-on-K8s with executor pods).

Figures: wall time; messages scanned per second per executor core (the floor has one core);
Redis CPU spent (INFO CPU deltas); Redis busy share of the wall time (1.0: the run waits on
Redis, it is I/O-bound there); CPU spent outside Redis (driver, JVM, Python workers).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from relayfleet_testing.bench.cputime import tree_cpu_seconds
from relayfleet_testing.bench.scale.report import Figure, PhaseReport
from relayfleet_testing.bench.scale.servers import chart_redis, redis_cpu_s
from relayfleet_testing.bench.scale.store import IN_FLIGHT, LIMITS, Checkpoints
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.sharding import ShardMap, even_split
from relay.storage import keys as K
from relay.storage.maintenance import ShardMaintenance, TrimPolicy
from relay.storage.store import EnqueueRequest, ShardStore
from spark_jobs.retention import RetentionPolicy, run_sweep
from spark_jobs.shard_io import split_tasks

Say = Callable[[str], None]
DAY_MS = 86_400_000
POLICY = RetentionPolicy(max_age_s=7 * 86_400, max_messages=1_000, idle_s=7 * 86_400)
SHARD = "a"
PAGE = 1000  # SCAN COUNT of the floor


@dataclass(frozen=True, slots=True)
class Sweep:
    wall_s: float
    redis_cpu_s: float
    other_cpu_s: float  # this process tree less Redis: driver, JVM, Python workers
    removed: int
    bytes: int
    deleted: int
    queues: int


def messages_per_queue(messages: int, queues: int, rng: random.Random) -> Iterator[int]:
    """Counts averaging messages/queues, pairs of queues at avg-d and avg+d, summing exactly."""
    avg, extra = divmod(messages, queues)
    for i in range(0, queues, 2):
        d = rng.randrange(avg) if avg > 1 else 0
        yield avg - d + (i < extra)
        if i + 1 < queues:
            yield avg + d + (i + 1 < extra)


def _schedule(messages: int, queues: int, seed: int, now: int) -> Iterator[tuple[bytes, int]]:
    """(recipient, received ms) of every message: each queue active for a while within the
    last 10 days, so the 7-day age limit empties some queues and trims others."""
    rng = random.Random(seed)
    for n in messages_per_queue(messages, queues, rng):
        r = rng.randbytes(32)
        start = now - rng.randrange(10 * DAY_MS)
        step = max(1, (now - start) // max(1, n))
        for i in range(n):
            yield r, start + i * step


async def seed_shard(url: str, messages: int, queues: int, seed: int, now: int, say: Say) -> None:
    store = ShardStore("seed", url, LIMITS, max_connections=4)
    await store.start()
    loop = asyncio.get_running_loop()
    payload = random.Random(seed).randbytes(128)
    clock = Checkpoints("retention: seeding", messages, say)
    pending: set[asyncio.Future[Any]] = set()
    done = 0
    try:
        for r, at in _schedule(messages, queues, seed, now):
            reply: asyncio.Future[Any] = loop.create_future()
            store.enqueue_to(reply, K.queue_keys(r, b""), EnqueueRequest(r, b"", payload), at)
            pending.add(reply)
            if len(pending) >= IN_FLIGHT:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for f in finished:
                    f.result()
                    done += 1
                    clock.tick(done)
        for f in asyncio.as_completed(pending):
            await f
            done += 1
            clock.tick(done)
    finally:
        await store.close()


def floor_sweep(url: str, policy: TrimPolicy) -> tuple[int, int, int, int]:
    """The retention in one pass: SCAN the queues' metadata keys, trim each page's queues in one
    pipeline of trim.lua calls. (messages removed, bytes, queues deleted, queues trimmed)"""
    removed = nbytes = deleted = seen = 0
    with ShardMaintenance(url, batch=PAGE) as m, redis.Redis.from_url(url) as r:
        cursor = 0
        while True:
            cursor, names = r.scan(cursor, match=K.QUEUE_META_GLOB, count=PAGE)
            items = [q for q in (K.queue_of_meta_key(n.decode()) for n in names) if q is not None]
            for o in m.trim(items, policy):
                removed += o.removed
                nbytes += o.bytes
                deleted += o.deleted
            seen += len(items)
            if cursor == 0:
                return removed, nbytes, deleted, seen


def _measure(url: str, run: Callable[[], tuple[int, int, int, int]]) -> Sweep:
    redis0, tree0, t0 = redis_cpu_s(url), tree_cpu_seconds(os.getpid()), time.monotonic()
    removed, nbytes, deleted, queues = run()
    wall = time.monotonic() - t0
    redis_cpu = redis_cpu_s(url) - redis0
    other = tree_cpu_seconds(os.getpid()) - tree0 - redis_cpu
    return Sweep(wall, redis_cpu, other, removed, nbytes, deleted, queues)


def spark_sweep(shard_map: ShardMap, executors: int, at: int) -> Callable[[], tuple[int, int, int, int]]:
    from spark_jobs.session import get_session

    spark = get_session("relayfleet-bench-scale", f"local[{executors}]")
    # JVM and Python-worker start-up are not sweep time: one throwaway job first
    spark.sparkContext.parallelize(range(4), executors).count()
    tasks = split_tasks(shard_map)

    def run() -> tuple[int, int, int, int]:
        rows = run_sweep(spark, tasks, {SHARD: POLICY}, at)
        return _totals(rows)

    return run


def _totals(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int, int, int]:
    return (
        sum(int(r["messages_removed"]) for r in rows),
        sum(int(r["bytes_removed"]) for r in rows),
        sum(int(r["queues_deleted"]) for r in rows),
        sum(int(r["queues_scanned"]) for r in rows),
    )


def _restore(server: LocalRedis, snapshot: Path) -> None:
    server.stop()
    shutil.copy(snapshot, Path(server.dir) / "dump.rdb")
    server.start(timeout=600)


def run(messages: int, queues: int, executors: int, seed: int, say: Say) -> PhaseReport:
    report = PhaseReport("retention", {"messages": messages, "queues": queues, "executor cores": executors})
    server = chart_redis(appendonly=False)
    try:
        url = server.url
        now = int(time.time() * 1000)
        say(f"retention: seeding {messages:,} messages in {queues:,} queues on port {server.port}")
        asyncio.run(seed_shard(url, messages, queues, seed, now, say))
        with redis.Redis.from_url(url) as r:
            r.save()
        snapshot = Path(server.dir) / "seeded.rdb"
        shutil.copy(Path(server.dir) / "dump.rdb", snapshot)
        at = now + 1000
        say("retention: the floor, one SCAN pass with trim.lua, no Spark")
        floor = _measure(url, lambda: floor_sweep(url, POLICY.trim_policy(at)))
        say(f"retention: floor {floor.wall_s:.1f} s, {floor.removed:,} removed, {floor.deleted:,} deleted")
        _restore(server, snapshot)
        shard_map = even_split("bench", {SHARD: url})
        say(f"retention: the Spark job, local[{executors}]")
        job = spark_sweep(shard_map, executors, at)
        spark = _measure(url, job)
        say(f"retention: Spark {spark.wall_s:.1f} s, {spark.removed:,} removed, {spark.deleted:,} deleted")
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
    if (floor.removed, floor.bytes, floor.deleted) != (spark.removed, spark.bytes, spark.deleted):
        raise RuntimeError(f"the floor and the Spark job disagree: {floor} against {spark}")
    report.figures += [
        Figure("Spark job wall time", spark.wall_s, "s", "one SCAN + trim.lua pass, no Spark", floor.wall_s),
        Figure(
            "messages scanned per second per executor core",
            messages / spark.wall_s / executors,
            "msg/s",
            "the floor's, one core",
            messages / floor.wall_s,
        ),
        Figure("Redis CPU spent (INFO CPU delta)", spark.redis_cpu_s, "s", "the floor's", floor.redis_cpu_s),
        Figure(
            "Redis busy share of the wall time",
            spark.redis_cpu_s / spark.wall_s,
            "",
            "the floor's",
            floor.redis_cpu_s / floor.wall_s,
        ),
        Figure(
            "CPU outside Redis (driver, JVM, Python workers)",
            spark.other_cpu_s,
            "s",
            "the floor's (one Python thread)",
            floor.other_cpu_s,
        ),
    ]
    report.notes.append(
        f"Both removed {spark.removed:,} messages ({spark.bytes:,} bytes) and deleted {spark.deleted:,} of "
        f"{queues:,} queues (max age 7 days, cap {POLICY.max_messages}, idle 7 days)."
    )
    return report
