"""Retention sweep end to end: real redis-server shards, the real enqueue and trim
scripts, the job's Spark function in the shared local SparkSession."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from relay.fleet.sharding import ShardMap
from relay.storage import keys as K
from relay.storage.maintenance import ShardMaintenance
from relay.storage.store import QueueLimits
from spark_jobs import retention
from spark_jobs.retention import RetentionPolicy
from spark_jobs.shard_io import split_tasks
from tests.support.spark_session import FleetFactory, Seed, ack_upto, recipient_on, seed

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

HOUR = 3_600_000
MIN = 60_000


def _client(shard_map: ShardMap, shard: str) -> redis.Redis:
    return redis.Redis.from_url(shard_map.shards[shard])


def _queue_state(shard_map: ShardMap, recipient: bytes) -> dict[str, Any]:
    """What Redis holds for one queue: seqs, byte counter, index membership."""
    q = K.queue_keys(recipient, b"")
    with _client(shard_map, shard_map.shard_for(recipient)) as r:
        entries = r.xrange(q.msgs)
        meta = r.hgetall(q.meta)
        return {
            "seqs": [int(e[0].split(b"-")[0]) for e in entries],
            "sizes": sum(int(e[1][b"n"]) for e in entries),
            "bytes": int(meta.get(b"bytes", 0)),
            "seq": int(meta.get(b"seq", 0)),
            "exists": bool(r.exists(q.meta, q.msgs, q.idem, q.idemx)),
            "indexed": bool(r.sismember(q.index, q.qid)),
        }


def _stats_consistent(shard_map: ShardMap) -> None:
    """Every slot's statistics equal the sum over the queues its index lists."""
    for url in shard_map.shards.values():
        with redis.Redis.from_url(url) as r:
            for key in r.scan_iter(match="rf:*:stats"):
                slot = int(key.decode().split("{rf")[1].split("}")[0])
                msgs = nbytes = 0
                for qid in r.smembers(K.slot_index(slot)):
                    q = K.queue_keys_for_id(slot, qid.decode())
                    msgs += r.xlen(q.msgs)
                    nbytes += int(r.hget(q.meta, "bytes") or 0)
                stats = r.hgetall(key)
                assert int(stats.get(b"msgs", 0)) == msgs, slot
                assert int(stats.get(b"bytes", 0)) == nbytes, slot


def _totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    keys = ("messages_removed", "bytes_removed", "queues_deleted", "queues_scanned", "slots_skipped")
    return {k: sum(int(r[k]) for r in rows) for k in keys}


def test_retention_end_to_end(spark: SparkSession, redis_fleet: FleetFactory, tmp_path: Path) -> None:
    fleet = redis_fleet(["a", "b"])
    rng = random.Random(7)
    now = int(time.time() * 1000)
    old, recent = now - 2 * HOUR, now - 10 * MIN
    seeds: list[Seed] = []
    expect_removed = expect_bytes = 0

    def add(recipient: bytes, at: int, size: int, idem: str = "") -> None:
        seeds.append(Seed(recipient, b"", bytes([65 + len(seeds) % 26]) * size, at, idem))

    queues = {}
    for shard in ("a", "b"):
        # all old: removed by age; nothing live afterwards, so the queue goes
        q_old = queues[f"old-{shard}"] = recipient_on(fleet, shard, rng)
        for i in range(4):
            add(q_old, old + i, 10 + i)
        expect_removed += 4
        expect_bytes += 10 + 11 + 12 + 13
        # 3 old then 2 recent: the old ones go
        q_mixed = queues[f"mixed-{shard}"] = recipient_on(fleet, shard, rng)
        for i in range(3):
            add(q_mixed, old + i, 100)
        for i in range(2):
            add(q_mixed, recent + i, 7)
        expect_removed += 3
        expect_bytes += 300
        # 8 recent, cap 5: the 3 oldest go
        q_many = queues[f"many-{shard}"] = recipient_on(fleet, shard, rng)
        for i in range(8):
            add(q_many, recent + i, 20 + i)
        expect_removed += 3
        expect_bytes += 20 + 21 + 22
        # 4 old + 6 recent, cap 5: age takes 4, the cap one more
        q_both = queues[f"both-{shard}"] = recipient_on(fleet, shard, rng)
        for i in range(4):
            add(q_both, old + i, 30)
        for i in range(6):
            add(q_both, recent + i, 40)
        expect_removed += 5
        expect_bytes += 4 * 30 + 40
        # old messages with idempotency keys still live (7-day retention): emptied, kept
        q_idem = queues[f"idem-{shard}"] = recipient_on(fleet, shard, rng)
        for i in range(2):
            add(q_idem, old + i, 50, idem=f"k{i}")
        expect_removed += 2
        expect_bytes += 100
    # a queue in a slot being migrated: never touched
    q_mig = queues["migrating"] = recipient_on(fleet, "b", rng)
    for i in range(6):
        add(q_mig, old + i, 60)
    seed(fleet, seeds, QueueLimits(rate_count=10**9))
    mig_slot = K.queue_keys(q_mig, b"").slot
    with _client(fleet, "b") as r:
        r.set(K.slot_state(mig_slot), "migrating")

    policy = RetentionPolicy(max_age_s=3600, max_messages=5, idle_s=3600)
    policies = {"a": policy, "b": policy}
    tasks = split_tasks(fleet, 1024)
    assert len(tasks) == 16  # partitioned by (shard, slot range)
    at = now

    rows = retention.run_sweep(spark, tasks, policies, at)
    assert len(rows) == len(tasks)
    totals = _totals(rows)
    assert totals["messages_removed"] == expect_removed
    assert totals["bytes_removed"] == expect_bytes
    assert totals["queues_deleted"] == 2
    assert totals["queues_scanned"] == 10  # the migrating slot is not even listed
    assert totals["slots_skipped"] == 1

    for shard in ("a", "b"):
        gone = _queue_state(fleet, queues[f"old-{shard}"])
        assert not gone["exists"]
        assert not gone["indexed"]
        mixed = _queue_state(fleet, queues[f"mixed-{shard}"])
        assert mixed["seqs"] == [4, 5]
        assert mixed["bytes"] == mixed["sizes"] == 14
        assert mixed["indexed"]
        many = _queue_state(fleet, queues[f"many-{shard}"])
        assert many["seqs"] == [4, 5, 6, 7, 8]
        assert many["bytes"] == many["sizes"]
        both = _queue_state(fleet, queues[f"both-{shard}"])
        assert both["seqs"] == [6, 7, 8, 9, 10]
        assert both["bytes"] == 5 * 40
        idem = _queue_state(fleet, queues[f"idem-{shard}"])
        assert idem["seqs"] == []
        assert idem["bytes"] == 0
        assert idem["indexed"]
        assert idem["seq"] == 2
    mig = _queue_state(fleet, q_mig)
    assert mig["seqs"] == [1, 2, 3, 4, 5, 6]
    assert mig["bytes"] == 360
    _stats_consistent(fleet)

    # the seq survives an emptied queue that was kept: the next enqueue continues it
    again = seed(fleet, [Seed(queues["idem-a"], b"", b"new", now)])
    assert again[0].seq == 3

    # idempotent: a second sweep at the same time removes nothing
    second = _totals(retention.run_sweep(spark, tasks, policies, at))
    assert (second["messages_removed"], second["bytes_removed"], second["queues_deleted"]) == (0, 0, 0)
    _stats_consistent(fleet)

    # report: per shard, written as JSON lines
    report = retention.per_shard(retention.report_frame(spark, rows))
    path = tmp_path / "report.jsonl"
    retention.write_report(report, str(path))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["shard"] for line in lines] == ["a", "b"]
    assert list(lines[0]) == list(retention.REPORT_COLUMNS)
    assert sum(line["messages_removed"] for line in lines) == expect_removed
    assert lines[0]["tasks"] == 8
    assert lines[1]["slots_skipped"] == 1

    # or as Parquet (a Spark output directory), same rows
    parquet = tmp_path / "report.parquet"
    retention.write_report(report, str(parquet))
    back = {r["shard"]: r.asDict() for r in spark.read.parquet(str(parquet)).collect()}
    assert back == {line["shard"]: line for line in lines}

    # once the slot is owned again, its old messages go like any others
    with _client(fleet, "b") as r:
        r.delete(K.slot_state(mig_slot))
    third = _totals(retention.run_sweep(spark, tasks, policies, at))
    assert third["messages_removed"] == 6
    assert third["queues_deleted"] == 1
    _stats_consistent(fleet)


def test_budget_and_idle_rules(redis_fleet: FleetFactory) -> None:
    """The trim script on its own: bounded calls, and deletion only when provably idle."""
    fleet = redis_fleet(["a"])
    rng = random.Random(3)
    now = int(time.time() * 1000)
    big = recipient_on(fleet, "a", rng)
    drained = recipient_on(fleet, "a", rng)
    seed(
        fleet,
        [Seed(big, b"", b"x" * 5, now - 2 * HOUR + i) for i in range(2500)]
        + [Seed(drained, b"", b"y", now - 2 * HOUR)],
    )
    qd = K.queue_keys(drained, b"")
    # acked before any sweep: the stream is empty and the time of seq 1 is gone with it
    assert ack_upto(fleet, drained, 1) == 1
    qb = K.queue_keys(big, b"")
    policy = RetentionPolicy(max_age_s=3600, max_messages=None, idle_s=3600).trim_policy(now)
    with ShardMaintenance(fleet.shards["a"], batch=7) as m:
        out = {o.qid: o for o in m.trim([(qb.slot, qb.qid), (qd.slot, qd.qid)], policy)}
        # 2500 messages with a budget of 1000 per call: three calls, one result
        assert out[qb.qid].removed == 2500
        assert out[qb.qid].bytes == 12500
        assert out[qb.qid].deleted
        # emptied by an ack before any sweep saw it: not provably idle yet, so kept and marked
        assert out[qd.qid].removed == 0
        assert not out[qd.qid].deleted
        assert m.client.hget(qd.meta, "tseen") == f"1:{now}".encode()
        again = m.trim([(qd.slot, qd.qid)], policy)
        assert not again[0].deleted
        later = RetentionPolicy(max_age_s=3600, max_messages=None, idle_s=3600).trim_policy(now + HOUR)
        assert m.trim([(qd.slot, qd.qid)], later)[0].deleted
        assert m.client.exists(qd.meta, qd.msgs) == 0
        assert qd.qid not in m.slot_queues(qd.slot)
        # a stale index entry (no keys behind it) is dropped
        m.client.sadd(K.slot_index(5), "ghost.")
        assert m.trim([(5, "ghost.")], policy)[0].deleted
        assert m.slot_queues(5) == []


# its own JVM in a subprocess, not the worker's session: a work unit apart from the spark group
@pytest.mark.xdist_group("spark-retention-cli")
def test_retention_command_line(redis_fleet: FleetFactory, tmp_path: Path) -> None:
    """`python -m spark_jobs.retention` as the CronJob runs it (its own local Spark)."""
    fleet = redis_fleet(["a", "b"])
    rng = random.Random(5)
    now = int(time.time() * 1000)
    seeds = []
    for shard in ("a", "b"):
        for _ in range(3):
            r = recipient_on(fleet, shard, rng)
            seeds += [Seed(r, b"", b"p" * 10, now - 3 * HOUR + i) for i in range(4)]
            seeds += [Seed(r, b"", b"q" * 10, now - MIN + i) for i in range(2)]
    seed(fleet, seeds)
    path = tmp_path / "map.json"
    path.write_text(fleet.dumps())
    report = tmp_path / "report.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "spark_jobs.retention", "--shard-map", str(path), "--max-age", "3600",
         "--report", str(report), "--master", "local[2]"],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert {line["shard"]: line["messages_removed"] for line in lines} == {"a": 12, "b": 12}
    assert sum(line["bytes_removed"] for line in lines) == 240
    assert "retention: 2 shards, 6 queues scanned, 24 messages and 240 bytes removed" in proc.stderr
    assert "redis://" not in proc.stderr + proc.stdout

    bad = subprocess.run(
        [sys.executable, "-m", "spark_jobs.retention", "--shard-map", str(path), "--max-age", "0"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip() == "retention: --max-age must be >= 1"
