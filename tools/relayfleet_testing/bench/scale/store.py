"""Store phase: N queues on one shard, one message each, through the relay's storage layer.

Filled through ShardStore.enqueue (relay/storage/store.py: enqueue.lua with every per-queue key
the relay writes: stream, metadata, index entry, rate state), many enqueues in flight so the
store's batcher pipelines them as it does for a relay under load. The figures:

- held recipients per GiB: 2^30 / (shard bytes after the fill - before) x N; anchor: the same
  payloads stored as plain Redis strings under the 32-byte recipient (SET), measured in the same
  run: what Redis itself needs to hold one message per recipient;
- bytes an idle queue leaves behind once drained (drain.lua on every queue), and after a
  retention pass deletes idle empty queues (trim.lua): the floor is 0.

The fill and drain times at N/100, N/10 and N (checkpoints of the one fill) give the exponent.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis
from relayfleet_testing.bench.memory import shard_bytes
from relayfleet_testing.bench.scale.report import Figure, Growth, PhaseReport
from relayfleet_testing.bench.scale.servers import chart_redis

from relay.fleet.sharding import SLOT_COUNT
from relay.storage import keys as K
from relay.storage.maintenance import ShardMaintenance, TrimPolicy
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore

Say = Callable[[str], None]
GIB = 2**30
IN_FLIGHT = 1000  # operations awaiting their reply at once: enough for full batches
# no rate limit in the way of one filling client; reply deadlines a loaded machine meets
LIMITS = QueueLimits(rate_count=10**9, recipient_rate_count=10**9, write_timeout_s=120, read_timeout_s=120)


def recipients(n: int, seed: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    for _ in range(n):
        yield rng.randbytes(32)


def checkpoints(n: int) -> list[int]:
    return sorted({max(1, n // 100), max(1, n // 10), n})


async def _each(
    n: int, seed: int, op: Callable[[bytes], asyncio.Future[object]], tick: Callable[[int], None]
) -> None:
    """`op` on every recipient, at most IN_FLIGHT at once; tick(done) after each. The first
    failure ends it (the rest are cancelled)."""
    pending: set[asyncio.Future[object]] = set()
    done = 0
    try:
        it = iter(recipients(n, seed))
        while True:
            for r in it:
                pending.add(op(r))
                if len(pending) >= IN_FLIGHT:
                    break
            if not pending:
                return
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for f in finished:
                f.result()
                done += 1
                tick(done)
    finally:
        for f in pending:
            f.cancel()


class Checkpoints:
    """Elapsed time at N/100, N/10 and N operations done, and a progress line every 5 s."""

    def __init__(self, what: str, n: int, say: Say) -> None:
        self.what, self.n, self.say = what, n, say
        self.marks = set(checkpoints(n))
        self.times: list[float] = []
        self.t0 = self.shown = time.monotonic()

    def tick(self, done: int) -> None:
        now = time.monotonic()
        if done in self.marks:
            self.times.append(now - self.t0)
        if now - self.shown >= 5 or done == self.n:
            self.shown = now
            self.say(f"{self.what} {done:,}/{self.n:,} ({done / max(1e-9, now - self.t0):,.0f}/s)")


@dataclass
class FillDrain:
    fill_s: list[float] = field(default_factory=list)  # at each checkpoint
    drain_s: list[float] = field(default_factory=list)
    filled_bytes: int = 0  # shard_bytes once every queue holds its message


async def fill_and_drain(url: str, n: int, payload: bytes, seed: int, say: Say) -> FillDrain:
    store = ShardStore("scale", url, LIMITS, max_connections=4)
    await store.start()
    out = FillDrain()
    try:
        now = int(time.time() * 1000)
        loop = asyncio.get_running_loop()

        def enqueue(r: bytes) -> asyncio.Future[object]:
            # the relay's own way in: the reply goes to a future, no task per message
            reply: asyncio.Future[object] = loop.create_future()
            store.enqueue_to(reply, K.queue_keys(r, b""), EnqueueRequest(r, b"", payload), now)
            return reply

        def drain(r: bytes) -> asyncio.Future[object]:
            async def one() -> object:
                got = await store.drain(K.queue_keys(r, b""), 100)
                if len(got.messages) != 1:
                    raise RuntimeError(f"drain found {len(got.messages)} messages, not 1")
                return got

            return asyncio.ensure_future(one())

        for name, op in (("fill", enqueue), ("drain", drain)):
            # an enqueue's reply is not decoded here: the drain checks every queue held its one
            # message, so a refused enqueue fails the run there
            clock = Checkpoints(f"store: {name}", n, say)
            await _each(n, seed, op, clock.tick)
            if name == "fill":
                out.fill_s, out.filled_bytes = clock.times, shard_bytes(url)
            else:
                out.drain_s = clock.times
    finally:
        await store.close()
    return out


def raw_bytes_per_message(url: str, n: int, payload: bytes, seed: int) -> float:
    """Bytes per recipient of the same payloads as plain strings under the recipient (SET)."""
    before = shard_bytes(url)
    with redis.Redis.from_url(url) as r:
        pipe = r.pipeline(transaction=False)
        for i, rcpt in enumerate(recipients(n, seed + 1)):
            pipe.set(rcpt, payload)
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()
        used = shard_bytes(url) - before
        keys = [rc for rc in recipients(n, seed + 1)]
        for i in range(0, len(keys), 1000):
            r.delete(*keys[i : i + 1000])
    return used / n


def idle_deletion(url: str) -> int:
    """A retention pass deleting every empty queue (idle period 0), as the job runs it
    (ShardMaintenance.trim_slots): queues deleted."""
    now = int(time.time() * 1000)
    with ShardMaintenance(url) as m:
        return sum(s.deleted for s in m.trim_slots(range(SLOT_COUNT), TrimPolicy(now_ms=now, idle_ms=0)))


def run(queues: int, payload_size: int, seed: int, say: Say) -> PhaseReport:
    report = PhaseReport("store", {"queues": queues, "payload bytes": payload_size, "messages per queue": 1})
    payload = bytes(random.Random(seed).randbytes(payload_size))
    server = chart_redis()
    try:
        url = server.url
        empty = shard_bytes(url)
        say(f"store: redis-server with the chart's settings on port {server.port}; filling {queues:,} queues")
        got = asyncio.run(fill_and_drain(url, queues, payload, seed, say))
        per_queue = (got.filled_bytes - empty) / queues
        drained = shard_bytes(url) - empty
        with redis.Redis.from_url(url) as r:
            keys_left = int(r.dbsize())
        say(f"store: drained; {drained / queues:,.1f} bytes and {keys_left / queues:.2f} keys left per queue")
        deleted = idle_deletion(url)
        swept = shard_bytes(url) - empty
        say(f"store: retention deleted {deleted:,} idle queues; measuring the raw-string anchor")
        anchor_n = min(queues, 100_000)
        raw = raw_bytes_per_message(url, anchor_n, payload, seed)
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)  # its AOF: gigabytes at the default size
    fill_s, drain_s = got.fill_s, got.drain_s
    report.figures += [
        Figure(
            "held recipients per GiB (1 message each)",
            GIB / per_queue,
            "",
            "the payloads as raw Redis strings",
            GIB / raw,
        ),
        Figure(
            "bytes per held queue (1 message)",
            per_queue,
            "B",
            "raw string of the payload, per recipient",
            raw,
        ),
        Figure("bytes left per drained idle queue", drained / queues, "B", "nothing left", 0.0),
        Figure(
            "bytes left per queue after retention's idle deletion", swept / queues, "B", "nothing left", 0.0
        ),
        Figure(
            "fill rate (storage layer, pipelined)",
            queues / fill_s[-1],
            "queues/s",
            "drain rate, same run",
            queues / drain_s[-1],
        ),
    ]
    marks = checkpoints(queues)
    report.growth += [
        Growth("fill time", "s", tuple(marks), tuple(fill_s)),
        Growth("drain time", "s", tuple(marks), tuple(drain_s)),
    ]
    report.notes.append(
        f"Filled through ShardStore.enqueue (enqueue.lua, the relay's storage layer), {IN_FLIGHT} in flight; "
        f"keys left after the drain: {keys_left:,}; queues deleted by retention: {deleted:,}; "
        f"anchor over {anchor_n:,} SETs."
    )
    return report
