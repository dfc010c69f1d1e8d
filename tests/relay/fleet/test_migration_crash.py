"""Crash test: `relayfleet migrate` killed at each step of the protocol in turn, then run
again, while traffic continues through a relay process. Every rerun must complete the
move, the history must hold every guarantee, and nothing may be left behind.

The kill is the test hook RELAYFLEET_MIGRATION_CRASH_AT=<step> (the process calls
os._exit at that point, as abrupt as SIGKILL: no cleanup, no finally).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from relay.fleet.migration.crash_points import CRASH_EXIT, STEPS
from relay.storage import keys as K
from tests.support.fleet_harness import (
    FleetProcs,
    final_placement_problems,
    fleet_procs,
    retries,
)
from tests.support.migration_crash import (
    CLI,
    HI,
    LO,
    check_fillers,
    migrate,
    moving_workload,
    post_fillers,
)


async def _states(fleet: FleetProcs, slot: int) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, server in fleet.servers.items():
        client = aioredis.Redis.from_url(server.url)
        try:
            raw = await client.get(K.slot_state(slot))
            out[name] = raw.decode() if isinstance(raw, bytes) else raw
        finally:
            await client.aclose()
    return out


def _shape(states: dict[str, str | None], src: str, tgt: str) -> tuple[str, str]:
    """States as the crash-resume table in docs/migration.md writes them."""

    def short(v: str | None) -> str:
        if v is None:
            return "owned"
        return "moved" if v.startswith("moved ") else v

    return short(states[src]), short(states[tgt])


# What each crash leaves on (source, target), and whether the map already names the target.
EXPECTED = {
    "fenced": (("migrating", "importing"), False),
    "mid-copy": (("migrating", "importing"), False),
    "copied": (("migrating", "importing"), False),
    "mid-flip": (("moved", "importing"), False),
    "flipped": (("moved", "owned"), False),
    "published": (("moved", "owned"), True),
    "woken": (("moved", "owned"), True),
    "mid-cleanup": (("moved", "owned"), True),
}


@pytest.mark.timeout(600)
async def test_migration_killed_at_every_step_resumes_and_loses_nothing(tmp_path: Path) -> None:
    assert set(EXPECTED) == set(STEPS)
    with fleet_procs(tmp_path, shards=2, relays=1, all_on_first=True) as fleet:
        fillers = await post_fillers(fleet)
        work = moving_workload(fleet, seed=3)
        src, tgt = "a", "b"
        async with work.running():
            for step in STEPS:
                await asyncio.sleep(0.5)
                crashed = await asyncio.to_thread(migrate, fleet, tgt, step)
                assert crashed.returncode == CRASH_EXIT, f"{step}: {crashed.stderr[-2000:]}"
                shape, published = EXPECTED[step]
                assert _shape(await _states(fleet, LO), src, tgt) == shape, step
                assert (fleet.shard_map().shard_for_slot(LO) == tgt) is published, step
                await asyncio.sleep(0.3)  # traffic meets the half-done state
                rerun = await asyncio.to_thread(migrate, fleet, tgt)
                assert rerun.returncode == 0, f"{step}: rerun failed: {rerun.stderr[-2000:]}"
                m = re.search(r"already there: (\d+), resumed from an earlier run: (\d+)", rerun.stdout)
                assert m is not None, rerun.stdout
                already, resumed = int(m[1]), int(m[2])
                if published:  # only slots that still have keys on the source are left to do
                    assert already + resumed == HI - LO + 1, rerun.stdout
                    assert resumed > 0, rerun.stdout
                else:
                    assert resumed == HI - LO + 1, rerun.stdout
                assert fleet.shard_map().shard_for_slot(HI) == tgt
                assert _shape(await _states(fleet, LO), src, tgt) == ("moved", "owned")
                src, tgt = tgt, src
        retried = retries(fleet)
        assert retried.get("migrating", 0) > 0, retried
        assert retried.get("moved", 0) > 0, retried
        verdict = work.verdict(tmp_path)
        assert verdict.ok, f"{verdict.render()}\n{fleet.relay_logs()}"
        assert verdict.counts["messages_acknowledged"] > 100
        assert not await final_placement_problems(fleet, list(range(LO, HI + 1)))
        await check_fillers(fleet, fillers)


async def test_migrate_cli_rejects_bad_arguments(tmp_path: Path) -> None:
    with fleet_procs(tmp_path, shards=2, relays=0) as fleet:

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*CLI, "migrate", *args], capture_output=True, text=True, timeout=60, check=False
            )

        bad = run("--shard-map", fleet.map_path, "--slots", "9-3", "--to", "b")
        assert bad.returncode == 2
        assert "bad slot range" in bad.stderr
        assert "Traceback" not in bad.stderr
        bad = run("--shard-map", fleet.map_path, "--slots", "1-3", "--to", "zz")
        assert bad.returncode == 2
        assert "unknown target shard 'zz'" in bad.stderr
        bad = run("--shard-map", str(tmp_path / "nope.json"), "--slots", "1-3", "--to", "b")
        assert bad.returncode == 2
        assert "cannot read shard map" in bad.stderr
        ok = run("--shard-map", fleet.map_path, "--slots", "0-99", "--to", "b")
        assert ok.returncode == 0, ok.stderr
        assert "migrated 100 slot(s) to b" in ok.stdout
        assert "100/100 slots" in ok.stderr  # the progress bar
        again = run("--shard-map", fleet.map_path, "--slots", "0-99", "--to", "b")
        assert again.returncode == 0
        assert "migrated 0 slot(s)" in again.stdout
        assert "already there: 100" in again.stdout
        # a shard that does not answer: a clear failure, exit 1, no traceback
        fleet.servers["b"].stop()
        down = run("--shard-map", fleet.map_path, "--slots", "5000-5001", "--to", "b")
        assert down.returncode == 1
        assert "shard b" in down.stderr
        assert "Traceback" not in down.stderr
