"""Memory per held queue and per stored message on a real Redis with the operator's settings
(issue 41's targets; where each byte goes: docs/memory.md).

The figures are Redis' own byte counts (used_memory differences, jemalloc's size classes
included) through the relay's storage layer (ShardStore.enqueue), not timings: they depend on the
data's layout only, so they hold on a loaded machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from relayfleet_operator.builders.redis_conf import MEMORY_SETTINGS
from relayfleet_testing.bench.memory import fill, queue_figures, recipients
from relayfleet_testing.localredis import LocalRedis

from relay.storage import keys as K


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
    # stream ~620, meta ~225-270, index entry ~85, tables ~45: ~1,020 (before: ~5,200)
    assert f.held_queue_bytes <= 1200, f
    # with its rate window's key (~220 B, for as long as the window: 5 s by default): ~1,250,
    # the target of 1,200 missed by that much (docs/memory.md)
    assert f.queue_bytes <= 1350, f


def test_ten_256_byte_messages_per_queue(url: str) -> None:
    f = queue_figures(url, queues=1000, per_queue=10, size=256)
    # ~1.48x: the ten entries' listpack is 2,807 B, in jemalloc's 3,072-B class (1.2x before
    # anything else), the stream's key ~300, meta ~225, index entry ~65
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
