"""Faults on real Pods, each under the recording workload with the history checker clean.

One fleet: shard `h`, replicated (two Redis replicas, writes wait for one: minReplicas 1, three
Sentinels), two relays behind the fleet Service. In order, each with a fresh workload:

1. SIGKILL of a relay container (from the node): the kubelet restarts it.
2. The Redis primary Pod deleted: the Sentinels fail over, the relays find the new primary
   through the Sentinels' DNS names.
3. The primary cut off from its Sentinels and relays for 30 s (iptables DROP in its network
   namespace): a failover happens behind it; with minReplicas 1 nothing acknowledged is lost.
4. `kubectl rollout restart` of the relays while long-polls and live sockets are open: sockets
   close with 1001, clients reopen them, nothing lost.

What clients saw in each fault's window (requests, failures by status, enqueue p50/p99/max) is
printed as `e2e fault figures` and kept in FIGURES.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e.env import Env
from e2e.node_faults import partitioned, sigkill_container
from e2e.probes import http_get, phase, primary_pod, relay_url, shard, wait_for
from e2e.workload import Workload, window_figures

SHARD = "h"
RELAYS = f"relayfleet-{SHARD}-relay"
FIGURES: dict[str, dict[str, Any]] = {}
# Steps wait for real Pods: volumes bound, images started, failovers (each wait bounded itself).
pytestmark = pytest.mark.timeout(600)
PARTITION_S = 30.0
GOING_AWAY = 1001


@pytest.fixture(scope="module", autouse=True)
def _print_figures() -> Iterator[None]:
    yield
    print(f"e2e fault figures: {json.dumps(FIGURES)}")


def relay_pods(e2e: Env) -> list[dict[str, Any]]:
    return e2e.pods(f"relayfleet.dev/shard={SHARD},app.kubernetes.io/component=relay")


def redis_pods(e2e: Env) -> list[dict[str, Any]]:
    return e2e.pods(f"relayfleet.dev/shard={SHARD},app.kubernetes.io/component=redis")


def ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or ()
    return pod["metadata"].get("deletionTimestamp") is None and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conds
    )


def replicas_online(e2e: Env) -> int:
    """Replicas the primary reports online (status.redis, as the operator read it)."""
    obj: Any = e2e.get("rshard", SHARD)
    redis = ((obj or {}).get("status") or {}).get("redis") or {}
    return len([r for r in redis.get("replicas") or () if r.get("state") == "online"])


def fleet_whole(e2e: Env) -> bool:
    """Shard Ready, every Redis Pod and both relays ready, the primary with both replicas online."""
    return (
        phase(e2e, "rshard", SHARD) == "Ready"
        and len([p for p in redis_pods(e2e) if ready(p)]) == 3
        and len([p for p in relay_pods(e2e) if ready(p)]) == 2
        and replicas_online(e2e) == 2
    )


def under_workload(e2e: Env, name: str, fault: Callable[[], None], live: int = 0) -> Workload:
    """A fresh workload; `fault` runs once it stores, and returns once the fleet is whole again;
    messages must flow afterwards; the history must be clean (a request whose relay died
    mid-answer is allowed no answer; what it did is still checked)."""
    work = Workload(lambda: relay_url(e2e), live=live, seed=len(FIGURES) + 1).start()
    try:
        wait_for(f"{name}: messages stored before", lambda: work.stored >= 20, timeout=60)
        start = time.monotonic()
        fault()
        end = time.monotonic()
        mark = work.stored
        wait_for(f"{name}: messages stored after", lambda: work.stored >= mark + 20, timeout=90)
    finally:
        work.stop(timeout=120)
    work.history.save(str(e2e.workdir / f"history-{name}.jsonl"))
    verdict = work.history.check(allow_unanswered=True)
    FIGURES[name] = {
        "stored": work.stored,
        "verdict": "ok" if verdict.ok else verdict.by_kind(),
        "unanswered": verdict.counts.get("unanswered", 0),
        "not_sent_no_endpoint": work.connect_failures,
        "window": window_figures(work.history, start, end),
        "live_closes": [code for _, code in work.closes],
    }
    print(f"{name}: {json.dumps(FIGURES[name])}")
    assert verdict.counts.get("messages_delivered", 0) >= work.stored
    assert verdict.ok, verdict.render()
    return work


def test_replicated_shard_serves(e2e: Env) -> None:
    t0 = time.monotonic()
    e2e.kubectl("apply", "-f", "-", input=shard(SHARD, ha=True, replicas=2))
    wait_for("replicated shard h whole", lambda: fleet_whole(e2e), timeout=300, interval=2)
    wait_for("fleet service answers /readyz", lambda: http_get(relay_url(e2e) + "/readyz")[0] == 200)
    FIGURES["ready"] = {"seconds": round(time.monotonic() - t0, 1)}


def test_relay_container_sigkilled(e2e: Env) -> None:
    victim = relay_pods(e2e)[0]
    restarts = victim["status"]["containerStatuses"][0].get("restartCount", 0)

    def fault() -> None:
        sigkill_container(victim, "relay")

        def restarted() -> bool:
            pod: Any = e2e.get("pod", victim["metadata"]["name"])
            return bool(pod) and pod["status"]["containerStatuses"][0].get("restartCount", 0) > restarts

        wait_for("killed relay restarted by the kubelet", restarted, timeout=120)
        wait_for("fleet whole after the kill", lambda: fleet_whole(e2e), timeout=120)

    under_workload(e2e, "relay SIGKILL", fault)


def _new_primary(e2e: Env, old: str) -> Callable[[], bool]:
    def moved() -> bool:
        with contextlib.suppress(LookupError):
            return primary_pod(e2e, SHARD) != old
        return False

    return moved


def test_redis_primary_pod_deleted(e2e: Env) -> None:
    old = primary_pod(e2e, SHARD)

    def fault() -> None:
        e2e.kubectl("delete", "pod", old, "--wait=false")
        wait_for("a replica promoted by the Sentinels", _new_primary(e2e, old), timeout=120)
        wait_for("fleet whole after the failover", lambda: fleet_whole(e2e), timeout=180, interval=1)

    under_workload(e2e, "primary pod deleted", fault)


def test_primary_partitioned_from_sentinels_and_relays(e2e: Env) -> None:
    old = primary_pod(e2e, SHARD)
    pod = e2e.get("pod", old)
    assert pod is not None
    sentinels = e2e.pods(f"relayfleet.dev/shard={SHARD},app.kubernetes.io/component=sentinel")
    peers = [p["status"]["podIP"] for p in [*sentinels, *relay_pods(e2e)]]
    assert len(peers) == 5

    def fault() -> None:
        with partitioned(pod, "redis", peers):
            time.sleep(PARTITION_S)
            FIGURES["partition"] = {"primary during": primary_pod(e2e, SHARD), "before": old}
        wait_for("fleet whole after the partition", lambda: fleet_whole(e2e), timeout=180, interval=1)

    under_workload(e2e, "primary partitioned 30 s", fault)


def test_rollout_restart_with_open_long_polls_and_live_sockets(e2e: Env) -> None:
    before = {p["metadata"]["name"] for p in relay_pods(e2e)}

    def fault() -> None:
        e2e.kubectl("rollout", "restart", f"deployment/{RELAYS}")
        e2e.kubectl("rollout", "status", f"deployment/{RELAYS}", "--timeout=180s", timeout=200)
        wait_for("old relays gone", lambda: not before & {p["metadata"]["name"] for p in relay_pods(e2e)})
        wait_for("fleet whole after the restart", lambda: fleet_whole(e2e), timeout=120)

    work = under_workload(e2e, "rollout restart", fault, live=3)
    codes = [code for _, code in work.closes]
    assert codes, "no live socket was closed by the restart"
    assert set(codes) == {GOING_AWAY}, codes
    unanswered_reads = [e for e in work.history.events if e["op"] == "deliver" and e["status"] == 0]
    assert not unanswered_reads, f"{len(unanswered_reads)} long-polls cut without an answer"
