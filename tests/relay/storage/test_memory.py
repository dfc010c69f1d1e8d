"""Memory per held queue and per stored message on a real Redis with the operator's settings
(issue 41's targets; where each byte goes: docs/memory.md).

The figures are Redis' own byte counts (used_memory differences, jemalloc's size classes
included) through the relay's storage layer (ShardStore.enqueue), not timings: they depend on the
data's layout only, so they hold on a loaded machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from relayfleet_operator.builders.redis_conf import MEMORY_SETTINGS
from relayfleet_testing.bench.memory import fill, queue_figures, recipients, shard_bytes
from relayfleet_testing.localredis import LocalRedis

from relay.storage import keys as K
from relay.storage.limits import QueueLimits
from relay.storage.maintenance import ShardMaintenance, TrimPolicy
from relay.storage.store import ShardStore


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    # its own server: nothing else writes while a difference is taken
    server = LocalRedis(dir=str(tmp_path / "redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


def test_redis_runs_with_the_operators_stream_settings(url: str) -> None:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        for name, value in MEMORY_SETTINGS:
            assert client.config_get(name) == {name: value}
    finally:
        client.close()


def test_a_queue_holding_one_256_byte_message(url: str) -> None:
    f = queue_figures(url, queues=4000, per_queue=1, size=256)
    # its rate state included (a window of one enqueue is the meta's field 'w', no key of its
    # own): stream ~610, meta ~290, index entry ~80, tables ~50: ~1,030 (before: ~1,160 with the
    # window's key; ~5,200 before the stream's copy)
    assert f.queue_bytes <= 1200, f
    assert f.held_queue_bytes <= 1200, f
    # no rate key, nor anything else beside the stream and the meta
    client = redis.Redis.from_url(url)
    try:
        q = K.queue_keys(recipients(1)[0], b"")
        assert client.exists(q.meta, q.msgs) == 2
        assert not client.exists(q.rate, q.idem, q.idemx)
    finally:
        client.close()


def test_ten_256_byte_messages_per_queue(url: str) -> None:
    # 3,000 queues: the shard's used_memory moves by 100-150 KB with how the relay batched the
    # enqueues (more per call on a loaded machine), outside any queue's keys; over 1,000 queues
    # that read 1.52-1.55x at load ~27 where 3,000 read 1.48-1.49x (docs/memory.md)
    f = queue_figures(url, queues=3000, per_queue=10, size=256)
    # ~1.49x: the ten entries' listpack is 2,807 B, in jemalloc's 3,072-B class (1.2x before
    # anything else), the stream's key ~300, meta ~225, index entry ~80, tables ~140
    assert f.ratio <= 1.5, f


def test_4_kib_messages(url: str) -> None:
    f = queue_figures(url, queues=40, per_queue=100, size=4096)
    # ~1.05x: 31 of them share a 128-KiB node (stream-node-max-bytes 131072); at Redis' default
    # 4 KiB each had a node of its own in jemalloc's 5-KiB class (1.27x)
    assert f.ratio <= 1.1, f


def test_the_stream_copy_leaves_nothing_and_keeps_the_streams_ids(url: str) -> None:
    """The first entry's copy (enqueue.lua) leaves no key of its own, and the stream keeps what
    XINFO says of it: length, last id, entries added, first id."""
    (rcpt,) = recipients(1, slots=1)
    q = K.queue_keys(rcpt, b"")
    asyncio.run(fill(url, [rcpt], per_queue=3, size=100))
    client = redis.Redis.from_url(url)
    try:
        assert not client.exists(q.msgs + ":" + K.COMPACT_SUFFIX)
        info = client.xinfo_stream(q.msgs)
        assert (info["length"], info["last-generated-id"], info["entries-added"]) == (3, b"3-0", 3)
        assert info["first-entry"][0] == b"1-0"
        assert not [k for k in client.scan_iter(match="*:" + K.COMPACT_SUFFIX)]
    finally:
        client.close()


def test_a_drained_idle_queue_leaves_nothing_after_retention(url: str) -> None:
    """Issue 41's floor: a queue drained and then idle costs 0 bytes once the retention pass
    (trim_slot.lua) deleted it: none of its keys, no index entry, no field of its own in any
    slot's keys (the slots' statistics count on)."""
    every = recipients(256 + 2000)
    asyncio.run(fill(url, every[:256], 1, 256))  # the slots' own keys, kept (their queues hold)
    client = redis.Redis.from_url(url)
    try:
        # a first round loads the scripts and grows the keyspace's tables (kept, as a shard does)
        _filled_drained_deleted(url, every[256:1256])
        keys, before = _key_bytes(client), shard_bytes(url)
        _filled_drained_deleted(url, every[1256:])
        after = _key_bytes(client)
        assert after.keys() == keys.keys()
        grown = {k: after[k] - keys[k] for k in keys if after[k] != keys[k]}
        # the slots' statistics (their counters' digits; 'w<minute>' on a minute's turn) and
        # index sets' tables at most: ~5 B per queue gone, nothing a queue holds
        assert all(k.endswith((b":stats", b":queues")) for k in grown), grown
        assert sum(grown.values()) <= 16 * 1000, grown
        # used_memory moves by some tens of KB between two identical rounds outside any key
        # (measured +28 to +47 KB per 1,000 queues, with the keys as above): a bound, not 0
        assert (shard_bytes(url) - before) / 1000 <= 64
    finally:
        client.close()


def _key_bytes(client: redis.Redis) -> dict[bytes, int]:
    return {k: int(client.memory_usage(k, samples=0) or 0) for k in client.scan_iter(count=1000)}


def _filled_drained_deleted(url: str, rcpts: list[bytes]) -> None:
    asyncio.run(fill(url, rcpts, 1, 256))
    asyncio.run(_drain(url, rcpts))
    with ShardMaintenance(url) as m:
        trimmed = m.trim_slots(range(256), TrimPolicy(now_ms=int(time.time() * 1000), idle_ms=0))
    assert sum(t.deleted for t in trimmed) == len(rcpts)


async def _drain(url: str, rcpts: list[bytes]) -> None:
    store = ShardStore("memory", url, QueueLimits())
    await store.start()
    try:
        for r in rcpts:
            assert len((await store.drain(K.queue_keys(r, b""), 10)).messages) == 1
    finally:
        await store.close()
