"""The jobs' in-cluster paths against a real kube-apiserver: the shard map from its
ConfigMap, weights and retention from RelayShards, proposals as RelayRebalance
objects validated by the real CRD schema."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from kubernetes import client

from relay.fleet.sharding import ShardMap
from relay.storage import keys as K
from spark_jobs import rebalance, retention
from tests.support.k8s_cluster import KubeCluster
from tests.support.spark_session import FleetFactory, Seed, recipient_on, seed

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.k8s, pytest.mark.spark]

CRDS = Path(__file__).resolve().parents[2] / "crds"
GROUP, VERSION = "relayfleet.dev", "v1alpha1"


@pytest.fixture
def namespace(kube_apiserver: KubeCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh namespace with the CRDs installed; KUBECONFIG points the jobs at the cluster."""
    kube_apiserver.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    kube_apiserver.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/relayshards.relayfleet.dev", "crd/relayrebalances.relayfleet.dev",
    )  # fmt: skip
    name = f"spark-{uuid.uuid4().hex[:8]}"
    kube_apiserver.kubectl("create", "namespace", name)
    monkeypatch.setenv("KUBECONFIG", str(kube_apiserver.kubeconfig))
    yield name
    kube_apiserver.kubectl("delete", "namespace", name, "--wait=false", check=False)


def publish_fleet(cluster: KubeCluster, ns: str, fleet: ShardMap, shards: dict[str, dict[str, Any]]) -> str:
    """The shard map ConfigMap and one RelayShard per shard, as the operator would have them."""
    cm_name = f"relayfleet-{fleet.fleet}-shardmap"
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": cm_name, "namespace": ns},
        "data": {"shardmap.json": fleet.dumps()},
    }
    docs = [cm]
    for name, extra in shards.items():
        spec = {"fleet": fleet.fleet, "redis": {"external": {"url": fleet.shards[name]}}, **extra}
        docs.append(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "RelayShard",
                "metadata": {"name": name, "namespace": ns},
                "spec": spec,
            }
        )
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return f"{ns}/{cm_name}"


def rebalances(cluster: KubeCluster, ns: str) -> list[dict[str, Any]]:
    with cluster.api_client() as api:
        listing: Any = client.CustomObjectsApi(api).list_namespaced_custom_object(
            GROUP, VERSION, ns, "relayrebalances"
        )
    items: list[dict[str, Any]] = listing["items"]
    return items


def test_rebalance_proposal_from_configmap_and_weights(
    spark: SparkSession,
    kube_apiserver: KubeCluster,
    namespace: str,
    redis_fleet: FleetFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = redis_fleet(["a", "b", "c"])
    rng = random.Random(4)
    now = int(time.time() * 1000)
    seeds = []
    for shard in ("a", "b", "c"):
        for _ in range(30):
            r = recipient_on(fleet, shard, rng)
            seeds += [Seed(r, b"", b"m" * 400, now) for _ in range(2)]
    seed(fleet, seeds)
    # equal load per shard, but c has three times the weight: c should receive slots
    cm = publish_fleet(
        kube_apiserver, namespace, fleet, {"a": {"weight": 100}, "b": {"weight": 100}, "c": {"weight": 300}}
    )

    assert rebalance.main(["--shard-map-configmap", cm, "--metric", "bytes", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "created proposal" in err
    items = rebalances(kube_apiserver, namespace)
    assert len(items) == 1
    spec = items[0]["spec"]
    assert spec["fleet"] == "test"
    assert spec["autoApprove"] is False
    moves = spec["proposal"]["moves"]
    assert moves
    assert {m["to"] for m in moves} == {"c"}
    assert spec["proposal"]["shardMapEpoch"] == fleet.epoch
    assert spec["proposal"]["summary"]["balanced"] is True
    assert items[0]["metadata"]["labels"]["relayfleet.dev/proposed-by"] == "spark-rebalance"

    # a second run refreshes the open proposal instead of piling up another one
    assert (
        rebalance.main(["--shard-map-configmap", cm, "--metric", "bytes", "--quiet", "--auto-approve"]) == 0
    )
    assert "refreshed proposal" in capsys.readouterr().err
    again = rebalances(kube_apiserver, namespace)
    assert len(again) == 1
    assert again[0]["spec"]["autoApprove"] is True

    # a missing ConfigMap is a failure with one line, not a traceback
    assert rebalance.main(["--shard-map-configmap", f"{namespace}/nope", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "cannot read ConfigMap" in err
    assert "Traceback" not in err


def test_retention_uses_each_relayshard_policy(
    spark: SparkSession,
    kube_apiserver: KubeCluster,
    namespace: str,
    redis_fleet: FleetFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = redis_fleet(["a", "b"])
    rng = random.Random(8)
    now = int(time.time() * 1000)
    queues = {shard: recipient_on(fleet, shard, rng) for shard in ("a", "b")}
    # 2-hour-old messages, 6 per queue
    seed(fleet, [Seed(r, b"", b"x" * 10, now - 2 * 3_600_000 + i) for r in queues.values() for i in range(6)])
    # a keeps messages for 1h, b for the 7-day default but at most 4 per queue
    cm = publish_fleet(
        kube_apiserver,
        namespace,
        fleet,
        {"a": {"retention": {"maxAge": "1h"}}, "b": {"retention": {"maxMessages": 4}}},
    )
    assert retention.main(["--shard-map-configmap", cm, "--quiet"]) == 0
    out = capsys.readouterr().out
    lines = {d["shard"]: d for d in (json.loads(line) for line in out.splitlines())}
    assert lines["a"]["messages_removed"] == 6
    assert lines["a"]["queues_deleted"] == 1  # idle period defaults to the shard's maxAge
    assert lines["b"]["messages_removed"] == 2
    assert lines["b"]["queues_deleted"] == 0
    import redis

    with redis.Redis.from_url(fleet.shards["b"]) as r:
        assert r.xlen(K.queue_keys(queues["b"], b"").msgs) == 4
