"""RelayShard / RelayRebalance against a real API server (built from source, tests/support/k8s_cluster.py).

Bare kube-apiserver: the CRDs' schemas, defaults, CEL rules and scale subresource, and the
chart's server-side dry-run. kwok cluster (controllers + fake nodes): the operator, run as a
subprocess, reconciling shards whose Redis are real local redis-servers, so slot moves on
deletion and rebalancing move real data.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from relayfleet_operator import shard_redis

from relay.storage.connection import RedisTarget
from tests.support.chart import HELM, helm
from tests.support.k8s_cluster import KubeCluster
from tests.support.operator_harness import (
    ROOT,
    KwokFleet,
    conditions,
    create,
    create_when_served,
    get,
    rebalance,
    wait_for,
)
from tests.support.shard_specs import shard
from tests.support.tls_pki import make_pki

pytestmark = pytest.mark.k8s


# --- the CRDs on a bare API server ---------------------------------------------------------------


def test_valid_relayshard_is_accepted_with_defaults(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    # The API server may need a moment before it serves a freshly established type.
    wait_for(
        "RelayShard to be served", lambda: create(kube_apiserver, apiserver_ns, shard("a")).returncode == 0
    )
    got = get(kube_apiserver, apiserver_ns, "rshard", "a")
    assert got is not None
    spec = got["spec"]
    assert spec["replicas"] == 2
    assert spec["weight"] == 100
    assert spec["autoRebalance"] is False
    assert spec["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}
    assert spec["redis"]["managed"]["appendfsync"] == "everysec"
    assert spec["redis"]["managed"]["storage"] == {"size": "1Gi"}
    assert spec["retention"] == {"maxAge": "7d", "maxMessages": 10000}
    assert spec["limits"]["maxPayloadBytes"] == 5242880
    assert spec["limits"]["rateLimitMessages"] == 500
    # no image is stored: the operator's configured images apply, and follow a chart upgrade
    assert "image" not in spec
    assert "image" not in spec["redis"]["managed"]
    table = kube_apiserver.kubectl("-n", apiserver_ns, "get", "rshard").stdout.split()
    assert table[:6] == ["NAME", "REPLICAS", "READY", "SLOTS", "PHASE", "AGE"]


INVALID = [
    (shard("x", redis={}), "exactly one of redis.managed or redis.external must be set"),
    (
        shard("x", redis={"managed": {}, "external": {"url": "redis://r:6379/0"}}),
        "exactly one of redis.managed or redis.external must be set",
    ),
    (
        shard("x", redis={"external": {}}),
        "exactly one of redis.external.url or redis.external.secretRef must be set",
    ),
    (shard("x", redis={"external": {"url": "http://r/"}}), "redis.external.url must start with redis://"),
    (shard("x", replicas=-1), "spec.replicas"),
    (shard("x", weight=0), "spec.weight"),
    (shard("x", retention={"maxAge": "1w"}), "spec.retention.maxAge"),
    (shard("x", redis={"managed": {"appendfsync": "no"}}), "spec.redis.managed.appendfsync"),
    (
        shard("x", redis={"managed": {"replicas": 1, "tls": {"secretName": "x-tls"}}}),
        "redis.managed.tls is not supported with replicas yet",
    ),
    (shard("x", redis={"managed": {"tls": {}}}), "spec.redis.managed.tls.secretName"),
    (shard("x" * 33), "RelayShard name must be at most 32 characters"),
    (shard("x", fleet="Bad_Fleet"), "spec.fleet"),
    # the rest of what operator/relayfleet_operator/spec.py checked by hand before relying on the
    # schema: every range, type and enum it had, rejected here by the API server
    (shard("a.b"), "RelayShard name must be a DNS-1035 label"),
    (shard("1a"), "RelayShard name must be a DNS-1035 label"),
    (shard("x", fleet="f" * 33), "spec.fleet"),
    (shard("x", replicas=1001), "spec.replicas"),
    (shard("x", replicas="two"), "spec.replicas"),
    (shard("x", weight=10001), "spec.weight"),
    (shard("x", weight="heavy"), "spec.weight"),
    (shard("x", image=""), "spec.image"),
    (shard("x", imagePullPolicy="Sometimes"), "spec.imagePullPolicy"),
    (shard("x", autoRebalance="yes"), "spec.autoRebalance"),
    (shard("x", resources={"requests": {"cpu": "lots"}}), "spec.resources.requests.cpu"),
    (shard("x", redis={"managed": {"replicas": 3}}), "spec.redis.managed.replicas"),
    (
        shard("x", redis={"managed": {"replicas": 1, "minReplicas": 2}}),
        "redis.managed.minReplicas must not exceed redis.managed.replicas",
    ),
    (shard("x", redis={"managed": {"image": ""}}), "spec.redis.managed.image"),
    (shard("x", redis={"managed": {"storage": {"size": "big"}}}), "spec.redis.managed.storage.size"),
    (shard("x", redis={"managed": {"maxmemory": "lots"}}), "spec.redis.managed.maxmemory"),
    (
        shard("x", redis={"managed": {"resources": {"limits": {"memory": True}}}}),
        "spec.redis.managed.resources.limits.memory",
    ),
    (shard("x", redis={"external": {"secretRef": {}}}), "spec.redis.external.secretRef.name"),
    (
        shard("x", redis={"external": {"secretRef": {"name": "s", "key": ""}}}),
        "spec.redis.external.secretRef.key",
    ),
    (shard("x", backup={"schedule": ""}), "spec.backup.schedule"),
    (shard("x", backup={"keep": 0}), "spec.backup.keep"),
    (shard("x", backup={"keep": 1001}), "spec.backup.keep"),
    (shard("x", backup={"suspend": "yes"}), "spec.backup.suspend"),
    (shard("x", retention={"maxMessages": 0}), "spec.retention.maxMessages"),
    (shard("x", limits={"maxPayloadBytes": 0}), "spec.limits.maxPayloadBytes"),
    (shard("x", limits={"maxPayloadBytes": 2**29 + 1}), "spec.limits.maxPayloadBytes"),
    (shard("x", limits={"rateLimitMessages": 0}), "spec.limits.rateLimitMessages"),
    (shard("x", limits={"rateLimitWindowSeconds": 3601}), "spec.limits.rateLimitWindowSeconds"),
    (shard("x", limits={"maxQueueMessages": 0}), "spec.limits.maxQueueMessages"),
    (shard("x", limits={"maxQueueBytes": 2**40 + 1}), "spec.limits.maxQueueBytes"),
    (rebalance("r", mode="drain"), "mode drain needs spec.drainShards"),
    (
        rebalance("r", proposal={"moves": [{"slots": "0-10", "from": "a", "to": "a"}]}),
        "a move's from and to must differ",
    ),
    (
        rebalance("r", proposal={"moves": [{"slots": "0-x", "from": "a", "to": "b"}]}),
        "spec.proposal.moves[0].slots",
    ),
]


@pytest.mark.parametrize(("doc", "message"), INVALID, ids=[m for _, m in INVALID])
def test_invalid_objects_are_rejected_with_their_message(
    kube_apiserver: KubeCluster, apiserver_ns: str, doc: dict[str, Any], message: str
) -> None:
    proc = create_when_served(kube_apiserver, apiserver_ns, doc)
    assert proc.returncode != 0
    assert "Invalid" in proc.stderr
    assert message in proc.stderr


def test_immutable_fields_are_enforced_on_update(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    wait_for(
        "RelayShard to be served", lambda: create(kube_apiserver, apiserver_ns, shard("a")).returncode == 0
    )

    def patch(p: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return kube_apiserver.kubectl(
            "-n", apiserver_ns, "patch", "rshard", "a", "--type=merge", "-p", json.dumps(p), check=False
        )

    proc = patch({"spec": {"fleet": "other"}})
    assert proc.returncode != 0
    assert "fleet is immutable" in proc.stderr
    proc = patch({"spec": {"redis": {"managed": None, "external": {"url": "redis://r:6379/0"}}}})
    assert proc.returncode != 0
    assert "cannot be switched after creation" in proc.stderr
    proc = patch({"spec": {"redis": {"managed": {"storage": {"size": "5Gi"}}}}})
    assert proc.returncode != 0
    assert "redis.managed.storage is immutable" in proc.stderr
    assert patch({"spec": {"weight": 300, "replicas": 4}}).returncode == 0


def test_scale_subresource(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    wait_for(
        "RelayShard to be served", lambda: create(kube_apiserver, apiserver_ns, shard("a")).returncode == 0
    )
    kube_apiserver.kubectl("-n", apiserver_ns, "scale", "rshard/a", "--replicas=3")
    got = get(kube_apiserver, apiserver_ns, "rshard", "a")
    assert got is not None
    assert got["spec"]["replicas"] == 3
    # The /scale endpoint reads status.replicas and the selector the operator publishes.
    status = {
        "status": {"replicas": 3, "selector": "relayfleet.dev/shard=a,app.kubernetes.io/component=relay"}
    }
    kube_apiserver.kubectl(
        "-n",
        apiserver_ns,
        "patch",
        "rshard",
        "a",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    raw = kube_apiserver.kubectl(
        "get", "--raw", f"/apis/relayfleet.dev/v1alpha1/namespaces/{apiserver_ns}/relayshards/a/scale"
    ).stdout
    scale = json.loads(raw)
    assert scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == status["status"]["selector"]
    proc = kube_apiserver.kubectl("-n", apiserver_ns, "scale", "rshard/a", "--replicas=-2", check=False)
    assert proc.returncode != 0


@pytest.mark.skipif(HELM is None, reason="helm not built yet: run hack/control-plane.sh")
def test_chart_passes_server_side_dry_run(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    rendered = helm(
        "template", "relayfleet", str(ROOT / "charts" / "relayfleet"), "--namespace", apiserver_ns
    )
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert {d["kind"] for d in docs} >= {"Deployment", "CronJob", "Role", "ServiceAccount", "Namespace"}
    # a dry run creates nothing: the Spark namespace's objects need it to exist already
    (spark_ns,) = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    kube_apiserver.kubectl("create", "namespace", spark_ns)
    try:
        proc = kube_apiserver.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered, check=False)
    finally:
        kube_apiserver.kubectl("delete", "namespace", spark_ns, "--wait=false", check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(docs)
    # The CRDs as the chart ships them go through the same check.
    crds = kube_apiserver.kubectl(
        "apply", "--dry-run=server", "-f", str(ROOT / "charts" / "relayfleet" / "crds"), check=False
    )
    assert crds.returncode == 0, crds.stderr


# --- the operator on a kwok cluster --------------------------------------------------------------


def test_operator_creates_children_and_reports_status(kwok_fleet: KwokFleet) -> None:
    fleet, ns = kwok_fleet, kwok_fleet.ns
    fleet.redis("a")
    # what the chart sets from its values: the images of shards that name none
    fleet.operator.start(
        RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE="registry.test/relay:7",
        RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE="registry.test/redis:7",
    )
    fleet.apply(fleet.external("a"), shard("b", replicas=1))

    def a_ready() -> dict[str, Any] | None:
        got = fleet.get("rshard", "a")
        return got if got and (got.get("status") or {}).get("phase") == "Ready" else None

    a = wait_for("shard a to become Ready", a_ready, timeout=120)
    status = a["status"]
    assert status["slotCount"] == 16384
    assert status["readyReplicas"] == 1
    assert status["redisEndpoint"] == f"127.0.0.1:{fleet.servers['a'].port}"
    assert status["observedGeneration"] == a["metadata"]["generation"]
    conds = conditions(a)
    assert {t: c["status"] for t, c in conds.items()} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "Migrating": "False",
    }
    assert all(
        c["observedGeneration"] == a["metadata"]["generation"] and c["lastTransitionTime"]
        for c in conds.values()
    )
    assert "relayfleet.dev/drain" in a["metadata"]["finalizers"]

    # Children of the external shard: relay objects only.
    for kind, name in [
        ("deployment", "relayfleet-a-relay"),
        ("service", "relayfleet-a-relay"),
        ("poddisruptionbudget", "relayfleet-a-relay"),
        ("service", "relayfleet-main"),
        ("serviceaccount", "relayfleet-main-relay"),
        ("role", "relayfleet-main-relay"),
        ("rolebinding", "relayfleet-main-relay"),
        ("secret", "relayfleet-main-credentials"),
    ]:
        obj = wait_for(f"{kind}/{name}", lambda k=kind, n=name: fleet.get(k, n))  # type: ignore[misc]
        assert obj["metadata"]["labels"]["relayfleet.dev/fleet"] == "main"
    dep = fleet.get("deployment", "relayfleet-a-relay")
    assert dep is not None
    assert dep["metadata"]["ownerReferences"][0]["uid"] == a["metadata"]["uid"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.test/relay:7"
    assert fleet.get("statefulset", "relayfleet-a-redis") is None

    # The managed shard gets its Redis objects, joins with no slots, and waits for its PVC.
    for kind, name in [
        ("statefulset", "relayfleet-b-redis"),
        ("service", "relayfleet-b-redis"),
        ("configmap", "relayfleet-b-redis-config"),
        ("secret", "relayfleet-b-redis"),
        ("deployment", "relayfleet-b-relay"),
    ]:
        wait_for(f"{kind}/{name}", lambda k=kind, n=name: fleet.get(k, n))  # type: ignore[misc]
    sts = fleet.get("statefulset", "relayfleet-b-redis")
    assert sts is not None
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.test/redis:7"
    conf = fleet.get("configmap", "relayfleet-b-redis-config")
    assert conf is not None
    assert "appendonly yes" in conf["data"]["redis.conf"]
    assert "maxmemory-policy noeviction" in conf["data"]["redis.conf"]
    m = wait_for("shard b in the map", lambda: (sm := fleet.shard_map()) and "b" in sm.shards and sm)
    assert m.slot_counts() == {"a": 16384, "b": 0}
    assert m.shards["b"] == f"redis://relayfleet-b-redis.{ns}.svc:6379/0"  # no password in the map
    b = fleet.get("rshard", "b")
    assert b is not None
    assert b["status"]["slotCount"] == 0
    assert b["status"]["phase"] in ("Provisioning", "Pending")
    assert conditions(b)["Progressing"]["status"] == "True"

    # Scaling through the scale subresource reaches the Deployment.
    fleet.cluster.kubectl("-n", ns, "scale", "rshard/a", "--replicas=3")
    wait_for(
        "the relay Deployment to scale",
        lambda: (d := fleet.get("deployment", "relayfleet-a-relay")) and d["spec"]["replicas"] == 3,
    )
    wait_for(
        "status.readyReplicas to follow",
        lambda: (s := fleet.get("rshard", "a")) and s["status"].get("readyReplicas") == 3,
        timeout=120,
    )

    # Drift: a hand edit of an owned field is reverted, a deleted child comes back.
    fleet.cluster.kubectl(
        "-n", ns, "patch", "deployment", "relayfleet-a-relay", "--type=merge", "-p", '{"spec":{"replicas":7}}'
    )
    fleet.cluster.kubectl("-n", ns, "delete", "service", "relayfleet-main")
    wait_for(
        "the Deployment's replicas to be restored",
        lambda: (d := fleet.get("deployment", "relayfleet-a-relay")) and d["spec"]["replicas"] == 3,
    )
    wait_for("the fleet Service to come back", lambda: fleet.get("service", "relayfleet-main"))
    events = fleet.cluster.kubectl("-n", ns, "get", "events", "-o", "json").stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"JoinedFleet", "Reconciled"} <= reasons

    # The operator's own endpoints: kopf liveness and Prometheus metrics.
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.operator.health_port}/healthz", timeout=5) as resp:
        assert resp.status == 200
        assert json.loads(resp.read())["kube"] == "ok"
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.operator.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'relayfleet_operator_reconciles_total{kind="RelayShard",result="ok"}' in text
    assert f'relayfleet_operator_shard_map_epoch{{fleet="main",namespace="{ns}"}}' in text


_REQUESTS = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$", re.M)


def _writes(fleet: KwokFleet) -> dict[str, float]:
    """The API server's count of server-side applies per resource and of patches of RelayShards
    and Secrets: the operator's writes (the controllers and kwok write with PUT, or PATCH
    other resources)."""
    text = fleet.cluster.kubectl("get", "--raw", "/metrics").stdout
    out: dict[str, float] = {}
    for m in _REQUESTS.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        verb, resource = labels.get("verb"), labels.get("resource", "")
        if verb == "APPLY" or (verb == "PATCH" and resource in ("relayshards", "secrets")):
            key = f"{verb} {resource}"
            out[key] = out.get(key, 0.0) + float(m.group("value"))
    return out


def test_an_unchanged_resync_writes_nothing_and_a_moved_deployment_is_applied_again(
    kwok_fleet: KwokFleet,
) -> None:
    """At rest a resync reads (the shard map, the Deployment) and writes nothing: its children,
    the fleet's shared objects and its status are as last written (docs/operator.md, Drift).
    A Deployment whose spec someone changed (its generation moved) is written again at the
    next resync, however far the re-apply period is."""
    fleet = kwok_fleet
    fleet.redis("a")
    fleet.operator.start(RELAYFLEET_OPERATOR_RESYNC_SECONDS="1", RELAYFLEET_OPERATOR_REAPPLY_SECONDS="3600")
    fleet.apply(fleet.external("a"))
    wait_for(
        "shard a Ready",
        lambda: (a := fleet.get("rshard", "a")) and (a.get("status") or {}).get("phase") == "Ready",
    )
    time.sleep(2)  # the status write that said Ready has landed
    before = _writes(fleet)
    time.sleep(5)  # five resyncs
    after = _writes(fleet)
    assert before, "the API server counted no apply at all: the filter is wrong"
    assert {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k)} == {}

    fleet.cluster.kubectl(
        "-n",
        fleet.ns,
        "patch",
        "deployment",
        "relayfleet-a-relay",
        "--type=merge",
        "-p",
        '{"spec":{"replicas":4}}',
    )
    wait_for(
        "the Deployment's replicas to be restored",
        lambda: (d := fleet.get("deployment", "relayfleet-a-relay")) and d["spec"]["replicas"] == 1,
        timeout=30,
    )


def test_spark_namespace_gets_the_credentials_copy_and_a_redis_peer(kwok_fleet: KwokFleet) -> None:
    """What the chart tells the operator about the Spark jobs: their namespace holds a copy of
    the fleet's credentials Secret, kept equal to it (a shard leaving removes its key), and the
    managed shards' Redis NetworkPolicy admits the fleet's Pods of that namespace."""
    fleet, ns = kwok_fleet, kwok_fleet.ns
    spark_ns = f"{ns}-spark"
    fleet.cluster.kubectl("create", "namespace", spark_ns)
    try:
        fleet.redis("a")
        fleet.operator.start(
            RELAYFLEET_OPERATOR_POD_NAMESPACE=ns,
            RELAYFLEET_OPERATOR_SPARK_NAMESPACE=spark_ns,
            RELAYFLEET_OPERATOR_SPARK_FLEETS=f"{ns}/main",
        )
        fleet.apply(fleet.external("a"), shard("b"))

        def copied(keys: set[str]) -> dict[str, Any] | None:
            source = fleet.get("secret", "relayfleet-main-credentials")
            copy = get(fleet.cluster, spark_ns, "secret", "relayfleet-main-credentials")
            if not (source and copy) or set(copy.get("data") or {}) != keys:
                return None
            return copy if copy["data"] == source["data"] else None

        copy = wait_for("the credentials copy with a and b", partial(copied, {"a", "b"}), timeout=120)
        assert copy["metadata"]["annotations"]["relayfleet.dev/source-namespace"] == ns
        assert "ownerReferences" not in copy["metadata"]
        policy = wait_for("b's Redis NetworkPolicy", lambda: fleet.get("networkpolicy", "relayfleet-b-redis"))
        peers = policy["spec"]["ingress"][0]["from"]
        assert {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spark_ns}},
            "podSelector": {
                "matchLabels": {"relayfleet.dev/fleet": "main", "relayfleet.dev/redis-client": "true"}
            },
        } in peers
        fleet.cluster.kubectl("-n", ns, "delete", "rshard", "b", "--wait=false")
        wait_for("b's key gone from the copy", partial(copied, {"a"}), timeout=180)
    finally:
        fleet.cluster.kubectl("delete", "namespace", spark_ns, "--wait=false", check=False)


def test_auto_rebalance_gives_a_new_shard_its_share(kwok_fleet: KwokFleet) -> None:
    fleet = kwok_fleet
    fleet.redis("a", "b")
    expected = fleet.seed("a", queues=20, per_queue=2)
    fleet.operator.start()
    fleet.auto_rebalanced_join()
    assert fleet.shard_map().slot_counts() == {"a": 12288, "b": 4096}
    fleet.history_intact(expected)
    joined = fleet.get("rrebalance", "b-join")
    assert joined is not None
    assert joined["spec"]["autoApprove"] is True
    assert joined["metadata"]["ownerReferences"][0]["name"] == "b"


def test_deleting_a_shard_moves_its_slots_first(kwok_fleet: KwokFleet) -> None:
    fleet, ns = kwok_fleet, kwok_fleet.ns
    fleet.redis("a", "b", "c")
    expected = fleet.seed("a", queues=40, per_queue=5)
    fleet.operator.start()
    fleet.found(fleet.external("a"), fleet.external("b", weight=100), fleet.external("c", weight=300))

    def ready(name: str) -> bool:
        return bool(conditions(fleet.get("rshard", name) or {}).get("Ready", {}).get("status") == "True")

    for name in ("b", "c"):  # slots only move into Ready shards: both must be, to share by weight
        wait_for(f"shard {name} Ready", partial(ready, name), timeout=60)

    fleet.cluster.kubectl("-n", ns, "delete", "rshard", "a", "--wait=false")
    wait_for("shard a to be gone", lambda: fleet.get("rshard", "a") is None, timeout=180)
    m = fleet.shard_map()
    assert set(m.shards) == {"b", "c"}
    counts = m.slot_counts()
    assert counts == {"b": 4096, "c": 12288}  # by weight 1:3
    fleet.history_intact(expected)
    assert not asyncio.run(shard_redis.holds_data(fleet.servers["a"].url, range(16384)))  # source cleaned

    # The last shards: c can leave (b takes its slots); b, alone with data, cannot.
    fleet.cluster.kubectl("-n", ns, "delete", "rshard", "c", "--wait=false")
    wait_for("shard c to be gone", lambda: fleet.get("rshard", "c") is None, timeout=180)
    assert fleet.shard_map().slot_counts() == {"b": 16384}
    fleet.history_intact(expected)
    fleet.cluster.kubectl("-n", ns, "delete", "rshard", "b", "--wait=false")

    def blocked() -> dict[str, Any] | None:
        got = fleet.get("rshard", "b")
        return got if got and got["status"].get("phase") == "DeletionBlocked" else None

    b = wait_for("shard b to refuse deletion", blocked, timeout=60)
    degraded = conditions(b)["Degraded"]
    assert degraded["status"] == "True"
    assert degraded["reason"] == "DeletionBlocked"
    assert "last shard of fleet main and holds data" in degraded["message"]
    time.sleep(3)
    assert fleet.get("rshard", "b") is not None
    fleet.cluster.kubectl("-n", ns, "annotate", "rshard", "b", "relayfleet.dev/force-delete=true")
    wait_for("shard b to be gone after force-delete", lambda: fleet.get("rshard", "b") is None)
    wait_for("the shard map to be gone", lambda: fleet.shard_map() is None)


def test_rebalance_waits_for_approval_then_moves_data(kwok_fleet: KwokFleet) -> None:
    fleet, ns = kwok_fleet, kwok_fleet.ns
    fleet.redis("a", "b")
    expected = fleet.seed("a", queues=30, per_queue=4)
    fleet.operator.start()
    fleet.found(fleet.external("a"), fleet.external("b"))

    fleet.apply(rebalance("even", concurrency=2))
    wait_for("a proposal", lambda: fleet.rebalance_phase("even") == "ProposalReady")
    proposal = fleet.get("rrebalance", "even")
    assert proposal is not None
    moves = proposal["status"]["moves"]
    assert [(m["from"], m["to"], m["state"]) for m in moves] == [("a", "b", "Pending")]
    assert proposal["status"]["progress"]["slotsTotal"] == 8192
    assert proposal["status"]["progress"]["bytesTotal"] > 0
    time.sleep(3)  # not approved: nothing moves
    assert fleet.rebalance_phase("even") == "ProposalReady"
    assert fleet.shard_map().slot_counts() == {"a": 16384, "b": 0}

    # stop, then refresh: a new proposal, still waiting for approval.
    fleet.cluster.kubectl("-n", ns, "annotate", "rrebalance", "even", "relayfleet.dev/rebalance=stop")
    wait_for("Stopped", lambda: fleet.rebalance_phase("even") == "Stopped")
    fleet.cluster.kubectl(
        "-n", ns, "annotate", "--overwrite", "rrebalance", "even", "relayfleet.dev/rebalance=refresh"
    )
    wait_for("a refreshed proposal", lambda: fleet.rebalance_phase("even") == "ProposalReady")

    fleet.cluster.kubectl("-n", ns, "annotate", "rrebalance", "even", "relayfleet.dev/rebalance=approve")
    wait_for("the rebalance to finish", lambda: fleet.rebalance_phase("even") == "Ready", timeout=120)
    done = fleet.get("rrebalance", "even")
    assert done is not None
    assert done["status"]["progress"]["percent"] == "100%"
    assert "relayfleet.dev/rebalance" not in (done["metadata"].get("annotations") or {})
    assert fleet.shard_map().slot_counts() == {"a": 8192, "b": 8192}
    fleet.history_intact(expected)
    wait_for(
        "shard b to report its slots",
        lambda: (b := fleet.get("rshard", "b")) and b["status"].get("slotCount") == 8192,
    )


def test_operator_killed_mid_rebalance_resumes(kwok_fleet: KwokFleet) -> None:
    fleet, operator = kwok_fleet, kwok_fleet.operator
    fleet.redis("a", "b", "c")
    expected = fleet.seed("a", queues=40, per_queue=3)
    operator.start()
    fleet.found(fleet.external("a"), fleet.external("b"), fleet.external("c"))
    operator.stop()

    # The migration library's own crash hook kills the operator in the middle of a copy.
    operator.start(RELAYFLEET_MIGRATION_CRASH_AT="mid-copy")
    fleet.apply(rebalance("spread", autoApprove=True))
    assert operator.wait_exit(120) == 86, operator.tail()
    assert fleet.rebalance_phase("spread") == "Rebalancing"
    states = [m["state"] for m in fleet.get("rrebalance", "spread")["status"]["moves"]]  # type: ignore[index]
    assert "Migrating" in states

    operator.start()
    wait_for("the resumed rebalance", lambda: fleet.rebalance_phase("spread") == "Ready", timeout=150)
    counts = fleet.shard_map().slot_counts()
    assert sorted(counts.values()) == [5461, 5461, 5462]
    fleet.history_intact(expected)


# --- deletion under live traffic, relays following the real ConfigMap ---------------------------


async def test_deleting_a_shard_under_traffic_keeps_the_history(kwok_fleet: KwokFleet) -> None:
    """Relay processes read the map from the ConfigMap the operator writes; producers,
    read+ack consumers, drainers and long-polls run while deleting shard a makes the
    operator move all 16384 slots to b and c. The history checker then holds every
    guarantee: nothing acknowledged lost, nothing delivered twice or after its ack,
    per-queue order kept, no 5xx but 503 + Retry-After."""
    from tests.support.fleet_harness import Workload, make_queues

    fleet = kwok_fleet
    fleet.redis("a", "b", "c")
    fleet.operator.start()
    await asyncio.to_thread(fleet.found, fleet.external("a"), fleet.external("b"), fleet.external("c"))
    urls = await asyncio.to_thread(fleet.start_relays, 2)
    work = Workload(urls, make_queues(16, seed=21), producers=6, seed=21)
    await work.start()
    await work.until_stored(50)
    fleet.cluster.kubectl("-n", fleet.ns, "delete", "rshard", "a", "--wait=false")
    await asyncio.to_thread(wait_for, "shard a to be gone", lambda: fleet.get("rshard", "a") is None, 240)
    await work.until_stored(50)  # traffic on the new owners
    await work.stop()
    verdict = work.history.check()
    print(verdict.render())
    assert verdict.ok, f"{verdict.render()}\n{fleet.relay_logs()}"
    assert verdict.counts["messages_acknowledged"] > 50
    assert fleet.shard_map().slot_counts() == {"b": 8192, "c": 8192}
    assert not await shard_redis.holds_data(fleet.servers["a"].url, range(16384))


def test_managed_tls_shard_gets_a_rediss_url_with_its_ca(kwok_fleet: KwokFleet, tmp_path: Path) -> None:
    """spec.redis.managed.tls on the real API server: the Redis objects mount the certificate
    Secret and serve TLS only; the map and the credentials carry rediss:// with the CA."""
    fleet, ns = kwok_fleet, kwok_fleet.ns
    pki = make_pki(tmp_path / "pki")
    fleet.redis("a")
    fleet.operator.start()
    tls_secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "t-redis-tls"},
        "type": "kubernetes.io/tls",
        "data": {
            key: base64.b64encode(path.read_bytes()).decode()
            for key, path in (("tls.crt", pki.server_cert), ("tls.key", pki.server_key), ("ca.crt", pki.ca))
        },
    }
    fleet.apply(tls_secret, fleet.external("a"))
    fleet.join(shard("t", redis={"managed": {"tls": {"secretName": "t-redis-tls"}}}))
    url = fleet.shard_map().shards["t"]
    assert url.startswith(f"rediss://relayfleet-t-redis.{ns}.svc:6379/0?ssl_ca_data=")  # no password
    target = RedisTarget.from_url(url)
    assert target.tls
    assert target.options["ssl_ca_data"] == pki.ca.read_text().strip()

    def credentials() -> str | None:
        secret = fleet.get("secret", "relayfleet-main-credentials")
        value = ((secret or {}).get("data") or {}).get("t")
        return base64.b64decode(value).decode() if value else None

    full = RedisTarget.from_url(wait_for("credentials for t", credentials))
    assert full.password
    assert full.tls
    assert full.options["ssl_ca_data"] == target.options["ssl_ca_data"]
    sts = fleet.get("statefulset", "relayfleet-t-redis")
    assert sts is not None
    pod = sts["spec"]["template"]["spec"]
    assert [v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "tls"] == ["t-redis-tls"]
    conf = fleet.get("configmap", "relayfleet-t-redis-config")
    assert conf is not None
    assert "tls-port 6379" in conf["data"]["redis.conf"]
