"""The hot path's hand-written pipeline against redis-py, on one connection, in one run.

    python -m relayfleet_testing.resp_bench [--n 20000] [--wave 256] [--rounds 5]

Starts a local redis-server, then sends `n` EVALSHA calls shaped like an enqueue (3 keys,
a 256 B payload and 6 small arguments; the script answers a 3-element array, as the
enqueue script does) in waves of `wave` concurrent callers, through:

- ``hand``: relay/storage/pipeline.py's ScriptBatcher (what the relay runs);
- ``redis-py pipeline``: one redis-py asyncio pipeline (transaction=False) per wave, on a
  one-connection pool, hiredis parsing (the closest redis-py has to the coalescing batcher);
- ``redis-py calls``: each caller awaits its own ``evalsha`` on a 4-connection blocking pool.

and `n` PUBLISHes of a 200 B wakeup (sent by a separate process) received by one subscriber:

- ``hand``: a RESP stream read as it arrives, replies parsed by hiredis (what the relay's
  wakeup subscriber, relay/storage/wakeups.py, runs);
- ``redis-py pubsub``: ``PubSub.get_message`` in a loop (hiredis parsing).

Rounds alternate the clients; the figure is the median client CPU (this process's
process_time) per call, and wall-clock calls/s. Redis runs in its own process, so its CPU
is not counted. Ratios only: the machine it runs on may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import uvloop
from relayfleet_testing.localredis import LocalRedis

from relay.storage.connection import RedisTarget
from relay.storage.pipeline import Conn, ScriptBatcher, open_connection
from relay.storage.scripts import Script

SOURCE = "return {1, ARGV[2], 'q'}"
PAYLOAD = b"x" * 256


def _args(i: int) -> tuple[tuple[str, ...], tuple[bytes | str | int, ...]]:
    q = f"{{q{i % 64}}}"
    return (f"{q}:m", f"{q}:s", f"{q}:e"), (PAYLOAD, i, 1_700_000_000_000, 3600, 1000, "mid", 0)


async def _hand(url: str, n: int, wave: int, script: Script) -> None:
    client = aioredis.Redis.from_url(url)
    batcher = ScriptBatcher(client, url)
    try:
        await client.script_load(SOURCE)
        await batcher.call(script, *_args(0))  # connect + script load outside the timing
        for start in range(0, n, wave):
            await asyncio.gather(*[batcher.call(script, *_args(i)) for i in range(start, start + wave)])
    finally:
        await batcher.close()
        await client.aclose()


async def _pipeline(url: str, n: int, wave: int, script: Script) -> None:
    client = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, max_connections=1))
    try:
        await client.script_load(SOURCE)
        for start in range(0, n, wave):
            pipe = client.pipeline(transaction=False)
            for i in range(start, start + wave):
                keys, args = _args(i)
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            await pipe.execute()
    finally:
        await client.aclose()


async def _calls(url: str, n: int, wave: int, script: Script) -> None:
    client = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, max_connections=4))
    try:
        await client.script_load(SOURCE)

        async def one(i: int) -> None:
            keys, args = _args(i)
            await client.evalsha(script.sha, len(keys), *keys, *args)

        for start in range(0, n, wave):
            await asyncio.gather(*[one(i) for i in range(start, start + wave)])
    finally:
        await client.aclose()


async def _publish(url: str, n: int) -> None:
    """PUBLISH `n` wakeups from another process (its CPU is not this process's)."""
    code = (
        "import redis,sys; r=redis.Redis.from_url(sys.argv[1]); p=r.pipeline(transaction=False)\n"
        "for i in range(int(sys.argv[2])): p.publish('wake', b'w' * 200)\n"
        "p.execute()"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, url, str(n))
    await proc.wait()


async def _receive(url: str, n: int, arrived: Callable[[], Awaitable[int]]) -> float:
    """Start the publisher, then count what `arrived` says came (messages per call) until all
    `n` did: the CPU microseconds per message after the first arrival."""
    pub = asyncio.ensure_future(_publish(url, n))
    first = got = await arrived()
    c0 = time.process_time()
    while got < n:
        got += await arrived()
    cpu = time.process_time() - c0
    await pub
    return cpu / max(1, n - first) * 1e6


async def _sub_hand(url: str, n: int) -> float:
    reader, writer = await open_connection(RedisTarget.from_url(url), 5.0)
    conn = Conn(reader, writer)

    async def arrived() -> int:
        replies = conn.received(await conn.read())
        return sum(1 for msg in replies if isinstance(msg, list) and msg[0] == b"message")

    try:
        conn.send("SUBSCRIBE", "wake")
        await conn.reply()
        return await _receive(url, n, arrived)
    finally:
        conn.close()


async def _sub_redis_py(url: str, n: int) -> float:
    client = aioredis.Redis.from_url(url)
    try:
        async with client.pubsub() as ps:

            async def arrived() -> int:
                msg = await ps.get_message(timeout=5.0)
                return int(msg is not None and msg["type"] == "message")

            await ps.subscribe("wake")
            await ps.get_message(timeout=5.0)  # the subscribe confirmation
            return await _receive(url, n, arrived)
    finally:
        await client.aclose()


SUBSCRIBERS: dict[str, Callable[[str, int], Awaitable[float]]] = {
    "hand": _sub_hand,
    "redis-py pubsub": _sub_redis_py,
}


Runner = Callable[[str, int, int, Script], Awaitable[None]]
CLIENTS: dict[str, Runner] = {"hand": _hand, "redis-py pipeline": _pipeline, "redis-py calls": _calls}


async def _measure(url: str, n: int, wave: int, rounds: int) -> dict[str, tuple[float, float]]:
    script = Script("bench", SOURCE, hashlib.sha1(SOURCE.encode()).hexdigest())
    cpu: dict[str, list[float]] = {name: [] for name in CLIENTS}
    rate: dict[str, list[float]] = {name: [] for name in CLIENTS}
    for _ in range(rounds):
        for name, run in CLIENTS.items():
            c0, w0 = time.process_time(), time.perf_counter()
            await run(url, n, wave, script)
            c1, w1 = time.process_time(), time.perf_counter()
            cpu[name].append((c1 - c0) / n * 1e6)
            rate[name].append(n / (w1 - w0))
    return {name: (statistics.median(cpu[name]), statistics.median(rate[name])) for name in CLIENTS}


async def _measure_wake(url: str, n: int, rounds: int) -> dict[str, float]:
    cpu: dict[str, list[float]] = {name: [] for name in SUBSCRIBERS}
    for _ in range(rounds):
        for name, run in SUBSCRIBERS.items():
            cpu[name].append(await run(url, n))
    return {name: statistics.median(cpu[name]) for name in SUBSCRIBERS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--wave", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    opts = ap.parse_args()
    server = LocalRedis().start()
    try:
        figures = uvloop.run(_measure(server.url, opts.n, opts.wave, opts.rounds))
        wake = uvloop.run(_measure_wake(server.url, opts.n, opts.rounds))
    finally:
        server.stop()
    base = figures["hand"][0]
    print(f"{opts.n} EVALSHA per round, waves of {opts.wave}, median of {opts.rounds} rounds")
    for name, (us, per_s) in figures.items():
        print(f"{name:20s} {us:7.1f} us CPU/call  {per_s:9.0f} calls/s  CPU x{us / base:.2f} of hand")
    print(f"{opts.n} PUBLISHed wakeups of 200 B to one subscriber, median of {opts.rounds} rounds")
    for name, us in wake.items():
        print(f"{name:20s} {us:7.1f} us CPU/message  CPU x{us / wake['hand']:.2f} of hand")


if __name__ == "__main__":
    main()
