"""Fleet-wide presence and live displacement across two relay processes on two Redis shards.

- status.live_delivery through either relay while a live socket is open on the other; false
  again after the socket closes, and after its relay is SIGKILLed (its lease lapses); the lease
  moves with its slot when the slot migrates to the other shard;
- a socket on one relay displaced (4409) by a socket on the other, 20 times under load:
  1,000 messages under the history checker, none lost, none delivered to a displaced socket
  after the newer socket's first delivery (the checker's ``displaced`` kind).

Figures (time to 4409, the status flips) are printed for the report (pytest -s).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from relay.fleet.migration import file_publisher, migrate_slots
from relay.fleet.sharding import slot_of
from relay.storage import keys as K
from tests.support.fleet_harness import FleetProcs, stop_relays
from tests.support.live_displacement import (
    LiveQueue,
    displace_under_load,
    live_delivery,
    open_live,
    scrape,
    session,
    until_live,
)

TTL_S = 3.0  # RELAY_PRESENCE_TTL_S of these relays: a killed relay's lease lapses within it


@contextlib.contextmanager
def _fleet(tmp_path: Path) -> Iterator[FleetProcs]:
    """Two relays on two shards, with the short presence TTL."""
    fleet = FleetProcs(tmp_path, shards=2, relays=2).start(env={"RELAY_PRESENCE_TTL_S": str(TTL_S)})
    try:
        yield fleet
    finally:
        fleet.stop()


async def test_status_is_fleet_wide_moves_with_its_slot_and_lapses_when_the_holder_dies(
    tmp_path: Path,
) -> None:
    with _fleet(tmp_path) as fleet:
        a, b = fleet.urls
        q = LiveQueue()
        async with session() as http:
            assert not await live_delivery(http, a, q)
            for here, there in ((a, b), (b, a)):
                ws = await open_live(http, here, q)
                on = await until_live(http, there, q, True, 5)  # the lease is taken before "empty"
                assert await live_delivery(http, here, q)
                # the relay's figures: the lease it holds, its take, the other's answer
                assert (await scrape(http, here, "relayfleet_presence_leases"))[("live",)] == 1
                assert (await scrape(http, here, "relayfleet_presence_writes_total"))[("take", "ok")] >= 1
                assert (await scrape(http, there, "relayfleet_presence_checks_total"))[("live",)] >= 1
                await ws.close()
                off = await until_live(http, there, q, False, 5)
                print(f"presence: socket on one relay, status via the other: true after {on:.3f}s, "
                      f"false {off:.3f}s after the close")  # fmt: skip
                assert off < 1.0, off  # the close drops the lease: no wait for its expiry
            await _lease_moves_with_its_slot(fleet, http, q)
            ws = await open_live(http, b, q)
            assert await live_delivery(http, a, q)
            stop_relays([fleet.relays[1]], signal.SIGKILL)
            lapsed = await until_live(http, a, q, False, TTL_S + 5)
            print(f"presence: the holder's relay SIGKILLed, status via the other false after "
                  f"{lapsed:.3f}s (TTL {TTL_S}s)")  # fmt: skip
            assert lapsed <= TTL_S + 1.0
            await ws.close()


async def _lease_moves_with_its_slot(fleet: FleetProcs, http: aiohttp.ClientSession, q: LiveQueue) -> None:
    """A socket open while its queue's slot moves to the other shard: the migration copies the
    slot's presence hash, the source keeps none, status stays true, the close lands on the target."""
    a, b = fleet.urls
    slot = slot_of(q.keys.public, b"")
    source = fleet.shard_map().shard_for_slot(slot)
    target = next(n for n in fleet.servers if n != source)
    key = K.slot_presence(slot)
    field = f"l|{K.queue_id(q.keys.public, b'')}"
    ws = await open_live(http, a, q)
    src = redis.Redis.from_url(fleet.servers[source].url)
    dst = redis.Redis.from_url(fleet.servers[target].url)
    try:
        assert src.hexists(key, field)
        await migrate_slots(fleet.shard_map(), [slot], target, file_publisher(fleet.map_path))
        assert dst.hexists(key, field)  # copied with the slot, its expiry with it
        assert 0 < dst.pttl(key) <= TTL_S * 1000
        assert not src.exists(key)
        assert await live_delivery(http, b, q)
        await ws.close()
        await until_live(http, b, q, False, 5)
        assert not dst.hexists(key, field)  # the drop followed the slot
    finally:
        src.close()
        dst.close()


@pytest.mark.serial  # the displaced check compares arrival times on two sockets: a quiet client
async def test_displacement_across_relays_under_load_keeps_the_history(tmp_path: Path) -> None:
    with _fleet(tmp_path) as fleet:
        run = await displace_under_load(fleet.urls, cycles=20, total=1000)
        async with session() as http:
            displaced = [await scrape(http, u, "relayfleet_live_displaced_total") for u in fleet.urls]
            waits = [await scrape(http, u, "relayfleet_live_takeover_wait_seconds_count") for u in fleet.urls]
    # every takeover crossed relays: learnt from the notice (or a renewal), waited for a release
    assert sum(d.get(("notice",), 0) + d.get(("lease",), 0) for d in displaced) == 20, displaced
    assert sum(w[()] for w in waits) >= 20, waits
    run.history.save(str(tmp_path / "history.jsonl"))
    verdict = run.verdict()
    print(f"displacement across two relays: {run.figures()}; {verdict.render()}")
    assert verdict.ok, verdict.render()
    assert verdict.counts["messages_acknowledged"] == 1000
    assert run.closes == [4409] * 20
