"""The rebalance planner as pure functions, and `relayfleet plan` (plan_main) on real shards."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from relay.fleet.contract import Move
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange, even_split
from spark_jobs.load_planner import Plan, PlanningError, SlotLoad, plan, plan_main, slot_loads
from tests.support.chart import crd, schema_of
from tests.support.naive_planner import naive
from tests.support.spark_session import FleetFactory, Seed, seed

URLS = {name: f"redis://127.0.0.1:{6400 + i}/0" for i, name in enumerate("abcd")}


def fleet(names: str, ranges: Sequence[tuple[int, int, str]] | None = None) -> ShardMap:
    shards = {n: URLS[n] for n in names}
    if ranges is None:
        return even_split("f", shards)
    return ShardMap("f", 3, shards, tuple(SlotRange(a, b, s) for a, b, s in ranges))


def uniform(m: ShardMap, nbytes: int = 1000, rate: float = 1.0) -> list[SlotLoad]:
    return [SlotLoad(s, m.shard_for_slot(s), nbytes // 100, nbytes, rate) for s in range(SLOT_COUNT)]


def apply(m: ShardMap, moves: Sequence[Move]) -> ShardMap:
    out = m
    for mv in moves:
        assert all(m.shard_for_slot(s) == mv.source for s in range(mv.start, mv.end + 1))
        out = out.with_slots(range(mv.start, mv.end + 1), mv.target)
    return out


def test_balanced_fleet_stays_put() -> None:
    m = fleet("abc")
    p = plan(m, uniform(m))
    assert p.moves == ()
    assert p.balanced
    assert Plan.max_ratio(p.before) == pytest.approx(1.0, abs=1e-3)


def test_no_load_no_moves() -> None:
    p = plan(fleet("abc"), [])
    assert p.moves == ()
    assert p.balanced


def test_skew_is_fixed_within_tolerance_with_contiguous_moves() -> None:
    m = fleet("abc")
    rng = random.Random(5)
    stats = [
        SlotLoad(s, m.shard_for_slot(s), 1, rng.randint(500, 1500) * (3 if m.shard_for_slot(s) == "a" else 1))
        for s in range(SLOT_COUNT)
    ]
    p = plan(m, stats, metric="bytes", tolerance=0.1)
    assert Plan.max_ratio(p.before) > 1.7
    assert p.balanced
    assert Plan.max_ratio(p.after) <= 1.1 + 1e-9
    assert {mv.source for mv in p.moves} == {"a"}
    assert len(p.moves) <= 2  # one contiguous range per receiver
    after = apply(m, p.moves)
    assert len(after.ranges) <= len(m.ranges) + 2
    # the before/after table and the JSON agree with the moves
    doc = p.to_json()
    assert doc["moves"] == [  # the RelayRebalance shape
        {"slots": mv.slots, "from": mv.source, "to": mv.target, "bytes": mv.bytes, "messages": mv.messages}
        for mv in p.moves
    ]
    assert doc["bytesMoved"] == sum(mv.bytes for mv in p.moves)
    assert doc["shards"]["a"]["after"]["slots"] == after.slot_counts()["a"]
    assert "max load/mean" in p.table()


def test_skew_moves_the_cheap_slots() -> None:
    """Half the hot shard's excess is write traffic on small queues, half is big
    backlogs: moving the write-hot slots balances the blend for a fraction of the bytes."""
    m = fleet("abc")
    stats = []
    for s in range(SLOT_COUNT):
        owner = m.shard_for_slot(s)
        size, rate = 1000, 1.0
        if owner == "a" and s < 1500:
            size, rate = 200, 12.0  # write-hot, small
        elif owner == "a" and s >= 4000:
            size, rate = 8000, 1.0  # big backlogs at the end of a's range
        stats.append(SlotLoad(s, owner, size // 100, size, rate))
    load = slot_loads(stats, "blend")
    nbytes = [st.bytes for st in stats]
    p = plan(m, stats, metric="blend", tolerance=0.1)
    assert p.balanced
    ref_bytes, ref_ratio = naive(m, load, nbytes, 0.1)
    assert ref_ratio <= 1.1 + 1e-9
    assert p.bytes_moved < ref_bytes / 3
    assert all(mv.end < 1500 for mv in p.moves)


def test_weights_are_respected() -> None:
    m = fleet("ab")
    p = plan(m, uniform(m), weights={"a": 1, "b": 3}, metric="bytes", tolerance=0.05)
    assert p.balanced
    after = {b.shard: b for b in p.after}
    share_a = after["a"].load / (after["a"].load + after["b"].load)
    assert share_a == pytest.approx(0.25, abs=0.02)
    assert p.moves
    assert all(mv.source == "a" and mv.target == "b" for mv in p.moves)
    assert len(p.moves) == 1
    # the moved range borders b's range, so the map stays two ranges
    assert len(apply(m, p.moves).ranges) == 2


def test_new_empty_shard_receives_slots() -> None:
    m = fleet("abc", [(0, 8191, "a"), (8192, SLOT_COUNT - 1, "b")])
    p = plan(m, uniform(m), metric="bytes", tolerance=0.1)
    assert p.balanced
    assert {mv.target for mv in p.moves} == {"c"}
    assert next(b for b in p.before if b.shard == "c").slots == 0


def test_migrating_slots_never_move() -> None:
    m = fleet("ab")
    pinned = set(range(6000, 8192)) | {100, 2000, 4001}  # a range in flight, and a few strays
    stats = []
    for s in range(SLOT_COUNT):
        owner = m.shard_for_slot(s)
        state = "importing" if s == 2000 else "migrating" if s in pinned else None
        stats.append(SlotLoad(s, owner, 1, 3000 if owner == "a" else 1000, 0.0, state))
    p = plan(m, stats, metric="bytes", tolerance=0.1)
    assert p.balanced
    moved = {s for mv in p.moves for s in range(mv.start, mv.end + 1)}
    assert moved
    assert not moved & pinned
    assert any(f"{len(pinned)} slots not movable" in n for n in p.notes)


def test_stale_statistics_stay_in_place() -> None:
    m = fleet("ab")
    stats = uniform(m)
    stats[10] = SlotLoad(10, "b", 1, 10**9)  # the map says a owns slot 10
    p = plan(m, stats, metric="bytes")
    assert all(not (mv.start <= 10 <= mv.end) for mv in p.moves)
    assert any("does not name as owner" in n for n in p.notes)


def test_one_giant_slot_is_reported_not_chased() -> None:
    m = fleet("ab")
    stats = uniform(m, nbytes=10)
    stats[7] = SlotLoad(7, "a", 1, 10**9)
    p = plan(m, stats, metric="bytes")
    assert not p.balanced
    assert any("no movable slot range lowers it" in n for n in p.notes)
    assert Plan.max_ratio(p.after) <= Plan.max_ratio(p.before)


def test_bad_inputs() -> None:
    m = fleet("ab")
    with pytest.raises(PlanningError, match="unknown shard"):
        plan(m, [], weights={"z": 1})
    with pytest.raises(PlanningError, match="must be > 0"):
        plan(m, [], weights={"a": 0})
    with pytest.raises(PlanningError, match="unknown metric"):
        plan(m, [], metric="vibes")
    with pytest.raises(PlanningError, match="tolerance"):
        plan(m, [], tolerance=-1)


def test_planner_is_fast_enough_for_a_cron_job() -> None:
    m = fleet("abcd")
    rng = random.Random(9)
    stats = [
        SlotLoad(s, m.shard_for_slot(s), 1, rng.randint(1, 5000) * (1 + (s % 7 == 0) * 20), rng.random() * 5)
        for s in range(SLOT_COUNT)
    ]
    started = time.monotonic()
    p = plan(m, stats)
    assert time.monotonic() - started < 20
    assert Plan.max_ratio(p.after) <= Plan.max_ratio(p.before)


# --- relayfleet plan: exit codes and a real read of the shards --------------


def test_plan_main_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main([]) == 2
    assert "required" in capsys.readouterr().err
    assert plan_main(["--shard-map", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot read shard map" in err
    assert len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"fleet": "f", "epoch": 1, "shards": {}, "slots": []}')
    assert plan_main(["--shard-map", str(bad)]) == 2
    good = tmp_path / "good.json"
    good.write_text(fleet("ab").dumps())
    assert plan_main(["--shard-map", str(good), "--tolerance", "x"]) == 2
    assert plan_main(["--shard-map", str(good), "--weight", "z=1"]) == 2
    assert plan_main(["--shard-map", str(good), "--weight", "a=-1"]) == 2


def test_plan_main_unreachable_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "map.json"
    doc = fleet("ab").to_json()
    doc["shards"] = {"a": {"redis": "redis://127.0.0.1:1/0"}, "b": {"redis": "redis://127.0.0.1:1/0"}}
    path.write_text(json.dumps(doc))
    assert plan_main(["--shard-map", str(path)]) == 1
    err = capsys.readouterr().err
    assert "127.0.0.1:1/0" in err
    assert "Traceback" not in err


def test_plan_main_reads_real_shards(
    redis_fleet: FleetFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = redis_fleet(["a", "b"])
    rng = random.Random(1)
    now = int(time.time() * 1000)
    seeds = []
    for _ in range(60):
        recipient = rng.randbytes(32)
        if m.shard_for(recipient) == "a":
            seeds += [Seed(recipient, b"", b"z" * 500, now) for _ in range(3)]
    seed(m, seeds)
    path = tmp_path / "map.json"
    path.write_text(m.dumps())
    rebalance = tmp_path / "rebalance.yaml"
    argv = ["--shard-map", str(path), "--metric", "bytes", "--table", "--min-bytes", "0"]
    assert plan_main([*argv, "--rebalance-yaml", str(rebalance)]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert "load/mean" in out.err
    assert doc["maxOverMean"]["before"] == pytest.approx(2.0)
    assert doc["balanced"]
    assert doc["moves"]
    assert all((mv["from"], mv["to"]) == ("a", "b") for mv in doc["moves"])
    assert doc["bytesMoved"] == sum(mv["bytes"] for mv in doc["moves"]) > 0
    assert f"(tolerance {doc['tolerance']:g})" in out.err  # one notation in the JSON and the table
    manifest = yaml.safe_load(rebalance.read_text())
    assert manifest["kind"] == "RelayRebalance"
    assert manifest["spec"]["proposal"]["moves"] == doc["moves"]
    jsonschema.validate(manifest, schema_of(crd("relayrebalances.yaml")))
    # the same fleet under a floor it does not reach (64 MiB, 10000 enqueues/min): idle, no moves
    assert plan_main(["--shard-map", str(path), "--metric", "bytes", "--min-rate", "10000"]) == 0
    idle = json.loads(capsys.readouterr().out)
    assert (idle["balanced"], idle["idle"], idle["moves"]) == (True, True, [])
    assert "below the minimum load" in idle["notes"][-1]


def test_plan_reads_the_shard_map_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "map.json"
    doc = fleet("ab").to_json()
    doc["shards"] = {"a": {"redis": "redis://127.0.0.1:1/0"}, "b": {"redis": "redis://127.0.0.1:1/0"}}
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("RELAY_SHARD_MAP", str(path))
    assert plan_main([]) == 1  # the map was read (its shards are down): not "required"
    assert "127.0.0.1:1/0" in capsys.readouterr().err
    monkeypatch.setenv("RELAY_SHARD_MAP", str(tmp_path / "nope.json"))
    assert plan_main([]) == 2
