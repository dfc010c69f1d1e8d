"""Store phase: N queues on one shard, one message each, through the relay's storage layer.

Filled through ShardStore.enqueue (relay/storage/store.py: enqueue.lua with every per-queue key
the relay writes: stream, metadata, index entry, rate state), many enqueues in flight so the
store's batcher pipelines them as it does for a relay under load. The figures:

- held recipients per GiB: 2^30 / bytes per held queue (shard bytes after the fill - before,
  its rate state expired: the rate keys deleted) x N; anchor: the same N payloads stored as plain
  Redis strings under the 32-byte recipient (SET), measured in the same run: what Redis itself
  needs to hold one message per recipient;
- bytes an idle queue leaves behind once drained (drain.lua on every queue), and after a
  retention pass deletes idle empty queues (trim_slot.lua): the floor is 0.

"Before" is a warmed shard: a queue in every slot the fill uses filled, drained and deleted, so
the slots' own keys (statistics with their queue generation, kept for good: ~240 B a slot, a
cost per shard, reported apart) and the loaded scripts are there before any figure's start.
The fill and drain times and CPU (this process and Redis) at N/100, N/10 and N (checkpoints of
the one fill) give the exponents; CPU seconds move less than wall time on a shared machine.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from relayfleet_testing.bench.memory import shard_bytes
from relayfleet_testing.bench.scale.report import Figure, Growth, PhaseReport
from relayfleet_testing.bench.scale.servers import chart_redis, redis_cpu_s

from relay.fleet.sharding import SLOT_COUNT, slot_of
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


def one_per_slot(seed: int, slots: Collection[int]) -> list[bytes]:
    """A recipient whose default-channel queue is in each of `slots`, in slot order."""
    rng = random.Random(seed)
    wanted = set(slots)
    found: dict[int, bytes] = {}
    while len(found) < len(wanted):
        r = rng.randbytes(32)
        s = slot_of(r)
        if s in wanted:
            found.setdefault(s, r)
    return [found[s] for s in sorted(found)]


def checkpoints(n: int) -> list[int]:
    return sorted({max(1, n // 100), max(1, n // 10), n})


T = TypeVar("T")


async def each(
    items: Iterable[T], op: Callable[[T], asyncio.Future[Any]], tick: Callable[[int], None]
) -> None:
    """`op` on every item, at most IN_FLIGHT awaiting their reply at once; tick(done) after each.
    The first failure ends it (the rest are cancelled). Each reply frees its place through a
    done-callback: asyncio.wait over the 1,000 in flight adds and removes a callback on every
    one of them per wake, which held the retention seeding at ~1,300 messages/s (py-spy: 29 %
    in asyncio's _wait)."""
    pending: set[asyncio.Future[Any]] = set()
    room = asyncio.Event()
    failed: list[BaseException] = []
    done = 0

    def finished(f: asyncio.Future[Any]) -> None:
        nonlocal done
        pending.discard(f)
        if f.cancelled():
            return
        exc = f.exception()
        if exc is not None:
            failed.append(exc)
        done += 1
        tick(done)
        if len(pending) < IN_FLIGHT // 2 or failed:  # refill in batches: fewer wakes
            room.set()

    try:
        for item in items:
            f = op(item)
            pending.add(f)
            f.add_done_callback(finished)
            if len(pending) >= IN_FLIGHT:
                room.clear()
                await room.wait()
            if failed:
                raise failed[0]
        while pending and not failed:
            room.clear()
            await room.wait()
        if failed:
            raise failed[0]
    finally:
        for f in list(pending):
            f.cancel()


class Checkpoints:
    """Elapsed time at N/100, N/10 and N operations done (and, given the Redis URL, CPU seconds
    of this process and of Redis), and a progress line every 5 s."""

    def __init__(self, what: str, n: int, say: Say, url: str | None = None) -> None:
        self.what, self.n, self.say, self.url = what, n, say, url
        self.marks = set(checkpoints(n))
        self.times: list[float] = []
        self.cpu: list[float] = []  # this process + Redis
        self.cpu0 = self._cpu()
        self.t0 = self.shown = time.monotonic()

    def _cpu(self) -> float:
        return time.process_time() + redis_cpu_s(self.url) if self.url is not None else 0.0

    def tick(self, done: int) -> None:
        now = time.monotonic()
        if done in self.marks:
            self.times.append(now - self.t0)
            self.cpu.append(self._cpu() - self.cpu0)
        if now - self.shown >= 5 or done == self.n:
            self.shown = now
            self.say(f"{self.what} {done:,}/{self.n:,} ({done / max(1e-9, now - self.t0):,.0f}/s)")


@dataclass
class FillDrain:
    fill_s: list[float] = field(default_factory=list)  # at each checkpoint
    drain_s: list[float] = field(default_factory=list)
    fill_cpu: list[float] = field(default_factory=list)
    drain_cpu: list[float] = field(default_factory=list)
    filled_bytes: int = 0  # shard_bytes once every queue holds its message
    held_bytes: int = 0  # the same once the queues' rate state expired (the rate keys deleted)


def delete_rate_keys(url: str, rcpts: Iterable[bytes]) -> None:
    """What the queues' rate keys expiring frees: the keys deleted (their expiry is the rate
    window; a held queue of a phone waiting for its owner has none)."""
    with redis.Redis.from_url(url) as r:
        pipe = r.pipeline(transaction=False)
        for i, rcpt in enumerate(rcpts):
            pipe.delete(K.queue_keys(rcpt, b"").rate)
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()


async def fill_and_drain(
    url: str, rcpts: Callable[[], Iterable[bytes]], n: int, payload: bytes, say: Say, measure: bool = True
) -> FillDrain:
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
            clock = Checkpoints(f"store: {name}", n, say if measure else lambda _: None, url)
            await each(rcpts(), op, clock.tick)
            if name == "fill":
                out.fill_s, out.fill_cpu, out.filled_bytes = clock.times, clock.cpu, shard_bytes(url)
                if measure:
                    delete_rate_keys(url, rcpts())
                    out.held_bytes = shard_bytes(url)
            else:
                out.drain_s, out.drain_cpu = clock.times, clock.cpu
    finally:
        await store.close()
    return out


def settled_bytes(url: str, timeout_s: float = 10.0) -> int:
    """shard_bytes once Redis has shrunk the keyspace's tables after mass deletion (its cron
    does, a few times a second): the same reading twice 0.5 s apart, or the last one."""
    last = shard_bytes(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = shard_bytes(url)
        if now == last:
            break
        last = now
    return last


def slot_stats_bytes(url: str) -> int:
    """What the slots' statistics hashes take (MEMORY USAGE of each): the slots' own state,
    which a queue's enqueue adds a minute's rate counter to (kept by design: the planner reads
    the last minute's) and which retention keeps (the queue generation)."""
    with redis.Redis.from_url(url) as r:
        pipe = r.pipeline(transaction=False)
        for s in range(SLOT_COUNT):  # (16,384 replies: a fraction of a second)
            pipe.memory_usage(K.slot_stats(s), samples=0)
        return sum(int(b or 0) for b in pipe.execute())


def raw_bytes_per_message(url: str, n: int, payload: bytes, seed: int) -> float:
    """Bytes per recipient of the same payloads as plain strings under the recipient (SET)."""
    before = settled_bytes(url)
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


def idle_deletion(url: str, slots: Collection[int] = range(SLOT_COUNT)) -> int:
    """A retention pass deleting every empty queue (idle period 0), as the job runs it
    (ShardMaintenance.trim_slots): queues deleted."""
    now = int(time.time() * 1000)
    with ShardMaintenance(url) as m:
        return sum(s.deleted for s in m.trim_slots(sorted(slots), TrimPolicy(now_ms=now, idle_ms=0)))


def run(queues: int, payload_size: int, seed: int, say: Say) -> PhaseReport:
    report = PhaseReport("store", {"queues": queues, "payload bytes": payload_size, "messages per queue": 1})
    payload = bytes(random.Random(seed).randbytes(payload_size))
    server = chart_redis()
    try:
        url = server.url
        empty = shard_bytes(url)
        say(f"store: redis-server with the chart's settings on port {server.port}; warming every slot")
        # the slots the fill uses (all of them from ~100,000 queues on)
        used = {slot_of(r) for r in recipients(queues, seed)}
        warm = one_per_slot(seed + 2, used)
        asyncio.run(fill_and_drain(url, lambda: warm, len(warm), payload, say, measure=False))
        idle_deletion(url, used)
        base = settled_bytes(url)
        base_stats = slot_stats_bytes(url)
        with redis.Redis.from_url(url) as r:
            base_keys = int(r.dbsize())
        say(f"store: filling {queues:,} queues")
        got = asyncio.run(fill_and_drain(url, lambda: recipients(queues, seed), queues, payload, say))
        with_rate = (got.filled_bytes - base) / queues
        per_queue = (got.held_bytes - base) / queues
        drained = shard_bytes(url) - base
        with redis.Redis.from_url(url) as r:
            keys_left = int(r.dbsize())
        say(f"store: drained; {drained / queues:,.1f} bytes and {keys_left / queues:.2f} keys left per queue")
        deleted = idle_deletion(url)
        # the slots' statistics grew by the fill's minute counters: slot state, not a queue's
        stats_grew = slot_stats_bytes(url) - base_stats
        swept = settled_bytes(url) - base - stats_grew
        with redis.Redis.from_url(url) as r:
            swept_keys = int(r.dbsize()) - base_keys
        say(f"store: retention deleted {deleted:,} idle queues; measuring the raw-string anchor")
        raw = raw_bytes_per_message(url, queues, payload, seed)
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
        Figure(
            "bytes per queue right after its enqueue (rate state held)",
            with_rate,
            "B",
            "raw string of the payload, per recipient",
            raw,
        ),
        Figure("bytes left per drained idle queue", drained / queues, "B", "nothing left", 0.0),
        Figure(
            "bytes left per queue after retention's idle deletion", swept / queues, "B", "nothing left", 0.0
        ),
        Figure("keys left per queue after retention's idle deletion", swept_keys / queues, "", "none", 0.0),
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
        Growth("fill CPU (this process + Redis)", "s", tuple(marks), tuple(got.fill_cpu)),
        Growth("drain time", "s", tuple(marks), tuple(drain_s)),
        Growth("drain CPU (this process + Redis)", "s", tuple(marks), tuple(got.drain_cpu)),
    ]
    report.notes.append(
        f"Filled through ShardStore.enqueue (enqueue.lua, the relay's storage layer), {IN_FLIGHT} in flight; "
        f"keys left after the drain: {keys_left:,}; queues deleted by retention: {deleted:,}; "
        f"anchor over {queues:,} SETs. Before the figures, each of the {len(used):,} slots the fill uses "
        f"warmed (a queue filled, drained and deleted): the slots' own keys that stay for good, "
        f"{(base - empty) / len(used):,.0f} B a slot "
        f"({(base - empty) / 2**20:,.1f} MiB a shard), are outside every figure; the fill's minute counters "
        f"added {stats_grew:,} B to them, not counted as left by the queues."
    )
    return report
