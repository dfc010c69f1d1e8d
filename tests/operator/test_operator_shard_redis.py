"""The operator's Redis side on real redis-servers: the migration adapter moves data with the
shared library and publishes only its own slots; the data and statistics probes answer."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator, Sequence

import pytest
from relayfleet_operator import shard_redis
from relayfleet_testing.localredis import LocalRedis, redis_server_binary

from relay.fleet.contract import Move
from relay.fleet.sharding import ShardMap, SlotRange
from relay.storage import keys as K
from tests.support.operator_harness import (
    PAYLOAD_BYTES,
    enqueue_messages,
    read_queue,
    read_queues,
    recipients_on,
)

DEBIAN_REDIS = "/usr/bin/redis-server"


@pytest.fixture
def two_shards() -> Iterator[ShardMap]:
    """Shards a (all slots) and b (none) on two real redis-servers, a with a password."""
    binary = DEBIAN_REDIS if os.path.exists(DEBIAN_REDIS) else ""
    a = LocalRedis(binary=binary, password="pw-a").start()
    b = LocalRedis(binary=binary).start()
    try:
        yield ShardMap("f", 1, {"a": a.url, "b": b.url}, (SlotRange(0, 16383, "a"),))
    finally:
        a.stop()
        b.stop()


async def test_one_late_answer_does_not_make_a_redis_unreachable() -> None:
    """A Redis that misses one PING's limit (stopped for a moment, as a loaded node's can be)
    and answers the next try is reachable: one late answer flapped shards Ready -> Degraded."""
    server = LocalRedis(binary=redis_server_binary()).start()
    assert server.proc is not None
    pid = server.proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(0.8, os.kill, pid, signal.SIGCONT)
        started = time.monotonic()
        assert await shard_redis.ping(server.url, limit_s=0.5)
        assert time.monotonic() - started >= 0.5  # the first try went unanswered
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop()


async def test_probes_see_data_and_bytes(two_shards: ShardMap) -> None:
    url_a, url_b = two_shards.shards["a"], two_shards.shards["b"]
    assert await shard_redis.ping(url_a)
    assert not await shard_redis.ping("redis://127.0.0.1:1/0", limit_s=0.5)
    assert not await shard_redis.holds_data(url_a, range(16384))
    (r,) = recipients_on(range(0, 8192), 1, seed=5)
    await enqueue_messages(url_a, [r], 3)
    slot = K.queue_keys(r, b"").slot
    assert await shard_redis.holds_data(url_a, range(16384))
    assert not await shard_redis.holds_data(url_a, [s for s in range(16384) if s != slot])
    stats = await shard_redis.slot_bytes(url_a, [slot])
    assert stats[slot][0] == 3
    assert stats[slot][1] == 3 * PAYLOAD_BYTES
    (est,) = await shard_redis.estimate([Move(slot, slot, "a", "b")], {"a": url_a, "b": url_b})
    assert (est.messages, est.bytes) == (3, 3 * PAYLOAD_BYTES)


async def test_migrate_range_moves_data_and_publishes_only_its_slots(two_shards: ShardMap) -> None:
    url_a, url_b = two_shards.shards["a"], two_shards.shards["b"]
    recipients = recipients_on(range(8192, 16384), 20, seed=5)
    await enqueue_messages(url_a, recipients, 4)
    before = await read_queues(url_a, recipients)
    published: list[tuple[list[int], str]] = []
    current = two_shards

    async def publish(slots: Sequence[int], target: str) -> ShardMap:
        nonlocal current
        published.append((list(slots), target))
        current = current.with_slots(slots, target)
        return current

    move = Move(8192, 16383, "a", "b")
    result = await shard_redis.migrate_range(two_shards, move, {"a": url_a, "b": url_b}, publish)
    assert result.keys > 0
    assert result.bytes == 20 * 4 * PAYLOAD_BYTES
    assert current.slot_counts() == {"a": 8192, "b": 8192}
    assert all(target == "b" and all(8192 <= s <= 16383 for s in slots) for slots, target in published)
    for r in recipients:
        assert await read_queue(url_b, r) == before[r]
    assert not await shard_redis.holds_data(url_a, range(8192, 16384))
    # Running the same move again (a restarted operator) finds it done and changes nothing.
    again = await shard_redis.migrate_range(current, move, {"a": url_a, "b": url_b}, publish)
    assert again.keys == 0
    assert current.slot_counts() == {"a": 8192, "b": 8192}


async def test_migration_failure_is_a_clear_error(two_shards: ShardMap) -> None:
    async def publish(slots: Sequence[int], target: str) -> ShardMap:
        raise AssertionError("nothing may be published")

    bad_urls = {"a": two_shards.shards["a"], "b": "redis://127.0.0.1:1/0"}
    with pytest.raises(shard_redis.MoveError):
        await shard_redis.migrate_range(two_shards, Move(0, 10, "a", "b"), bad_urls, publish)
