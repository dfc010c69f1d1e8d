"""The slot-move protocol: the fenced MIGRATE steps of docs/migration.md and `migrate_slots`, which runs them.

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
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from relay.fleet.migration import shard_ops
from relay.fleet.migration.crash_points import crash_point
from relay.fleet.migration.errors import MigrationError, ShardInterrupted
from relay.fleet.migration.publishing import CurrentMap, MapConflict, PublishMap
from relay.fleet.migration.report import MigrationReport, Progress, ProgressFn
from relay.fleet.migration.shard_ops import Shard, all_keys
from relay.fleet.sharding import SLOT_COUNT, ShardMap, is_sentinel_url
from relay.retrying import MAP_WRITE, MIGRATION_RESUME, retrying

__all__ = ["migrate_slots", "validate_request"]

# A batch's map offered again this many times in all when other migrations keep publishing first
# (each loss is another migration's progress, so many losses in a row are rare, not a fault).
_PUBLISH_ATTEMPTS = 16


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
            name: Shard(name, urls.get(name, url), op_timeout) for name, url in shard_map.shards.items()
        }
        # MIGRATE's destination; a Sentinel shard's is found afresh for every batch.
        self.target_addr = (
            shard_ops.migrate_address(target, self.shards[target].url)
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
            if moved and (left := await sh.slots_with_keys(moved)):
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
        sizes = await sh.slot_sizes(slots)  # slot -> (payload bytes, queues)
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
        doomed = [(s, all_keys(s, stale[s])) for s in batch]
        await tgt.drop("dropping stale keys before the copy", doomed, ("importing",))
        if is_sentinel_url(tgt.url):
            self.target_addr = await tgt.address()
        fenced_at = time.monotonic()  # taken before the fence is sent: the pause is not understated
        try:
            # the listing follows the fence: no queue can appear in the slot after it
            qids = await src.fence("fencing (migrating)", batch, "migrating", ("", "migrating"))
            crash_point("fenced")
            await self.copy(src, tgt, batch, qids)
            await tgt.stamp_imports(qids)
        except BaseException:
            await asyncio.shield(self.rollback(src, tgt, batch))
            raise
        crash_point("copied")
        self.tick("flip")
        await src.cas(
            "flipping (moved)", batch, f"moved {self.target} {epoch}", ("migrating", f"moved {self.target} *")
        )
        crash_point("mid-flip")
        await tgt.cas("flipping (owned)", batch, "", ("importing", ""))
        crash_point("flipped")
        await self.publish(batch)
        published_at = time.monotonic()
        self.report.pauses_s.extend([published_at - fenced_at] * len(batch))
        self.report.slots_moved += len(batch)
        self.report.batches += 1
        self.slots_done += len(batch)
        crash_point("published")
        # Wake and clean overlap the next batch's copy: both are outside the pause, and
        # at most one batch's cleanup is outstanding.
        await self.settle_cleanup()
        self.cleanup = asyncio.get_running_loop().create_task(self.wake_and_clean(src, qids))
        self.tick("copy")

    async def wake_and_clean(self, src: Shard, qids: Mapping[int, Sequence[str]]) -> None:
        await self.wake(src, qids)
        crash_point("woken")
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
        self, src: Shard, tgt: Shard, batch: Sequence[int], qids: Mapping[int, Sequence[str]]
    ) -> None:
        self.tick("copy")
        wanted, required = await src.keys_to_copy(batch, qids)
        # Chunks bound how long one MIGRATE blocks the source for its other slots.
        chunk: list[str] = []
        chunk_bytes = 0
        sent = 0
        for key, nbytes in wanted:
            if chunk and (len(chunk) >= self.chunk_keys or chunk_bytes + nbytes > self.chunk_bytes):
                await self.migrate(src, chunk, chunk_bytes)
                sent += 1
                if sent == 1:
                    crash_point("mid-copy")
                chunk, chunk_bytes = [], 0
            chunk.append(key)
            chunk_bytes += nbytes
        if chunk:
            await self.migrate(src, chunk, chunk_bytes)
            if sent == 0:
                crash_point("mid-copy")
        # Verify before the flip: every persistent key of the fenced source exists on the target.
        present = await tgt.count_existing(required)
        if present != len(required):
            raise MigrationError(
                f"copy to {tgt.name} incomplete: {present} of {len(required)} keys of slots "
                f"{batch[0]}-{batch[-1]} arrived"
            )

    async def migrate(self, src: Shard, keys: Sequence[str], nbytes: int) -> None:
        a = self.target_addr
        assert a is not None
        await src.migrate_keys(a, self.target, keys, self.migrate_timeout_ms)
        self.report.keys += len(keys)
        self.report.bytes += nbytes
        self.tick("copy")

    async def rollback(self, src: Shard, tgt: Shard, batch: Sequence[int]) -> None:
        """Undo a fence whose copy failed: the source serves again, the target forgets the partial copy."""
        try:
            # a copy cut short may hold some of a queue's keys without the slot index that
            # names the queue: the source (fenced, so its list is final) names them too
            await tgt.purge("dropping a partial copy", batch, ("importing",), await src.members(batch))
            await tgt.cas(
                "rolling back (importing)", batch, f"moved {src.name} {self.map.epoch}", ("importing",)
            )
            await src.cas("rolling back (migrating)", batch, "", ("migrating", ""))
        except MigrationError:
            pass  # the slots stay fenced; running the migration again resumes them

    async def publish(self, slots: Sequence[int]) -> None:
        if all(self.map.shard_for_slot(s) == self.target for s in slots):
            return
        lost: list[MapConflict] = []

        async def attempt() -> None:
            if lost and self.current_map is not None:
                # Another migration published meanwhile: build on its map. Our slots are
                # ours alone (their states say so), so the two changes compose.
                self.map = await self.current_map()
            new_map = self.map.with_slots(slots, self.target)
            try:
                published = await self.publish_map(new_map)
            except MapConflict as exc:
                lost.append(exc)
                raise
            self.map = published if published is not None else new_map

        def worth(exc: BaseException) -> bool:
            return isinstance(exc, MapConflict) and self.current_map is not None

        await retrying(MAP_WRITE, worth, attempts=_PUBLISH_ATTEMPTS)(attempt)

    async def wake(self, src: Shard, qids: Mapping[int, Sequence[str]]) -> None:
        await src.wake_moved(qids, self.map.epoch)

    async def clean(self, src: Shard, qids: Mapping[int, Sequence[str]], allowed_state: str = "") -> None:
        allowed = (allowed_state or f"moved {self.target} *",)
        await src.drop(
            "deleting the source's copy",
            [(s, all_keys(s, qs)) for s, qs in qids.items()],
            allowed,
            after_first=lambda: crash_point("mid-cleanup"),
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


def validate_request(shard_map: ShardMap, slots: Iterable[int], target: str) -> list[int]:
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
    wanted = validate_request(shard_map, slots, target)
    # A shard's failover mid-run (Sentinel shards) stops the run like a crash; every step is
    # resumable, so it starts over from the shard states on the new primary, within a bound.
    urls = {**shard_map.shards, **(redis_urls or {})}
    if not any(is_sentinel_url(u) for u in urls.values()):
        resume_for_s = 0.0  # a plain Redis that broke is not failing over: report it at once
    give_up_at = asyncio.get_running_loop().time() + resume_for_s
    runs: list[_Migration] = []

    async def attempt() -> MigrationReport:
        nonlocal shard_map
        if runs:
            shard_map = runs[-1].map  # the last map it published: later batches build on it
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
        runs.append(m)
        try:
            report = await m.run(wanted)
        finally:
            await m.close()
        report.resumes = len(runs) - 1
        return report

    report: MigrationReport = await retrying(MIGRATION_RESUME, ShardInterrupted, deadline=give_up_at)(attempt)
    return report
