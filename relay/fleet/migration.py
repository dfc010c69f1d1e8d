"""Online slot migration: the fenced MIGRATE protocol of DESIGN §4, as a library and a CLI.

Per slot, Redis Cluster's shape (docs/migration.md has the crash-resume table):

1. fence    target state 'importing', source state 'migrating': every queue script on
            either shard refuses the slot with a retryable reply (the relay retries
            within the request's deadline). Redis runs one script at a time, so every
            write that started before the fence has finished when the SET returns.
2. copy     stale keys of the slot on the target are dropped, then the slot's keys
            (index set -> each queue's keys, plus the slot-level keys) go over with
            ``MIGRATE ... COPY REPLACE KEYS``: streams keep their IDs, meta keeps seq.
            The copy is verified (every key present on the target) before the flip.
3. flip     source 'moved <target> <epoch>' first, then the target's state deleted
            (owned). Until the target is owned a request gets MOVED or 'migrating':
            both retryable, never served twice.
4. publish  the shard map with the slots on the target and epoch + 1, through the
            caller's callback (a file written by rename; the operator: the ConfigMap).
5. wake     PUBLISH on each moved queue's wake channel on the source, so long-polls
            parked there re-read, meet MOVED and re-wait on the target.
6. clean    the source's copies are deleted (guarded: only while it says 'moved').

Where a slot stands is read back from the state keys of every shard, so running the
same migration again after a crash at any point picks every slot up where it stopped.
Wake comes before clean (the brief lists it last) so that a rerun still finds the
queue ids to wake in the source's index.
"""

from __future__ import annotations

import asyncio
import fcntl
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from relay.fleet.sharding import (
    SLOT_COUNT,
    ShardMap,
    ShardMapError,
    is_sentinel_url,
    loads_shard_map,
    min_replicas_of,
    parse_slot_spec,
)
from relay.storage import keys as K
from relay.storage import script_runner, scripts, sentinel
from relay.storage.connection import RedisTarget, RedisURLError
from relay.storage.script_runner import ScriptLoadFailed

__all__ = [
    "CRASH_ENV",
    "STEPS",
    "MapConflict",
    "MigrationError",
    "MigrationReport",
    "Progress",
    "ProgressBar",
    "PublishMap",
    "file_publisher",
    "file_reader",
    "migrate_main",
    "migrate_slots",
    "write_map_file",
]

CRASH_ENV = "RELAYFLEET_MIGRATION_CRASH_AT"
# Points the test hook can stop the process at, in protocol order.
STEPS = ("fenced", "mid-copy", "copied", "mid-flip", "flipped", "published", "woken", "mid-cleanup")
CRASH_EXIT = 86

PublishMap = Callable[[ShardMap], Awaitable[ShardMap | None]]
CurrentMap = Callable[[], Awaitable[ShardMap]]


class MigrationError(Exception):
    """A migration could not go on; the message says which slot or shard and why."""


class ShardInterrupted(MigrationError):
    """A shard's connection broke or its node stopped being the primary (a failover): the
    run stops like a crash would, and ``migrate_slots`` resumes it on the new primary."""


class MapConflict(MigrationError):
    """A publisher found a map newer than the one it was given (someone else published)."""


@dataclass(frozen=True, slots=True)
class Progress:
    slots_done: int
    slots_total: int
    keys: int
    bytes: int  # payload bytes copied
    elapsed_s: float
    phase: str  # 'locate', 'copy', 'flip', 'done'


ProgressFn = Callable[[Progress], None]


@dataclass
class MigrationReport:
    target: str
    slots_requested: int
    slots_moved: int = 0  # flipped to the target by this run (from any step)
    slots_already: int = 0  # on the target before this run began its work on them
    slots_resumed: int = 0  # found mid-way (fenced, copied or flipped) by an earlier run
    keys: int = 0
    bytes: int = 0  # payload bytes copied (the per-queue byte counters)
    batches: int = 0
    elapsed_s: float = 0.0
    pauses_s: list[float] = field(default_factory=list)  # per slot: fence -> map published
    map_epoch: int = 0
    final_map: ShardMap | None = None
    resumes: int = 0  # times a shard's failover interrupted the run and it resumed

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def pause(self, q: float) -> float:
        """Quantile `q` (0..1) of the per-slot write pause, seconds (nearest rank)."""
        if not self.pauses_s:
            return 0.0
        ordered = sorted(self.pauses_s)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def summary(self) -> str:
        lines = [
            f"migrated {self.slots_moved} slot(s) to {self.target} in {self.elapsed_s:.2f} s "
            f"({self.batches} batch(es), shard map epoch {self.map_epoch})",
            f"already there: {self.slots_already}, resumed from an earlier run: {self.slots_resumed}",
            f"copied {self.keys} key(s), {self.bytes / 1e6:.2f} MB of payload, {self.mb_per_s:.1f} MB/s",
        ]
        if self.pauses_s:
            lines.append(
                "write pause per slot: "
                f"p50 {self.pause(0.5) * 1000:.0f} ms, p99 {self.pause(0.99) * 1000:.0f} ms, "
                f"max {max(self.pauses_s) * 1000:.0f} ms"
            )
        return "\n".join(lines)


def _crash_point(step: str) -> None:
    """Test hook: die here, like a killed process, when the environment asks for it."""
    if os.environ.get(CRASH_ENV) == step:
        sys.stderr.write(f"\nrelayfleet migrate: {CRASH_ENV}={step}: exiting now\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT)


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
class _Address:
    """Where a source's MIGRATE connects: the target as the shard map names it."""

    host: str
    port: int
    db: int
    auth: tuple[str, ...]  # the MIGRATE arguments: () | ('AUTH', pw) | ('AUTH2', user, pw)


def _address(name: str, url: str) -> _Address:
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
    return _Address(target.host, target.port, target.db, auth)


# replies of a node that is not (or no longer) a writable primary
# (IOERR: MIGRATE could not reach the target, e.g. its primary died mid-copy)
_FAILOVER_REPLIES = ("READONLY", "LOADING", "MASTERDOWN", "NOREPLICAS", "The previous master", "IOERR")
_WAIT_TIMEOUT_MS = 2000


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class _Shard:
    """One shard's connection for the migrator (its own pool: never the relay's)."""

    def __init__(self, name: str, url: str, op_timeout_s: float) -> None:
        self.name = name
        self.url = url
        # a Sentinel service: the client finds the primary and leaves one that turns READONLY
        self.client: aioredis.Redis = sentinel.async_client(
            url, decode_responses=False, socket_connect_timeout=5.0, socket_timeout=op_timeout_s
        )
        self.min_replicas = min_replicas_of(url)  # state changes wait for WAIT, as relay writes do

    async def address(self) -> _Address:
        """Where another shard's MIGRATE reaches this one now (the primary, for a Sentinel shard)."""
        try:
            url = await sentinel.primary_url(self.url)
        except sentinel.NoPrimary as exc:
            raise ShardInterrupted(f"shard {self.name}: {exc}") from None
        return _address(self.name, url)

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
        for chunk in _chunks(slots, 4096):
            replies = await self.run("reading slot states", [("GET", K.slot_state(s)) for s in chunk])
            for s, v in zip(chunk, replies, strict=True):
                out[s] = None if v is None else _s(v)
        return out

    async def cas(self, what: str, slots: Sequence[int], new: str, allowed: Sequence[str]) -> None:
        """Set the state of every slot, refusing (MigrationError) where the prior state is not allowed."""
        cmds = [_evalsha(scripts.SLOT_STATE, (K.slot_state(s),), (new, *allowed)) for s in slots]
        for chunk_slots, chunk in zip(_chunks(slots, 2048), _chunks(cmds, 2048), strict=True):
            replies = await self.run(what, chunk, durable=True)
            for s, (ok, prior) in zip(chunk_slots, replies, strict=True):
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
            for chunk in _chunks(keys, 500)
        ]
        deleted = 0
        for i, part in enumerate(_chunks(calls, 128)):
            replies = await self.run(what, [cmd for _, cmd in part], durable=True)
            for (slot, _), (ok, n) in zip(part, replies, strict=True):
                if not int(ok):
                    state = _s(n) or "owned"
                    raise MigrationError(f"slot {slot}: shard {self.name} refused {what} in state {state!r}")
                deleted += int(n)
            if i == 0 and after_first is not None:
                after_first()
        return deleted

    async def purge(self, what: str, slots: Sequence[int], allowed: Sequence[str]) -> None:
        """Every key this shard holds of `slots` (its index says which), state keys excepted."""
        members = await self.members(slots)
        await self.drop(what, [(s, _all_keys(s, members[s])) for s in slots], allowed)

    async def fence(
        self, what: str, slots: Sequence[int], new: str, allowed: Sequence[str]
    ) -> dict[int, list[str]]:
        """Set the slots' state, then list their queues, in one round trip."""
        out: dict[int, list[str]] = {}
        for chunk in _chunks(slots, 512):
            cmds = [_evalsha(scripts.SLOT_STATE, (K.slot_state(s),), (new, *allowed)) for s in chunk]
            cmds += [("SMEMBERS", K.slot_index(s)) for s in chunk]
            replies = await self.run(what, cmds, durable=True)
            for s, (ok, prior) in zip(chunk, replies[: len(chunk)], strict=True):
                if not int(ok):
                    raise MigrationError(
                        f"slot {s}: shard {self.name} is in state {_s(prior) or 'owned'!r}, "
                        f"which does not allow {what}; is another migration running?"
                    )
            for s, members in zip(chunk, replies[len(chunk) :], strict=True):
                out[s] = sorted(_s(m) for m in members)
        return out

    async def stamp_imports(self, qids: Mapping[int, Sequence[str]]) -> None:
        """Copied queues count as written on this Redis run (see lua/import_stamp.lua)."""
        metas = [K.queue_keys_for_id(s, q).meta for s, qs in qids.items() for q in qs]
        for chunk in _chunks(metas, 512):
            await self.run(
                "stamping imported queues",
                [_evalsha(scripts.IMPORT_STAMP, (m,), ()) for m in chunk],
                durable=True,
            )

    async def members(self, slots: Sequence[int]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for chunk in _chunks(slots, 512):
            replies = await self.run("listing queues", [("SMEMBERS", K.slot_index(s)) for s in chunk])
            for s, members in zip(chunk, replies, strict=True):
                out[s] = sorted(_s(m) for m in members)
        return out


_evalsha = script_runner.evalsha
_MIGRATION_SCRIPTS = (scripts.SLOT_STATE, scripts.SLOT_DROP, scripts.IMPORT_STAMP)


def _slot_keys(slot: int) -> tuple[str, ...]:
    """Slot-level keys, the index last: deleting in this order leaves the index while anything remains."""
    return (K.slot_stats(slot), K.slot_nonces(slot), K.slot_didcomm(slot), K.slot_index(slot))


def _queue_keys(slot: int, qid: str) -> tuple[str, ...]:
    return K.queue_keys_for_id(slot, qid).all_keys()


def _all_keys(slot: int, qids: Iterable[str]) -> list[str]:
    """The slot's keys on a shard, in a safe deletion order: queues first, the index last."""
    return [k for q in qids for k in _queue_keys(slot, q)] + list(_slot_keys(slot))


@dataclass
class _Plan:
    """What each requested slot needs, from the states of every shard."""

    copy: dict[str, list[int]] = field(default_factory=dict)  # source -> slots to move
    finish: list[int] = field(default_factory=list)  # on the target: publish / wake / clean left to do
    already: list[int] = field(default_factory=list)
    resumed: set[int] = field(default_factory=set)
    states: dict[str, dict[int, str | None]] = field(default_factory=dict)
    # shard that says 'moved' -> slots it still holds keys of
    leftovers: dict[str, list[int]] = field(default_factory=dict)


class _Migration:
    def __init__(
        self,
        shard_map: ShardMap,
        target: str,
        publish_map: PublishMap,
        progress: ProgressFn | None,
        urls: Mapping[str, str],
        max_batch_slots: int,
        max_batch_bytes: int,
        max_batch_queues: int,
        chunk_keys: int,
        chunk_bytes: int,
        migrate_timeout_ms: int,
    ) -> None:
        self.map = shard_map
        self.target = target
        self.publish_map = publish_map
        self.progress = progress
        self.max_batch_slots = max_batch_slots
        self.max_batch_bytes = max_batch_bytes
        self.max_batch_queues = max_batch_queues
        self.chunk_keys = chunk_keys
        self.chunk_bytes = chunk_bytes
        self.migrate_timeout_ms = migrate_timeout_ms
        op_timeout = migrate_timeout_ms / 1000 + 10.0
        self.shards = {
            name: _Shard(name, urls.get(name, url), op_timeout) for name, url in shard_map.shards.items()
        }
        # MIGRATE's destination; a Sentinel shard's is found afresh for every batch
        self.target_addr = (
            _address(target, self.shards[target].url)
            if not is_sentinel_url(self.shards[target].url)
            else None
        )
        self.started = time.monotonic()
        self.report = MigrationReport(target, 0)
        self.slots_total = 0
        self.slots_done = 0
        self.cleanup: asyncio.Task[None] | None = None
        self.current_map: CurrentMap | None = None

    async def close(self) -> None:
        for shard in self.shards.values():
            await shard.close()

    def tick(self, phase: str) -> None:
        if self.progress is not None:
            self.progress(
                Progress(
                    self.slots_done,
                    self.slots_total,
                    self.report.keys,
                    self.report.bytes,
                    time.monotonic() - self.started,
                    phase,
                )
            )

    # -- locate ------------------------------------------------------------------
    async def plan(self, slots: Sequence[int]) -> _Plan:
        plan = _Plan()
        results = await asyncio.gather(*(sh.states(slots) for sh in self.shards.values()))
        plan.states = dict(zip(self.shards, results, strict=True))
        # A shard that says 'moved' never serves the slot again, so any keys it still
        # holds (a cleanup cut short) are garbage, deleted at the end of this run.
        # (The target's own stale keys are dropped before its copy instead.)
        for name, sh in self.shards.items():
            if name == self.target:
                continue
            moved = [s for s in slots if (plan.states[name][s] or "").startswith("moved ")]
            if moved:
                cmds = [("EXISTS", *_slot_keys(s)) for s in moved]
                replies = [
                    r for part in _chunks(cmds, 4096) for r in await sh.run("looking for leftovers", part)
                ]
                if left := [s for s, n in zip(moved, replies, strict=True) if int(n)]:
                    plan.leftovers[name] = left
        has_leftovers = {s for left in plan.leftovers.values() for s in left}
        for s in slots:
            owner = self.map.shard_for_slot(s)
            holder = self._holder(s, owner, plan.states)
            st = {name: plan.states[name][s] for name in self.shards}
            if holder == self.target:
                if st[self.target] is None and owner == self.target and s not in has_leftovers:
                    plan.already.append(s)
                else:
                    plan.finish.append(s)  # only an earlier, interrupted run leaves a slot here
                    plan.resumed.add(s)
            else:
                plan.copy.setdefault(holder, []).append(s)
                if st[holder] is not None or st[self.target] == "importing":
                    plan.resumed.add(s)
        return plan

    def _holder(self, slot: int, owner: str, states: Mapping[str, Mapping[int, str | None]]) -> str:
        """The shard whose copy of the slot is authoritative: the map's owner, or where it says it moved."""
        holder, seen = owner, {owner}
        while True:
            st = states[holder][slot]
            if st is None or st == "migrating":
                return holder
            if st == "importing":
                if holder != owner:
                    return holder  # the flip stopped between 'moved' on the source and owned here
                raise MigrationError(
                    f"slot {slot}: the shard map names {owner} but {owner} is only importing the slot"
                )
            parts = st.split()
            if len(parts) != 3 or parts[0] != "moved" or parts[1] not in self.shards or parts[1] in seen:
                raise MigrationError(f"slot {slot}: shard {holder} has state {st!r} that leads nowhere")
            holder = parts[1]
            seen.add(holder)

    # -- the steps ---------------------------------------------------------------
    async def run(self, slots: Sequence[int]) -> MigrationReport:
        self.report.slots_requested = len(slots)
        self.slots_total = len(slots)
        self.tick("locate")
        plan = await self.plan(slots)
        self.report.slots_already = len(plan.already)
        self.report.slots_resumed = len(plan.resumed)
        self.slots_done = len(plan.already)
        if plan.finish:
            await self.finish(plan.finish, plan)
        try:
            for source, source_slots in plan.copy.items():
                for batch in await self.batches(source, source_slots):
                    await self.move_batch(source, batch, plan)
        except BaseException:
            if self.cleanup is not None:  # resumable like any other step: the rerun finishes it
                self.cleanup.cancel()
                await asyncio.gather(self.cleanup, return_exceptions=True)
            raise
        await self.settle_cleanup()
        for name, left in plan.leftovers.items():
            sh = self.shards[name]
            members = await sh.members(left)
            await self.wake(sh, members)
            await self.clean(sh, members, "moved *")
        self.report.elapsed_s = time.monotonic() - self.started
        self.report.map_epoch = self.map.epoch
        self.report.final_map = self.map
        self.tick("done")
        return self.report

    async def batches(self, source: str, slots: Sequence[int]) -> list[list[int]]:
        """Consecutive runs of slots, each under the batch limits, sized from the slot statistics."""
        sh = self.shards[source]
        sizes: dict[int, tuple[int, int]] = {}  # slot -> (payload bytes, queues)
        for chunk in _chunks(slots, 2048):
            cmds = [
                c for s in chunk for c in (("HGET", K.slot_stats(s), "bytes"), ("SCARD", K.slot_index(s)))
            ]
            replies = await sh.run("reading slot statistics", cmds)
            for i, s in enumerate(chunk):
                sizes[s] = (max(0, int(replies[2 * i] or 0)), int(replies[2 * i + 1]))
        out: list[list[int]] = []
        cur: list[int] = []
        cur_bytes = cur_queues = 0
        for s in slots:
            nbytes, queues = sizes[s]
            if cur and (
                len(cur) >= self.max_batch_slots
                or cur_bytes + nbytes > self.max_batch_bytes
                or cur_queues + queues > self.max_batch_queues
            ):
                out.append(cur)
                cur, cur_bytes, cur_queues = [], 0, 0
            cur.append(s)
            cur_bytes += nbytes
            cur_queues += queues
        if cur:
            out.append(cur)
        return out

    async def move_batch(self, source: str, batch: list[int], plan: _Plan) -> None:
        src, tgt = self.shards[source], self.shards[self.target]
        epoch = self.map.epoch + 1
        self.tick("fence")
        # An earlier flip into the source that stopped before 'owned': complete it first.
        half = [s for s in batch if plan.states[source][s] == "importing"]
        if half:
            await src.cas("completing an earlier flip", half, "", ("importing",))
        await self.drop_strays(source, batch, plan, epoch)
        stale = await tgt.fence("fencing (importing)", batch, "importing", ("", "importing", "moved *"))
        # Stale keys on the target (an earlier attempt, old leftovers) must not survive the
        # copy; dropped before the source's fence so this work stays out of the write pause.
        doomed = [(s, _all_keys(s, stale[s])) for s in batch]
        await tgt.drop("dropping stale keys before the copy", doomed, ("importing",))
        if is_sentinel_url(tgt.url):
            self.target_addr = await tgt.address()
        fenced_at = time.monotonic()  # taken before the fence is sent: the pause is not understated
        try:
            # the listing follows the fence: no queue can appear in the slot after it
            qids = await src.fence("fencing (migrating)", batch, "migrating", ("", "migrating"))
            _crash_point("fenced")
            await self.copy(src, tgt, batch, qids)
            await tgt.stamp_imports(qids)
        except BaseException:
            await asyncio.shield(self.rollback(src, tgt, batch))
            raise
        _crash_point("copied")
        self.tick("flip")
        await src.cas(
            "flipping (moved)", batch, f"moved {self.target} {epoch}", ("migrating", f"moved {self.target} *")
        )
        _crash_point("mid-flip")
        await tgt.cas("flipping (owned)", batch, "", ("importing", ""))
        _crash_point("flipped")
        await self.publish(batch)
        published_at = time.monotonic()
        self.report.pauses_s.extend([published_at - fenced_at] * len(batch))
        self.report.slots_moved += len(batch)
        self.report.batches += 1
        self.slots_done += len(batch)
        _crash_point("published")
        # Wake and clean overlap the next batch's copy: both are outside the pause, and
        # at most one batch's cleanup is outstanding.
        await self.settle_cleanup()
        self.cleanup = asyncio.get_running_loop().create_task(self.wake_and_clean(src, qids))
        self.tick("copy")

    async def wake_and_clean(self, src: _Shard, qids: Mapping[int, Sequence[str]]) -> None:
        await self.wake(src, qids)
        _crash_point("woken")
        await self.clean(src, qids)

    async def settle_cleanup(self) -> None:
        task, self.cleanup = self.cleanup, None
        if task is not None:
            await task

    async def drop_strays(self, source: str, batch: Sequence[int], plan: _Plan, epoch: int) -> None:
        """Shards left 'importing' by an abandoned move elsewhere: empty them, point them at the source."""
        for name, sh in self.shards.items():
            if name in (source, self.target):
                continue
            strays = [s for s in batch if plan.states[name][s] == "importing"]
            if not strays:
                continue
            await sh.purge("dropping an abandoned import", strays, ("importing",))
            await sh.cas("closing an abandoned import", strays, f"moved {source} {epoch}", ("importing",))

    async def copy(
        self, src: _Shard, tgt: _Shard, batch: Sequence[int], qids: Mapping[int, Sequence[str]]
    ) -> None:
        self.tick("copy")
        # Which keys exist, and each queue's payload bytes, in one round trip.
        probe = [k for s in batch for k in (*_slot_keys(s), *(k for q in qids[s] for k in _queue_keys(s, q)))]
        streams = [K.queue_keys_for_id(s, q) for s in batch for q in qids[s]]

        cmds = [("PTTL", k) for k in probe] + [("HGET", qk.meta, "bytes") for qk in streams]
        replies: list[Any] = []
        for part in _chunks(cmds, 5000):
            replies.extend(await src.run("listing the slot's keys", part))
        size_of = {qk.msgs: max(0, int(v or 0)) for qk, v in zip(streams, replies[len(probe) :], strict=True)}
        ttls = [int(t) for t in replies[: len(probe)]]  # -2 missing, -1 persistent, else ms left
        wanted = [(k, size_of.get(k, 0)) for k, t in zip(probe, ttls, strict=True) if t != -2]
        # A key with a TTL (the rate window) may expire on either side at any moment: it
        # is copied, but only persistent keys are required to arrive.
        required = [k for k, t in zip(probe, ttls, strict=True) if t == -1]
        # Chunks bound how long one MIGRATE blocks the source for its other slots.
        chunk: list[str] = []
        chunk_bytes = 0
        sent = 0
        for key, nbytes in wanted:
            if chunk and (len(chunk) >= self.chunk_keys or chunk_bytes + nbytes > self.chunk_bytes):
                await self.migrate(src, chunk, chunk_bytes)
                sent += 1
                if sent == 1:
                    _crash_point("mid-copy")
                chunk, chunk_bytes = [], 0
            chunk.append(key)
            chunk_bytes += nbytes
        if chunk:
            await self.migrate(src, chunk, chunk_bytes)
            if sent == 0:
                _crash_point("mid-copy")
        # Verify before the flip: every persistent key of the fenced source exists on the target.
        present = 0
        for part in _chunks(required, 1000):
            (n,) = await tgt.run("verifying the copy", [("EXISTS", *part)])
            present += int(n)
        if present != len(required):
            raise MigrationError(
                f"copy to {tgt.name} incomplete: {present} of {len(required)} keys of slots "
                f"{batch[0]}-{batch[-1]} arrived"
            )

    async def migrate(self, src: _Shard, keys: Sequence[str], nbytes: int) -> None:
        a = self.target_addr
        assert a is not None
        try:
            await src.client.execute_command(  # type: ignore[no-untyped-call]
                "MIGRATE", a.host, a.port, "", a.db, self.migrate_timeout_ms,
                "COPY", "REPLACE", *a.auth, "KEYS", *keys,
            )  # fmt: skip
        except (RedisError, OSError) as exc:
            raise src.fail(f"MIGRATE to {self.target}", exc) from None
        self.report.keys += len(keys)
        self.report.bytes += nbytes
        self.tick("copy")

    async def rollback(self, src: _Shard, tgt: _Shard, batch: Sequence[int]) -> None:
        """Undo a fence whose copy failed: the source serves again, the target forgets the partial copy."""
        try:
            await tgt.purge("dropping a partial copy", batch, ("importing",))
            await tgt.cas(
                "rolling back (importing)", batch, f"moved {src.name} {self.map.epoch}", ("importing",)
            )
            await src.cas("rolling back (migrating)", batch, "", ("migrating", ""))
        except MigrationError:
            pass  # the slots stay fenced; running the migration again resumes them

    async def publish(self, slots: Sequence[int]) -> None:
        if all(self.map.shard_for_slot(s) == self.target for s in slots):
            return
        for attempt in range(8):
            new_map = self.map.with_slots(slots, self.target)
            try:
                published = await self.publish_map(new_map)
            except MapConflict:
                if self.current_map is None or attempt == 7:
                    raise
                # Another migration published meanwhile: build on its map. Our slots are
                # ours alone (their states say so), so the two changes compose.
                self.map = await self.current_map()
                continue
            self.map = published if published is not None else new_map
            return

    async def wake(self, src: _Shard, qids: Mapping[int, Sequence[str]]) -> None:
        channels = [K.queue_keys_for_id(s, q).wake for s, qs in qids.items() for q in qs]
        for chunk in _chunks(channels, 1000):
            await src.run("waking waiters", [("PUBLISH", ch, "moved") for ch in chunk])
        # and the waiters on queues the index does not list (never written): their relays reload
        await src.run("announcing the map", [("PUBLISH", K.SHARD_MAP_MOVED, str(self.map.epoch))])

    async def clean(self, src: _Shard, qids: Mapping[int, Sequence[str]], allowed_state: str = "") -> None:
        allowed = (allowed_state or f"moved {self.target} *",)
        await src.drop(
            "deleting the source's copy",
            [(s, _all_keys(s, qs)) for s, qs in qids.items()],
            allowed,
            after_first=lambda: _crash_point("mid-cleanup"),
        )

    async def finish(self, slots: list[int], plan: _Plan) -> None:
        """Slots whose data already lives on the target: complete flip, publish, wake and clean."""
        tgt = self.shards[self.target]
        epoch = self.map.epoch + 1
        importing = [s for s in slots if plan.states[self.target][s] == "importing"]
        if importing:
            await tgt.cas("completing the flip", importing, "", ("importing",))
        migrating = [s for s in slots if plan.states[self.target][s] == "migrating"]
        if migrating:
            # A move away from the target stopped before its flip: the target's copy is current.
            for name, sh in self.shards.items():
                strays = [s for s in migrating if name != self.target and plan.states[name][s] == "importing"]
                if strays:
                    await sh.purge("dropping an abandoned import", strays, ("importing",))
                    await sh.cas(
                        "closing an abandoned import", strays, f"moved {self.target} {epoch}", ("importing",)
                    )
            await tgt.cas("rolling back a fence", migrating, "", ("migrating",))
        await self.publish(slots)
        self.slots_done += len(slots)
        self.report.slots_moved += len(slots)
        self.tick("copy")  # the sources' leftovers are woken and deleted at the end of the run


def _validate(shard_map: ShardMap, slots: Iterable[int], target: str) -> list[int]:
    if target not in shard_map.shards:
        raise MigrationError(
            f"unknown target shard {target!r}; the map has {', '.join(sorted(shard_map.shards))}"
        )
    wanted = sorted(set(slots))
    if not wanted:
        raise MigrationError("no slots to migrate")
    if wanted[0] < 0 or wanted[-1] >= SLOT_COUNT:
        raise MigrationError(f"slots must be within 0-{SLOT_COUNT - 1}")
    return wanted


async def migrate_slots(
    shard_map: ShardMap,
    slots: Iterable[int],
    target: str,
    publish_map: PublishMap,
    progress: ProgressFn | None = None,
    *,
    redis_urls: Mapping[str, str] | None = None,
    max_batch_slots: int = 1024,
    max_batch_bytes: int = 8 << 20,
    max_batch_queues: int = 5000,
    chunk_keys: int = 500,
    chunk_bytes: int = 4 << 20,
    migrate_timeout_ms: int = 15_000,
    current_map: CurrentMap | None = None,
    resume_for_s: float = 60.0,
) -> MigrationReport:
    """Move `slots` to shard `target`, online; safe to call again after any failure or crash.

    `shard_map` is the map in force (its owners are the sources). After each batch is
    flipped, `publish_map` receives the next map (slots on the target, epoch + 1) and
    must make it durable before returning — the relays' file or ConfigMap. It may
    return the map it actually stored (e.g. merged with a concurrent change); the next
    batch builds on that. `redis_urls` overrides the map's URLs per shard (credentials);
    every source must reach the target at the URL used here, since MIGRATE is issued
    by the source's Redis. When `publish_map` raises `MapConflict` (another migration
    published first), the next map is rebuilt on `current_map()` and offered again;
    without `current_map` the conflict ends the run (rerun it). A lost connection or a
    shard failing over (`ShardInterrupted`) resumes the run for up to `resume_for_s`
    seconds (0: fail at once; only when some shard is Sentinel-managed). Batches are
    consecutive slots of one source, bounded by
    `max_batch_slots`, `max_batch_bytes` (payload) and `max_batch_queues`: together the
    bound on each slot's write pause.
    """
    wanted = _validate(shard_map, slots, target)
    # A shard's failover mid-run (Sentinel shards) stops the run like a crash; every step is
    # resumable, so it starts over from the shard states on the new primary, within a bound.
    urls = {**shard_map.shards, **(redis_urls or {})}
    if not any(is_sentinel_url(u) for u in urls.values()):
        resume_for_s = 0.0  # a plain Redis that broke is not failing over: report it at once
    give_up_at = time.monotonic() + resume_for_s
    resumes = 0
    while True:
        m = _Migration(
            shard_map,
            target,
            publish_map,
            progress,
            dict(redis_urls or {}),
            max(1, max_batch_slots),
            max(1, max_batch_bytes),
            max(1, max_batch_queues),
            max(1, chunk_keys),
            max(1, chunk_bytes),
            migrate_timeout_ms,
        )
        m.current_map = current_map
        try:
            report = await m.run(wanted)
            report.resumes = resumes
            return report
        except ShardInterrupted:
            if time.monotonic() >= give_up_at:
                raise
            shard_map = m.map  # the last map it published: later batches build on it
        finally:
            await m.close()
        resumes += 1
        await asyncio.sleep(0.5)


# -- the shard map file -----------------------------------------------------------


def write_map_file(path: str, shard_map: ShardMap) -> None:
    """Replace the file atomically (write, fsync, rename): readers see the old map or the new one."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(shard_map.dumps())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_map_file(path: str) -> ShardMap:
    with open(path, "rb") as f:
        return loads_shard_map(f.read())


def _publish_file(path: str, new_map: ShardMap) -> None:
    # The lock makes read-compare-write atomic against other migrations on this host.
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = _read_map_file(path)
            if current.epoch >= new_map.epoch:
                raise MapConflict(f"{path} changed during the migration (now epoch {current.epoch})")
            write_map_file(path, new_map)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def file_publisher(path: str) -> PublishMap:
    """Publishes to a shard map file; `MapConflict` when someone else published a newer map."""

    async def publish(new_map: ShardMap) -> ShardMap:
        await asyncio.to_thread(_publish_file, path, new_map)
        return new_map

    return publish


def file_reader(path: str) -> CurrentMap:
    """The map in the file now (the `current_map` that goes with `file_publisher`)."""

    async def read() -> ShardMap:
        return await asyncio.to_thread(_read_map_file, path)

    return read


# -- the command line ---------------------------------------------------------------


class ProgressBar:
    """Slots, keys and bytes on stderr: redrawn in place on a terminal, a line now and then otherwise."""

    def __init__(self, target: str, stream: TextIO | None = None, width: int = 28) -> None:
        self.target = target
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self._last = 0.0
        self._drawn = False

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        final = p.phase == "done"
        if not final and now - self._last < (0.1 if self.tty else 2.0):
            return
        self._last = now
        frac = p.slots_done / p.slots_total if p.slots_total else 1.0
        filled = round(frac * self.width)
        rate = p.bytes / 1e6 / p.elapsed_s if p.elapsed_s > 0 else 0.0
        line = (
            f"migrate -> {self.target} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{p.slots_done}/{p.slots_total} slots  {p.keys} keys  {p.bytes / 1e6:.1f} MB  "
            f"{rate:.1f} MB/s  {p.phase}"
        )
        if self.tty:
            self.stream.write("\r" + line + "\033[K" + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._drawn = True


def migrate_main(shard_map_path: str, slots: str, to: str) -> int:
    """`relayfleet migrate --shard-map FILE --slots A-B --to SHARD`: 0 done, 2 bad arguments, 1 failed."""
    try:
        wanted = parse_slot_spec(slots)
        shard_map = _read_map_file(shard_map_path)
        _validate(shard_map, wanted, to)
    except OSError as exc:
        print(f"relayfleet: cannot read shard map {shard_map_path}: {exc.strerror}", file=sys.stderr)
        return 2
    except (ShardMapError, MigrationError) as exc:
        print(f"relayfleet: {exc}", file=sys.stderr)
        return 2
    bar = ProgressBar(to)
    try:
        report = asyncio.run(
            migrate_slots(
                shard_map,
                wanted,
                to,
                file_publisher(shard_map_path),
                bar,
                current_map=file_reader(shard_map_path),
            )
        )
    except MigrationError as exc:
        print(f"\nrelayfleet migrate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"\nrelayfleet migrate: cannot write shard map {shard_map_path}: {exc.strerror}", file=sys.stderr
        )
        return 1
    print(report.summary())
    return 0
