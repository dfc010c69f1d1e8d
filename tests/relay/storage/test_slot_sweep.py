"""Slot statistics read in batches by lua/slot_sweep.lua, on a real redis-server, against each
slot's keys read one by one and interpreted by this file's own statement of the rule
(`reference_load`, docs/design-decisions.md): the Spark jobs' and `relayfleet plan`'s
ShardMaintenance.slot_stats (the script's rows) and the relays' shard_health.read_load (its
totals) are both the script's one reading, so they agree with each other and with the rule.
Populated, empty, moved, migrating and importing slots, statistics of zero, a former relay's
minute counters; the batch bound (one script call per SWEEP_SLOTS slots), a caller out of
step with the script failing loudly, and a relay's loop free between two calls."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import time
from collections.abc import Sequence

import aiohttp
import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

import relay.storage.store
from relay.fleet.sharding import SLOT_COUNT
from relay.shard_health import LOAD_SLOTS, MONITOR, ShardLoad, read_load
from relay.storage import keys as K
from relay.storage import maintenance, scripts
from relay.storage.limits import QueueLimits
from relay.storage.maintenance import SWEEP_SLOTS, ShardMaintenance, SlotStats, SweepMismatch
from relay.storage.script_runner import evalsha
from relay.storage.store import EnqueueRequest, ShardStore
from tests.support.in_process_relay import RunningRelay

NOW = 1_700_000_030_000
MINUTE = NOW - NOW % 60_000
ALL = list(range(SLOT_COUNT))


async def populate(url: str, queues: int, now_ms: int) -> None:
    """`queues` queues of one 256-byte message each, enqueued at `now_ms` through the storage
    layer's own enqueue (ShardStore.enqueue, which batches the calls of a tick into one
    enqueue.lua call): a thousand at a time, each call given the slack of a seeding tool's
    bulk write on a loaded machine (the relay's own deadline, 2 s, is for a client's write)."""
    store = ShardStore("populate", url, QueueLimits(write_timeout_s=60.0))
    await store.start()
    try:
        for done in range(0, queues, 1000):
            recipients = [os.urandom(32) for _ in range(min(1000, queues - done))]
            outcomes = await asyncio.gather(
                *(
                    store.enqueue(
                        K.queue_keys(r, b""), EnqueueRequest(r, b"", b"x" * 256, message_id="mid"), now_ms
                    )
                    for r in recipients
                )
            )
            assert {o.kind for o in outcomes} == {"stored"}
    finally:
        await store.close()


async def varied_shard(url: str, r: redis.Redis) -> dict[str, int]:
    """2,000 queues, then slots of every kind the readers must tell apart; their slot numbers."""
    await populate(url, 2000, NOW)
    # slots of one queue each: 2,000 random keys share a slot now and then, and the expected
    # totals take the moved slot's one queue away
    held = [s for s in ALL if r.scard(K.slot_index(s)) == 1]
    empty = [s for s in ALL if not r.exists(K.slot_index(s), K.slot_stats(s))]
    kinds = {
        "moved": held[0],
        "migrating": held[1],
        "importing": empty[0],  # a migration's target: the copy has not arrived yet
        "legacy_now": held[2],
        "legacy_last": empty[1],
        "zeros": empty[2],
        "index_only": empty[3],
        "moved_empty": empty[4],
        "burst": empty[5],  # more enqueues this minute than the last
        "last_only": empty[6],
        "stale": empty[7],  # counters of two minutes ago: no rate now
        "legacy_stale": empty[8],
        "below_zero": empty[9],  # counters drifted below zero read as nothing
    }
    r.set(K.slot_state(kinds["moved"]), "moved b 3")
    r.set(K.slot_state(kinds["migrating"]), "migrating")
    r.set(K.slot_state(kinds["importing"]), "importing")
    r.set(K.slot_state(kinds["moved_empty"]), "moved b 3")
    r.hset(K.slot_stats(kinds["burst"]), mapping={f"w{MINUTE}": 9, f"w{MINUTE - 60_000}": 2})
    r.hset(K.slot_stats(kinds["last_only"]), mapping={f"w{MINUTE - 60_000}": 5})
    r.hset(K.slot_stats(kinds["stale"]), mapping={f"w{MINUTE - 120_000}": 8})
    r.hset(K.slot_stats(kinds["below_zero"]), mapping={"msgs": -3, "bytes": -10})
    # relays before 2026-11 counted minutes in wstart/wcur/wprev (lua/slot_sweep.lua)
    r.hset(K.slot_stats(kinds["legacy_now"]), mapping={"wstart": MINUTE, "wcur": 7, "wprev": 2})
    r.hset(K.slot_stats(kinds["legacy_last"]), mapping={"wstart": MINUTE - 60_000, "wcur": 4, "msgs": 3})
    r.hset(K.slot_stats(kinds["legacy_stale"]), mapping={"wstart": MINUTE - 120_000, "wcur": 6})
    r.hset(K.slot_stats(kinds["zeros"]), mapping={"msgs": 0, "bytes": 0, "qgen": 2})
    r.sadd(K.slot_index(kinds["index_only"]), "q")
    return kinds


def reference_load(values: Sequence[bytes | None], now_ms: int) -> tuple[int, int, float]:
    """The rule, restated here so the script is checked against it (not against itself): held
    messages and bytes (never below zero), and the enqueues of the last complete minute or this
    one, whichever is more; a relay before 2026-11 counted minutes in wstart/wcur/wprev."""
    msgs, nbytes, this_minute, last_minute, wstart, wcur, wprev = (int(v or 0) for v in values)
    minute = now_ms - now_ms % 60_000
    if wstart == minute:
        this_minute, last_minute = max(this_minute, wcur), max(last_minute, wprev)
    elif wstart == minute - 60_000:
        last_minute = max(last_minute, wcur)
    return max(0, msgs), max(0, nbytes), float(max(this_minute, last_minute))


def one_by_one(r: redis.Redis, slots: Sequence[int], now_ms: int) -> list[SlotStats]:
    """Each slot's GET, HMGET and SCARD, interpreted by reference_load."""
    minute = now_ms - now_ms % 60_000
    fields = ["msgs", "bytes", f"w{minute}", f"w{minute - 60_000}", "wstart", "wcur", "wprev"]
    pipe = r.pipeline(transaction=False)
    for s in slots:
        pipe.get(K.slot_state(s))
        pipe.hmget(K.slot_stats(s), fields)
        pipe.scard(K.slot_index(s))
    replies = pipe.execute()
    out = []
    for i, s in enumerate(slots):
        state, values, queues = replies[3 * i : 3 * i + 3]
        msgs, nbytes, rate = reference_load(values, now_ms)
        out.append(SlotStats(s, state.decode() if state is not None else None, msgs, nbytes, rate, queues))
    return out


def script_calls(r: redis.Redis) -> int:
    """Script calls Redis ran since the last CONFIG RESETSTAT (a NOSCRIPT refusal did not run)."""
    stats = r.info("commandstats").get("cmdstat_evalsha", {})
    refused = int(stats.get("rejected_calls", 0)) + int(stats.get("failed_calls", 0))
    return int(stats.get("calls", 0)) - refused


async def test_maintenance_slot_stats_match_each_slots_keys(redis_server: LocalRedis, r: redis.Redis) -> None:
    kinds = await varied_shard(redis_server.url, r)
    expected = one_by_one(r, ALL, NOW)
    by_slot = {s.slot: s for s in expected}
    # the reference is pinned by hand where the rule has a case
    rates = {"burst": 9.0, "last_only": 5.0, "stale": 0.0, "legacy_now": 7.0, "legacy_last": 4.0}
    assert {kind: by_slot[kinds[kind]].rate for kind in [*rates, "legacy_stale"]} == {
        **rates,
        "legacy_stale": 0.0,
    }
    assert (by_slot[kinds["below_zero"]].msgs, by_slot[kinds["below_zero"]].bytes) == (0, 0)
    assert sum(s.queues for s in expected) == 2001
    r.config_resetstat()
    with ShardMaintenance(redis_server.url) as m:
        assert m.slot_stats(ALL, NOW) == expected
        assert script_calls(r) == math.ceil(SLOT_COUNT / SWEEP_SLOTS)  # the batch bound
        # any subset, in any order; and after Redis lost its script cache (a restart, a failover)
        some = [*ALL[::-7], kinds["moved"], kinds["zeros"]]
        r.script_flush()
        assert m.slot_stats(some, NOW) == one_by_one(r, some, NOW)


async def test_read_load_totals_match_each_slots_keys(redis_server: LocalRedis, r: redis.Redis) -> None:
    kinds = await varied_shard(redis_server.url, r)
    counted = [s for s in one_by_one(r, ALL, NOW) if not (s.state or "").startswith("moved")]
    expected = ShardLoad(
        messages=sum(s.msgs for s in counted),
        bytes=sum(s.bytes for s in counted),
        queues=sum(s.queues for s in counted),
        enqueues_per_minute=sum(s.rate for s in counted),
        slots=SLOT_COUNT,
        migrating=2,
    )
    assert expected.messages == 2000 - 1 + 3  # the moved slot's queue counts for nothing
    store = ShardStore("s", redis_server.url, QueueLimits())
    await store.start()
    try:
        r.config_resetstat()
        assert await read_load(store, ALL, NOW) == expected
        assert script_calls(r) == math.ceil(SLOT_COUNT / LOAD_SLOTS)
        # a shard holding some of the slots: only those are read
        half = ALL[: SLOT_COUNT // 2]
        load = await read_load(store, half, NOW)
        assert load.slots == len(half)
        assert load.queues == sum(s.queues for s in one_by_one(r, half, NOW) if s.slot != kinds["moved"])
    finally:
        await store.close()


async def test_read_load_reads_totals_in_small_calls_beside_the_store(
    redis_server: LocalRedis, r: redis.Redis
) -> None:
    """The relay's sweep reads LOAD_SLOTS slots a call and gets only their totals back, on the
    store's bulk lane: a stream of store calls on the hot lane keeps being answered while it
    runs (the sweep never holds either for more than one small call), and a Redis that lost
    its scripts (a restart, a failover) is given them again."""
    await populate(redis_server.url, 2000, NOW)
    slots = ALL[: 64 * LOAD_SLOTS]
    store = ShardStore("s", redis_server.url, QueueLimits())
    await store.start()
    try:
        r.script_flush()
        alone = await read_load(store, slots, NOW)
        r.config_resetstat()
        served = 0

        async def stream() -> None:
            nonlocal served
            while not sweep.done():
                assert await store.ping()
                served += 1

        sweep = asyncio.get_running_loop().create_task(read_load(store, slots, NOW))
        await stream()
        beside = await sweep
    finally:
        await store.close()
    assert beside == alone
    assert alone.queues == sum(s.queues for s in one_by_one(r, slots, NOW))
    assert script_calls(r) == math.ceil(len(slots) / LOAD_SLOTS)
    assert served >= 8


async def test_the_loop_serves_requests_between_a_sweeps_batches(
    redis_server: LocalRedis, relay: RunningRelay
) -> None:
    """A sweep of all 16,384 slots, most of them populated, is one script call per
    SWEEP_SLOTS slots, the relay answers requests in between, and no stretch of the sweep's
    own work holds the loop long. The stretch is measured in this thread's CPU time (a busy
    machine's other processes do not count) with the collector off (a pass over the test
    process's heap is not the sweep's): ~1 ms here, 30-60 ms with redis-py pipelines of 256
    slots, the way the sweep was before."""
    (shard,) = relay.fleet.stores
    await asyncio.wait_for(relay.app[MONITOR].first_round.wait(), 10)
    await populate(redis_server.url, 20_000, int(time.time() * 1000))
    with redis.Redis.from_url(redis_server.url) as r:
        r.config_resetstat()
    slots = relay.fleet.map.slots_of(shard)
    served = 0
    longest = 0.0

    async def requests() -> None:
        nonlocal served
        async with aiohttp.ClientSession() as http:
            while not sweep.done():
                async with http.get(relay.base_url + "/healthz") as resp:
                    assert resp.status == 200
                served += 1

    async def turns() -> None:
        nonlocal longest
        last = time.thread_time()
        while not sweep.done():
            await asyncio.sleep(0)
            now = time.thread_time()
            longest = max(longest, now - last)
            last = now

    gc.disable()
    try:
        sweep = asyncio.get_running_loop().create_task(
            read_load(relay.fleet.stores[shard], slots, int(time.time() * 1000))
        )
        await asyncio.gather(requests(), turns())
        load = await sweep
    finally:
        gc.enable()
    assert load.queues == 20_000
    with redis.Redis.from_url(redis_server.url) as r:
        assert script_calls(r) == len(slots) // LOAD_SLOTS
    assert served >= len(slots) // 512
    assert longest < 0.010


def former_call(slots: Sequence[int], mode: str, now_ms: int) -> tuple[list[str], list[str]]:
    """The arguments slot_sweep.lua took before it read the statistics itself: the minute (or '')
    then the fields by position. A caller still sending them is out of step with the script."""
    keys, _ = maintenance.sweep_args(slots, mode, now_ms)
    minute = now_ms - now_ms % 60_000
    return keys, ["" if mode == maintenance.ROWS else str(minute), "msgs", "bytes", f"w{minute}"]


async def test_a_caller_out_of_step_with_the_script_fails_loudly(
    redis_server: LocalRedis, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arguments the script does not take are refused, and a reply of another shape than the
    reader's is not read by position into numbers: either way SweepMismatch (the relay logs it
    as an error; a Spark job or `relayfleet plan` stops with it), never a wrong load."""
    await populate(redis_server.url, 200, NOW)
    some = ALL[:256]
    store = ShardStore("s", redis_server.url, QueueLimits())
    await store.start()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(relay.storage.store, "sweep_args", former_call)
            with pytest.raises(SweepMismatch, match="slot_sweep: expected"):
                await read_load(store, some, NOW)
        with monkeypatch.context() as patch:  # the rows asked for where totals are read
            patch.setattr(
                relay.storage.store, "sweep_args", lambda s, _, now: maintenance.sweep_args(s, "rows", now)
            )
            with pytest.raises(SweepMismatch, match="slot_sweep totals: expected 5 integers"):
                await read_load(store, some, NOW)
        assert (await read_load(store, some, NOW)).queues == sum(s.queues for s in one_by_one(r, some, NOW))
    finally:
        await store.close()
    with ShardMaintenance(redis_server.url) as m:
        with monkeypatch.context() as patch:
            patch.setattr(
                maintenance,
                "sweep_call",
                lambda s, now: evalsha(scripts.SLOT_SWEEP, *former_call(s, maintenance.ROWS, now)),
            )
            with pytest.raises(SweepMismatch, match="slot_sweep: expected"):
                m.slot_stats(some, NOW)
        with monkeypatch.context() as patch:  # the totals asked for where rows are read
            patch.setattr(
                maintenance,
                "sweep_call",
                lambda s, now: evalsha(scripts.SLOT_SWEEP, *maintenance.sweep_args(s, "totals", now)),
            )
            with pytest.raises(SweepMismatch, match="slot_sweep rows: expected rows of 6"):
                m.slot_stats(some, NOW)
        assert m.slot_stats(some, NOW) == one_by_one(r, some, NOW)
    with pytest.raises(SweepMismatch, match="no mode 'sums'"):
        maintenance.sweep_args(some, "sums", NOW)
