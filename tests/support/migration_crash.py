"""Crashing `relayfleet migrate` at a step: the CLI's argv and crash env, filler queues in the
moving range, and a workload whose queues live there
(tests/relay/fleet/test_migration_crash.py, tests/relay/fleet/test_faults_migration.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import aiohttp

from relay.fleet.migration.crash_points import CRASH_ENV
from relay.fleet.sharding import slot_of
from tests.support.fleet_harness import FleetProcs, QueueSpec, Workload, b64

LO, HI = 1000, 1199  # the slot range that moves; one batch, so every crash hits it whole
FILLERS = 300  # queues holding one message each: enough keys for several MIGRATE chunks


def queues_in_range(n: int, seed: int, prefix: str) -> list[QueueSpec]:
    rnd = random.Random(seed)
    out: list[QueueSpec] = []
    while len(out) < n:
        recipient = rnd.randbytes(32)
        if LO <= slot_of(recipient) <= HI:
            out.append(
                QueueSpec(f"{prefix}{len(out):03d}", recipient, b"", "read" if len(out) % 3 else "drain")
            )
    return out


# `relayfleet ARGS` with this interpreter: relay.cli has no __main__ block, `python -m relay` runs `relay`
CLI = (sys.executable, "-c", "import sys; from relay.cli import main; sys.exit(main(sys.argv[1:]))")


def migrate_argv(fleet: FleetProcs, to: str) -> list[str]:
    """`relayfleet migrate` of the slots LO-HI to shard `to`."""
    return [*CLI, "migrate", "--shard-map", fleet.map_path, "--slots", f"{LO}-{HI}", "--to", to]


def migrate_env(crash_at: str | None = None) -> dict[str, str]:
    """This environment, the crash hook set to `crash_at` or left out."""
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    if crash_at:
        env[CRASH_ENV] = crash_at
    return env


def migrate(fleet: FleetProcs, to: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        migrate_argv(fleet, to),
        env=migrate_env(crash_at),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


FILLER = "{} filler"  # a filler queue's one message, by queue name


async def post_fillers(fleet: FleetProcs) -> list[QueueSpec]:
    """FILLERS queues in LO-HI holding one message each, posted through the first relay."""
    fillers = queues_in_range(FILLERS, seed=1, prefix="f")
    async with aiohttp.ClientSession() as http:
        for q in fillers:
            async with http.post(
                fleet.urls[0] + q.path("messages"),
                data=FILLER.format(q.name).encode(),
                headers={"Idempotency-Key": q.name},
            ) as resp:
                assert resp.status == 201
    return fillers


async def check_fillers(fleet: FleetProcs, fillers: list[QueueSpec]) -> None:
    """Every filler message is still there, exactly once, with its seq and payload."""
    async with aiohttp.ClientSession() as http:
        for q in fillers:
            async with http.get(fleet.urls[0] + q.path("messages")) as resp:
                doc = await resp.json()
            assert [m["seq"] for m in doc["messages"]] == [1], q.name
            assert doc["messages"][0]["payload"] == b64(FILLER.format(q.name).encode())


def moving_workload(fleet: FleetProcs, seed: int) -> Workload:
    """Traffic on 8 queues in LO-HI, the range the tests move."""
    return Workload(
        fleet.urls, queues_in_range(8, seed=2, prefix="q"), producers=4, seed=seed, max_wait_s=2.0
    )
