"""Rebalance end to end: 3 real redis-server shards seeded with skewed load through
the real enqueue script, statistics read by Spark tasks, the plan applied with the
migration library, every message checked afterwards."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from relay.fleet.migration import migrate_slots
from relay.fleet.sharding import ShardMap, even_split
from relay.storage import keys as K
from relay.storage.store import QueueLimits, ShardStore
from spark_jobs import rebalance
from spark_jobs.load_planner import Plan, SlotLoad, plan, slot_loads
from spark_jobs.shard_io import SlotTask, split_tasks
from tests.support.naive_planner import naive
from tests.support.spark_session import FleetFactory, Seed, seed

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

T0 = 1_800_000_000_000  # a fixed minute start: the enqueue-rate windows are deterministic
TOL = 0.10


def recipient_in(shard_map: ShardMap, lo: int, hi: int, rng: random.Random) -> bytes:
    while True:
        recipient = rng.randbytes(32)
        if lo <= K.queue_keys(recipient, b"").slot <= hi:
            return recipient


def skewed_seeds(shard_map: ShardMap) -> list[Seed]:
    """Shard a (slots 0-5460): write-hot small queues low in its range, big backlogs
    high in it; b moderate; c light."""
    rng = random.Random(11)
    seeds: list[Seed] = []

    def queue(lo: int, hi: int, count: int, size: int) -> None:
        r = recipient_in(shard_map, lo, hi, rng)
        seeds.extend(Seed(r, b"", rng.randbytes(size), T0 + 1000 + i) for i in range(count))

    for _ in range(40):
        queue(0, 1999, 30, 50)
    for _ in range(40):
        queue(4000, 5460, 5, 2000)
    for _ in range(20):
        queue(5461, 10922, 5, 1000)
    for _ in range(10):
        queue(10923, 16383, 3, 500)
    return seeds


def history(shard_map: ShardMap, recipients: set[bytes]) -> dict[bytes, list[tuple[int, bytes]]]:
    """(seq, payload) of every queue, read through the store from the shard the map names."""

    async def read() -> dict[bytes, list[tuple[int, bytes]]]:
        stores = {n: ShardStore(n, u, QueueLimits()) for n, u in shard_map.shards.items()}
        out = {}
        try:
            for st in stores.values():
                await st.start()
            for r in recipients:
                res = await stores[shard_map.shard_for(r)].read(K.queue_keys(r, b""), None, 1000)
                out[r] = [(m.seq, m.payload) for m in res.messages]
        finally:
            for st in stores.values():
                await st.close()
        return out

    return asyncio.run(read())


def test_rebalance_plan_applied_keeps_every_message(spark: SparkSession, redis_fleet: FleetFactory) -> None:
    fleet = redis_fleet(["a", "b", "c"])
    seeds = skewed_seeds(fleet)
    seed(fleet, seeds)
    expected: dict[bytes, list[tuple[int, bytes]]] = {}
    for s in seeds:
        expected.setdefault(s.recipient, []).append((len(expected.get(s.recipient, [])) + 1, s.payload))
    # one of a's write-hot slots is in the middle of a migration: it must stay put
    pinned = K.queue_keys(seeds[0].recipient, b"").slot
    with redis.Redis.from_url(fleet.shards["a"]) as r:
        r.set(K.slot_state(pinned), "migrating")

    tasks = split_tasks(fleet, 1024)
    rows = rebalance.collect_slot_stats(spark, tasks, T0 + 30_000)
    slots = rebalance.slot_frame(spark, rows)
    totals = {r["shard"]: r.asDict() for r in rebalance.shard_totals(slots).collect()}
    assert totals["a"]["msgs"] == 40 * 30 + 40 * 5
    assert totals["a"]["pinned"] == 1
    assert totals["c"]["bytes"] == 10 * 3 * 500
    loads = rebalance.loads_from(slots)
    result = plan(fleet, loads, metric="blend", tolerance=TOL)

    assert Plan.max_ratio(result.before) > 2
    assert result.balanced
    moved = {s for m in result.moves for s in range(m.start, m.end + 1)}
    assert pinned not in moved
    assert {m.source for m in result.moves} == {"a"}
    # the bytes-blind reference plan reaches the same tolerance moving far more bytes
    load = slot_loads(loads, "blend")
    nbytes = [0] * 16384
    for sl in loads:
        nbytes[sl.slot] = sl.bytes
    ref_bytes, ref_ratio = naive(fleet, load, nbytes, TOL)
    assert ref_ratio <= 1 + TOL + 1e-9
    assert result.bytes_moved < ref_bytes

    # apply it with the migration library (the pinned slot's fence is lifted first,
    # as its migration would finish); then every message is where the map says
    with redis.Redis.from_url(fleet.shards["a"]) as r:
        r.delete(K.slot_state(pinned))

    async def publish(new_map: ShardMap) -> ShardMap:
        return new_map

    async def apply() -> ShardMap:
        m = fleet
        for mv in result.moves:
            report = await migrate_slots(m, range(mv.start, mv.end + 1), mv.target, publish)
            assert report.final_map is not None
            m = report.final_map
        return m

    current = asyncio.run(apply())
    assert current.epoch > fleet.epoch
    assert history(current, set(expected)) == expected

    # measured again after the moves: within tolerance, nothing left to do
    again_rows = rebalance.collect_slot_stats(spark, split_tasks(current, 1024), T0 + 30_000)
    again = plan(current, rebalance.loads_from(rebalance.slot_frame(spark, again_rows)), tolerance=TOL)
    assert Plan.max_ratio(again.before) <= 1 + TOL + 1e-9
    assert again.moves == ()


def test_rebalance_cli_dry_run(
    spark: SparkSession, redis_fleet: FleetFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = redis_fleet(["a", "b", "c"])
    seed(fleet, skewed_seeds(fleet))
    path = tmp_path / "map.json"
    path.write_text(fleet.dumps())
    out_file = tmp_path / "plan.json"
    code = rebalance.main(
        [
            "--shard-map",
            str(path),
            "--dry-run",
            "--metric",
            "bytes",
            "--output",
            str(out_file),
            "--quiet",
            "--min-bytes",
            "0",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc == json.loads(out_file.read_text())
    assert doc["balanced"]
    assert doc["maxOverMean"]["after"] <= 1 + TOL
    assert doc["moves"]
    for move in doc["moves"]:
        start, _, end = move["slots"].partition("-")
        assert 0 <= int(start) <= int(end or start) < 16384
        assert fleet.shard_for_slot(int(start)) == move["from"] != move["to"]
        assert move["bytes"] >= 0
    assert "load/mean" in captured.err  # the before/after table
    assert "redis://" not in captured.err + captured.out
    # the session is the test's: the job did not stop it
    assert spark.range(3).count() == 3  # a stopped session could not run this


def test_rebalance_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert rebalance.main(["--dry-run"]) == 2
    assert "required" in capsys.readouterr().err
    path = tmp_path / "map.json"
    path.write_text("{not json")
    assert rebalance.main(["--shard-map", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "not valid JSON" in err
    assert rebalance.main(["--shard-map", str(path), "--shard-map-configmap", "ns/x"]) == 2


def test_rebalance_errors_during_the_run(
    spark: SparkSession, redis_fleet: FleetFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Errors after Spark started keep the contract: a plan the options forbid is bad
    input (2), an unwritable output a failure (1); each is one line, no traceback."""
    fleet = redis_fleet(["a", "b"])
    path = tmp_path / "map.json"
    path.write_text(fleet.dumps())
    common = ["--shard-map", str(path), "--dry-run", "--quiet", "--task-slots", "8192"]
    assert rebalance.main([*common, "--tolerance", "50"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "rebalance: tolerance must be within 0..10, got 50.0"
    assert "run summary" not in err  # exit 2: the error is the job's last word
    assert rebalance.main([*common, "--output", str(tmp_path / "missing" / "plan.json")]) == 1
    err = capsys.readouterr().err
    assert f"rebalance: cannot write {tmp_path / 'missing' / 'plan.json'}: No such file" in err
    assert "Traceback" not in err
    # the session is the test's: a failed run did not stop it either
    assert spark.range(3).count() == 3  # a stopped session could not run this


def test_unreachable_shard_fails_the_job(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = {
        "fleet": "f",
        "epoch": 1,
        "shards": {"a": {"redis": "redis://127.0.0.1:1/0"}},
        "slots": [[0, 16383, "a"]],
    }
    path = tmp_path / "map.json"
    path.write_text(json.dumps(doc))
    assert rebalance.main(["--shard-map", str(path), "--dry-run", "--quiet", "--task-slots", "8192"]) == 1
    err = capsys.readouterr().err
    assert "127.0.0.1:1/0" in err
    assert "Traceback" not in err


def test_proposal_body_matches_the_crd() -> None:
    fleet = even_split("prod", {"a": "redis://x", "b": "redis://y"}, epoch=4)
    stats = [SlotLoad(s, fleet.shard_for_slot(s), 1, 300 if s < 8192 else 100) for s in range(16384)]
    result = plan(fleet, stats, metric="bytes")
    body = rebalance.proposal_body(result, "ns1", auto_approve=True)
    assert body["apiVersion"] == "relayfleet.dev/v1alpha1"
    assert body["kind"] == "RelayRebalance"
    assert body["metadata"]["namespace"] == "ns1"
    assert body["metadata"]["labels"]["relayfleet.dev/fleet"] == "prod"
    spec = body["spec"]
    assert spec["fleet"] == "prod"
    assert spec["autoApprove"] is True
    assert spec["proposal"]["shardMapEpoch"] == 4
    assert spec["proposal"]["moves"]
    for mv in spec["proposal"]["moves"]:
        assert set(mv) == {"slots", "from", "to", "bytes", "messages"}
        assert mv["from"] != mv["to"]
        lo, _, hi = mv["slots"].partition("-")
        assert int(lo) <= int(hi or lo) < 16384


def test_tasks_cover_every_slot_once() -> None:
    fleet = even_split("f", {"a": "redis://:secret@x", "b": "redis://y", "c": "redis://z"})
    tasks = split_tasks(fleet, 700)
    covered = sorted(s for t in tasks for s in t.slots)
    assert covered == list(range(16384))
    assert all(t.end - t.start < 700 for t in tasks)
    assert all(fleet.shard_for_slot(t.start) == t.shard == fleet.shard_for_slot(t.end) for t in tasks)
    # shards interleave, so the first executors spread over all shards
    assert [t.shard for t in tasks[:3]] == ["a", "b", "c"]
    assert "secret" not in repr(tasks[0])
    assert isinstance(tasks[0], SlotTask)
