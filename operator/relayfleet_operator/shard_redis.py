"""The operator's only contact with Redis.

`migrate_range` is the one adapter between the operator and the shared migration library
(`relay.fleet.migration`, the fenced MIGRATE protocol of docs/migration.md): every slot move the
operator makes (draining a deleted shard, executing a RelayRebalance) goes through it.
The rest answers the few questions the operator asks a shard directly: does it answer, does
it hold data, how many bytes sit in these slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from relay.fleet import migration as fleet_migration
from relay.fleet.contract import Move
from relay.fleet.sharding import ShardMap
from relay.retrying import REDIS_PING, retrying
from relay.storage import keys
from relay.storage.sentinel import async_client


class MoveError(RuntimeError):
    """The migration library could not complete a move; the message says which slot and why.
    Running the same move again resumes it."""


@dataclass(frozen=True)
class MoveResult:
    keys: int = 0
    bytes: int = 0


# Records in the fleet's shard map that `slots` now belong to `target` (epoch + 1) and
# returns the map as stored: the relays' source of truth is then up to date.
PublishSlots = Callable[[Sequence[int], str], Awaitable[ShardMap]]


async def migrate_range(
    shard_map: ShardMap, move: Move, urls: Mapping[str, str], publish: PublishSlots
) -> MoveResult:
    """Move `move`'s slots from its source to its target with the shared migration library.

    `shard_map` is the map in force; `urls` maps shard names to full Redis URLs (credentials
    included). Idempotent and resumable: the library reads where each slot stands from the
    shards' own state keys, so the operator simply calls it again after a restart.
    """

    async def publish_map(new_map: ShardMap) -> ShardMap:
        # The library proposes a whole map built on its own view; publish only this move's
        # flipped slots onto the current ConfigMap so concurrent changes are not overwritten.
        flipped = [s for s in move.slot_list() if new_map.shard_for_slot(s) == move.target]
        return await publish(flipped, move.target)

    try:
        report = await fleet_migration.migrate_slots(
            shard_map, move.slot_list(), move.target, publish_map, redis_urls=urls
        )
    except fleet_migration.MigrationError as exc:
        raise MoveError(str(exc)) from None
    return MoveResult(keys=report.keys, bytes=report.bytes)


def _client(url: str, timeout: float) -> aioredis.Redis:
    # A shard with replicas is a redis+sentinel:// URL: the client follows its primary.
    return async_client(url, socket_timeout=timeout, socket_connect_timeout=timeout)


async def ping(url: str, limit_s: float = 2.0) -> bool:
    """Does the Redis answer PING (each try within `limit_s`, REDIS_PING's tries)?"""

    async def once() -> bool:
        client = _client(url, limit_s)
        try:
            return bool(await asyncio.wait_for(client.ping(), limit_s))
        finally:
            await client.aclose()

    try:
        return await retrying(REDIS_PING, (RedisError, OSError, TimeoutError))(once)
    except (RedisError, OSError, TimeoutError):
        return False


async def holds_data(url: str, slots: Iterable[int], limit_s: float = 5.0) -> bool:
    """True if any of `slots` has a queue on this shard (per-slot index, no SCAN)."""
    indexes = [keys.slot_index(slot) for slot in slots]
    client = _client(url, limit_s)
    try:
        pipe = client.pipeline(transaction=False)
        # Redis deletes a set with its last member: an index exists iff its slot holds a
        # queue. One EXISTS per 4096 of them, not a SCARD each (16,384 replies, each timed).
        for i in range(0, len(indexes), 4096):
            pipe.exists(*indexes[i : i + 4096])
        return any(int(n) > 0 for n in await pipe.execute())
    finally:
        await client.aclose()


async def slot_bytes(url: str, slots: Iterable[int], limit_s: float = 5.0) -> dict[int, tuple[int, int]]:
    """(messages, bytes) per slot from the per-slot statistics the write scripts keep."""
    client = _client(url, limit_s)
    wanted = list(slots)
    try:
        pipe = client.pipeline(transaction=False)
        for slot in wanted:
            pipe.hmget(keys.slot_stats(slot), "msgs", "bytes")
        out: dict[int, tuple[int, int]] = {}
        for slot, (msgs, size) in zip(wanted, await pipe.execute(), strict=True):
            out[slot] = (int(msgs or 0), int(size or 0))
        return out
    finally:
        await client.aclose()


async def estimate(moves: list[Move], urls: Mapping[str, str]) -> list[Move]:
    """Moves with bytes/messages filled from the source shards' statistics (best effort:
    an unreachable shard leaves its moves at zero)."""
    by_source: dict[str, list[int]] = {}
    for m in moves:
        by_source.setdefault(m.source, []).extend(m.slot_list())
    stats: dict[str, dict[int, tuple[int, int]]] = {}
    for source, slots in by_source.items():
        url = urls.get(source)
        if url is None:
            continue
        try:
            stats[source] = await slot_bytes(url, slots)
        except (RedisError, OSError, TimeoutError):
            continue
    out = []
    for m in moves:
        per = stats.get(m.source, {})
        msgs = sum(per.get(s, (0, 0))[0] for s in m.slot_list())
        size = sum(per.get(s, (0, 0))[1] for s in m.slot_list())
        out.append(Move(m.start, m.end, m.source, m.target, size, msgs))
    return out
