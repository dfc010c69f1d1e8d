"""Redis memory of stored messages and held queues: the one measuring function.

`shard_bytes` is what every memory figure is a difference of (`relayfleet bench --scale`'s Store
phase, tests/relay/storage/test_memory.py, docs/memory.md): the bytes a shard's data takes, as
Redis counts them (INFO memory: used_memory, which jemalloc's size classes round up, less
used_memory_startup). `queue_figures` fills a shard through the relay's storage layer
(ShardStore.enqueue, so enqueue.lua writes every key a queue has) and divides the difference.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import redis

from relay.fleet.sharding import slot_of
from relay.storage import keys as K
from relay.storage.limits import QueueLimits
from relay.storage.store import EnqueueRequest, ShardStore


def shard_bytes(url: str) -> int:
    """The bytes the shard's data takes in Redis now (used_memory - used_memory_startup).
    Callers take differences (after - before) and divide them by what they added."""
    client = redis.Redis.from_url(url)
    try:
        info = client.info("memory")
    finally:
        client.close()
    return int(info["used_memory"]) - int(info["used_memory_startup"])


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    queues: int
    per_queue: int  # messages held by each queue
    size: int  # payload bytes of each message
    queue_bytes: float  # per queue, right after the enqueues (its rate state included)
    # per queue once the rate window passed: its rate key expired (a window of two enqueues or
    # more; a window of one is a field of the queue's meta, which stays: docs/memory.md)
    held_queue_bytes: float
    # per queue, where the bytes go ("rate", "stream", "meta", "index entry", the rest), when
    # measured (queue_figures(..., breakdown=True) deletes the queues to weigh each part)
    parts: tuple[tuple[str, float], ...] = ()

    @property
    def message_bytes(self) -> float:
        """Per message held, the queue's own keys shared among its messages (rate state expired)."""
        return self.held_queue_bytes / self.per_queue

    @property
    def ratio(self) -> float:
        """Bytes per held message over its payload bytes."""
        return self.message_bytes / self.size


def recipients(n: int, slots: int = 256, first: int = 0) -> list[bytes]:
    """`n` distinct 32-byte recipients (an Ed25519 key's length) whose default-channel queues
    lie in slots first .. first + slots - 1: a shard's share of the 16,384 slots when a fleet has
    16,384 / slots shards (256: 64 shards), so the slots' own keys (statistics, queue index)
    weigh on each queue as they do at scale, not once per queue as 10,000 queues spread over
    all 16,384 slots would make them."""
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        rcpt = i.to_bytes(8, "big") + bytes(24)
        if first <= slot_of(rcpt) < first + slots:
            out.append(rcpt)
        i += 1
    return out


async def fill(url: str, rcpts: list[bytes], per_queue: int, size: int) -> None:
    """`per_queue` messages of `size` random bytes into each recipient's default-channel queue,
    through ShardStore.enqueue (enqueue.lua: every key a queue has), many at a time."""
    # a rate window longer than any fill: every queue's rate state is still held when weighed
    limits = QueueLimits(rate_count=max(500, per_queue), rate_window_ms=3_600_000)
    store = ShardStore("memory", url, limits)
    await store.start()
    payload = os.urandom(size)
    now = int(time.time() * 1000)

    async def one(rcpt: bytes) -> None:
        q = K.queue_keys(rcpt, b"")
        for _ in range(per_queue):
            outcome = await store.enqueue(q, EnqueueRequest(rcpt, b"", payload), now)
            if outcome.kind != "stored":
                raise RuntimeError(f"enqueue answered {outcome.kind} {outcome.reason}")

    try:
        for start in range(0, len(rcpts), 512):
            await asyncio.gather(*(one(r) for r in rcpts[start : start + 512]))
    finally:
        await store.close()


def _weigh(url: str, rcpts: list[bytes], everything: bool) -> list[tuple[str, float]]:
    """Delete the queues' rate keys, and with `everything` the rest of the queues part by part,
    each part weighed per queue by the bytes its deletion frees; what deleting does not free
    (the keyspace's hash tables, which do not shrink at once, and the slots' statistics, which the
    warming queues made) is "slot keys and keyspace tables"."""
    client = redis.Redis.from_url(url)
    parts: list[tuple[str, float]] = []
    qs = [K.queue_keys(r, b"") for r in rcpts]
    try:
        for name in ("rate", "stream", "meta", "index entry"):
            before = shard_bytes(url)
            pipe = client.pipeline(transaction=False)
            for q in qs:
                if name == "index entry":
                    pipe.srem(q.index, q.qid)
                else:
                    pipe.delete({"rate": q.rate, "stream": q.msgs, "meta": q.meta}[name])
            pipe.execute()
            parts.append((name, (before - shard_bytes(url)) / len(qs)))
            if not everything:
                break
    finally:
        client.close()
    return parts


_WARM_QUEUES = 1000
_WARM_BYTES = 40 << 20  # payload bytes of the warming queues at most


def queue_figures(
    url: str, queues: int, per_queue: int, size: int, slots: int = 256, breakdown: bool = False
) -> MemoryFigures:
    """Fill `queues` new queues (in `slots` slots: `recipients`) with `per_queue` messages of
    `size` bytes each and measure bytes per queue with its rate state (right after the
    enqueues) and without it (as once the rate window passed and the rate key expired: the
    rate keys are deleted, which frees what their expiry frees). With `breakdown`, then delete
    the queues part by part and weigh each part (MemoryFigures.parts)."""
    warm = max(1, min(_WARM_QUEUES, _WARM_BYTES // (per_queue * size)))
    every = recipients(slots + warm + queues, slots)
    # First a queue per measured slot, then `warm` queues of the measured shape: the scripts are
    # loaded and run (~400 KB of used_memory, once per Redis), the slots' own keys made, and
    # whatever a shard allocates once for its first thousand queues of a shape (~330 KB at
    # 10 x 256 B, outside every queue's and slot's keys), all before `before`: the figure is
    # what one more queue costs, the same for 1,000 queues as for 1,000,000 (1,000 queues of
    # 10 x 256 B on a fresh shard measure 1.58x without it, 1.47x with it).
    asyncio.run(fill(url, every[:slots], 1, size))
    asyncio.run(fill(url, every[slots : slots + warm], per_queue, size))
    rcpts = every[slots + warm :]
    before = shard_bytes(url)
    asyncio.run(fill(url, rcpts, per_queue, size))
    at_once = shard_bytes(url) - before
    parts = _weigh(url, rcpts, everything=breakdown)
    held = at_once / queues - parts[0][1]
    if not breakdown:
        return MemoryFigures(queues, per_queue, size, at_once / queues, held)
    parts.append(("slot keys and keyspace tables", at_once / queues - sum(b for _, b in parts)))
    return MemoryFigures(queues, per_queue, size, at_once / queues, held, tuple(parts))
