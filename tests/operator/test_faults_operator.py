"""Fault: the operator SIGKILLed at random moments mid-rebalance, under live relay traffic.

tests/operator/test_operator_k8s.py kills it at one fixed point (the migration library's
"mid-copy" hook); here the real process gets SIGKILL after random delays, again and
again, while relays that follow the operator's ConfigMap carry a recording workload.
Each restart must pick the rebalance up; at the end the slots are spread, the seeded
queues are intact and the traffic's history holds every guarantee.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest

from tests.support.faults import report
from tests.support.fleet_harness import Workload, make_queues
from tests.support.operator_harness import (
    KwokFleet,
    rebalance,
    wait_for,
)

pytestmark = [pytest.mark.faults, pytest.mark.k8s]


@pytest.mark.timeout(400)
async def test_operator_sigkilled_at_random_moments_mid_rebalance(kwok_fleet: KwokFleet) -> None:
    fleet, operator, rnd = kwok_fleet, kwok_fleet.operator, random.Random(23)
    fleet.redis("a", "b", "c")
    expected = await asyncio.to_thread(fleet.seed, "a", 40, 3)
    operator.start()
    await asyncio.to_thread(fleet.found, fleet.external("a"), fleet.external("b"), fleet.external("c"))
    urls = await asyncio.to_thread(fleet.start_relays, 2)
    kills = 0
    t0 = time.monotonic()
    work = Workload(urls, make_queues(10, seed=31), producers=4, seed=31)
    await work.start()
    await work.until_stored(40)
    fleet.apply(rebalance("spread", autoApprove=True))
    while fleet.rebalance_phase("spread") != "Ready" and time.monotonic() - t0 < 300:
        await asyncio.sleep(rnd.uniform(0.5, 3.0))
        if fleet.rebalance_phase("spread") == "Ready" or kills >= 4:
            break
        assert operator.proc is not None
        operator.proc.send_signal(signal.SIGKILL)
        operator.proc.wait(10)
        kills += 1
        operator.start()
    await asyncio.to_thread(
        wait_for, "the rebalance to finish", lambda: fleet.rebalance_phase("spread") == "Ready", 240
    )
    took = time.monotonic() - t0
    await work.until_stored(40)  # traffic on the final owners
    await work.stop()
    verdict = work.history.check()
    report("operator-sigkill-mid-rebalance", verdict, kills=kills, rebalance_s=round(took, 1))
    assert verdict.ok, f"{verdict.render()}\n{fleet.relay_logs()}"
    assert kills >= 1
    assert sorted(fleet.shard_map().slot_counts().values()) == [5461, 5461, 5462]
    await asyncio.to_thread(fleet.history_intact, expected)
