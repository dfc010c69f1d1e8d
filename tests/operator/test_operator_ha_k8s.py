"""Replicated managed Redis and backups against a real API server (tests/support/k8s_cluster.py).

Bare kube-apiserver: the CRD's new fields, defaults and CEL rules, and every object the
builders make for a replicated shard with backups accepted by server-side dry-run. kwok
cluster: the operator creates the Sentinel group, PodDisruptionBudgets, backup CronJob and
claim, writes the shard map entry as a Sentinel entry, and retires what the spec drops.
(The Redis and Sentinel processes themselves run in tests/relay/storage/test_redis_ha.py.)
"""

from __future__ import annotations

import base64
import json
import subprocess
from typing import Any

import pytest
import yaml
from relayfleet_operator import builders
from relayfleet_operator.spec import parse_shard

from relay.fleet.sharding import is_sentinel_url, parse_sentinel_url
from tests.support.k8s_cluster import KubeCluster
from tests.support.operator_harness import (
    KwokFleet,
    create,
    create_when_served,
    get,
    wait_for,
)
from tests.support.shard_specs import shard

pytestmark = pytest.mark.k8s


def test_replicas_min_replicas_and_backup_fields(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    ok = create_when_served(
        kube_apiserver, apiserver_ns, shard("r", redis={"managed": {"replicas": 2}}, backup={})
    )
    assert ok.returncode == 0, ok.stderr
    got = get(kube_apiserver, apiserver_ns, "rshard", "r")
    assert got is not None
    managed = got["spec"]["redis"]["managed"]
    assert (managed["replicas"], managed["minReplicas"]) == (2, 0)
    assert got["spec"]["backup"] == {
        "schedule": "17 * * * *",
        "keep": 24,
        "suspend": False,
        "storage": {"size": "10Gi"},
    }
    plain = create_when_served(kube_apiserver, apiserver_ns, shard("p"))
    assert plain.returncode == 0
    p = get(kube_apiserver, apiserver_ns, "rshard", "p")
    assert p is not None
    assert p["spec"]["redis"]["managed"]["replicas"] == 0
    assert "backup" not in p["spec"]

    for doc, message in [
        (
            shard("x", redis={"managed": {"replicas": 1, "minReplicas": 2}}),
            "redis.managed.minReplicas must not exceed redis.managed.replicas",
        ),
        (shard("x", redis={"managed": {"replicas": 3}}), "spec.redis.managed.replicas"),
        (shard("x", redis={"managed": {"minReplicas": 1}}), "minReplicas must not exceed"),
        (shard("x", backup={"keep": 0}), "spec.backup.keep"),
    ]:
        proc = create(kube_apiserver, apiserver_ns, doc)
        assert proc.returncode != 0
        assert message in proc.stderr, proc.stderr

    def patch(p: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return kube_apiserver.kubectl(
            "-n", apiserver_ns, "patch", "rshard", "r", "--type=merge", "-p", json.dumps(p), check=False
        )

    proc = patch({"spec": {"backup": {"storage": {"size": "20Gi"}}}})
    assert proc.returncode != 0
    assert "backup.storage is immutable" in proc.stderr
    proc = patch({"spec": {"redis": {"managed": {"minReplicas": 3}}}})
    assert proc.returncode != 0
    assert patch({"spec": {"redis": {"managed": {"minReplicas": 2}}}}).returncode == 0
    assert patch({"spec": {"redis": {"managed": {"replicas": 1}}}}).returncode != 0  # below minReplicas 2


def test_every_object_of_a_replicated_shard_passes_server_side_dry_run(
    kube_apiserver: KubeCluster, apiserver_ns: str
) -> None:
    spec = parse_shard(
        {
            "metadata": {
                "name": "r",
                "namespace": apiserver_ns,
                "uid": "0b3a5d2e-1111-2222-3333-444455556666",
            },
            "spec": {
                "fleet": "main",
                "redis": {"managed": {"replicas": 2, "minReplicas": 1}},
                "backup": {"schedule": "5 * * * *", "keep": 3},
            },
        }
    )
    objs = [builders.redis_password_secret(spec, "pw"), *builders.shard_children(spec)]
    kinds = {o["kind"] for o in objs}
    assert {
        "StatefulSet",
        "PodDisruptionBudget",
        "CronJob",
        "PersistentVolumeClaim",
        "NetworkPolicy",
    } <= kinds
    text = yaml.safe_dump_all(objs)
    proc = kube_apiserver.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", input=text, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(objs), proc.stdout


def test_operator_builds_the_sentinel_group_and_backups_and_retires_them(kwok_fleet: KwokFleet) -> None:
    fleet = kwok_fleet
    fleet.operator.start()
    fleet.apply(
        shard("r", replicas=1, redis={"managed": {"replicas": 2, "minReplicas": 1}}, backup={"keep": 3})
    )
    for kind, name in [
        ("configmap", "relayfleet-r-redis-ha"),
        ("service", "relayfleet-r-sentinel"),
        ("networkpolicy", "relayfleet-r-sentinel"),
        ("poddisruptionbudget", "relayfleet-r-redis"),
        ("poddisruptionbudget", "relayfleet-r-sentinel"),
        ("statefulset", "relayfleet-r-sentinel"),
        ("statefulset", "relayfleet-r-redis"),
        ("cronjob", "relayfleet-r-backup"),
        ("persistentvolumeclaim", "relayfleet-r-backup"),
    ]:
        wait_for(f"{kind}/{name}", lambda k=kind, n=name: fleet.get(k, n), timeout=60)  # type: ignore[misc]
    sts = fleet.get("statefulset", "relayfleet-r-redis")
    assert sts is not None
    assert sts["spec"]["replicas"] == 3

    # The map names the Sentinels (no password); the credentials Secret has the full URL.
    m = wait_for("shard r in the map", lambda: (sm := fleet.shard_map()) and "r" in sm.shards and sm)
    public = m.shards["r"]
    assert is_sentinel_url(public)
    target = parse_sentinel_url(public)
    assert (target.service, target.min_replicas, target.password) == ("r", 1, None)
    cm = fleet.get("configmap", "relayfleet-main-shardmap")
    assert cm is not None
    entry = json.loads(cm["data"]["shardmap.json"])["shards"]["r"]
    assert entry["minReplicas"] == 1
    assert len(entry["sentinels"]) == 3
    secret = fleet.get("secret", "relayfleet-main-credentials")
    assert secret is not None
    full = parse_sentinel_url(base64.b64decode(secret["data"]["r"]).decode())
    assert full.password is not None

    # No Sentinel runs under kwok: the status says so instead of failing the reconcile.
    def probed() -> dict[str, Any] | None:
        got = fleet.get("rshard", "r")
        return got if got and "redis" in (got.get("status") or {}) else None

    status = wait_for("status.redis", probed, timeout=60)["status"]
    assert status["redis"]["sentinelsReachable"] == 0
    assert status["redis"]["message"] == "no Sentinel answers"

    # replicas back to 0: the Sentinel objects go, the entry is one Redis URL again.
    fleet.apply(shard("r", replicas=1, redis={"managed": {"replicas": 0, "minReplicas": 0}}))
    wait_for(
        "the Sentinel StatefulSet to be retired",
        lambda: fleet.get("statefulset", "relayfleet-r-sentinel") is None or None,
        timeout=60,
    )
    for kind, name in [
        ("poddisruptionbudget", "relayfleet-r-sentinel"),
        ("poddisruptionbudget", "relayfleet-r-redis"),
        ("configmap", "relayfleet-r-redis-ha"),
        ("cronjob", "relayfleet-r-backup"),  # spec.backup was dropped too
    ]:
        assert fleet.get(kind, name) is None, f"{kind}/{name} still there"
    assert fleet.get("persistentvolumeclaim", "relayfleet-r-backup") is not None  # backups stay
    m = wait_for(
        "the plain entry", lambda: (sm := fleet.shard_map()) and not is_sentinel_url(sm.shards["r"]) and sm
    )
    assert m.shards["r"] == f"redis://relayfleet-r-redis.{fleet.ns}.svc:6379/0"
    redis_sts = fleet.get("statefulset", "relayfleet-r-redis")
    assert redis_sts is not None
    assert redis_sts["spec"]["replicas"] == 1
