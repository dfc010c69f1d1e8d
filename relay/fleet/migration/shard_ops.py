"""One shard as the migrator sees it — every Redis command of a migration goes through here:
its own connection, the pipelined state changes (compare-and-set of slot states, guarded
deletes, import stamps) with WAIT on shards that require replicas, listing and sizing a
slot's keys, MIGRATE to another shard (and the address that shard is reached at), the
wakeups after a flip. A broken connection or a failover surfaces as `ShardInterrupted`,
which the protocol resumes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from relay.fleet.migration.errors import MigrationError, ShardInterrupted
from relay.fleet.sharding import is_sentinel_url, min_replicas_of
from relay.storage import keys as K
from relay.storage import script_runner, scripts, sentinel
from relay.storage.connection import RedisTarget, RedisURLError
from relay.storage.script_runner import ScriptLoadFailed

__all__ = ["MigrateAddress", "Shard", "all_keys", "migrate_address"]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _redacted(url: str) -> str:
    if is_sentinel_url(url):
        return sentinel.redacted(url)
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname}:{parts.port or 6379}"


@dataclass(frozen=True, slots=True)
class MigrateAddress:
    """Where a source's MIGRATE connects: the target as the shard map names it."""

    host: str
    port: int
    db: int
    auth: tuple[str, ...]  # the MIGRATE arguments: () | ('AUTH', pw) | ('AUTH2', user, pw)


def migrate_address(name: str, url: str) -> MigrateAddress:
    try:
        target = RedisTarget.from_url(url)  # the same parse as the relays' connections
    except RedisURLError as exc:
        raise MigrationError(f"shard {name}: {exc}") from None
    if target.unix_path is not None:
        raise MigrationError(f"shard {name}: MIGRATE needs a redis://host:port URL to reach it")
    auth: tuple[str, ...] = ()
    if target.password is not None:
        who = ("AUTH2", target.username) if target.username else ("AUTH",)
        auth = (*who, target.password)
    return MigrateAddress(target.host, target.port, target.db, auth)


# replies of a node that is not (or no longer) a writable primary
# (IOERR: MIGRATE could not reach the target, e.g. its primary died mid-copy)
_FAILOVER_REPLIES = ("READONLY", "LOADING", "MASTERDOWN", "NOREPLICAS", "The previous master", "IOERR")
_WAIT_TIMEOUT_MS = 2000


def chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class Shard:
    """One shard's connection for the migrator (its own pool: never the relay's)."""

    def __init__(self, name: str, url: str, op_timeout_s: float) -> None:
        self.name = name
        self.url = url
        self.op_timeout_s = op_timeout_s
        # Each round trip is bounded as a whole (`_bounded`), not each reply: redis-py arms and
        # cancels a timer per reply, ~40 % of the CPU of a pipeline of 4096 GETs. (Sentinel's
        # own questions keep the bound per reply, as `sentinel.async_client` sets it from this.)
        per_reply = op_timeout_s if is_sentinel_url(url) else None
        # a Sentinel service: the client finds the primary and leaves one that turns READONLY
        self.client: aioredis.Redis = sentinel.async_client(
            url, decode_responses=False, socket_connect_timeout=5.0, socket_timeout=per_reply
        )
        self.min_replicas = min_replicas_of(url)  # state changes wait for WAIT, as relay writes do

    def _bounded(self) -> asyncio.Timeout:
        """The bound of one round trip: its TimeoutError is a broken connection's (`fail`)."""
        return asyncio.timeout(self.op_timeout_s)

    async def address(self) -> MigrateAddress:
        """Where another shard's MIGRATE reaches this one now (the primary, for a Sentinel shard)."""
        try:
            url = await sentinel.primary_url(self.url)
        except sentinel.NoPrimary as exc:
            raise ShardInterrupted(f"shard {self.name}: {exc}") from None
        return migrate_address(self.name, url)

    async def close(self) -> None:
        await self.client.aclose()

    def fail(self, what: str, exc: BaseException) -> MigrationError:
        text = str(exc).split("\n", 1)[0][:300]
        message = f"{what} on shard {self.name} ({_redacted(self.url)}) failed: {text or type(exc).__name__}"
        broke = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)
        if isinstance(exc, broke) or text.startswith(_FAILOVER_REPLIES):
            return ShardInterrupted(message)
        return MigrationError(message)

    async def run(self, what: str, commands: Sequence[Sequence[Any]], durable: bool = False) -> list[Any]:
        """One pipelined round trip; reloads the migration scripts once if Redis lost them.
        `durable` (a state change) on a shard with minReplicas: WAIT follows on the same
        connection, and too few replicas confirming it stops the run (it resumes)."""
        if not commands:
            return []
        if durable and self.min_replicas:
            replies = await self.run(what, [*commands, ("WAIT", self.min_replicas, _WAIT_TIMEOUT_MS)])
            if int(replies[-1]) < self.min_replicas:
                raise ShardInterrupted(
                    f"{what} on shard {self.name}: {replies[-1]} of {self.min_replicas} replica(s) "
                    "confirmed it in time"
                )
            return replies[:-1]
        try:
            # every command these pipelines carry is safe to repeat, and a WAIT must follow
            # the repeated writes: after a NOSCRIPT the whole batch runs again
            async with self._bounded():
                replies = await script_runner.run_async(self.client, commands, _MIGRATION_SCRIPTS, "all")
        except ScriptLoadFailed as exc:
            raise self.fail("loading the migration scripts", exc.cause) from None
        except (RedisError, OSError) as exc:
            raise self.fail(what, exc) from None
        for r in replies:
            if isinstance(r, Exception):
                raise self.fail(what, r)
        return replies

    async def states(self, slots: Sequence[int]) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        for chunk in chunks(slots, 4096):
            # one MGET, not a GET per slot: a command's client cost is ~10x that of a key in one
            (replies,) = await self.run("reading slot states", [("MGET", *map(K.slot_state, chunk))])
            for s, v in zip(chunk, replies, strict=True):
                out[s] = None if v is None else _s(v)
        return out

    async def cas(self, what: str, slots: Sequence[int], new: str, allowed: Sequence[str]) -> None:
        """Set the state of every slot, refusing (MigrationError) where the prior state is not allowed."""
        for chunk in chunks(slots, 2048):
            replies = await self.run(what, _set_states(chunk, new, allowed), durable=True)
            self._check_set(what, chunk, replies)

    def _check_set(self, what: str, slots: Sequence[int], replies: Sequence[Any]) -> None:
        """The replies of `_set_states` for `slots`: MigrationError at the first refused slot."""
        for s, (ok, prior) in zip(slots, replies, strict=True):
            if not int(ok):
                raise MigrationError(
                    f"slot {s}: shard {self.name} is in state {_s(prior) or 'owned'!r}, "
                    f"which does not allow {what}; is another migration running?"
                )

    async def drop(
        self,
        what: str,
        items: Iterable[tuple[int, Sequence[str]]],
        allowed: Sequence[str],
        after_first: Callable[[], None] | None = None,
    ) -> int:
        """Delete keys slot by slot, in the order given, each call guarded by the slot's state; pipelined."""
        calls = [
            (slot, _evalsha(scripts.SLOT_DROP, (K.slot_state(slot), *chunk), allowed))
            for slot, keys in items
            for chunk in chunks(keys, 500)
        ]
        deleted = 0
        for i, part in enumerate(chunks(calls, 128)):
            replies = await self.run(what, [cmd for _, cmd in part], durable=True)
            for (slot, _), (ok, n) in zip(part, replies, strict=True):
                if not int(ok):
                    state = _s(n) or "owned"
                    raise MigrationError(f"slot {slot}: shard {self.name} refused {what} in state {state!r}")
                deleted += int(n)
            if i == 0 and after_first is not None:
                after_first()
        return deleted

    async def purge(
        self,
        what: str,
        slots: Sequence[int],
        allowed: Sequence[str],
        also: dict[int, list[str]] | None = None,
    ) -> None:
        """Every key this shard holds of `slots` (its index says which, plus the queues in `also`),
        state keys excepted."""
        members = await self.members(slots)
        extra = also or {}
        keys = [(s, all_keys(s, sorted({*members[s], *extra.get(s, [])}))) for s in slots]
        await self.drop(what, keys, allowed)

    async def fence(
        self, what: str, slots: Sequence[int], new: str, allowed: Sequence[str]
    ) -> dict[int, list[str]]:
        """Set the slots' state, then list their queues, in one round trip."""
        out: dict[int, list[str]] = {}
        for chunk in chunks(slots, 512):
            cmds = [*_set_states(chunk, new, allowed), *(("SMEMBERS", K.slot_index(s)) for s in chunk)]
            replies = await self.run(what, cmds, durable=True)
            self._check_set(what, chunk, replies[: len(chunk)])
            for s, members in zip(chunk, replies[len(chunk) :], strict=True):
                out[s] = sorted(_s(m) for m in members)
        return out

    async def stamp_imports(self, qids: Mapping[int, Sequence[str]]) -> None:
        """Copied queues count as written on this Redis run (see lua/import_stamp.lua)."""
        metas = [K.queue_keys_for_id(s, q).meta for s, qs in qids.items() for q in qs]
        for chunk in chunks(metas, 512):
            await self.run(
                "stamping imported queues",
                [_evalsha(scripts.IMPORT_STAMP, (m,), ()) for m in chunk],
                durable=True,
            )

    async def members(self, slots: Sequence[int]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for chunk in chunks(slots, 512):
            replies = await self.run("listing queues", [("SMEMBERS", K.slot_index(s)) for s in chunk])
            for s, members in zip(chunk, replies, strict=True):
                out[s] = sorted(_s(m) for m in members)
        return out

    async def slots_with_keys(self, slots: Sequence[int]) -> list[int]:
        """The slots of which this shard still holds a slot-level key (the index outlives every queue)."""
        cmds = [("EXISTS", *slot_keys(s)) for s in slots]
        replies = [r for part in chunks(cmds, 4096) for r in await self.run("looking for leftovers", part)]
        return [s for s, n in zip(slots, replies, strict=True) if int(n)]

    async def slot_sizes(self, slots: Sequence[int]) -> dict[int, tuple[int, int]]:
        """slot -> (payload bytes, queues), from the slot statistics and index."""
        sizes: dict[int, tuple[int, int]] = {}
        for chunk in chunks(slots, 2048):
            cmds = [
                c for s in chunk for c in (("HGET", K.slot_stats(s), "bytes"), ("SCARD", K.slot_index(s)))
            ]
            replies = await self.run("reading slot statistics", cmds)
            for i, s in enumerate(chunk):
                sizes[s] = (max(0, int(replies[2 * i] or 0)), int(replies[2 * i + 1]))
        return sizes

    async def keys_to_copy(
        self, slots: Sequence[int], qids: Mapping[int, Sequence[str]]
    ) -> tuple[list[tuple[str, int]], list[str]]:
        """The keys of `slots` that exist here, each with its queue's payload bytes (0 for slot-level
        keys), and those of them that must arrive (persistent); one round trip per 5000 commands."""
        keys_of = {s: [*slot_keys(s), *(k for q in qids[s] for k in queue_keys(s, q))] for s in slots}
        # Most slots hold no key: one EXISTS per slot finds those that do, and only their keys
        # are probed one by one (a PTTL per key of every slot was a third of a move's CPU).
        counts: list[Any] = []
        for part in chunks([("EXISTS", *keys_of[s]) for s in slots], 4096):
            counts.extend(await self.run("looking for the slot's keys", part))
        held = [s for s, n in zip(slots, counts, strict=True) if int(n)]
        probe = [k for s in held for k in keys_of[s]]
        streams = [K.queue_keys_for_id(s, q) for s in held for q in qids[s]]

        cmds = [("PTTL", k) for k in probe] + [("HGET", qk.meta, "bytes") for qk in streams]
        replies: list[Any] = []
        for part in chunks(cmds, 5000):
            replies.extend(await self.run("listing the slot's keys", part))
        size_of = {qk.msgs: max(0, int(v or 0)) for qk, v in zip(streams, replies[len(probe) :], strict=True)}
        ttls = [int(t) for t in replies[: len(probe)]]  # -2 missing, -1 persistent, else ms left
        wanted = [(k, size_of.get(k, 0)) for k, t in zip(probe, ttls, strict=True) if t != -2]
        # A key with a TTL (the rate window) may expire on either side at any moment: it
        # is copied, but only persistent keys are required to arrive.
        required = [k for k, t in zip(probe, ttls, strict=True) if t == -1]
        return wanted, required

    async def count_existing(self, keys: Sequence[str]) -> int:
        """How many of `keys` this shard holds (verifying a copy)."""
        present = 0
        for part in chunks(keys, 1000):
            (n,) = await self.run("verifying the copy", [("EXISTS", *part)])
            present += int(n)
        return present

    async def migrate_keys(
        self, to: MigrateAddress, to_name: str, keys: Sequence[str], timeout_ms: int
    ) -> None:
        """MIGRATE ... COPY REPLACE: this shard's Redis sends `keys` to `to` (streams keep their IDs)."""
        try:
            async with self._bounded():
                await self.client.execute_command(  # type: ignore[no-untyped-call]
                    "MIGRATE", to.host, to.port, "", to.db, timeout_ms,
                    "COPY", "REPLACE", *to.auth, "KEYS", *keys,
                )  # fmt: skip
        except (RedisError, OSError) as exc:
            raise self.fail(f"MIGRATE to {to_name}", exc) from None

    async def wake_moved(self, qids: Mapping[int, Sequence[str]], epoch: int) -> None:
        """Wake the long-polls parked on these queues here (they re-read and meet MOVED)."""
        channels = [K.queue_keys_for_id(s, q).wake for s, qs in qids.items() for q in qs]
        for chunk in chunks(channels, 1000):
            await self.run("waking waiters", [("PUBLISH", ch, "moved") for ch in chunk])
        # and the waiters on queues the index does not list (never written): their relays reload
        await self.run("announcing the map", [("PUBLISH", K.SHARD_MAP_MOVED, str(epoch))])


_evalsha = script_runner.evalsha
_MIGRATION_SCRIPTS = (scripts.SLOT_STATE, scripts.SLOT_DROP, scripts.IMPORT_STAMP)


def _set_states(slots: Sequence[int], new: str, allowed: Sequence[str]) -> list[tuple[Any, ...]]:
    """lua/slot_state.lua per slot: set `new` where the prior state is one of `allowed`."""
    return [_evalsha(scripts.SLOT_STATE, (K.slot_state(s),), (new, *allowed)) for s in slots]


def slot_keys(slot: int) -> tuple[str, ...]:
    """Slot-level keys, the index last: deleting in this order leaves the index while anything remains."""
    return (
        K.slot_stats(slot),
        K.slot_nonces(slot),
        K.slot_didcomm(slot),
        K.slot_recipients(slot),
        K.slot_didcomm_idle(slot),
        K.slot_presence(slot),
        K.slot_index(slot),
    )


def queue_keys(slot: int, qid: str) -> tuple[str, ...]:
    return K.queue_keys_for_id(slot, qid).all_keys()


def all_keys(slot: int, qids: Iterable[str]) -> list[str]:
    """The slot's keys on a shard, in a safe deletion order: queues first, the index last."""
    return [k for q in qids for k in queue_keys(slot, q)] + list(slot_keys(slot))
