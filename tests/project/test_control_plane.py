"""The test control planes are real: CEL validation, scheduling, pinned version."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.support.k8s_cluster import KubeCluster, pinned_kube_version
from tests.support.operator_harness import wait_for

T = TypeVar("T")

pytestmark = pytest.mark.k8s

CEL_MESSAGE = "spec.minReplicas must not exceed spec.maxReplicas"


@pytest.fixture
def apiserver_client(kube_apiserver: KubeCluster) -> Iterator[client.ApiClient]:
    with kube_apiserver.api_client() as api:
        yield api


@pytest.fixture
def kwok_client(kwok_cluster: KubeCluster) -> Iterator[client.ApiClient]:
    with kwok_cluster.api_client() as api:
        yield api


def build(factory: Callable[[dict[str, Any]], T | None], data: dict[str, Any]) -> T:
    """A typed client model from a manifest dict (Model.from_dict)."""
    obj = factory(data)
    assert obj is not None
    return obj


def widget_crd(group: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["minReplicas", "maxReplicas"],
                                    "properties": {
                                        "minReplicas": {"type": "integer", "minimum": 0},
                                        "maxReplicas": {"type": "integer", "minimum": 0},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.minReplicas <= self.maxReplicas",
                                            "message": CEL_MESSAGE,
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def test_apiserver_reports_pinned_version(
    kube_apiserver: KubeCluster, apiserver_client: client.ApiClient
) -> None:
    info = client.VersionApi(apiserver_client).get_code()
    if kube_apiserver.external:
        assert info.git_version.startswith("v1.")
        return
    pinned = pinned_kube_version()
    assert info.git_version == pinned
    assert (info.major, info.minor) == tuple(pinned.removeprefix("v").split(".")[:2])
    assert kube_apiserver.bin_dir is not None
    binary = subprocess.run(
        [str(kube_apiserver.bin_dir / "kube-apiserver"), "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert binary.stdout.strip() == f"Kubernetes {pinned}"


def test_crd_cel_rule_rejects_invalid_object(apiserver_client: client.ApiClient) -> None:
    group = f"cp{uuid.uuid4().hex[:8]}.test.relayfleet.dev"
    extensions = client.ApiextensionsV1Api(apiserver_client)
    custom = client.CustomObjectsApi(apiserver_client)
    crd = widget_crd(group)
    extensions.create_custom_resource_definition(build(client.V1CustomResourceDefinition.from_dict, crd))
    try:

        def established() -> bool:
            status = extensions.read_custom_resource_definition(crd["metadata"]["name"]).status
            conditions = (status.conditions if status else None) or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        wait_for("the CRD to be established", established, timeout=60)

        def widget(name: str, lo: int, hi: int) -> dict[str, Any]:
            return {
                "apiVersion": f"{group}/v1",
                "kind": "Widget",
                "metadata": {"name": name},
                "spec": {"minReplicas": lo, "maxReplicas": hi},
            }

        # The API server can serve the new type a moment after Established.
        def create_valid() -> bool:
            try:
                custom.create_namespaced_custom_object(group, "v1", "default", "widgets", widget("ok", 1, 3))
            except ApiException as exc:
                if exc.status == 404:
                    return False
                raise
            return True

        wait_for("the Widget type to be served", create_valid, timeout=60)

        with pytest.raises(ApiException) as rejected:
            custom.create_namespaced_custom_object(group, "v1", "default", "widgets", widget("bad", 5, 2))
        assert rejected.value.status == 422
        assert CEL_MESSAGE in str(rejected.value.body)

        # Updates are validated too (transition from valid to invalid).
        with pytest.raises(ApiException) as rejected_patch:
            custom.patch_namespaced_custom_object(
                group, "v1", "default", "widgets", "ok", {"spec": {"minReplicas": 9}}
            )
        assert rejected_patch.value.status == 422
        assert CEL_MESSAGE in str(rejected_patch.value.body)

        stored = custom.get_namespaced_custom_object(group, "v1", "default", "widgets", "ok")
        assert isinstance(stored, dict)
        assert stored["spec"] == {"minReplicas": 1, "maxReplicas": 3}
        custom.delete_namespaced_custom_object(group, "v1", "default", "widgets", "ok")
    finally:
        extensions.delete_custom_resource_definition(crd["metadata"]["name"])


def test_deployment_pods_run_on_kwok_nodes(kwok_cluster: KubeCluster, kwok_client: client.ApiClient) -> None:
    core = client.CoreV1Api(kwok_client)
    apps = client.AppsV1Api(kwok_client)
    kwok_nodes = {
        n.metadata.name
        for n in core.list_node().items
        if n.metadata
        and n.metadata.name
        and (n.metadata.annotations or {}).get("kwok.x-k8s.io/node") == "fake"
    }
    if not kwok_nodes:
        assert kwok_cluster.external, "the kwok cluster has no kwok nodes"
        pytest.skip("the external cluster has no kwok nodes")

    namespace = f"cp-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    try:
        labels = {"app": "kwok-smoke"}
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "smoke", "labels": labels},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        # kwok never pulls or runs images; the name only has to be valid.
                        "containers": [{"name": "app", "image": "registry.invalid/relayfleet/smoke:0"}],
                        "nodeSelector": {"type": "kwok"},
                        "tolerations": [
                            {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
                        ],
                    },
                },
            },
        }
        apps.create_namespaced_deployment(namespace, build(client.V1Deployment.from_dict, deployment))

        def running_pods() -> dict[str, str]:
            """Running pod name -> its kwok node, once all 3 are there."""
            running = {
                p.metadata.name: p.spec.node_name
                for p in core.list_namespaced_pod(namespace, label_selector="app=kwok-smoke").items
                if p.metadata and p.metadata.name and p.spec and p.spec.node_name in kwok_nodes
                if p.status and p.status.phase == "Running"
            }
            return running if len(running) == 3 else {}

        pods = wait_for("3 Running pods on kwok nodes", running_pods, timeout=180)
        assert set(pods.values()) <= kwok_nodes

        def available() -> bool:
            status = apps.read_namespaced_deployment_status("smoke", namespace).status
            return status is not None and status.available_replicas == 3

        wait_for("the Deployment to be available", available, timeout=120)
    finally:
        core.delete_namespace(namespace)
