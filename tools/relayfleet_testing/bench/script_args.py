"""What Redis spends taking a message into a script, by payload size.

``python -m relayfleet_testing.bench.script_args [--sizes 256,4096,65536] [--calls N]``

Starts a redis-server (AOF, never fsynced) and, per payload size, sends N commands of distinct random
payloads, pipelined, three ways: a plain XADD of the payload (the floor of storing it), an
EVALSHA of a script that only binds the payload (what Redis spends before a script's first
line: its arguments become Lua strings, and Redis's Lua hashes every byte of a string it
creates, where stock Lua 5.1 samples at most 32), and the relay's own enqueue.lua, one item
per call (relay/storage/lua/enqueue.lua, on 64 queues). Prints Redis's own time per call
(INFO commandstats, reset before each way: a script's time includes the commands it runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import redis
from relayfleet_testing.bench.results import counts, size_label
from relayfleet_testing.bench.sweep_cost import enqueue_call
from relayfleet_testing.localredis import LocalRedis

from relay.storage import keys as K
from relay.storage import scripts

# the payload bound and nothing done with it (the intake alone)
_PROBE = "-- ARGV[1] payload\nlocal payload = ARGV[1]\nreturn 1\n"
_QUEUES = 64
_BATCH = 100


def _usec_per_call(r: redis.Redis, command: str) -> float:
    stats: dict[str, Any] = r.info("commandstats")
    return float(stats[f"cmdstat_{command}"]["usec_per_call"])


def _send(r: redis.Redis, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
    """Each (sha, arguments) as EVALSHA sha *arguments, or ("", (payload,)) as a plain XADD."""
    pipe = r.pipeline(transaction=False)
    for sha, args in calls:
        if sha:
            pipe.evalsha(sha, *args)
        else:
            pipe.xadd("bench:plain", {"p": args[0]})
        if len(pipe) >= _BATCH:
            pipe.execute()
    pipe.execute()


def measure(r: redis.Redis, size: int, n: int) -> tuple[float, float, float]:
    """Redis µs per call at `size`: plain XADD, the probe script, enqueue.lua."""
    probe = r.script_load(_PROBE)
    r.script_load(scripts.ENQUEUE.source)
    queues = [K.queue_keys(os.urandom(32), b"") for _ in range(_QUEUES)]
    now = int(time.time() * 1000)
    out = []
    for way in ("xadd", "probe", "enqueue"):
        r.flushall()
        r.config_resetstat()
        calls: list[tuple[str, tuple[Any, ...]]] = []
        for i in range(n):
            payload = os.urandom(size)
            if way == "xadd":
                calls.append(("", (payload,)))
            elif way == "probe":
                calls.append((probe, (0, payload)))
            else:
                calls.append(
                    (scripts.ENQUEUE.sha, enqueue_call(queues[i % _QUEUES], payload, now, "", f"{i:016x}"))
                )
        _send(r, calls)
        out.append(_usec_per_call(r, "xadd" if way == "xadd" else "evalsha"))
        if way == "enqueue" and sum(r.xlen(k.msgs) for k in queues) != n:
            raise RuntimeError("enqueue.lua refused some of the messages: the figure is not of storing them")
    r.flushall()
    return out[0], out[1], out[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m relayfleet_testing.bench.script_args", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--sizes", type=counts, default=[256, 4096, 65536], help="payload bytes (no env)")
    p.add_argument("--calls", type=int, default=1000, help="commands per size and way (no env)")
    args = p.parse_args(argv)
    server = LocalRedis(appendfsync="no").start()
    try:
        with redis.Redis.from_url(server.url) as r:
            print(
                "| payload | XADD µs/call | script taking it, µs/call | ns per byte | enqueue.lua µs/call |"
            )
            print("|---|---|---|---|---|")
            for size in args.sizes:
                xadd, probe, enqueue = measure(r, size, args.calls)
                print(
                    f"| {size_label(size)} | {xadd:.2f} | {probe:.2f} | {1000 * probe / size:.2f} "
                    f"| {enqueue:.2f} |"
                )
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
