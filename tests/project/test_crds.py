"""CRDs and the Helm chart: shape, drift between crds/ and the chart, schema validity of every
object the chart renders and the operator builds (kubernetes-validate, strict)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
import pytest
import yaml
from relayfleet_operator import builders
from relayfleet_operator.spec import QUOTA_ENV, parse_shard

from relay.fleet.sharding import even_split
from tests.support.chart import (
    CHART,
    CRDS,
    K8S_VERSION,
    crd,
    helm,
    needs_helm,
    render,
    schema_of,
)

# Kinds kubernetes-validate has no schema for; the monitoring ones are checked by shape below.
NO_SCHEMA = {"ServiceMonitor", "PrometheusRule"}


# --- the CRDs -----------------------------------------------------------------------------------


def test_relayshard_crd_contract() -> None:
    doc = crd("relayshards.yaml")
    assert doc["metadata"]["name"] == "relayshards.relayfleet.dev"
    spec = doc["spec"]
    assert spec["group"] == "relayfleet.dev"
    assert spec["names"]["kind"] == "RelayShard"
    assert spec["names"]["shortNames"] == ["rshard"]
    version = spec["versions"][0]
    assert version["served"]
    assert version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Replicas", "Ready", "Slots", "Phase", "Age"]
    schema = schema_of(doc)
    props = schema["properties"]["spec"]["properties"]
    for field in ("fleet", "replicas", "weight", "image", "resources", "redis", "retention", "limits"):
        assert field in props, field
    assert props["redis"]["properties"]["managed"]["properties"]["appendfsync"]["enum"] == [
        "everysec",
        "always",
    ]
    assert set(props["redis"]["properties"]["external"]["properties"]) == {"url", "secretRef"}
    rules = {r["rule"] for r in props["redis"]["x-kubernetes-validations"]}
    assert "has(self.managed) != has(self.external)" in rules
    assert props["fleet"]["x-kubernetes-validations"] == [
        {"rule": "self == oldSelf", "message": "fleet is immutable"}
    ]
    status = schema["properties"]["status"]["properties"]
    for field in ("observedGeneration", "phase", "conditions", "slotCount", "readyReplicas", "redisEndpoint"):
        assert field in status, field
    cond = status["conditions"]["items"]["properties"]
    assert set(cond) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    assert cond["type"]["enum"] == ["Ready", "Progressing", "Degraded", "Migrating"]
    assert status["kopf"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def test_spec_limits_carry_every_quota_setting() -> None:
    """Issue 36: spec.limits has a camelCase key for each agreed quota variable, unset by
    default (the relay's default holds), 0 allowed (off), out-of-range values refused."""
    limits = schema_of(crd("relayshards.yaml"))["properties"]["spec"]["properties"]["limits"]
    props = limits["properties"]
    assert set(QUOTA_ENV) | {"trustedProxies"} <= set(props)
    for key in QUOTA_ENV:
        assert "default" not in props[key], key
        assert props[key]["description"].startswith(QUOTA_ENV[key] + " - "), key
        assert props[key]["minimum"] == (1 if key == "clientRateWindowMs" else 0), key
    validator = jsonschema.Draft7Validator(limits)
    good = {
        "clientRateMessages": 0,
        "clientRateBytes": 33554432,
        "trustedProxies": ["10.0.0.0/8", "2001:db8::/32"],
        "shardReserveFraction": 0.05,
    }
    assert list(validator.iter_errors(good)) == []
    for bad in (
        {"clientRateMessages": -1},
        {"clientRateWindowMs": 0},
        {"trustedProxies": ["not a cidr"]},
        {"trustedProxies": "10.0.0.0/8"},
        {"shardReserveFraction": 1.5},
        {"didcommMaxKeysPerConnection": "many"},
    ):
        assert list(validator.iter_errors(bad)), bad


def test_relayrebalance_crd_contract() -> None:
    doc = crd("relayrebalances.yaml")
    spec = doc["spec"]
    assert spec["group"] == "relayfleet.dev"
    assert spec["names"]["kind"] == "RelayRebalance"
    assert spec["names"]["shortNames"] == ["rrebalance"]
    schema = schema_of(doc)
    props = schema["properties"]["spec"]["properties"]
    assert props["autoApprove"]["default"] is False
    move = props["proposal"]["properties"]["moves"]["items"]["properties"]
    assert {"slots", "from", "to", "bytes"} <= set(move)
    status = schema["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == [
        "New",
        "PendingProposal",
        "ProposalReady",
        "Rebalancing",
        "Ready",
        "Stopped",
        "NotReady",
    ]
    assert {"moves", "progress", "conditions", "observedGeneration"} <= set(status)
    assert status["kopf"]["x-kubernetes-preserve-unknown-fields"] is True


def _structural(node: Any, where: str) -> None:
    """Every schema node has a type (or int-or-string / preserve-unknown-fields)."""
    if not isinstance(node, dict):
        return
    typed = (
        "type" in node
        or node.get("x-kubernetes-int-or-string")
        or node.get("x-kubernetes-preserve-unknown-fields")
    )
    assert typed, f"{where} has no type (not a structural schema)"
    for name, child in (node.get("properties") or {}).items():
        _structural(child, f"{where}.{name}")
    if isinstance(node.get("items"), dict):
        _structural(node["items"], f"{where}[]")
    if isinstance(node.get("additionalProperties"), dict):
        _structural(node["additionalProperties"], f"{where}.*")


@pytest.mark.parametrize("name", ["relayshards.yaml", "relayrebalances.yaml"])
def test_crds_are_structural_and_schema_valid(name: str) -> None:
    doc = crd(name)
    _structural(schema_of(doc), doc["spec"]["names"]["kind"])
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_chart_crds_do_not_drift_from_crds_dir() -> None:
    source = sorted(p.name for p in CRDS.glob("*.yaml"))
    copied = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert copied == source, "charts/relayfleet/crds/ must hold exactly the files of crds/"
    for name in source:
        assert (CHART / "crds" / name).read_bytes() == (CRDS / name).read_bytes(), (
            f"charts/relayfleet/crds/{name} differs from crds/{name}: copy crds/ into the chart"
        )


# --- values and examples ------------------------------------------------------------------------


def test_values_match_their_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"operator": {"watchAllNamespace": True}}, schema)  # a typo


def test_examples_parse_as_relayfleet_objects() -> None:
    kinds = []
    for path in sorted((CHART / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kinds.append(doc["kind"])
            if doc["kind"] == "RelayShard":
                parse_shard({**doc, "metadata": {**doc["metadata"], "namespace": "ns"}})
    assert kinds.count("RelayShard") >= 2
    assert "RelayRebalance" in kinds


# --- the operator's children --------------------------------------------------------------------


def builder_objects() -> list[dict[str, Any]]:
    body: dict[str, Any] = {
        "metadata": {"name": "a", "namespace": "ns", "uid": "0b3a5d2e-1111-2222-3333-444455556666"},
        "spec": {
            "fleet": "main",
            "resources": {"requests": {"cpu": "100m"}, "limits": {"memory": "1Gi"}},
            "redis": {"managed": {"storage": {"size": "2Gi", "storageClassName": "fast"}}},
        },
    }
    managed = parse_shard(body)
    external = parse_shard(
        {
            **body,
            "metadata": {**body["metadata"], "name": "b"},
            "spec": {"fleet": "main", "redis": {"external": {"url": "redis://r:6379/0"}}},
        }
    )
    replicated = parse_shard(
        {
            **body,
            "metadata": {**body["metadata"], "name": "c"},
            "spec": {
                "fleet": "main",
                "redis": {"managed": {"replicas": 2, "minReplicas": 1}},
                "backup": {"schedule": "5 * * * *", "keep": 3},
            },
        }
    )
    owners = [managed, external, replicated]
    objs = builders.shard_children(managed) + builders.shard_children(external)
    objs += builders.shard_children(replicated)
    objs.append(builders.redis_password_secret(managed, "pw"))
    objs += builders.fleet_objects("ns", "main", owners)
    objs.append(builders.credentials_secret("ns", "main", {"a": "redis://:pw@h:6379/0"}, owners))
    objs.append(builders.shard_map_configmap("ns", even_split("main", {"a": "redis://a/0"}), owners))
    return objs


def test_every_built_object_passes_kubernetes_validate() -> None:
    for obj in builder_objects():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- the chart, rendered by helm ----------------------------------------------------------------


EVERYTHING_ON = [
    "metrics.serviceMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "metrics.grafanaDashboard.enabled=true",
    "spark.fleets={default,blue}",
    "spark.retention.maxAgeSeconds=3600",
    "spark.rebalance.autoApprove=true",
]


@needs_helm
def test_helm_lint_is_clean() -> None:
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out
    helm("lint", "--strict", str(CHART), "--set", ",".join(s for s in EVERYTHING_ON if "{" not in s))
    helm("lint", "--strict", str(CHART), "--set", "operator.watchAllNamespaces=true")


@needs_helm
@pytest.mark.parametrize(
    "sets",
    [[], EVERYTHING_ON, ["operator.watchAllNamespaces=true", "spark.retention.enabled=false"]],
    ids=["defaults", "everything-on", "cluster-wide"],
)
def test_rendered_manifests_pass_kubernetes_validate(sets: list[str]) -> None:
    docs = render(*sets)
    assert docs
    for doc in docs:
        if doc["kind"] in NO_SCHEMA:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["spec"]
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}"
            )


@needs_helm
def test_rendered_chart_contents() -> None:
    docs = render()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    # CRDs come from crds/ unchanged.
    rendered_crds = {d["metadata"]["name"]: d for d in by_kind["CustomResourceDefinition"]}
    for name in ("relayshards.yaml", "relayrebalances.yaml"):
        source = crd(name)
        assert rendered_crds[source["metadata"]["name"]] == source
    (operator,) = by_kind["Deployment"]
    assert operator["spec"]["replicas"] == 1
    assert operator["spec"]["strategy"] == {"type": "Recreate"}
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["args"] == ["operator", "--namespace", "relay"]
    assert operator["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # Namespaced by default: a Role, plus the read-only CRD watch (cluster-scoped: named
    # "<namespace>.<fullname>-...", one per release and namespace).
    roles = {r["metadata"]["name"]: r for r in by_kind["Role"]}
    assert "relayfleet-operator" in roles
    # (crd-apply: get/patch on its own two CRDs, for operator.manageCRDs)
    assert sorted(r["metadata"]["name"] for r in by_kind["ClusterRole"]) == [
        "relay.relayfleet-operator-crd-apply",
        "relay.relayfleet-operator-crds",
    ]
    cluster_roles = {r["metadata"]["name"]: r for r in by_kind["ClusterRole"]}
    assert cluster_roles["relay.relayfleet-operator-crds"]["rules"] == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["list", "watch"],
        }
    ]
    for rule in roles["relayfleet-operator"]["rules"]:
        assert "*" not in rule["verbs"], rule
        assert "*" not in rule["resources"], rule
    # Both Spark jobs: spark-submit against the in-cluster API, client mode, own ServiceAccount.
    cronjobs = {c["metadata"]["name"]: c for c in by_kind["CronJob"]}
    assert set(cronjobs) == {"relayfleet-retention-default", "relayfleet-rebalance-default"}
    for job in ("retention", "rebalance"):
        cj = cronjobs[f"relayfleet-{job}-default"]
        assert cj["spec"]["concurrencyPolicy"] == "Forbid"
        pod = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "relayfleet-spark"
        args = pod["containers"][0]["args"]
        assert args[:4] == ["--master", "k8s://https://kubernetes.default.svc", "--deploy-mode", "client"]
        i = args.index(f"local:///app/spark_jobs/{job}.py")
        assert args[i + 1 : i + 3] == [
            "--shard-map-configmap",
            "relay/relayfleet-default-shardmap",  # the fleets' namespace: the jobs run in Spark's
        ]
        assert cj["metadata"]["namespace"] != "relay"
    spark_role = next(r for r in by_kind["Role"] if r["metadata"]["name"] == "relayfleet-spark")
    assert any("pods" in r["resources"] and "create" in r["verbs"] for r in spark_role["rules"])
    # Observability stays off unless asked for.
    assert not ({"ServiceMonitor", "PrometheusRule"} & set(by_kind))
    # (the ConfigMaps are the operator's CRD files and the Spark executors' Pod template, not a dashboard)
    assert sorted(c["metadata"]["name"] for c in by_kind["ConfigMap"]) == [
        "relayfleet-crds",
        "relayfleet-spark-executor",
    ]
