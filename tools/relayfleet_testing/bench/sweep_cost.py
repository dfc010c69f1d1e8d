"""What one load sweep of a shard costs: the relay's CPU, Redis's CPU, and the loop's longest stall.

``python -m relayfleet_testing.bench.sweep_cost [--queues N] [--sweeps K]``

Starts a redis-server, writes N queues of one message each with the relay's own enqueue
script (random recipients, so spread over the 16,384 slots as a fleet's are), then runs
`relay.shard_health.read_load` over all 16,384 slots K times, as a relay's health loop does
once per stats interval while /metrics is scraped. Per sweep it prints the relay's CPU
seconds (this process), Redis's CPU (INFO cpu), the calls the relay sent and the mean time
Redis spent in one (INFO commandstats: one slot_sweep.lua call blocks Redis that long; the
commands a script runs are not counted as calls sent), and the longest gap between two
turns of a task that only yields, in CPU time (what a request arriving meanwhile waits at
worst).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import redis
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.sharding import SLOT_COUNT
from relay.shard_health import read_load
from relay.storage import keys as K
from relay.storage import scripts
from relay.storage.limits import QueueLimits
from relay.storage.store import ShardStore


@dataclass(frozen=True)
class Sweep:
    relay_cpu_ms: float
    redis_cpu_ms: float
    wall_ms: float
    calls: int  # calls the relay sent (a script call counts once)
    call_us: float  # Redis's mean time in one of them
    longest_stall_ms: float
    messages: int


def enqueue_call(k: K.QueueKeys, payload: bytes, now_ms: int, message_id: str, token: str) -> tuple[Any, ...]:
    """EVALSHA's numkeys, keys and arguments for an enqueue.lua call of one item with the default
    limits (the order relay/storage/lua/enqueue.lua declares)."""
    limits = QueueLimits()
    fixed = (
        limits.rate_count,
        limits.rate_window_ms,
        limits.max_messages,
        limits.max_bytes,
        limits.retention_ms,
        limits.recipient_max_messages,
        limits.recipient_max_bytes,
        limits.recipient_rate_count,
        0,  # the shard is not within its reserve
    )
    keys = (k.state, k.meta, k.msgs, k.idem, k.idemx, k.rate, k.index, k.stats, K.slot_recipients(k.slot))
    return (len(keys), *keys, *fixed, payload, now_ms, "", "", message_id, k.qid, k.wake, token, "")


def populate(r: redis.Redis, queues: int, now_ms: int) -> None:
    """`queues` queues of one 256-byte message each, enqueued at `now_ms` by the relay's script."""
    r.script_load(scripts.ENQUEUE.source)
    pipe = r.pipeline(transaction=False)
    for n in range(queues):
        k = K.queue_keys(os.urandom(32), b"")
        pipe.evalsha(scripts.ENQUEUE.sha, *enqueue_call(k, b"x" * 256, now_ms, "mid", f"t{n}"))
        if len(pipe) >= 500:
            pipe.execute()
    pipe.execute()


def redis_cpu_s(r: redis.Redis) -> float:
    cpu: dict[str, Any] = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def longest_stall_s(store: ShardStore) -> float:
    """The most CPU this thread spent between two turns of a task that only yields, during one
    sweep: the longest piece of sweep work a request would wait behind. CPU time, not wall time:
    on a shared machine the wall clock also counts the time other processes held the core. (A
    separate sweep: the yielding task's own turns would count as the relay's CPU.)"""
    stall = 0.0
    done = False

    async def ticker() -> None:
        nonlocal stall
        last = time.thread_time()
        while not done:
            await asyncio.sleep(0)
            now = time.thread_time()
            stall = max(stall, now - last)
            last = now

    tick = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(0)
    await read_load(store, list(range(SLOT_COUNT)), int(time.time() * 1000))
    done = True
    await tick
    return stall


async def one_sweep(store: ShardStore, r: redis.Redis) -> Sweep:
    r.config_resetstat()
    redis_before = redis_cpu_s(r)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    load = await read_load(store, list(range(SLOT_COUNT)), int(time.time() * 1000))
    cpu1, wall1 = time.process_time(), time.perf_counter()
    redis_after = redis_cpu_s(r)
    stats: dict[str, dict[str, Any]] = r.info("commandstats")
    scripted = stats.get("cmdstat_evalsha")
    if scripted:  # the commands the script ran are counted too, not sent by the relay
        sent = [scripted]
    else:
        sent = [v for k, v in stats.items() if k in ("cmdstat_get", "cmdstat_hmget", "cmdstat_scard")]
    calls = sum(int(v["calls"]) for v in sent)
    return Sweep(
        relay_cpu_ms=1000 * (cpu1 - cpu0),
        redis_cpu_ms=1000 * (redis_after - redis_before),
        wall_ms=1000 * (wall1 - wall0),
        calls=calls,
        call_us=sum(float(v["usec"]) for v in sent) / max(1, calls),
        longest_stall_ms=1000 * await longest_stall_s(store),
        messages=load.messages,
    )


async def run(args: argparse.Namespace) -> int:
    server = LocalRedis(appendfsync="no").start()
    try:
        with redis.Redis.from_url(server.url) as r:
            populate(r, args.queues, int(time.time() * 1000))
            store = ShardStore("bench", server.url, QueueLimits())
            await store.start()
            try:
                await read_load(store, [0], 0)  # connect (and load the script) outside the measure
                sweeps = [await one_sweep(store, r) for _ in range(args.sweeps)]
            finally:
                await store.close()
        for s in sweeps:
            print(
                f"sweep of {SLOT_COUNT} slots, {args.queues} queues ({s.messages} messages): "
                f"relay CPU {s.relay_cpu_ms:.0f} ms, Redis CPU {s.redis_cpu_ms:.0f} ms, "
                f"wall {s.wall_ms:.0f} ms, {s.calls} calls sent ({s.call_us:.0f} µs each in Redis), "
                f"longest loop stall {s.longest_stall_ms:.2f} ms"
            )
        print(
            f"median of {len(sweeps)}: relay CPU {statistics.median(s.relay_cpu_ms for s in sweeps):.0f} ms, "
            f"Redis CPU {statistics.median(s.redis_cpu_ms for s in sweeps):.0f} ms, "
            f"longest loop stall {statistics.median(s.longest_stall_ms for s in sweeps):.2f} ms"
        )
    finally:
        server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m relayfleet_testing.bench.sweep_cost", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--queues", type=int, default=10_000, help="queues written before the sweeps (no env)")
    p.add_argument("--sweeps", type=int, default=3, help="sweeps measured (no env)")
    args = p.parse_args(argv)
    try:
        import uvloop  # the relay's own loop

        return uvloop.run(run(args))
    except ImportError:
        return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
