"""The fleet harness (tests/support/fleet_harness.py) checked on its own: a workload
without migration gives a clean history, and the relays serve every shard."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.fleet_harness import FleetProcs, Workload, fleet_procs, make_queues


@pytest.fixture
async def small_fleet(tmp_path: Path) -> AsyncIterator[FleetProcs]:
    with fleet_procs(tmp_path, shards=2, relays=2) as fleet:
        yield fleet


async def test_workload_without_migration_gives_a_clean_history(small_fleet: FleetProcs) -> None:
    queues = make_queues(6, seed=3)
    work = Workload(small_fleet.urls, queues, producers=3, max_wait_s=1.0)
    await work.start()
    await work.until_stored(150)
    await work.stop()
    verdict = work.history.check()
    assert verdict.ok, verdict.render()
    assert verdict.counts["messages_acknowledged"] > 50
    assert verdict.counts["idempotent_duplicates"] >= 1


async def test_harness_relays_serve_every_shard(small_fleet: FleetProcs) -> None:
    shard_map = small_fleet.shard_map()
    owners = {shard_map.shard_for_slot(q.slot) for q in make_queues(20, seed=5)}
    assert owners == {"a", "b"}
    assert all(r.proc.poll() is None for r in small_fleet.relays)
