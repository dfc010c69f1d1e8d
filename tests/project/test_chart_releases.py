"""Two releases of the chart on one cluster (helm template): a cluster-scoped object is named per
release and namespace, so a second `helm install` in another namespace does not collide with the
first (helm refuses to take over an object another release owns)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.chart import needs_helm, render

pytestmark = needs_helm

# Kinds the chart renders that live outside any namespace (its CRDs, from crds/, are shared by
# every release on purpose: helm installs them once and never replaces them).
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "Namespace"}
NAMESPACED = {
    "ConfigMap", "CronJob", "Deployment", "Gateway", "HTTPRoute", "Ingress", "Job", "PrometheusRule",
    "RelayShard", "Role", "RoleBinding", "Service", "ServiceAccount", "ServiceMonitor",
}  # fmt: skip
# Everything the chart can render, so every kind and every template is looked at.
EVERYTHING = (
    "metrics.serviceMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "metrics.grafanaDashboard.enabled=true",
    "ingress.enabled=true",
    "ingress.fleets[0].name=default",
    "ingress.fleets[0].hosts[0]=relay.example.com",
    "gateway.enabled=true",
    "gateway.create=true",
    "gateway.gatewayClassName=example",
    "gateway.tls.certificateRefs[0].name=relay-tls",
    "gateway.fleets[0].name=default",
    "gateway.fleets[0].hostnames[0]=relay.example.com",
)


def cluster_scoped(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    kinds = {d["kind"] for d in docs}
    assert kinds <= CLUSTER_SCOPED | NAMESPACED, f"a kind this test does not know: {kinds - NAMESPACED}"
    return {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in CLUSTER_SCOPED}


def bindings_point_at_their_own_roles(objs: dict[tuple[str, str], dict[str, Any]]) -> None:
    for (kind, _), obj in objs.items():
        if kind == "ClusterRoleBinding" and obj["roleRef"]["kind"] == "ClusterRole":
            assert ("ClusterRole", obj["roleRef"]["name"]) in objs, obj


@pytest.mark.parametrize("scope", ["operator.watchAllNamespaces=false", "operator.watchAllNamespaces=true"])
def test_two_releases_in_two_namespaces_share_no_cluster_scoped_name(scope: str) -> None:
    first = cluster_scoped(render(scope, *EVERYTHING, include_crds=False, namespace="relay"))
    second = cluster_scoped(render(scope, *EVERYTHING, include_crds=False, namespace="relay-two"))
    assert first
    assert second
    assert not set(first) & set(second), sorted(set(first) & set(second))
    for objs, namespace in ((first, "relay"), (second, "relay-two")):
        bindings_point_at_their_own_roles(objs)
        for obj in objs.values():
            assert namespace in obj["metadata"]["name"]
            for subject in obj.get("subjects", ()):
                assert subject["namespace"] == namespace, obj


def test_names_cannot_coincide_across_namespace_and_release_names() -> None:
    """Namespace "a" with release "b-x" and namespace "a-b" with release "x" must not meet on
    "a-b-x-...": the namespace is set off by a character no namespace holds. The Spark
    namespace's name cannot hold one either ("<namespace>-<fullname>-spark"): such a pair
    meets there, helm refuses the second install (the Namespace belongs to the first release)
    and spark.namespace.name sets another (docs/spark.md)."""
    one = cluster_scoped(render(include_crds=False, namespace="a", release="b-x"))
    two = cluster_scoped(render(include_crds=False, namespace="a-b", release="x"))
    met = set(one) & set(two)
    assert met == {("Namespace", "a-b-x-relayfleet-spark")}, sorted(met)


def test_two_releases_in_one_namespace_share_no_name() -> None:
    one = render(*EVERYTHING, include_crds=False, release="blue")
    two = render(*EVERYTHING, include_crds=False, release="green")
    names = {(d["kind"], d["metadata"]["name"]) for d in one}
    assert not names & {(d["kind"], d["metadata"]["name"]) for d in two}
