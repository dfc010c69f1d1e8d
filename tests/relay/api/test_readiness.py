"""Readiness says whether this relay can serve; a shard's outage costs only the queues in its
slots. Real redis-servers, one of them stopped (or never started) under a running relay."""

from __future__ import annotations

import os
from typing import Any

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis, free_port

from relay.client import RelayError
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange
from tests.support.in_process_relay import RelayFactory, RunningRelay

HALF = SLOT_COUNT // 2


def recipient_on(shard_map: ShardMap, shard: str) -> bytes:
    while True:
        r = os.urandom(32)
        if shard_map.shard_for(r) == shard:
            return r


async def readyz(relay: RunningRelay, http: aiohttp.ClientSession) -> tuple[int, dict[str, Any]]:
    async with http.get(relay.base_url + "/readyz") as resp:
        doc: dict[str, Any] = await resp.json()
        return resp.status, doc


async def test_a_down_shard_leaves_the_relay_ready_and_every_other_queue_served(
    two_redis: dict[str, LocalRedis], relay_factory: RelayFactory, http: aiohttp.ClientSession
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # a shard whose Redis never started, 0 slots
    shard_map = ShardMap(
        "f",
        1,
        {"a": two_redis["a"].url, "b": two_redis["b"].url, "c": dead},
        (SlotRange(0, HALF - 1, "a"), SlotRange(HALF, SLOT_COUNT - 1, "b")),
    )
    relay = await relay_factory(shard_map=shard_map)
    status, doc = await readyz(relay, http)
    assert status == 200, doc
    assert (doc["status"], doc["shardsDown"], doc["slotsUnavailable"]) == ("ready", ["c"], 0)
    assert doc["perShard"]["c"] == {"up": False, "slots": 0, "subscriber": False}
    assert doc["reasons"]["c"]

    two_redis["b"].stop()
    status, doc = await readyz(relay, http)
    assert status == 200, doc
    assert sorted(doc["shardsDown"]) == ["b", "c"]
    assert doc["slotsUnavailable"] == SLOT_COUNT - HALF
    assert doc["perShard"]["a"] == {"up": True, "slots": HALF, "subscriber": True}
    async with http.get(relay.base_url + "/metrics") as resp:
        text = await resp.text()
    assert 'relayfleet_shard_up{shard="b"} 0.0' in text
    assert 'relayfleet_shard_up{shard="a"} 1.0' in text
    on_a, on_b = recipient_on(shard_map, "a"), recipient_on(shard_map, "b")
    async with relay.client() as c:
        assert await c.enqueue(on_a, b"still served") == (1, False)
        assert [m.payload for m in (await c.read(on_a)).messages] == [b"still served"]
        with pytest.raises(RelayError, match="503"):
            await c.enqueue(on_b, b"its shard is down")

    two_redis["a"].stop()  # no shard owning slots answers: this relay can serve nothing
    status, doc = await readyz(relay, http)
    assert status == 503
    assert (doc["code"], doc["slotsUnavailable"]) == ("not_ready", SLOT_COUNT)
