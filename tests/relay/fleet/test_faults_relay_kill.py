"""Fault: relay processes SIGKILLed and restarted (same port) under load.

Clients retry every unanswered or 503 request; enqueues reuse their Idempotency-Key.
Shows: no acknowledged message is lost, retries are stored once (200, same seq),
read+ack delivery stays in order with no re-delivery after an ack. Requests that were
in flight on the killed process get no answer (allowed, counted); queues here use
read+ack, since a drain whose answer dies with the process has removed its messages
(drain is at-most-once across a lost response: see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import pytest

from tests.support.faults import report
from tests.support.fleet_harness import (
    FleetProcs,
    Workload,
    fleet_procs,
    make_queues,
    stop_relays,
    wait_ready,
)

pytestmark = [pytest.mark.faults]


def _restart(fleet: FleetProcs, i: int) -> float:
    """SIGKILL relay i, start it again on its port; seconds until it is ready."""
    stop_relays([fleet.relays[i]], signal.SIGKILL)
    t0 = time.monotonic()
    fleet.relays[i] = fleet.start_relay(port=fleet.relays[i].port)
    wait_ready(fleet.relays[i])
    return time.monotonic() - t0


async def _run(tmp_path: Path, seconds: float, kills: int) -> None:
    with fleet_procs(tmp_path, shards=2, relays=2) as fleet:
        work = Workload(
            fleet.urls, make_queues(8, seed=21, drain_share=0.0), producers=4, seed=9, max_wait_s=2.0
        )
        rnd = random.Random(4)
        restarts: list[float] = []
        async with work.running():
            for _ in range(kills):
                await asyncio.sleep(rnd.uniform(0.5, 2 * seconds / kills - 0.5))
                restarts.append(await asyncio.to_thread(_restart, fleet, rnd.randrange(len(fleet.relays))))
        verdict = work.verdict(tmp_path, allow_unanswered=True)
        report(
            "relay-sigkill",
            verdict,
            kills=len(restarts),
            restart_ready_s_max=round(max(restarts), 2),
            unanswered=verdict.counts.get("unanswered", 0),
            idempotent_retries=verdict.counts.get("idempotent_duplicates", 0),
        )
        assert verdict.ok, f"{verdict.render()}\n{fleet.relay_logs()}"
        assert verdict.counts["messages_acknowledged"] > 100


@pytest.mark.timeout(240)
async def test_relays_sigkilled_and_restarted_under_load(tmp_path: Path) -> None:
    await _run(tmp_path, seconds=12.0, kills=4)


@pytest.mark.soak
@pytest.mark.timeout(7200)
async def test_relays_sigkilled_soak(tmp_path: Path, soak_seconds: float) -> None:
    await _run(tmp_path, seconds=soak_seconds, kills=max(4, int(soak_seconds / 5)))
