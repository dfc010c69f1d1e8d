"""The measurements of the throughput phase: each function runs one scenario against one
target and returns a Row (the wake phase's are in bench/wake.py).

Throughput scenarios drive wrk; calibration and read+ack use the own generator
(relayfleet_testing.bench.loadgen). A scenario never starts or stops servers: the runner owns
their lifetimes.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import io
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis.asyncio as aioredis
from relayfleet_testing.bench import wrk
from relayfleet_testing.bench.cputime import ForeignLoad
from relayfleet_testing.bench.loadgen import Conn, HttpError, build_request, closed_loop
from relayfleet_testing.bench.procs import BenchError, Procs, wait_exit
from relayfleet_testing.bench.results import Row
from relayfleet_testing.bench.targets import CpuMeter, RedisServer, Target

from relay.storage import keys as K
from relay.storage import scripts
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore

REDIS_BENCHMARK = "/usr/bin/redis-benchmark"
OCTET = {"Content-Type": "application/octet-stream"}
LONGPOLL_WAIT_S = 60  # the contract's maximum; idle polls are re-armed when they time out


def filler(size: int) -> bytes:
    """A printable payload of exactly ``size`` bytes (the same bytes wrk sends)."""
    unit = b"relayfleet-bench-0123456789abcdef"
    return (unit * (size // len(unit) + 1))[:size]


def recipient() -> bytes:
    return os.urandom(32)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@dataclass
class Run:
    """What every scenario needs: the process owner and timing knobs of this mode."""

    procs: Procs
    seconds: int  # measured wrk duration
    warmup: int  # wrk warm-up duration (0 = none)


# -- generator calibration -----------------------------------------------------------------


async def calibrate(run: Run, target: Target, path: str, connections: int) -> list[Row]:
    """Both generators against a do-nothing endpoint: the most either can drive here."""
    script = wrk.lua_script("GET", [path], [], {})
    res = await wrk.run(run.procs, target.urls()[:1], [script], connections, 1, run.seconds, "wrk-cal")
    own_req = build_request("GET", path, f"127.0.0.1:{target.ports[0]}")
    own = await closed_loop("127.0.0.1", target.ports[:1], lambda _: own_req, connections, run.seconds)
    params: dict[str, int | str] = {"path": path, "conns": connections}
    return [
        Row("calibration", target.name, {**params, "generator": "wrk -t1"}, {"rate": res.ok_rate}),
        Row(
            "calibration",
            target.name,
            {**params, "generator": "own (uvloop)"},
            {"rate": own.rate, "errors": float(own.errors)},
        ),
    ]


# -- the physical limit ---------------------------------------------------------------------


async def _redis_benchmark(
    run: Run, port: int, connections: int, n: int, keyspace: int, cmd: list[str]
) -> Row:
    if not have_redis_benchmark():
        raise BenchError(f"{REDIS_BENCHMARK} is missing (Debian: apt-get install redis-tools)")
    argv = [REDIS_BENCHMARK, "-h", "127.0.0.1", "-p", str(port), "-c", str(connections), "-n", str(n)]
    argv += ["-P", "16", "-r", str(keyspace), "--csv", *cmd]
    child = run.procs.start("redis-benchmark", argv, capture=True)
    try:
        await wait_exit(child, 120)
        out = child.output()
    finally:
        run.procs.stop(child)
    rows = [r for r in csv.reader(io.StringIO(out)) if len(r) >= 7 and r[0] != "test"]
    if child.popen.returncode != 0 or not rows:
        raise BenchError(f"redis-benchmark failed: {child.log_tail(5) or out[-300:]}")
    last = rows[-1]
    return Row(
        "limit", "redis", {}, {"rate": float(last[1]), "p50_ms": float(last[4]), "p99_ms": float(last[6])}
    )


async def _measured_limit(
    run: Run, redis: RedisServer, connections: int, n: int, keyspace: int, cmd: list[str]
) -> Row:
    """A redis-benchmark run and Redis's CPU per command over it (for the Redis side of enqueue)."""
    await redis.settle()
    before = redis.cpu_seconds()
    row = await _redis_benchmark(run, redis.port, connections, n, keyspace, cmd)
    await redis.settle()
    row.values["redis_cpu_us"] = (redis.cpu_seconds() - before) / n * 1e6
    return row


async def redis_limit(run: Run, redis: RedisServer, size: int, connections: int, seconds: float) -> list[Row]:
    """redis-benchmark, pipelined 16 deep (the relay coalesces calls into pipelines).

    XADD alone is the physical limit of storing a message; EVALSHA of the relay's own
    enqueue script is the limit of storing it with full semantics. Bench-only key names
    (rfbench:*) are used, never the relay's.
    """
    payload = filler(size).decode()
    # bounded memory: approximate trimming keeps ~100 entries per stream
    xadd_keys = max(16, (256 << 20) // (100 * (size + 64)))
    xadd = ["XADD", "rfbench:{__rand_int__}", "MAXLEN", "~", "100", "*", "p", payload]
    probe = await _redis_benchmark(run, redis.port, connections, 5000, xadd_keys, xadd)
    n = max(5000, int(probe.values["rate"] * seconds))
    row = await _measured_limit(run, redis, connections, n, xadd_keys, xadd)
    row.target, row.params = "redis XADD", {"size": size, "conns": connections}
    await redis.flushall()

    client = aioredis.Redis(port=redis.port)
    try:
        await client.script_load(scripts.ENQUEUE.source)
    finally:
        await client.aclose()
    # One queue per run: redis-benchmark draws each __rand_int__ on its own, so a random
    # queue name would pair one queue's counter with another's stream. Caps are lifted and
    # the rate window is 1 ms (its zset expires at once), so every call takes the full
    # store path: fence, rate check, caps, XADD, counters, index, statistics, PUBLISH.
    now = str(int(time.time() * 1000))
    q = "rfbench:{q}"
    keys = [f"{q}:{k}" for k in ("state", "meta", "msgs", "idem", "idemx", "rate", "index", "stats", "rcpt")]
    big = str(1 << 50)
    # (recipient limits off: "bench" is no default-channel queue id, so none would apply)
    fixed = [big, "1", big, big, "604800000", "0", "0", "0", "0"]
    argv = [*fixed, payload, now, "", "", "", "bench", "rfbench:wake", "e", ""]
    script_cmd = ["EVALSHA", scripts.ENQUEUE.sha, str(len(keys)), *keys, *argv]
    # these messages stay (no trim in the script): cap the bytes written
    budget = max(5000, (1 << 30) // (size + 256))
    probe = await _redis_benchmark(run, redis.port, connections, min(5000, budget), 1, script_cmd)
    n = min(budget, max(5000, int(probe.values["rate"] * seconds)))
    script_row = await _measured_limit(run, redis, connections, n, 1, script_cmd)
    script_row.target, script_row.params = "redis enqueue.lua", {"size": size, "conns": connections}
    await redis.flushall()
    return [row, script_row]


# -- enqueue throughput ---------------------------------------------------------------------


async def diagnose(target: Target, method: str, path: str, body: bytes, content_type: str) -> str:
    """One request like the failing ones, so a run with errors says what the errors were."""
    try:
        conn = await Conn.open(target.host, target.ports[0])
        try:
            resp = await asyncio.wait_for(
                conn.request(method, path, body, (("Content-Type", content_type),)), 10
            )
        finally:
            conn.close()
    except (OSError, HttpError, TimeoutError) as exc:
        return f"a sample request failed: {type(exc).__name__}"
    text = resp.body[:160].decode(errors="replace")
    return f"a sample request got {resp.status}: {text}"


def _enqueue_scripts(target: Target, size: int) -> list[str]:
    # a recipient pool per server port: the relay's per-queue rate limit (500 / 5 s) never binds
    pool = wrk.pool_size(size, 4096)
    return [
        wrk.lua_script(
            "POST", [target.enqueue_path(recipient()) for _ in range(pool)], [], OCTET, filler_size=size
        )
        for _ in target.ports
    ]


async def enqueue(
    run: Run, target: Target, size: int, connections: int, redis: RedisServer | None = None
) -> Row:
    """Messages stored per second, and the CPU the server and ``redis`` spent per stored message.

    The CPU window is the measured wrk run alone: it opens after the warm-up has ended
    and Redis has no fork left from it, and closes when wrk has exited (the server) and
    Redis has finished any AOF rewrite the run started (Redis). Without ``redis`` the
    Redis column is NaN. ``foreign_cores``: the cores other processes of this machine kept
    busy over the measured run, on average (cputime.ForeignLoad).
    """
    scripts_ = _enqueue_scripts(target, size)
    threads = len(target.ports)  # one wrk thread per server process
    if run.warmup:
        await wrk.run(run.procs, target.urls(), scripts_, connections, threads, run.warmup, "wrk-warmup")
    meter = await CpuMeter.open(target, redis)
    foreign = ForeignLoad([c.pid for c in target.children] + ([redis.child.pid] if redis else []))
    res = await wrk.run(run.procs, target.urls(), scripts_, connections, threads, run.seconds, "wrk")
    foreign_cores = foreign.cores()
    cpu = await meter.close(max(0, res.requests - res.errors))
    target.check_alive()
    note = "no request completed within the run" if res.requests == 0 else ""
    if res.errors:
        note = await diagnose(
            target, "POST", target.enqueue_path(recipient()), filler(size), OCTET["Content-Type"]
        )
    return Row(
        "enqueue",
        target.name,
        {"size": size, "conns": connections},
        {
            "rate": res.ok_rate,
            "p50_ms": res.p50_ms,
            "p99_ms": res.p99_ms,
            "errors": float(res.errors),
            **cpu.values(),
            "foreign_cores": foreign_cores,
        },
        note,
    )


# -- fan-out --------------------------------------------------------------------------------


async def fanout(run: Run, target: Target, size: int, recipients: int, connections: int) -> Row:
    payload = _b64(filler(size))
    bodies_per_port = 64
    scripts_ = []
    for _ in target.ports:
        bodies = [
            orjson.dumps({"recipients": [_b64(recipient()) for _ in range(recipients)], "payload": payload})
            for _ in range(bodies_per_port)
        ]
        scripts_.append(
            wrk.lua_script(
                "POST",
                ["/v1/messages"] * bodies_per_port,
                bodies,
                {"Content-Type": "application/json"},
                count_inner_errors=True,
            )
        )
    threads = len(target.ports)
    if run.warmup:
        await wrk.run(run.procs, target.urls(), scripts_, connections, threads, run.warmup, "wrk-warmup")
    res = await wrk.run(run.procs, target.urls(), scripts_, connections, threads, run.seconds, "wrk")
    target.check_alive()
    note = "no request completed within the run" if res.requests == 0 else ""
    if res.errors or res.inner_errors:
        sample = orjson.dumps(
            {"recipients": [_b64(recipient()) for _ in range(recipients)], "payload": payload}
        )
        note = await diagnose(target, "POST", "/v1/messages", sample, "application/json")
    return Row(
        "fanout",
        target.name,
        {"size": size, "recipients": recipients, "conns": connections},
        {
            "rate": res.ok_rate,
            "msg_rate": res.ok_rate * recipients,
            "p50_ms": res.p50_ms,
            "p99_ms": res.p99_ms,
            "errors": float(res.errors),
            "inner_errors": float(res.inner_errors),
        },
        note,
    )


# -- read + ack -----------------------------------------------------------------------------


async def prefill(redis_url: str, queues: list[bytes], per_queue: int, size: int) -> None:
    """Store messages through the relay's own enqueue script, many calls per pipeline.

    Faster than HTTP, and the rate limit is lifted only for this filling client.
    """
    store = ShardStore("bench", redis_url, QueueLimits(rate_count=1 << 30), max_connections=8)
    await store.start()
    payload = filler(size)
    now = int(time.time() * 1000)
    try:
        for r in queues:
            q = K.queue_keys(r, b"")
            outcomes = await asyncio.gather(
                *(store.enqueue(q, EnqueueRequest(r, b"", payload), now) for _ in range(per_queue))
            )
            if any(o.kind != "stored" for o in outcomes):
                raise BenchError(f"prefill refused: {outcomes[0].kind}")
    finally:
        await store.close()


async def read_ack(
    target: Target, redis_url: str, batch: int, total: int, connections: int, size: int = 256
) -> Row:
    # a few batches per queue, and at least as many queues as readers
    per_queue = max(batch, min(10000, 5 * batch, total // connections // batch * batch))
    n_queues = max(1, math.ceil(total / per_queue))
    queues = [recipient() for _ in range(n_queues)]
    await prefill(redis_url, queues, per_queue, size)
    expected = n_queues * per_queue
    todo = list(queues)
    delivered = [0]
    requests = [0]
    conns = [await Conn.open("127.0.0.1", target.ports[i % len(target.ports)]) for i in range(connections)]

    async def reader(conn: Conn) -> None:
        while todo:
            r = K.b64(todo.pop())
            from_seq = ""
            while True:
                resp = await conn.request("GET", f"/v1/queues/{r}/messages?limit={batch}{from_seq}")
                requests[0] += 1
                if resp.status != 200:
                    raise BenchError(f"read answered {resp.status}: {resp.body[:200]!r}")
                doc = orjson.loads(resp.body)
                got = len(doc["messages"])
                if got == 0:
                    break
                next_seq = int(doc["nextSeq"])
                ack = await conn.request(
                    "POST",
                    f"/v1/queues/{r}/ack",
                    orjson.dumps({"upToSeq": next_seq - 1}),
                    (("Content-Type", "application/json"),),
                )
                requests[0] += 1
                if ack.status != 200:
                    raise BenchError(f"ack answered {ack.status}: {ack.body[:200]!r}")
                delivered[0] += got
                from_seq = f"&fromSeq={next_seq}"

    started = time.perf_counter()
    try:
        await asyncio.gather(*(reader(c) for c in conns))
    finally:
        for c in conns:
            c.close()
    elapsed = time.perf_counter() - started
    target.check_alive()
    if delivered[0] != expected:
        raise BenchError(f"read+ack delivered {delivered[0]} of {expected} messages")
    return Row(
        "read_ack",
        target.name,
        {"batch": batch, "size": size, "conns": connections, "queues": n_queues},
        {"rate": delivered[0] / elapsed, "req_rate": requests[0] / elapsed, "messages": float(expected)},
    )


def have_redis_benchmark() -> bool:
    return Path(REDIS_BENCHMARK).exists() or shutil.which("redis-benchmark") is not None
