"""Fault: the operator SIGKILLed at random moments mid-rebalance, under live relay traffic.

tests/test_operator_k8s.py kills it at one fixed point (the migration library's
"mid-copy" hook); here the real process gets SIGKILL after random delays, again and
again, while relays that follow the operator's ConfigMap carry a recording workload.
Each restart must pick the rebalance up; at the end the slots are spread, the seeded
queues are intact and the traffic's history holds every guarantee.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.localredis import LocalRedis
from tests.k8s_cluster import KubeCluster
from tests.test_faults_support import report
from tests.test_migration_harness import Workload, make_queues
from tests.test_operator_k8s import (  # noqa: F401  (fixtures are used by name)
    Operator,
    _enqueue,
    _read,
    apply,
    external,
    get,
    history_intact,
    kwok_ns,
    operator,
    rebalance,
    rebalance_phase,
    recipients_on,
    redis_servers,
    shard_map,
    start_relay,
    wait_for,
)

pytestmark = [pytest.mark.faults, pytest.mark.k8s]


@pytest.mark.timeout(400)
async def test_operator_sigkilled_at_random_moments_mid_rebalance(
    kwok_cluster: KubeCluster,
    kwok_ns: str,  # noqa: F811
    operator: Operator,  # noqa: F811
    redis_servers: Callable[[], LocalRedis],  # noqa: F811
    tmp_path: Path,
) -> None:
    ns, rnd = kwok_ns, random.Random(23)
    servers = {"a": redis_servers(), "b": redis_servers(), "c": redis_servers()}
    recipients = recipients_on(range(16384), 40)
    await _enqueue(servers["a"].url, recipients, 3)
    expected = {r: await _read(servers["a"].url, r) for r in recipients}
    operator.start()
    apply(kwok_cluster, ns, external("a", servers["a"]))
    await asyncio.to_thread(
        wait_for, "a in the map", lambda: (m := shard_map(kwok_cluster, ns)) and "a" in m.shards
    )
    apply(kwok_cluster, ns, external("b", servers["b"]), external("c", servers["c"]))
    await asyncio.to_thread(
        wait_for,
        "b, c in the map",
        lambda: (m := shard_map(kwok_cluster, ns)) and {"b", "c"} <= set(m.shards),
    )
    relays = [
        await asyncio.to_thread(start_relay, kwok_cluster, ns, tmp_path / f"relay-{i}.log") for i in range(2)
    ]
    kills = 0
    t0 = time.monotonic()
    try:
        work = Workload([url for _, url in relays], make_queues(10, seed=31), producers=4, seed=31)
        await work.start()
        await asyncio.sleep(1.5)
        apply(kwok_cluster, ns, rebalance("spread", autoApprove=True))
        while rebalance_phase(kwok_cluster, ns, "spread") != "Ready" and time.monotonic() - t0 < 300:
            await asyncio.sleep(rnd.uniform(0.5, 3.0))
            if rebalance_phase(kwok_cluster, ns, "spread") == "Ready" or kills >= 4:
                break
            assert operator.proc is not None
            operator.proc.send_signal(signal.SIGKILL)
            operator.proc.wait(10)
            kills += 1
            operator.start()
        await asyncio.to_thread(
            wait_for,
            "the rebalance to finish",
            lambda: rebalance_phase(kwok_cluster, ns, "spread") == "Ready",
            240,
        )
        took = time.monotonic() - t0
        await asyncio.sleep(1.5)  # traffic on the final owners
        await work.stop()
        verdict = work.history.check()
        report("operator-sigkill-mid-rebalance", verdict, kills=kills, rebalance_s=round(took, 1))
        logs = "\n".join((tmp_path / f"relay-{i}.log").read_text(errors="replace")[-3000:] for i in range(2))
        assert verdict.ok, f"{verdict.render()}\n{logs}"
        assert kills >= 1
        assert sorted(shard_map(kwok_cluster, ns).slot_counts().values()) == [5461, 5461, 5462]
        await asyncio.to_thread(history_intact, kwok_cluster, ns, servers, expected)
    finally:
        for proc, _ in relays:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in relays:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
