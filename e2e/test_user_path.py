"""The user's path on a cluster: install the chart, create a fleet, use it, scale it, run the jobs.

One module, steps in order (each test builds on the previous one's cluster state). Shard `b`
is replicated (two Redis replicas, writes wait for one, three Sentinels). A recording workload
sends and reads messages through the fleet's Service from before the scale-out until after the
scale-in; the history checker then verifies every message it saw acknowledged. Then both Spark
CronJobs run as Jobs with executor Pods; retention removes exactly what is past max-age.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from e2e.env import FLEET, RELEASE, Env
from e2e.probes import (
    TIMINGS,
    http_get,
    phase,
    relay_url,
    shard,
    shard_map,
    slots_of,
    wait_for,
)
from e2e.spark import MAX_AGE_S, JobRun, RetentionSeed, executor_pods, local_shard_map
from e2e.workload import Workload
from relay.fleet.sharding import SLOT_COUNT, ShardMap

STATE: dict[str, Any] = {}
# Steps wait for real Pods: volumes bound, images started, failovers (each wait bounded itself).
pytestmark = pytest.mark.timeout(600)
HELM_VALUES = [f"spark.retention.maxAgeSeconds={MAX_AGE_S}"]


@pytest.fixture(scope="module", autouse=True)
def _stop_workload() -> Iterator[None]:
    yield
    workload = STATE.pop("workload", None)
    if workload is not None:  # an earlier step failed: do not leave it running
        with contextlib.suppress(AssertionError):
            workload.stop(timeout=30)


# --- the steps -------------------------------------------------------------------------------


def test_chart_installs_and_operator_becomes_available(e2e: Env) -> None:
    def available() -> bool:
        dep: Any = e2e.get("deployment", f"{RELEASE}-operator")
        return bool(dep) and (dep.get("status") or {}).get("availableReplicas") == 1

    STATE["t_install"] = time.monotonic()
    wait_for("operator available", available, timeout=120)
    # the CronJobs live in the Spark namespace, none in the release's
    assert not e2e.kubectl("get", "cronjob", "-o", "name").stdout.split()
    crons = e2e.spark().kubectl("get", "cronjob", "-o", "name").stdout.split()
    assert f"cronjob.batch/{RELEASE}-retention-{FLEET}" in crons
    assert f"cronjob.batch/{RELEASE}-rebalance-{FLEET}" in crons


def test_two_shards_become_ready_and_messages_flow(e2e: Env) -> None:
    # The second shard joins with no slots; autoRebalance hands it its share at once.
    e2e.kubectl("apply", "-f", "-", input=shard("a"))

    def a_holds_all() -> bool:
        m = shard_map(e2e)
        return m is not None and slots_of(m).get("a") == SLOT_COUNT

    # The first shard of a fleet takes every slot. b is applied once a holds them, so
    # which shard comes first does not hang on the order the operator sees the two.
    wait_for("shard a holds every slot", a_holds_all, timeout=150)
    e2e.kubectl("apply", "-f", "-", input=shard("b", ha=True, autoRebalance=True))
    wait_for("shard a Ready", lambda: phase(e2e, "rshard", "a") == "Ready", timeout=150)
    wait_for("shard b (replicated) Ready", lambda: phase(e2e, "rshard", "b") == "Ready", timeout=240)
    TIMINGS["fleet Ready (a, then replicated b)"] = round(time.monotonic() - STATE["t_install"], 1)

    def split() -> ShardMap | None:
        m = shard_map(e2e)
        return m if m is not None and all(slots_of(m).get(s, 0) > 0 for s in ("a", "b")) else None

    m = wait_for("slots split between a and b", split, timeout=120)
    assert sum(slots_of(m).values()) == SLOT_COUNT
    wait_for("b-join rebalance Ready", lambda: phase(e2e, "rrebalance", "b-join") == "Ready", timeout=60)
    wait_for(
        "fleet service answers /readyz", lambda: http_get(relay_url(e2e) + "/readyz")[0] == 200, timeout=60
    )

    workload = Workload(lambda: relay_url(e2e)).start()
    STATE["workload"] = workload
    wait_for("first messages stored", lambda: workload.stored >= 20, timeout=60)


def test_third_shard_and_an_approved_rebalance(e2e: Env) -> None:
    workload: Workload = STATE["workload"]
    e2e.kubectl("apply", "-f", "-", input=shard("c"))
    wait_for("shard c Ready", lambda: phase(e2e, "rshard", "c") == "Ready", timeout=150)
    m = shard_map(e2e)
    assert m is not None
    assert slots_of(m)["c"] == 0

    rebalance = {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayRebalance",
        "metadata": {"name": "scale-out"},
        "spec": {"fleet": FLEET, "mode": "weight"},
    }
    e2e.kubectl("apply", "-f", "-", input=json.dumps(rebalance))
    wait_for("proposal ready", lambda: phase(e2e, "rrebalance", "scale-out") == "ProposalReady", timeout=60)
    obj: Any = e2e.get("rrebalance", "scale-out")
    assert any(mv["to"] == "c" for mv in obj["status"]["moves"])
    before = workload.stored
    e2e.kubectl("annotate", "rrebalance", "scale-out", "relayfleet.dev/rebalance=approve")
    wait_for("rebalance executed", lambda: phase(e2e, "rrebalance", "scale-out") == "Ready", timeout=120)
    m = shard_map(e2e)
    assert m is not None
    counts = slots_of(m)
    assert all(counts[s] > SLOT_COUNT // 5 for s in ("a", "b", "c")), counts
    wait_for("messages stored after the rebalance", lambda: workload.stored > before + 10, timeout=60)


def test_deleted_shard_drains_away(e2e: Env) -> None:
    workload: Workload = STATE["workload"]
    e2e.kubectl("delete", "rshard", "a", "--wait=false")

    def gone() -> bool:
        m = shard_map(e2e)
        return m is not None and "a" not in m.shards and e2e.get("rshard", "a") is None

    wait_for("shard a drained and removed", gone, timeout=150)
    m = shard_map(e2e)
    assert m is not None
    assert sum(slots_of(m).values()) == SLOT_COUNT
    assert set(m.shards) == {"b", "c"}
    wait_for("relay of a gone", lambda: e2e.get("deployment", "relayfleet-a-relay") is None, timeout=150)
    before = workload.stored
    wait_for("messages stored after the scale-in", lambda: workload.stored > before + 10, timeout=60)


def test_history_of_scale_out_rebalance_and_scale_in_is_valid(e2e: Env) -> None:
    workload: Workload = STATE.pop("workload")
    workload.stop(timeout=120)
    workload.history.save(str(e2e.workdir / "history.jsonl"))
    verdict = workload.history.check()
    print(verdict.render())
    print(f"stored {workload.stored}, not sent (no endpoint) {workload.connect_failures}, timings {TIMINGS}")
    assert workload.stored > 50
    assert verdict.counts.get("messages_delivered", 0) >= workload.stored
    # Epoch changes are tracked by the next test on their own (a known open issue).
    STATE["epoch_violations"] = [str(v) for v in verdict.violations if v.kind == "epoch"]
    others = [v for v in verdict.violations if v.kind != "epoch"]
    assert not others, verdict.render()


@pytest.mark.xfail(
    reason="open issue: queues moved by the operator's migrations report a second epoch "
    "(no message lost, duplicated or reordered); history kept in the e2e workdir",
    strict=False,
)
def test_queue_epochs_survive_migrations(e2e: Env) -> None:
    assert STATE.get("epoch_violations") == [], STATE.get("epoch_violations")


def no_executors(e2e: Env, job_name: str) -> bool:
    return not executor_pods(e2e, job_name)


# A Job's JVMs start slowly on a loaded 2-core node: retention took 290 s once at load 35
# (36-86 s at load 10-17); each Job is waited for up to 600 s.
@pytest.mark.timeout(1500)
def test_retention_and_rebalance_cronjobs_run_with_executor_pods(e2e: Env) -> None:
    planted = RetentionSeed(local_shard_map(e2e))
    planted.plant()
    before = planted.left()
    assert all(len(q["seqs"]) in (planted.old_per_queue, planted.old_per_queue + 2) for q in before.values())

    # One after the other: two drivers and four executors at once do not fit a 2-CPU node.
    retention = JobRun(e2e, "retention").start()
    wait_for("retention job succeeded", retention.finished, timeout=600, interval=2)
    rebalance = JobRun(e2e, "rebalance").start()
    wait_for("rebalance job succeeded", rebalance.finished, timeout=600, interval=2)
    for run in (retention, rebalance):
        TIMINGS[f"{run.job} job"] = run.seconds
        print(f"{run.job}: {run.seconds} s, executor pods seen {sorted(run.executors)}")
        assert len(run.executors) >= 2, (run.job, run.executors)
        # admitted where Pod Security "restricted" is enforced, with the pod template's context
        for name, spec in run.executor_specs.items():
            assert restricted(spec), (name, spec.get("securityContext"), spec["containers"])
        wait_for(f"{run.job} executors gone", partial(no_executors, e2e, run.name), timeout=120)

    # Exactly the messages past max-age, and the queue they emptied (idle past max-age too).
    rows = {r["shard"]: r for r in retention.json_lines() if "messages_removed" in r}
    assert set(rows) == set(planted.shard_map.shards), retention.log
    assert sum(int(r["messages_removed"]) for r in rows.values()) == planted.expected_removed, rows
    assert sum(int(r["queues_deleted"]) for r in rows.values()) == len(rows), rows
    after = planted.left()
    for name in planted.shard_map.shards:
        assert after[f"{name}/old_only"] == {"seqs": [], "exists": False}, after
        n = planted.old_per_queue
        assert after[f"{name}/mixed"] == {"seqs": [n + 1, n + 2], "exists": True}, after
    STATE["retention"] = {"removed": planted.expected_removed, "rows": rows}


def restricted(spec: dict[str, Any]) -> bool:
    """What Pod Security "restricted" asks of a Pod (the fields the pod template sets)."""
    pod = spec.get("securityContext") or {}
    for c in spec["containers"]:
        ctx = c.get("securityContext") or {}
        if ctx.get("allowPrivilegeEscalation") is not False or "ALL" not in (
            ctx.get("capabilities") or {}
        ).get("drop", []):
            return False
        if not (ctx.get("runAsNonRoot") or pod.get("runAsNonRoot")):
            return False
        seccomp = (ctx.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            return False
    return True


def test_metrics_are_served(e2e: Env) -> None:
    status, text = http_get(relay_url(e2e) + "/metrics")
    assert status == 200
    assert "relayfleet_http_requests_total" in text
    status, text = http_get(e2e.service_url(f"{RELEASE}-operator", 9090) + "/metrics")
    assert status == 200
    assert "relayfleet_operator_reconciles_total" in text
