"""relay/presence.py between two in-process relays on one Redis: a parked long-poll counts as
online (not live) through the other relay, stays so between polls, and lapses with its lease."""

from __future__ import annotations

import asyncio
import time

from relayfleet_testing.localredis import LocalRedis

from relay.api.context import CTX
from relay.presence import Presence
from relay.protocol import keypair
from tests.support.in_process_relay import RelayFactory
from tests.support.waiting import until

TTL_S = 1.0


async def test_a_parked_long_poll_is_online_fleet_wide_until_its_lease_lapses(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    a = await relay_factory(redis_server.url, presence_ttl_s=TTL_S)
    b = await relay_factory(redis_server.url, presence_ttl_s=TTL_S)
    there = b.app[CTX].presence
    public, private = keypair()
    assert not await there.online(public, b"")
    async with a.client(private) as reader, b.client() as sender:
        # a queue that exists (a poll of an unknown queue writes nothing: the storage attacks'
        # reads-of-unknown-queues test): one message stored and acknowledged first
        await sender.enqueue(public, b"first")
        assert await reader.ack(up_to_seq=1) == 1
        assert not await there.online(public, b"")
        poll = asyncio.create_task(reader.read(wait=5))
        await until("the poll online through the other relay", lambda: there.online(public, b""), 5, 0.02)
        assert a.app[CTX].presence.held_here(public, b"")
        assert not there.held_here(public, b"")
        assert not await there.live(public, b"")  # a poll is not a live socket
        await sender.enqueue(public, b"wake")
        assert [m.payload for m in (await poll).messages] == [b"wake"]
        ended = time.monotonic()
        assert await there.online(public, b"")  # between polls: still online
        await until("the poll lease lapsed", lambda: _offline(there, public), TTL_S + 3, 0.05)
        assert time.monotonic() - ended <= TTL_S + 1.0


async def _offline(presence: Presence, recipient: bytes) -> bool:
    return not await presence.online(recipient, b"")
