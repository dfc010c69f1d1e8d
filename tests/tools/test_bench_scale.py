"""`relayfleet bench --scale` at small sizes: each phase runs, and its report carries every figure
with its floor or anchor from the same run and the growth exponents. Structure, not timings (the
machine is shared)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
from relayfleet_testing.bench import main
from relayfleet_testing.bench.scale import retention
from relayfleet_testing.bench.scale.report import Figure, Growth, PhaseReport, growth_exponent, render
from relayfleet_testing.bench.scale.servers import chart_redis

from relay.storage import keys as K
from relay.storage.maintenance import ShardMaintenance, TrimPolicy
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore
from tests.support.k8s_cluster import KubeCluster

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from relayfleet_testing.localredis import LocalRedis


def run_phase(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "scale.json"
    md = tmp_path / "bench.md"
    assert main(["--scale", *args, "--json", str(out), "--output", str(md), "--quiet"]) == 0
    [phase] = json.loads(out.read_text())
    text = md.read_text()
    assert f"<!-- bench:scale-{phase['phase']}:begin -->" in text
    assert "| figure | value |" in text
    return dict(phase)


def figures(phase: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {f["name"]: f for f in phase["figures"]}
    for f in out.values():
        assert f["anchor"], f
        assert math.isfinite(f["value"]), f
    return out


def anchored(fig: dict[str, Any]) -> None:
    """A figure with its floor or anchor measured, and the ratio between them."""
    assert fig["anchor_value"] is not None, fig
    assert fig["anchor_value"] > 0, fig
    assert fig["ratio"] == pytest.approx(fig["value"] / fig["anchor_value"])


def test_growth_exponent_is_the_slope_of_the_logs() -> None:
    assert growth_exponent([10, 100, 1000], [1, 10, 100]) == pytest.approx(1.0)
    assert growth_exponent([10, 100], [1, 100]) == pytest.approx(2.0)
    assert growth_exponent([10], [1]) is None
    report = PhaseReport(
        "x", {"n": 3}, [Figure("f", 2.0, "s", "the floor", 1.0)], [Growth("t", "s", (1, 2), (1, 4))]
    )
    text = render(report)
    assert "| f | 2 s | the floor | 1 s | 2 |" in text
    assert "| 1 / 2 | 1 s / 4 s | 2.00 |" in text


def test_a_queue_meta_key_gives_back_its_slot_and_id() -> None:
    q = K.queue_keys(b"r" * 32, b"chan")
    assert K.queue_of_meta_key(q.meta) == (q.slot, q.qid)
    assert K.queue_of_meta_key(q.msgs) is None
    assert K.queue_of_meta_key(K.slot_stats(q.slot)) is None


async def test_seeded_queue_has_the_keys_enqueue_writes(redis_server: LocalRedis) -> None:
    """The retention phase's seed.lua leaves a queue as ShardStore.enqueue (enqueue.lua) does:
    the same stream entries, meta fields, index entry and slot statistics; and a retention pass
    trims both alike."""
    url = redis_server.url
    payload = b"p" * 256
    at = [1_700_000_000_000 + i * 5_000 for i in range(3)]
    enqueued, seeded = b"e" * 32, b"s" * 32
    store = ShardStore("t", url, QueueLimits(rate_count=100))
    await store.start()
    try:
        for t in at:
            out = await store.enqueue(K.queue_keys(enqueued, b""), EnqueueRequest(enqueued, b"", payload), t)
            assert out.kind == "stored"
    finally:
        await store.close()
    client = redis.Redis.from_url(url)
    try:
        client.delete(K.queue_keys(enqueued, b"").rate)  # days-old messages' rate state expired
        stats = client.hgetall(K.slot_stats(K.queue_keys(seeded, b"").slot))
        client.script_load(retention.SEED_SCRIPT)
        retention.seed_one(client, payload, [retention.SeededQueue(seeded, at[0], 5_000, 3)])
        e, s = K.queue_keys(enqueued, b""), K.queue_keys(seeded, b"")
        assert client.xrange(s.msgs) == client.xrange(e.msgs)
        assert client.xinfo_stream(s.msgs)["length"] == 3
        em, sm = client.hgetall(e.meta), client.hgetall(s.meta)
        # 'r': the mark of the relay run that wrote it (rf:boot, which ShardStore.start sets): a
        # shard seeded without a relay has no run; trim never reads it
        assert sorted(sm) == sorted(f for f in em if f != b"r")
        assert (sm[b"seq"], sm[b"bytes"]) == (em[b"seq"], em[b"bytes"]) == (b"3", b"768")
        assert client.sismember(s.index, s.qid)
        after = client.hgetall(K.slot_stats(s.slot))
        assert int(after[b"msgs"]) - int(stats.get(b"msgs", 0)) == 3
        assert int(after[b"bytes"]) - int(stats.get(b"bytes", 0)) == 768

        def suffixes(q: K.QueueKeys) -> list[str]:
            names = [n.decode() if isinstance(n, bytes) else n for n in client.keys(f"{q.base}:*")]
            return sorted(n.rsplit(":", 1)[-1] for n in names)

        assert suffixes(s) == suffixes(e) == ["meta", "msgs"]
    finally:
        client.close()
    policy = TrimPolicy(now_ms=at[2] + 1, cutoff_ms=at[1], max_messages=-1, idle_ms=-1)
    with ShardMaintenance(url) as m:
        [te, ts] = m.trim([(e.slot, e.qid), (s.slot, s.qid)], policy)
    assert (te.removed, te.bytes, te.deleted) == (ts.removed, ts.bytes, ts.deleted) == (1, 256, False)


def test_store_phase(tmp_path: Path) -> None:
    phase = run_phase(tmp_path, "--phase", "store", "--queues", "3000", "--payload", "256")
    figs = figures(phase)
    held = figs["held recipients per GiB (1 message each)"]
    anchored(held)
    assert 0 < held["ratio"] < 1  # a queue never costs less than its payload as a raw string
    per_queue = figs["bytes per held queue (1 message)"]
    anchored(per_queue)
    # the same run's bytes: recipients per GiB is 2^30 over the bytes per queue, both sides
    assert held["value"] == pytest.approx(2**30 / per_queue["value"])
    assert held["anchor_value"] == pytest.approx(2**30 / per_queue["anchor_value"])
    assert 256 + 32 < per_queue["anchor_value"] < 1024  # a SET of the payload under the recipient
    with_rate = figs["bytes per queue right after its enqueue (rate state held)"]
    anchored(with_rate)
    # a rate window of one enqueue is the meta's field 'w' (kept): deleting rate keys frees
    # nothing then, never makes a queue bigger
    assert with_rate["value"] >= per_queue["value"] - 1
    anchored(figs["fill rate (storage layer, pipelined)"])
    assert figs["bytes left per drained idle queue"]["value"] > 0  # meta kept until retention
    swept = figs["bytes left per queue after retention's idle deletion"]
    assert swept["anchor_value"] == 0
    # no key left; the bytes are a shard's fixed residue (~70 KB measured here, the
    # allocator's and Lua's), 23 B a queue at 3,000 and nothing at 1,000,000
    assert abs(swept["value"]) < 64
    assert figs["keys left per queue after retention's idle deletion"]["value"] == 0
    growth = {g["cost"]: g for g in phase["growth"]}
    assert set(growth) == {"fill time", "fill CPU (this process + Redis)", "drain time",
                           "drain CPU (this process + Redis)"}  # fmt: skip
    for g in growth.values():
        assert g["sizes"] == [30, 300, 3000]
        assert g["exponent"] is not None


def test_rebalance_phase(tmp_path: Path) -> None:
    """The issue's skew over 16, 32 and 64 shards (the smallest sizes where the plan needs
    moves: 1, 3 and 12): the plan reaches its tolerance and the report carries its CPU time's
    growth. The exponent itself is a benchmark figure (docs/benchmarks.md, 0.69 quiet), not
    bounded here: at these sizes the plans take 0.1-1 s, and beside three busy xdist workers
    the same code measured 1.36."""
    phase = run_phase(tmp_path, "--phase", "rebalance", "--shards", "64", "--skew", "0.6")
    figs = figures(phase)
    after = figs["max/mean load after the plan"]
    anchored(after)
    assert after["ratio"] >= 1 - 1e-9  # nothing beats the lower bound
    assert after["value"] <= 1.1 + 1e-9  # the planner's tolerance, from max/mean 1.44 before
    assert figs["max/mean load before"]["value"] > 1.3
    anchored(figs["max/mean load after the plan (vs LPT)"])
    anchored(figs["plan CPU time"])
    assert 0 < figs["slots moved"]["value"] < 1000
    [growth] = phase["growth"]
    assert growth["sizes"] == [16, 32, 64]
    assert all(v > 0 for v in growth["values"])
    assert growth["exponent"] is not None


@pytest.mark.spark
def test_retention_phase(spark: SparkSession, tmp_path: Path) -> None:
    args = ("--phase", "retention", "--retention-messages", "4000", "--retention-queues", "400",
            "--retention-payload", "64")  # fmt: skip
    phase = run_phase(tmp_path, *args)
    figs = figures(phase)
    for name in (
        "Spark job wall time",
        "messages scanned per second per executor core",
        "Redis CPU spent (INFO CPU delta)",
        "Redis busy share of the wall time",
        "executor cores' time in tasks (tasks' time / wall x cores)",
    ):
        anchored(figs[name])
    rate = figs["messages scanned per second per executor core"]
    wall = figs["Spark job wall time"]
    # both rates from the same run's wall times: 4,000 messages over each, per core
    assert rate["value"] == pytest.approx(4000 / wall["value"] / 2)
    assert rate["anchor_value"] == pytest.approx(4000 / wall["anchor_value"])
    assert "Both removed" in phase["notes"][0]
    assert phase["params"]["payload bytes"] == 64


def test_a_kept_seeded_shard_starts_the_next_run(tmp_path: Path) -> None:
    """--retention-snapshot: the first run seeds and keeps the shard, the next of the same sizes
    starts from it (same messages, same clock), one of other sizes seeds anew."""
    keep = tmp_path / "seeded.rdb"

    def seed(messages: int) -> tuple[list[str], int, int]:
        said: list[str] = []
        server = chart_redis(appendonly=False)
        try:
            _, now = retention.seeded(server, messages, 60, 64, 7, keep, said.append)
            with redis.Redis.from_url(server.url) as client:
                streams = client.scan_iter(match=K.QUEUE_META_GLOB.replace(":meta", ":msgs"), count=1000)
                held = sum(int(client.xlen(k)) for k in streams)
        finally:
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)
        return said, now, held

    first, now, held = seed(600)
    assert held == 600
    assert not any("restoring" in line for line in first)
    again, now_again, held_again = seed(600)
    assert any("restoring" in line for line in again)
    assert (now_again, held_again) == (now, 600)
    other, _, held_other = seed(300)
    assert held_other == 300
    assert not any("restoring" in line for line in other)


def test_operator_phase(kwok_cluster: KubeCluster, tmp_path: Path) -> None:
    phase = run_phase(
        tmp_path,
        "--phase", "operator", "--relayshards", "3", "--rest-seconds", "4",
        "--kubeconfig", str(kwok_cluster.kubeconfig),
        # the operator tests' pace (tests/support/operator_harness.py), not production's
        "--operator-env", "RELAYFLEET_OPERATOR_RESYNC_SECONDS=3",
        "--operator-env", "RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS=1",
        "--operator-env", "RELAYFLEET_OPERATOR_RETRY_SECONDS=2",
    )  # fmt: skip
    figs = figures(phase)
    for name in (
        "time until all 3 RelayShards are Ready",
        "operator API requests per minute per shard at rest",
        "operator RSS with 3 shards",
        "one slot migration (64 slots) among 3 shards",
        "API requests per minute during one migration",
    ):
        anchored(figs[name])
    assert figs["operator API requests per minute at rest"]["anchor_value"] is not None
    # every migration finished (a stuck one is NaN, which figures() refuses, and a note), no
    # shard left Ready, and a reconcile at rest (a window longer than the 3-s resync) takes
    # less than the resync period (more: the shards queue on each other)
    assert not [n for n in phase["notes"] if n.startswith("Not finished")], phase["notes"]
    assert figs["shards that left Ready during the run (flaps)"]["value"] == 0
    reconcile = figs["mean RelayShard reconcile time at rest (lock waits included)"]
    anchored(reconcile)
    assert reconcile["ratio"] < 1, reconcile
    [growth] = phase["growth"]
    assert growth["sizes"] == [1, 2]


def test_a_phase_that_cannot_finish_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-kubeconfig"
    assert main(["--scale", "--phase", "operator", "--relayshards", "2", "--kubeconfig", str(missing)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("relayfleet bench --scale: ")
    assert "Traceback" not in "\n".join(err)


def test_bad_sizes_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scale", "--queues", "0"]) == 2
    assert main(["--scale", "--phase", "nothing"]) == 2
    assert main(["--scale", "--retention-messages", "5", "--retention-queues", "10"]) == 2
    assert "--queues must be >= 1" in capsys.readouterr().err
