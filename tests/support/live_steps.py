"""Steps shared by the live-socket and wakeup tests (tests/relay/api): one frame within a
bound, silence for a while, a queue's held count once acks landed, and a count of the
relay's reads from Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from relay.client import LiveConnection, RelayClient
from relay.storage import keys as K
from tests.support.in_process_relay import RunningRelay

STEP = 5.0  # generous bound for one frame on a loaded 2-core machine


async def frame(conn: LiveConnection) -> dict[str, Any]:
    async with asyncio.timeout(STEP):
        return await conn.frame()


async def silent(conn: LiveConnection, seconds: float) -> bool:
    """True when the relay sends nothing for `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            await conn.frame()
    except TimeoutError:
        return True
    return False


async def count_held(owner: RelayClient, expected: int) -> int:
    """Poll status until the count reaches `expected` (acks on the socket are asynchronous)."""
    n = -1
    for _ in range(100):
        n = (await owner.status())["message_count"]
        if n == expected:
            break
        await asyncio.sleep(0.02)
    return n


@contextmanager
def counted_reads(relay: RunningRelay) -> Iterator[list[int]]:
    """How many times the relay read a queue from Redis (reads of its long-polls included)."""
    store = next(iter(relay.fleet.stores.values()))
    original = store.read
    count = [0]

    async def counting(q: K.QueueKeys, from_seq: int | None, limit: int) -> object:
        count[0] += 1
        return await original(q, from_seq, limit)

    store.read = counting  # type: ignore[method-assign,assignment]
    try:
        yield count
    finally:
        store.read = original  # type: ignore[method-assign]
