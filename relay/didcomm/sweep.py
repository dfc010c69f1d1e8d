"""The periodic sweep of the mediator's expired records (docs/design-decisions.md,
"Sweeping expired mediator records").

An expired record reads as absent at once (dc_get.lua), and the mediator's writes to a slot
remove up to 16 of its expired records; this loop removes the rest without any write to their
slot. Every RELAY_DIDCOMM_SWEEP_INTERVAL_S each relay with the mediator on tries to take each
shard's sweep lease (keys.SHARD_DIDCOMM_SWEEP_LEASE, 0.9 of an interval long); the one that
takes it runs lua/dc_expire.lua over the slots the map gives that shard, SLOTS a call on the
store's bulk lane, at most BUDGET records removed a call. A slot with 100,000 expired records
takes ~780 calls of ~0.5 ms of Redis each (~0.8 s in all), an empty shard of 16,384 slots 512
calls of ~0.2-0.3 ms; the loop and Redis serve others between two calls. So a fleet of N
relays sweeps each shard about once an interval, not N times, and an expired record is gone
from Redis at most two intervals after its expiry. Migrating, importing and moved slots are
skipped by the script (fence), as the other maintenance does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

from relay import metrics
from relay.fleet.rounds import every
from relay.fleet.routing import ShardRouter
from relay.storage import keys as K
from relay.storage.store import ShardStore, StoreRejected, StoreUnavailable

log = logging.getLogger("relay.didcomm.sweep")

# Slots a dc_expire.lua call (as the load sweep's LOAD_SLOTS): an empty slot costs a GET and a
# ZRANGEBYSCORE on a missing key.
SLOTS = 32
# Records removed a call at most (two hash fields and a zset member each): ~0.5 ms of Redis.
BUDGET = 128


@dataclass(frozen=True, slots=True)
class SweepRound:
    removed: int = 0
    calls: int = 0
    fenced: int = 0


async def sweep_slots(store: ShardStore, slots: list[int], now_ms: int, budget: int = BUDGET) -> SweepRound:
    """Remove every record of these slots whose idle expiry passed by `now_ms`, `budget` at most
    a call; slots this shard does not own right now (migrating, importing, moved) are skipped."""
    removed = calls = fenced = 0
    budget = max(1, budget)
    for i in range(0, len(slots), SLOTS):
        chunk = slots[i : i + SLOTS]
        while chunk:
            gone, resume, skipped = await store.record_expire(chunk, now_ms, budget)
            calls += 1
            removed += gone
            fenced += skipped
            if gone:
                metrics.DIDCOMM_RECORDS_EXPIRED.inc(gone)
            chunk = chunk[resume - 1 :] if resume else []
    return SweepRound(removed, calls, fenced)


class RecordSweep:
    """The background loop of one relay process (started with the mediator)."""

    def __init__(self, fleet: ShardRouter, interval_s: float) -> None:
        self.fleet = fleet
        self.interval_s = interval_s
        self.lease_ms = max(1, int(900 * interval_s))
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.rounds = 0  # completed rounds (tests wait on it)
        self.swept = 0  # shard sweeps this relay ran (it held the lease)

    async def run(self) -> None:
        await every(self.interval_s, self.tick, "DIDComm record sweep", wait_first=True)

    async def tick(self) -> None:
        stores = dict(self.fleet.stores)
        await asyncio.gather(*(self._sweep(name, store) for name, store in stores.items()))
        self.rounds += 1

    async def _sweep(self, name: str, store: ShardStore) -> None:
        try:
            if not await store.take_lease(K.SHARD_DIDCOMM_SWEEP_LEASE, self.holder, self.lease_ms):
                return  # another relay sweeps this shard this round
            self.swept += 1
            await sweep_slots(store, self.fleet.map.slots_of(name), int(time.time() * 1000))
        except (OSError, StoreUnavailable, StoreRejected) as exc:
            log.warning("shard %s: DIDComm record sweep failed: %s", name, type(exc).__name__)
