"""Fault: `relayfleet migrate` SIGKILLed at random moments under load, then rerun.

tests/relay/fleet/test_migration_crash.py kills the migrator at each named step (a test hook);
this one kills the real process with SIGKILL after a random delay, wherever it is
(mid-MIGRATE chunk, between fence and listing, mid-publish...; half the rounds count
the delay from the moment the source is fenced), then runs it again to
completion. Each time: the rerun finishes the move, and at the end the recorded
history holds every guarantee and no shard keeps stray keys or fences.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from relay.storage import keys as K
from tests.support.faults import report
from tests.support.fleet_harness import FleetProcs, final_placement_problems, fleet_procs
from tests.support.migration_crash import (
    HI,
    LO,
    check_fillers,
    migrate,
    migrate_argv,
    migrate_env,
    moving_workload,
    post_fillers,
)

pytestmark = [pytest.mark.faults]


def _killed_after(fleet: FleetProcs, to: str, delay: float, src: str | None = None) -> bool:
    """Start a migration, SIGKILL it `delay` s after it starts (or, with `src`, after it
    has fenced the source); True if it was still running when killed."""
    proc = subprocess.Popen(
        migrate_argv(fleet, to), env=migrate_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    if src is not None:  # wait for the fence: from here on every moment is mid-protocol
        client = redis.Redis.from_url(fleet.servers[src].url)
        try:
            while proc.poll() is None and client.get(K.slot_state(LO)) is None:
                time.sleep(0.002)
        finally:
            client.close()
    try:
        proc.wait(delay)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return True


def _complete(fleet: FleetProcs, to: str) -> float:
    t0 = time.monotonic()
    done = migrate(fleet, to)
    assert done.returncode == 0, done.stderr[-2000:]
    return time.monotonic() - t0


async def _run(tmp_path: Path, rounds: int, seed: int) -> None:
    rnd = random.Random(seed)
    with fleet_procs(tmp_path, shards=2, relays=2, all_on_first=True) as fleet:
        fillers = await post_fillers(fleet)
        work = moving_workload(fleet, seed)
        src, tgt = "a", "b"
        killed = 0
        delays: list[float] = []
        async with work.running():
            full = await asyncio.to_thread(_complete, fleet, tgt)  # one clean move: how long one takes
            src, tgt = tgt, src
            for n in range(rounds):
                await asyncio.sleep(0.3)
                # odd rounds: any moment of the run (start-up included); even rounds: a
                # moment after the fence, when the protocol is under way
                after_fence = n % 2 == 0
                delay = rnd.uniform(0.0, 0.08) if after_fence else rnd.uniform(0.2, full)
                delays.append(round(delay, 3))
                killed += await asyncio.to_thread(
                    _killed_after, fleet, tgt, delay, src if after_fence else None
                )
                await asyncio.sleep(0.3)  # traffic meets whatever half-done state is left
                await asyncio.to_thread(_complete, fleet, tgt)
                assert fleet.shard_map().shard_for_slot(LO) == tgt
                src, tgt = tgt, src
        verdict = work.verdict(tmp_path)
        report(
            "migration-sigkill-random",
            verdict,
            rounds=rounds,
            killed_mid_run=killed,
            clean_run_s=round(full, 2),
            kill_delays_s=delays,
        )
        assert verdict.ok, f"{verdict.render()}\n{fleet.relay_logs()}"
        assert killed >= 2, f"only {killed} of {rounds} kills landed mid-run"
        assert not await final_placement_problems(fleet, list(range(LO, HI + 1)))
        await check_fillers(fleet, fillers)


@pytest.mark.timeout(400)
async def test_migration_sigkilled_at_random_points_under_load(tmp_path: Path) -> None:
    await _run(tmp_path, rounds=5, seed=int(os.environ.get("RELAY_FAULTS_SEED", "17")))


@pytest.mark.soak
@pytest.mark.timeout(7200)
async def test_migration_sigkilled_soak(tmp_path: Path, soak_seconds: float) -> None:
    await _run(tmp_path, rounds=max(5, int(soak_seconds / 10)), seed=int(time.time()))
