"""The measurements besides the wake (bench/wake.py): each function runs one scenario against
one target and returns a Row. The enqueue drives wrk; calibration runs both generators; read +
ack and fan-out use the own generator (bench/loadgen.py). A scenario never starts or stops
servers: the runner owns their lifetimes.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass

import orjson
from relayfleet_testing.bench import wrk
from relayfleet_testing.bench.cputime import ForeignLoad
from relayfleet_testing.bench.loadgen import Conn, HttpError, Response, build_request, closed_loop
from relayfleet_testing.bench.procs import BenchError, Procs
from relayfleet_testing.bench.results import Row
from relayfleet_testing.bench.targets import CpuMeter, RedisServer, Target

from relay.storage import keys as K
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore

OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


def filler(size: int) -> bytes:
    """A printable payload of exactly ``size`` bytes (the same bytes wrk sends)."""
    unit = b"relayfleet-bench-0123456789abcdef"
    return (unit * (size // len(unit) + 1))[:size]


def recipient() -> bytes:
    return os.urandom(32)


@dataclass
class Run:
    """What every scenario needs: the process owner and timing knobs of this mode."""

    procs: Procs
    seconds: int  # measured wrk duration
    warmup: int  # wrk warm-up duration (0 = none)


async def calibrate(run: Run, target: Target, path: str, connections: int) -> Row:
    """Both generators against a do-nothing endpoint: the most either can drive here."""
    res = await wrk.run(
        run.procs, target.url, wrk.lua_script("GET", [path], {}), connections, run.seconds, "wrk-cal"
    )
    own_req = build_request("GET", path, f"127.0.0.1:{target.port}")
    own = await closed_loop(target.port, lambda _: own_req, connections, run.seconds)
    values = {"wrk_rate": res.ok_rate, "own_rate": own.rate, "errors": float(res.errors + own.errors)}
    return Row("calibration", target.name, {"path": path, "conns": connections}, values)


async def diagnose(target: Target, path: str, body: bytes, headers: dict[str, str]) -> str:
    """One POST like the failing ones, so a run with errors says what the errors were."""
    try:
        conn = await Conn.open("127.0.0.1", target.port)
        try:
            resp = await asyncio.wait_for(conn.request("POST", path, body, tuple(headers.items())), 10)
        finally:
            conn.close()
    except (OSError, HttpError, TimeoutError) as exc:
        return f"a sample request failed: {type(exc).__name__}"
    return f"a sample request got {resp.status}: {resp.body[:160].decode(errors='replace')}"


async def enqueue(run: Run, target: Target, size: int, connections: int, redis: RedisServer) -> Row:
    """Messages stored per second, and the CPU the server and ``redis`` spent per stored message.

    The CPU window is the measured wrk run alone: it opens after the warm-up has ended and Redis
    has no fork left from it, and closes when wrk has exited (the server) and Redis has finished
    any AOF rewrite the run started (Redis).
    ``foreign_cores``: the cores other processes of this machine kept busy over the measured
    run, on average (cputime.ForeignLoad).
    """
    # a recipient pool: the relay's per-queue rate limit (500 / 5 s) never binds
    paths = [target.enqueue_path(recipient()) for _ in range(wrk.pool_size(size, 4096))]
    script = wrk.lua_script("POST", paths, OCTET, filler_size=size)
    if run.warmup:
        await wrk.run(run.procs, target.url, script, connections, run.warmup, "wrk-warmup")
    meter = await CpuMeter.open(target, redis)
    foreign = ForeignLoad([c.pid for c in target.children] + [redis.child.pid])
    res = await wrk.run(run.procs, target.url, script, connections, run.seconds)
    foreign_cores = foreign.cores()
    cpu = await meter.close(max(0, res.requests - res.errors))
    target.check_alive()
    note = "no request completed within the run" if res.requests == 0 else ""
    if res.errors:
        note = await diagnose(target, target.enqueue_path(recipient()), filler(size), OCTET)
    values = {"rate": res.ok_rate, "p50_ms": res.p50_ms, "p99_ms": res.p99_ms, "errors": float(res.errors)}
    values |= cpu.values() | {"foreign_cores": foreign_cores}
    return Row("head_to_head", target.name, {"size": size, "conns": connections}, values, note)


def _recipient_errors(resp: Response) -> int:
    """Per-recipient refusals inside a 200 fan-out answer."""
    return sum(int(r.get("status", 200)) >= 400 for r in orjson.loads(resp.body).get("results", []))


async def fanout(run: Run, target: Target, size: int, recipients: int, connections: int) -> Row:
    """``POST /v1/messages`` to ``recipients`` new recipients a request, 64 bodies in turn."""
    payload = K.b64(filler(size))

    def body() -> bytes:
        return orjson.dumps(
            {"recipients": [K.b64(recipient()) for _ in range(recipients)], "payload": payload}
        )

    host = f"127.0.0.1:{target.port}"
    reqs = [build_request("POST", "/v1/messages", host, body(), tuple(JSON.items())) for _ in range(64)]
    res = await closed_loop(
        target.port, lambda n: reqs[n % len(reqs)], connections, run.seconds, _recipient_errors
    )
    target.check_alive()
    note = "no request completed within the run" if res.requests == 0 else ""
    if res.errors:
        note = await diagnose(target, "/v1/messages", body(), JSON)
    values = {"rate": res.rate, "msg_rate": res.rate * recipients, "errors": float(res.errors)}
    return Row(
        "fanout", target.name, {"size": size, "recipients": recipients, "conns": connections}, values, note
    )


async def prefill(redis_url: str, queues: list[bytes], per_queue: int, size: int) -> None:
    """Store messages through the relay's own enqueue script, many calls per pipeline: faster
    than HTTP, and the rate limit is lifted only for this filling client."""
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
    """Prefilled queues drained by ``GET ?limit=batch&fromSeq=S`` + ``POST /ack`` until empty."""
    # a few batches per queue, and at least as many queues as readers
    per_queue = max(batch, min(10000, 5 * batch, total // connections // batch * batch))
    n_queues = max(1, math.ceil(total / per_queue))
    queues = [recipient() for _ in range(n_queues)]
    await prefill(redis_url, queues, per_queue, size)
    expected = n_queues * per_queue
    todo = list(queues)
    delivered = requests = 0
    conns = [await Conn.open("127.0.0.1", target.port) for _ in range(connections)]

    async def reader(conn: Conn) -> None:
        nonlocal delivered, requests
        while todo:
            r = K.b64(todo.pop())
            from_seq = ""
            while True:
                resp = await conn.request("GET", f"/v1/queues/{r}/messages?limit={batch}{from_seq}")
                requests += 1
                if resp.status != 200:
                    raise BenchError(f"read answered {resp.status}: {resp.body[:200]!r}")
                doc = orjson.loads(resp.body)
                if not doc["messages"]:
                    break
                next_seq = int(doc["nextSeq"])
                ack = await conn.request(
                    "POST",
                    f"/v1/queues/{r}/ack",
                    orjson.dumps({"upToSeq": next_seq - 1}),
                    tuple(JSON.items()),
                )
                requests += 1
                if ack.status != 200:
                    raise BenchError(f"ack answered {ack.status}: {ack.body[:200]!r}")
                delivered += len(doc["messages"])
                from_seq = f"&fromSeq={next_seq}"

    started = time.perf_counter()
    try:
        await asyncio.gather(*(reader(c) for c in conns))
    finally:
        for c in conns:
            c.close()
    elapsed = time.perf_counter() - started
    target.check_alive()
    if delivered != expected:
        raise BenchError(f"read+ack delivered {delivered} of {expected} messages")
    return Row(
        "read_ack",
        target.name,
        {"batch": batch, "size": size, "conns": connections, "queues": n_queues},
        {"rate": delivered / elapsed, "req_rate": requests / elapsed, "messages": float(expected)},
    )
