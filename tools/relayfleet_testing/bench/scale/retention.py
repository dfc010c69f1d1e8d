"""Retention phase: the Spark retention job over M messages in Q queues on one shard, against the
floor of the same retention done by one SCAN pass in one process, without Spark.

Seeded once by seed.lua (the keys enqueue.lua writes, a queue's messages in one call), each queue's
messages spread over the last
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

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.client import Pipeline
from relayfleet_testing.bench.cputime import tree_cpu_seconds
from relayfleet_testing.bench.scale.report import Figure, PhaseReport
from relayfleet_testing.bench.scale.servers import chart_redis, redis_cpu_s
from relayfleet_testing.bench.scale.store import Checkpoints
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.sharding import ShardMap, even_split
from relay.storage import keys as K
from relay.storage.maintenance import ShardMaintenance, TrimPolicy
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
    task_s: float  # summed time of the job's tasks (the floor: its wall time)


def messages_per_queue(messages: int, queues: int, rng: random.Random) -> Iterator[int]:
    """Counts averaging messages/queues, pairs of queues at avg-d and avg+d, summing exactly."""
    avg, extra = divmod(messages, queues)
    for i in range(0, queues, 2):
        d = rng.randrange(avg) if avg > 1 else 0
        yield avg - d + (i < extra)
        if i + 1 < queues:
            yield avg + d + (i + 1 < extra)


@dataclass(frozen=True, slots=True)
class SeededQueue:
    recipient: bytes
    start_ms: int  # its first message's time
    step_ms: int  # between two of its messages
    messages: int


def schedule(messages: int, queues: int, seed: int, now: int) -> Iterator[SeededQueue]:
    """Every queue's messages: each queue active for a while within the last 10 days, so the
    7-day age limit empties some queues and trims others."""
    rng = random.Random(seed)
    for n in messages_per_queue(messages, queues, rng):
        r = rng.randbytes(32)
        start = now - rng.randrange(10 * DAY_MS)
        yield SeededQueue(r, start, max(1, (now - start) // max(1, n)), n)


SEED_SCRIPT = (Path(__file__).with_name("seed.lua")).read_text("utf-8")
SEED_SHA = hashlib.sha1(SEED_SCRIPT.encode()).hexdigest()
SEED_QUEUES = 32  # queues per seed.lua call
SEED_CALLS = 16  # calls per round trip


def seed_one(client: redis.Redis | Pipeline, payload: bytes, queues: Sequence[SeededQueue]) -> None:
    """One seed.lua call writing these queues' messages (a pipeline's: queued)."""
    keys: list[str] = []
    args: list[bytes | str | int] = [payload]
    for q in queues:
        k = K.queue_keys(q.recipient, b"")
        keys += [k.meta, k.msgs, k.index, k.stats]
        args += [k.qid, q.start_ms, q.step_ms, q.messages]
    client.evalsha(SEED_SHA, len(keys), *keys, *args)


def seed_shard(
    url: str, messages: int, queues: int, payload_size: int, seed: int, now: int, say: Say
) -> None:
    """The messages written by seed.lua (enqueue.lua's keys, a queue's messages in one loop),
    SEED_QUEUES queues a call, SEED_CALLS calls a round trip."""
    payload = random.Random(seed).randbytes(payload_size)
    clock = Checkpoints("retention: seeding", messages, say)
    done = 0
    with redis.Redis.from_url(url) as r:
        r.script_load(SEED_SCRIPT)
        batch: list[SeededQueue] = []
        pipe = r.pipeline(transaction=False)
        calls = 0
        for q in schedule(messages, queues, seed, now):
            batch.append(q)
            if len(batch) == SEED_QUEUES:
                seed_one(pipe, payload, batch)
                calls += 1
                done += sum(b.messages for b in batch)
                batch = []
                if calls == SEED_CALLS:
                    pipe.execute()
                    calls = 0
                    clock.tick(done)
        if batch:
            seed_one(pipe, payload, batch)
            done += sum(b.messages for b in batch)
        pipe.execute()
        clock.tick(done)
        if r.dbsize() == 0 or done != messages:
            raise RuntimeError(f"seeding wrote {done:,} messages, not {messages:,}")


Totals = tuple[int, int, int, int, float]  # messages removed, bytes, queues deleted, trimmed, task s


def floor_sweep(url: str, policy: TrimPolicy) -> Totals:
    """The retention in one pass: SCAN the queues' metadata keys, trim each page's queues in one
    pipeline of trim.lua calls. (messages removed, bytes, queues deleted, queues trimmed, 0)"""
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
                return removed, nbytes, deleted, seen, 0.0


def _measure(url: str, run: Callable[[], Totals]) -> Sweep:
    redis0, tree0, t0 = redis_cpu_s(url), tree_cpu_seconds(os.getpid()), time.monotonic()
    removed, nbytes, deleted, queues, task_s = run()
    wall = time.monotonic() - t0
    redis_cpu = redis_cpu_s(url) - redis0
    other = tree_cpu_seconds(os.getpid()) - tree0 - redis_cpu
    return Sweep(wall, redis_cpu, other, removed, nbytes, deleted, queues, task_s or wall)


def spark_sweep(shard_map: ShardMap, executors: int, at: int) -> Callable[[], Totals]:
    from spark_jobs.session import get_session

    spark = get_session("relayfleet-bench-scale", f"local[{executors}]")
    # JVM and Python-worker start-up are not sweep time: one throwaway job first
    spark.sparkContext.parallelize(range(4), executors).count()
    tasks = split_tasks(shard_map)

    def run() -> Totals:
        rows = run_sweep(spark, tasks, {SHARD: POLICY}, at)
        return _totals(rows)

    return run


def _totals(rows: Sequence[Mapping[str, Any]]) -> Totals:
    return (
        sum(int(r["messages_removed"]) for r in rows),
        sum(int(r["bytes_removed"]) for r in rows),
        sum(int(r["queues_deleted"]) for r in rows),
        sum(int(r["queues_scanned"]) for r in rows),
        sum(float(r["duration_s"]) for r in rows),
    )


def _restore(server: LocalRedis, snapshot: Path) -> None:
    server.stop()
    shutil.copy(snapshot, Path(server.dir) / "dump.rdb")
    server.start(timeout=600)


def snapshot_now(url: str, timeout_s: float = 1800) -> None:
    """An RDB of the shard in its dump file: BGSAVE, waited for (a foreground SAVE of a
    10,000,000-message shard outlasts a client's reply deadline)."""
    with redis.Redis.from_url(url) as r:
        before = int(r.info("persistence")["rdb_saves"])
        r.bgsave()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = r.info("persistence")
            if not int(p["rdb_bgsave_in_progress"]) and int(p["rdb_saves"]) > before:
                if p["rdb_last_bgsave_status"] != "ok":
                    raise RuntimeError("the seeded shard's snapshot (BGSAVE) failed")
                return
            time.sleep(0.5)
    raise RuntimeError(f"the seeded shard's snapshot (BGSAVE) took over {timeout_s:.0f} s")


def _seed_facts(url: str, messages: int, queues: int, payload: int, seed: int) -> dict[str, Any]:
    with redis.Redis.from_url(url) as r:
        version = str(r.info("server")["redis_version"])
    return {
        "messages": messages, "queues": queues, "payload": payload, "seed": seed,
        "seed.lua": SEED_SHA, "redis": version,
    }  # fmt: skip


def seeded(
    server: LocalRedis, messages: int, queues: int, payload: int, seed: int, keep: Path | None, say: Say
) -> tuple[Path, int]:
    """The shard seeded (or restored from `keep`, an RDB file seeded earlier with the same sizes,
    seed, seed.lua and Redis; a new seeding is kept there): the snapshot both runs start from,
    and the seeding's clock."""
    url = server.url
    facts = _seed_facts(url, messages, queues, payload, seed)
    facts_file = keep.with_name(keep.name + ".json") if keep is not None else None
    snapshot = Path(server.dir) / "seeded.rdb"
    if keep is not None and facts_file is not None and keep.exists() and facts_file.exists():
        kept = json.loads(facts_file.read_text())
        if {k: kept.get(k) for k in facts} == facts:
            say(f"retention: restoring the seeded shard from {keep}")
            shutil.copy(keep, snapshot)
            _restore(server, snapshot)
            return snapshot, int(kept["now"])
    now = int(time.time() * 1000)
    say(f"retention: seeding {messages:,} messages in {queues:,} queues on port {server.port}")
    seed_shard(url, messages, queues, payload, seed, now, say)
    snapshot_now(url)
    shutil.copy(Path(server.dir) / "dump.rdb", snapshot)
    if keep is not None and facts_file is not None:
        shutil.copy(snapshot, keep)
        facts_file.write_text(json.dumps({**facts, "now": now}))
    return snapshot, now


def run(
    messages: int,
    queues: int,
    executors: int,
    seed: int,
    say: Say,
    payload: int = 256,
    keep: Path | None = None,
) -> PhaseReport:
    report = PhaseReport(
        "retention",
        {"messages": messages, "queues": queues, "payload bytes": payload, "executor cores": executors},
    )
    server = chart_redis(appendonly=False)
    try:
        url = server.url
        snapshot, now = seeded(server, messages, queues, payload, seed, keep, say)
        with redis.Redis.from_url(url) as r:
            used = int(r.info("memory")["used_memory"])
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
        Figure(
            "executor cores' time in tasks (tasks' time / wall x cores)",
            spark.task_s / (spark.wall_s * executors),
            "",
            "the floor's (one thread)",
            floor.task_s / floor.wall_s,
        ),
    ]
    report.notes.append(
        f"Both removed {spark.removed:,} messages ({spark.bytes:,} bytes) and deleted {spark.deleted:,} of "
        f"{queues:,} queues (max age 7 days, cap {POLICY.max_messages}, idle 7 days); the seeded shard held "
        f"{used / 2**30:.2f} GiB (used_memory)."
    )
    return report
