"""Uninstalling: `helm uninstall` must not leave RelayShards and RelayRebalances whose
relayfleet.dev/drain finalizer no controller will ever remove. The chart's pre-delete hook
deletes them while the operator runs and waits; a fleet whose data would be lost holds the
uninstall back instead. The hook as rendered, and run against a real API server with the
operator (kwok cluster, real redis-servers as the shards' Redis)."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from typing import Any

import pytest
from relayfleet_operator import uninstall
from relayfleet_operator.kube import Kube

from tests.support.chart import needs_helm, render
from tests.support.operator_harness import KwokFleet, wait_for

HOOK = "relayfleet-uninstall"


def hook_objects(*sets: str) -> dict[str, dict[str, Any]]:
    # (cluster-scoped ones are named per namespace and release: "relay.relayfleet-uninstall")
    names = (HOOK, f"relay.{HOOK}")
    return {d["kind"]: d for d in render(*sets, include_crds=False) if d["metadata"]["name"] in names}


@needs_helm
def test_the_chart_deletes_its_custom_resources_before_the_operator_goes() -> None:
    objs = hook_objects()
    assert set(objs) == {"ServiceAccount", "Role", "RoleBinding", "Job"}
    for obj in objs.values():
        assert obj["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    # its identity exists before the Job runs, and may do nothing but list and delete the two kinds
    assert int(objs["ServiceAccount"]["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        objs["Job"]["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    assert objs["Role"]["rules"] == [
        {
            "apiGroups": ["relayfleet.dev"],
            "resources": ["relayshards", "relayrebalances"],
            "verbs": ["get", "list", "delete"],
        }
    ]
    job = objs["Job"]["spec"]
    pod = job["template"]["spec"]
    assert pod["serviceAccountName"] == HOOK
    container = pod["containers"][0]
    assert container["command"] == ["python", "-m", "relayfleet_operator.uninstall"]
    assert container["args"] == ["--namespace", "relay", "--timeout", "240"]
    assert job["activeDeadlineSeconds"] > 240  # the hook reports why before Kubernetes stops it

    cluster_wide = hook_objects("operator.watchAllNamespaces=true")
    assert {"ClusterRole", "ClusterRoleBinding"} <= set(cluster_wide)
    assert cluster_wide["Job"]["spec"]["template"]["spec"]["containers"][0]["args"][0] == "--all-namespaces"
    assert hook_objects("uninstall.deleteCustomResources=false") == {}


def test_the_hook_command_runs_from_the_package() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "relayfleet_operator.uninstall", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--all-namespaces" in done.stdout


def test_what_is_left_is_said_per_object() -> None:
    shard = {
        "metadata": {"namespace": "ns", "name": "b"},
        "status": {
            "phase": "DeletionBlocked",
            "conditions": [{"type": "Degraded", "status": "True", "message": "b holds data"}],
        },
    }
    assert uninstall.describe("RelayShard", shard) == "RelayShard ns/b: DeletionBlocked: b holds data"
    assert uninstall.describe("RelayRebalance", {"metadata": {"namespace": "ns", "name": "r"}}) == (
        "RelayRebalance ns/r: -"
    )


async def _run(fleet: KwokFleet, timeout_s: float) -> tuple[int, str]:
    kube = await Kube.from_config(str(fleet.cluster.kubeconfig))
    out = io.StringIO()
    try:
        code = await uninstall.run(kube, [fleet.ns], timeout_s, poll_s=0.5, out=out)
    finally:
        await kube.close()
    return code, out.getvalue()


@pytest.mark.k8s
def test_uninstall_ends_a_fleet_once_no_data_would_be_lost(kwok_fleet: KwokFleet) -> None:
    """Every shard of the fleet deleted at once (each owning slots, with data): the hook fails
    naming them, nothing lost and the operator still running; once their data may go (force
    delete), the whole fleet leaves. Before, each shard waited for the others to take its slots
    ("are leaving the fleet too") for ever."""
    fleet = kwok_fleet
    fleet.redis("a", "b")
    expected = fleet.seed("a", queues=20, per_queue=2)
    fleet.operator.start()
    fleet.auto_rebalanced_join()  # a: 12288 slots, b: 4096, and the RelayRebalance b-join
    assert set(fleet.shard_map().slot_counts().values()) == {12288, 4096}

    code, out = asyncio.run(_run(fleet, 20))
    assert code == 1, out
    # The two deletions reach the operator one after the other: it sees both shards leaving and
    # names both, or it has already drained a into b and holds b, the last shard, with the data.
    assert (
        "every shard of fleet main is being deleted and a holds data; b holds data" in out
        or "b is the last shard of fleet main and holds data" in out
    ), out
    assert fleet.get("rrebalance", "b-join") is None  # it holds no data: gone
    fleet.history_intact(expected)  # the fleet still routes every queue

    for name in ("a", "b"):  # a is gone already when it was drained into b
        if fleet.get("rshard", name) is not None:
            force = "relayfleet.dev/force-delete=true"
            fleet.cluster.kubectl("-n", fleet.ns, "annotate", "rshard", name, force)
    code, out = asyncio.run(_run(fleet, 90))
    assert code == 0, out
    assert fleet.get("rshard", "a") is None
    assert fleet.get("rshard", "b") is None
    wait_for("the shard map to be gone", lambda: fleet.shard_map() is None)
