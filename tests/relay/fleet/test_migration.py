"""The migration protocol against real redis-servers, without relays: what moves, exactly;
each row of the crash-resume table (docs/migration.md) set up by hand and completed;
rollback when the copy fails; credentials; clear errors."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.migration import (
    MapConflict,
    MigrationError,
    Progress,
    file_publisher,
    file_reader,
    migrate_slots,
    write_map_file,
)
from relay.fleet.routing import load_file
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange, slot_of
from relay.storage import keys as K
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore

DEBIAN_REDIS = "/usr/bin/redis-server"


class Shards:
    def __init__(self, tmp_path: Path, names: tuple[str, ...], **kw: str) -> None:
        self.servers = {n: LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / n), **kw) for n in names}  # type: ignore[arg-type]
        self.path = str(tmp_path / "map.json")

    def start(self) -> Shards:
        for s in self.servers.values():
            s.start()
        urls = {n: s.url for n, s in self.servers.items()}
        write_map_file(self.path, ShardMap("t", 1, urls, (SlotRange(0, SLOT_COUNT - 1, "a"),)))
        return self

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()

    def r(self, name: str) -> redis.Redis:
        return redis.Redis.from_url(self.servers[name].url)

    def map(self) -> ShardMap:
        return load_file(self.path)

    def set_states(self, slot: int, **states: str) -> None:
        """Set the slot's state by hand on the named shards, in the order given."""
        for name, value in states.items():
            with self.r(name) as c:
                c.set(K.slot_state(slot), value)

    def state(self, name: str, slot: int) -> str | None:
        with self.r(name) as c:
            v = c.get(K.slot_state(slot))
        return v.decode() if v is not None else None

    def slot_keys(self, name: str, slot: int) -> list[bytes]:
        with self.r(name) as c:
            return sorted(
                k
                for k in c.scan_iter(match=K.slot_key_pattern(slot), count=1000)
                if not k.endswith(b":state")
            )


@pytest.fixture
def shards(tmp_path: Path) -> Iterator[Shards]:
    s = Shards(tmp_path, ("a", "b", "c")).start()
    try:
        yield s
    finally:
        s.stop()


async def _fill(
    shards: Shards,
    n_queues: int,
    msgs: int,
    slot_range: tuple[int, int] = (0, SLOT_COUNT - 1),
    size: int = 200,
) -> list[bytes]:
    """Queues with messages, idempotency keys and nonces on shard a (the owner of everything)."""
    store = ShardStore("a", shards.servers["a"].url, QueueLimits())
    await store.start()
    out: list[bytes] = []
    try:
        while len(out) < n_queues:
            r = os.urandom(32)
            if not slot_range[0] <= slot_of(r) <= slot_range[1]:
                continue
            out.append(r)
            q = K.queue_keys(r, b"")
            now = int(time.time() * 1000)
            for i in range(msgs):
                # digest "*": the idempotency hash stays a listpack, whose DUMP is the same
                # bytes on both sides (a hashtable's, with sha256 digests, is in bucket order)
                req = EnqueueRequest(
                    r, b"", os.urandom(size), f"k{i}", f"m{i}", any_payload_is_duplicate=True
                )
                await store.enqueue(q, req, now + i)
            await store.ack_upto(q, 1)  # seq 1 acked: the stream starts at 2, seq counter stays
            await store.use_nonce(q.slot, "key.nonce", now, 600_000)
    finally:
        await store.close()
    return out


def _dump(c: redis.Redis, keys: list[bytes]) -> dict[bytes, object]:
    """Every key byte for byte, except: sets by their members, the rate window (volatile) and
    the meta hash's 'r' (the Redis run that last wrote the queue, re-stamped on import by design)."""
    out: dict[bytes, object] = {}
    for k in keys:
        if k.endswith(b":rate"):
            continue
        if k.endswith(b":meta"):
            meta = c.hgetall(k)
            meta.pop(b"r", None)
            out[k] = meta
        elif c.type(k) == b"set":
            # a hashtable set's DUMP lists members in bucket order, which each Redis process
            # seeds at random: two queues in one slot may dump in either order
            out[k] = c.smembers(k)
        else:
            out[k] = c.dump(k)
    return out


async def test_keys_arrive_byte_for_byte_and_the_source_is_emptied(shards: Shards) -> None:
    recipients = await _fill(shards, 30, 5)
    slots = sorted({slot_of(r) for r in recipients})
    before = {s: shards.slot_keys("a", s) for s in slots}
    with shards.r("a") as a:
        dumps = {s: _dump(a, before[s]) for s in slots}
    seen: list[Progress] = []
    report = await migrate_slots(shards.map(), slots, "b", file_publisher(shards.path), seen.append)
    assert report.slots_moved == len(slots)
    assert report.map_epoch == 2
    assert report.bytes == 30 * 4 * 200  # payload still held (seq 1 was acked)
    with shards.r("b") as b:
        for s in slots:
            assert shards.slot_keys("b", s) == before[s]
            assert _dump(b, before[s]) == dumps[s]  # stream IDs, seq counter, idempotency, nonces, stats
            assert shards.state("b", s) is None
            assert shards.state("a", s) == "moved b 2"
            assert shards.slot_keys("a", s) == []
    assert shards.map().shard_for_slot(slots[0]) == "b"
    assert seen[-1].phase == "done"
    assert seen[-1].slots_done == seen[-1].slots_total == len(slots)
    # a rerun changes nothing
    again = await migrate_slots(shards.map(), slots, "b", file_publisher(shards.path))
    assert again.slots_moved == 0
    assert again.slots_already == len(slots)
    assert shards.map().epoch == 2


async def test_fenced_slot_refuses_every_queue_operation(shards: Shards) -> None:
    """What the relay sees mid-migration: 'migrating' on both shards, MOVED on the source after."""
    from relay.storage.store import SlotMigrating, SlotMoved

    [r] = await _fill(shards, 1, 2)
    q = K.queue_keys(r, b"")
    with shards.r("a") as a, shards.r("b") as b:
        a.set(q.state, "migrating")
        b.set(q.state, "importing")
    for name in ("a", "b"):
        store = ShardStore(name, shards.servers[name].url, QueueLimits())
        await store.start()
        try:
            for op in (
                store.enqueue(q, EnqueueRequest(b"", b"", b"x"), 1),
                store.read(q, None, 10),
                store.drain(q, 10),
                store.ack_upto(q, 5),
                store.status(q),
            ):
                with pytest.raises(SlotMigrating):
                    await op
        finally:
            await store.close()
    with shards.r("a") as a:
        a.set(q.state, "moved b 9")
    store = ShardStore("a", shards.servers["a"].url, QueueLimits())
    await store.start()
    try:
        with pytest.raises(SlotMoved) as moved:
            await store.enqueue(q, EnqueueRequest(b"", b"", b"x"), 1)
        assert (moved.value.shard, moved.value.epoch) == ("b", 9)
    finally:
        await store.close()


async def test_concurrent_migrations_of_disjoint_slots_compose(shards: Shards) -> None:
    """Two migrations publish to one file at once: each rebuilds on the other's map."""
    await _fill(shards, 40, 2)
    start = shards.map()
    publish, current = file_publisher(shards.path), file_reader(shards.path)
    to_b = [s for s in range(0, 4000) if s % 2 == 0]
    to_c = [s for s in range(0, 4000) if s % 2 == 1]
    rb, rc = await asyncio.gather(
        migrate_slots(start, to_b, "b", publish, current_map=current, max_batch_slots=100),
        migrate_slots(start, to_c, "c", publish, current_map=current, max_batch_slots=100),
    )
    final = shards.map()
    assert all(final.shard_for_slot(s) == "b" for s in to_b)
    assert all(final.shard_for_slot(s) == "c" for s in to_c)
    assert final.epoch == 1 + rb.batches + rc.batches
    # without a way to re-read, a conflict stops the run (resumable)
    write_map_file(shards.path, final.with_slots([5000], "b"))
    with pytest.raises(MapConflict, match="changed during the migration"):
        await migrate_slots(final, [5001], "c", publish)


# -- every row of the crash-resume table, set up by hand ------------------------------------


async def _one_slot(shards: Shards) -> tuple[int, list[bytes]]:
    recipients = await _fill(shards, 3, 3, (777, 777))
    return 777, recipients


def _copy_slot(shards: Shards, slot: int, src: str, dst: str) -> None:
    keys = shards.slot_keys(src, slot)
    with shards.r(src) as c:
        port = shards.servers[dst].port
        c.execute_command("MIGRATE", "127.0.0.1", port, "", 0, 5000, "COPY", "REPLACE", "KEYS", *keys)


async def _complete_and_check(
    shards: Shards, slot: int, recipients: list[bytes], resumed: bool = True
) -> None:
    report = await migrate_slots(shards.map(), [slot], "b", file_publisher(shards.path))
    assert report.slots_resumed == (1 if resumed else 0)
    assert shards.map().shard_for_slot(slot) == "b"
    assert shards.state("b", slot) is None
    assert (shards.state("a", slot) or "").startswith("moved b ")
    assert shards.slot_keys("a", slot) == []
    store = ShardStore("b", shards.servers["b"].url, QueueLimits())
    await store.start()
    try:
        for r in recipients:
            got = await store.read(K.queue_keys(r, b""), None, 10)
            assert [m.seq for m in got.messages] == [2, 3]
    finally:
        await store.close()


async def test_resume_after_fence(shards: Shards) -> None:
    slot, recipients = await _one_slot(shards)
    shards.set_states(slot, b="importing", a="migrating")
    with shards.r("b") as b:
        b.set(K.queue_keys(recipients[0], b"").msgs, "garbage from a dead attempt")
        b.sadd(K.slot_index(slot), "phantom.queue")
        b.hset(K.queue_keys_for_id(slot, "phantom.queue").meta, "seq", 99)
    await _complete_and_check(shards, slot, recipients)
    with shards.r("b") as b:
        assert not b.exists(K.queue_keys_for_id(slot, "phantom.queue").meta)  # stale target keys purged
        assert not b.sismember(K.slot_index(slot), "phantom.queue")


# The rows after the fence: (source and target states, whether the map already names b); b
# holds a copy of the slot in each.
CRASHED_AFTER_THE_COPY = {
    "copied-before-flip": ({"b": "importing", "a": "migrating"}, False),
    "mid-flip": ({"b": "importing", "a": "moved b 2"}, False),
    "flipped-before-publish": ({"a": "moved b 2"}, False),
    "published-before-cleanup": ({"a": "moved b 2"}, True),
}


@pytest.mark.parametrize(("states", "published"), CRASHED_AFTER_THE_COPY.values(), ids=CRASHED_AFTER_THE_COPY)
async def test_resume_after_the_copy(shards: Shards, states: dict[str, str], published: bool) -> None:
    slot, recipients = await _one_slot(shards)
    _copy_slot(shards, slot, "a", "b")
    shards.set_states(slot, **states)
    if published:
        write_map_file(shards.path, shards.map().with_slots([slot], "b"))
    assert shards.map().shard_for_slot(slot) == ("b" if published else "a")
    await _complete_and_check(shards, slot, recipients)


async def test_abandoned_import_elsewhere_is_emptied(shards: Shards) -> None:
    """A dead migration to c left c 'importing' with a partial copy; now the slot goes to b."""
    slot, recipients = await _one_slot(shards)
    _copy_slot(shards, slot, "a", "c")
    shards.set_states(slot, c="importing", a="migrating")
    await _complete_and_check(shards, slot, recipients)
    assert shards.slot_keys("c", slot) == []
    assert (shards.state("c", slot) or "").startswith("moved a ")


async def test_moving_back_to_a_shard_whose_move_away_stopped_before_its_flip(shards: Shards) -> None:
    """b owns the slot; a dead move b -> c left b 'migrating', c 'importing'; moving to b rolls it back."""
    slot, _ = await _one_slot(shards)
    await migrate_slots(shards.map(), [slot], "b", file_publisher(shards.path))
    _copy_slot(shards, slot, "b", "c")
    shards.set_states(slot, c="importing", b="migrating")
    report = await migrate_slots(shards.map(), [slot], "b", file_publisher(shards.path))
    assert report.slots_resumed == 1
    assert shards.state("b", slot) is None
    assert shards.slot_keys("c", slot) == []
    assert (shards.state("c", slot) or "").startswith("moved b ")
    assert len(shards.slot_keys("b", slot)) > 0


async def test_inconsistent_states_are_refused_clearly(shards: Shards) -> None:
    slot, _ = await _one_slot(shards)
    shards.set_states(slot, a="importing")  # the map says a owns it, yet a only imports it
    with pytest.raises(MigrationError, match="the shard map names a but a is only importing"):
        await migrate_slots(shards.map(), [slot], "b", file_publisher(shards.path))
    shards.set_states(slot, a="moved zz 4")
    with pytest.raises(MigrationError, match="leads nowhere"):
        await migrate_slots(shards.map(), [slot], "b", file_publisher(shards.path))


# -- failures ---------------------------------------------------------------------------


async def test_failed_copy_rolls_back_and_the_source_serves_again(tmp_path: Path) -> None:
    s = Shards(tmp_path, ("a", "b")).start()
    try:
        recipients = await _fill(s, 20, 5, (100, 199), size=50_000)  # 5 MB
        with s.r("b") as b:
            used = int(b.info("memory")["used_memory"])
            b.config_set("maxmemory", str(used + 1_000_000))  # the target runs out during the copy: OOM

        with pytest.raises(MigrationError, match="MIGRATE to b"):
            await migrate_slots(s.map(), range(100, 200), "b", file_publisher(s.path))
        assert s.map().epoch == 1
        for slot in {slot_of(r) for r in recipients}:
            assert s.state("a", slot) is None  # serving again
            assert (s.state("b", slot) or "").startswith("moved a ")
            assert s.slot_keys("b", slot) == []
        store = ShardStore("a", s.servers["a"].url, QueueLimits())
        await store.start()
        try:
            out = await store.enqueue(
                K.queue_keys(recipients[0], b""),
                EnqueueRequest(recipients[0], b"", b"after"),
                int(time.time() * 1000),
            )
            assert out.kind == "stored"
            assert out.seq == 6
        finally:
            await store.close()
        with s.r("b") as b:
            b.config_set("maxmemory", "0")
        report = await migrate_slots(s.map(), range(100, 200), "b", file_publisher(s.path))
        assert report.slots_moved == 100
    finally:
        s.stop()


async def test_password_protected_shards(tmp_path: Path) -> None:
    s = Shards(tmp_path, ("a", "b"), password="s3cr3t-pw").start()
    try:
        recipients = await _fill(s, 5, 2, (5000, 5100))
        slots = sorted({slot_of(r) for r in recipients})
        report = await migrate_slots(s.map(), slots, "b", file_publisher(s.path))  # MIGRATE ... AUTH
        assert report.slots_moved == len(slots)
        assert all(s.slot_keys("b", slot) for slot in slots)
        # credentials given apart from the map (the operator's Secret), the map holding none
        bare = {n: f"redis://127.0.0.1:{srv.port}/0" for n, srv in s.servers.items()}
        m = s.map()
        write_map_file(s.path, ShardMap(m.fleet, m.epoch, bare, m.ranges))
        with pytest.raises(MigrationError, match=r"shard \w \(127\.0\.0\.1:\d+\)"):
            await migrate_slots(s.map(), slots, "a", file_publisher(s.path))
        report = await migrate_slots(
            s.map(),
            slots,
            "a",
            file_publisher(s.path),
            redis_urls={n: srv.url for n, srv in s.servers.items()},
        )
        assert report.slots_moved == len(slots)
    finally:
        s.stop()


async def test_bad_requests_are_clear(shards: Shards) -> None:
    m = shards.map()
    with pytest.raises(MigrationError, match="unknown target shard 'x'"):
        await migrate_slots(m, [1], "x", file_publisher(shards.path))
    with pytest.raises(MigrationError, match="no slots"):
        await migrate_slots(m, [], "b", file_publisher(shards.path))
    with pytest.raises(MigrationError, match="within 0-16383"):
        await migrate_slots(m, [SLOT_COUNT], "b", file_publisher(shards.path))
    unix = ShardMap(m.fleet, m.epoch, {**m.shards, "u": "unix:///tmp/redis.sock"}, m.ranges)
    with pytest.raises(MigrationError, match="MIGRATE needs a redis://host:port URL"):
        await migrate_slots(unix, [1], "u", file_publisher(shards.path))
    # someone else changed the file meanwhile: refused, not overwritten
    write_map_file(shards.path, m.with_slots([9], "c"))
    with pytest.raises(MigrationError, match="changed during the migration"):
        await migrate_slots(m, [1], "b", file_publisher(shards.path))
