"""A recipient's quota record lives in its home slot (the slot of its default channel) and
moves with it: after the home slot migrates, the channel cap and the held counters are the
same on the new shard (docs/design-decisions.md, "Per-recipient quotas")."""

from __future__ import annotations

from pathlib import Path

import redis
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.migration import file_publisher, migrate_slots, write_map_file
from relay.fleet.routing import ShardRouter, file_source, load_file
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange, slot_of
from relay.service import QueueService
from relay.settings import Settings
from relay.storage import keys as K
from relay.storage.limits import QueueLimits
from relay.storage.store import EnqueueRequest

RCPT = b"\x42" * 32


async def test_the_home_record_moves_with_its_slot(two_redis: dict[str, LocalRedis], tmp_path: Path) -> None:
    path = str(tmp_path / "map.json")
    write_map_file(
        path, ShardMap("t", 1, {n: s.url for n, s in two_redis.items()}, (SlotRange(0, SLOT_COUNT - 1, "a"),))
    )
    settings = Settings(auth="none", limits=QueueLimits(recipient_max_channels=2, recipient_max_messages=5))
    fleet = ShardRouter(load_file(path), settings.limits)
    await fleet.start(file_source(path), poll_s=3600)  # only a MOVED reply makes it reload
    service = QueueService(fleet, settings)
    try:
        for channel in (b"A", b"B", b"B"):
            assert (await service.enqueue(EnqueueRequest(RCPT, channel, b"m"))).kind == "stored"
        home = slot_of(RCPT, b"")
        report = await migrate_slots(load_file(path), [home], "b", file_publisher(path))
        assert report.slots_moved == 1
        ra, rb = (redis.Redis.from_url(two_redis[n].url) for n in ("a", "b"))
        assert not ra.exists(K.slot_recipients(home))
        field = K.recipient_field(RCPT)
        assert rb.hget(K.slot_recipients(home), field + "n") == b"3"
        # the same caps on the new shard: a third channel is refused, two more messages fit
        assert (await service.enqueue(EnqueueRequest(RCPT, b"C", b"m"))).reason == "channels"
        assert (await service.enqueue(EnqueueRequest(RCPT, b"A", b"m"))).kind == "stored"
        assert (await service.enqueue(EnqueueRequest(RCPT, b"", b"m"))).kind == "stored"
        full = await service.enqueue(EnqueueRequest(RCPT, b"A", b"m"))
        assert (full.kind, full.reason) == ("full", "recipient messages")
        listed = await service.channels(RCPT)
        assert [(ch, st.count) for ch, st in listed] == [(b"", 1), (b"A", 2), (b"B", 2)]
    finally:
        await fleet.close()
