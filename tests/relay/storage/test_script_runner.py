"""The cold paths' script runner (relay/storage/script_runner.py) on a real redis-server that
lost its script cache (SCRIPT FLUSH, as after a restart or a failover to a fresh replica)."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis
from relayfleet_testing.localredis import LocalRedis

from relay.storage import keys as K
from relay.storage import script_runner, scripts
from relay.storage.maintenance import ShardMaintenance, TrimPolicy

SLOT = 11


def _batch() -> list[tuple[object, ...]]:
    """A script call, a command that must not run twice when redo='missing', a script call."""
    return [
        script_runner.evalsha(scripts.SLOT_STATE, (K.slot_state(SLOT),), ("migrating", "", "migrating")),
        ("INCR", "counter"),
        script_runner.evalsha(scripts.SLOT_STATE, (K.slot_state(SLOT + 1),), ("importing", "")),
    ]


def test_missing_reloads_and_repeats_only_the_refused_calls(r: redis.Redis) -> None:
    r.script_flush()
    replies = script_runner.run(r, _batch(), (scripts.SLOT_STATE,), "missing")
    assert replies == [[1, b""], 1, [1, b""]]
    assert r.get("counter") == b"1"
    assert r.get(K.slot_state(SLOT)) == b"migrating"
    assert r.get(K.slot_state(SLOT + 1)) == b"importing"
    assert r.script_exists(scripts.SLOT_STATE.sha) == [True]


async def test_all_repeats_the_whole_batch(redis_server: LocalRedis) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.script_flush()
        replies = await script_runner.run_async(client, _batch(), (scripts.SLOT_STATE,), "all")
        assert replies == [[1, b""], 2, [1, b""]]  # the INCR ran with both sends
        # a cached script: one round trip, nothing repeated
        assert await script_runner.run_async(client, [("INCR", "counter")], (), "all") == [3]
    finally:
        await client.aclose()


def test_load_failure_names_its_cause(r: redis.Redis) -> None:
    r.script_flush()
    broken = scripts.Script("broken", "this is not lua", scripts.SLOT_STATE.sha)
    with pytest.raises(script_runner.ScriptLoadFailed) as failed:
        script_runner.run(r, _batch(), (broken,), "missing")
    assert isinstance(failed.value.cause, redis.ResponseError)


def test_retention_survives_a_flushed_script_cache(redis_server: LocalRedis, r: redis.Redis) -> None:
    q = K.queue_keys_for_id(SLOT, "q")
    for seq in (1, 2, 3):
        r.xadd(q.msgs, {"p": "x", "t": 1000 * seq, "m": "", "n": 1}, id=f"{seq}-0")
    r.hset(q.meta, mapping={"seq": 3, "bytes": 3, "epoch": "e", "created": 0})
    r.sadd(q.index, "q")
    with ShardMaintenance(redis_server.url) as shard:
        shard.trim([(SLOT, "q")], TrimPolicy(now_ms=10_000, cutoff_ms=1500))  # loads the script
        r.script_flush()
        [outcome] = shard.trim([(SLOT, "q")], TrimPolicy(now_ms=10_000, cutoff_ms=2500))
    assert (outcome.removed, outcome.bytes, outcome.fenced) == (1, 1, False)
    assert r.xlen(q.msgs) == 1
