"""Least privilege as the chart renders it (helm template), and on a real API server.

A7: the Spark jobs run in a namespace of their own; their ServiceAccount holds no right on
Pods, claims, Secrets or ServiceAccounts of the release namespace (only the shard maps by
name, RelayShards and RelayRebalances), and the operator's one right in the Spark namespace is
the credentials copy. Checked on the rendered RBAC and by `kubectl auth can-i --as` on the
bare kube-apiserver (RBAC authorizer) with the chart's objects applied.
A8: the executor pod template and the driver Pod meet Pod Security "restricted"; the Spark
namespace enforces it; the API server's PodSecurity admission admits the template's Pod there
and refuses the same Pod without it.
A9: the operator is told its namespace and its release's labels, and the Spark namespace and
fleets, from which it builds the Redis NetworkPolicy peers (tests/operator/test_builders.py).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.chart import CHART, HELM, K8S_VERSION, helm, needs_helm, render
from tests.support.k8s_cluster import KubeCluster

pytestmark = needs_helm

NS = "relay"
SPARK_NS = "relay-relayfleet-spark"
SA = "relayfleet-spark"
# what no Role of the Spark ServiceAccount may grant in the release namespace
DANGEROUS = {"pods", "pods/exec", "pods/attach", "persistentvolumeclaims", "secrets", "serviceaccounts",
             "serviceaccounts/token", "*"}  # fmt: skip


def docs(*sets: str, namespace: str = NS) -> list[dict[str, Any]]:
    return render(*sets, include_crds=False, namespace=namespace)


def by_kind(rendered: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in rendered if d["kind"] == kind]


def rules_of(
    rendered: list[dict[str, Any]], sa_ns: str, sa: str, cluster_wide: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Per namespace, the rules every RoleBinding of the rendered chart gives that ServiceAccount
    (and, unless `cluster_wide`, that no ClusterRoleBinding names it)."""
    roles = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in by_kind(rendered, "Role")}
    out: dict[str, list[dict[str, Any]]] = {}
    for rb in by_kind(rendered, "RoleBinding"):
        if {"kind": "ServiceAccount", "name": sa, "namespace": sa_ns} in rb["subjects"]:
            ns = rb["metadata"]["namespace"]
            out.setdefault(ns, []).extend(roles[(ns, rb["roleRef"]["name"])]["rules"])
    for crb in by_kind(rendered, "ClusterRoleBinding"):
        assert (
            cluster_wide or {"kind": "ServiceAccount", "name": sa, "namespace": sa_ns} not in crb["subjects"]
        ), crb
    return out


def test_spark_jobs_and_their_account_live_in_their_own_namespace() -> None:
    rendered = docs()
    (namespace,) = by_kind(rendered, "Namespace")
    assert namespace["metadata"]["name"] == SPARK_NS
    for kind in ("CronJob", "ServiceAccount"):
        spark = [d for d in by_kind(rendered, kind) if "spark" in d["metadata"]["name"] or kind == "CronJob"]
        assert spark, kind
        assert {d["metadata"]["namespace"] for d in spark} == {SPARK_NS}, kind
    for cj in by_kind(rendered, "CronJob"):
        pod = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == SA
        (secret,) = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert secret == "relayfleet-default-credentials"  # the operator's copy, in SPARK_NS
        args = pod["containers"][0]["args"]
        # the shard map is read across namespaces, from the fleets' own
        assert args[args.index("--shard-map-configmap") + 1] == f"{NS}/relayfleet-default-shardmap"


def test_spark_account_has_no_pod_claim_secret_or_account_rights_in_the_release_namespace() -> None:
    """A7: before, one Role in the release namespace gave pods/configmaps/PVCs create+delete
    and the fleets' credentials Secrets: a Pod made with it could mount the operator's token."""
    rules = rules_of(docs(), SPARK_NS, SA)
    assert set(rules) == {NS, SPARK_NS}
    for rule in rules[NS]:
        assert not set(rule["resources"]) & DANGEROUS, rule
        assert "*" not in rule["verbs"], rule
        assert "*" not in rule["apiGroups"], rule
    granted = {
        (g, r, v)
        for rule in rules[NS]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == {
        ("", "configmaps", "get"),
        ("relayfleet.dev", "relayshards", "get"),
        ("relayfleet.dev", "relayshards", "list"),
        ("relayfleet.dev", "relayrebalances", "get"),
        ("relayfleet.dev", "relayrebalances", "list"),
        ("relayfleet.dev", "relayrebalances", "create"),
        ("relayfleet.dev", "relayrebalances", "patch"),
    }
    (cm_rule,) = [r for r in rules[NS] if r["resources"] == ["configmaps"]]
    assert cm_rule["resourceNames"] == ["relayfleet-default-shardmap"]
    # in its own namespace: what client mode needs, and no Secrets
    own = {r for rule in rules[SPARK_NS] for r in rule["resources"]}
    assert own == {"pods", "configmaps", "services"}


def test_the_operator_may_only_keep_the_credentials_copy_in_the_spark_namespace() -> None:
    rendered = docs("spark.fleets={default,main}")
    rules = rules_of(rendered, NS, "relayfleet-operator", cluster_wide=True)
    assert rules[SPARK_NS] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["relayfleet-default-credentials", "relayfleet-main-credentials"],
            "verbs": ["get", "patch"],
        },
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    ]
    (dep,) = [d for d in by_kind(rendered, "Deployment") if d["metadata"]["name"] == "relayfleet-operator"]
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RELAYFLEET_OPERATOR_SPARK_NAMESPACE"]["value"] == SPARK_NS
    assert env["RELAYFLEET_OPERATOR_SPARK_FLEETS"]["value"] == f"{NS}/default,{NS}/main"
    assert env["RELAYFLEET_OPERATOR_POD_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}
    }
    # the labels the NetworkPolicy will select the operator by are its Pods' own, release included
    labels = dict(kv.split("=") for kv in env["RELAYFLEET_OPERATOR_POD_LABELS"]["value"].split(","))
    assert labels["app.kubernetes.io/instance"] == "relayfleet"
    assert labels.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # Spark off: no namespace, no rights there, no Spark settings for the operator
    off = docs("spark.retention.enabled=false", "spark.rebalance.enabled=false")
    assert not by_kind(off, "Namespace")
    assert SPARK_NS not in rules_of(off, NS, "relayfleet-operator", cluster_wide=True)
    (dep,) = [d for d in by_kind(off, "Deployment") if d["metadata"]["name"] == "relayfleet-operator"]
    names = {e["name"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "RELAYFLEET_OPERATOR_SPARK_NAMESPACE" not in names


def test_the_spark_namespace_value() -> None:
    named = docs("spark.namespace.name=jobs")
    assert by_kind(named, "Namespace")[0]["metadata"]["name"] == "jobs"
    assert {d["metadata"]["namespace"] for d in by_kind(named, "CronJob")} == {"jobs"}
    pre_created = docs("spark.namespace.name=jobs", "spark.namespace.create=false")
    assert not by_kind(pre_created, "Namespace")
    assert HELM is not None
    for bad in (f"spark.namespace.name={NS}", "spark.namespace.name=Not_A_Name"):
        proc = subprocess.run(
            [HELM, "template", "relayfleet", str(CHART), "--namespace", NS, "--set", bad],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode != 0, bad
    long = subprocess.run(
        [HELM, "template", "relayfleet", str(CHART), "--namespace", "n" * 60],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "set spark.namespace.name" in long.stderr


def executor_template(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = [
        d for d in by_kind(rendered, "ConfigMap") if d["metadata"]["name"] == "relayfleet-spark-executor"
    ]
    assert cm["metadata"]["namespace"] == SPARK_NS
    pod: dict[str, Any] = yaml.safe_load(cm["data"]["executor-pod.yaml"])
    return pod


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """Pod Security "restricted" (v1.36) as it bears on what the chart sets."""
    out = []
    pod = pod_spec.get("securityContext") or {}
    for c in pod_spec["containers"]:
        ctx = c.get("securityContext") or {}
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation")
        if "ALL" not in (ctx.get("capabilities") or {}).get("drop", []):
            out.append(f"{c['name']}: capabilities.drop ALL")
        if not (ctx.get("runAsNonRoot") or pod.get("runAsNonRoot")):
            out.append(f"{c['name']}: runAsNonRoot")
        if (ctx.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            out.append(f"{c['name']}: seccompProfile")
    return out


def test_executor_and_driver_pods_meet_pod_security_restricted() -> None:
    """A8: executors got no securityContext at all; the pod template gives them the driver's."""
    rendered = docs()
    (namespace,) = by_kind(rendered, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    template = executor_template(rendered)
    template["metadata"] = {"name": "exec"}
    template["spec"]["containers"][0]["image"] = "ghcr.io/relayfleet/relayfleet-spark:x"
    kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    assert restricted_violations(template["spec"]) == []
    assert template["spec"]["automountServiceAccountToken"] is False  # executors never call the API
    for cj in by_kind(rendered, "CronJob"):
        pod = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        assert restricted_violations(pod) == []
        container = pod["containers"][0]
        args = container["args"]
        conf = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--conf")
        path = conf["spark.kubernetes.executor.podTemplateFile"]
        assert conf["spark.kubernetes.executor.podTemplateContainerName"] == "spark-executor"
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "relayfleet-spark-executor"
        assert path.rsplit("/", 1)[1] == "executor-pod.yaml"


# --- on a real API server -----------------------------------------------------------------------


def apply_chart(cluster: KubeCluster, ns: str) -> tuple[str, list[dict[str, Any]]]:
    """The chart rendered for `ns`, applied for real (its Spark namespace made first)."""
    spark_ns = f"{ns}-relayfleet-spark"
    rendered = helm("template", "relayfleet", str(CHART), "--namespace", ns)
    objs = [d for d in yaml.safe_load_all(rendered) if d]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    return spark_ns, objs


def can_i(cluster: KubeCluster, user: str, ns: str, verb: str, resource: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", verb, resource, "-n", ns, f"--as={user}", check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stderr
    return proc.stdout.strip() == "yes"


def test_rbac_and_pod_security_on_the_api_server(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    """The RBAC authorizer and the PodSecurity admission plugin of a real kube-apiserver,
    with the chart's objects applied: the Spark account's matrix, a real create of a Pod as
    it in the release namespace (Forbidden), the executor template's Pod created in the Spark
    namespace (admitted) and the same Pod without it (refused)."""
    spark_ns, objs = apply_chart(kube_apiserver, apiserver_ns)
    try:
        user = f"system:serviceaccount:{spark_ns}:{SA}"
        for verb, resource in (("create", "pods"), ("delete", "persistentvolumeclaims"), ("get", "secrets")):
            assert not can_i(kube_apiserver, user, apiserver_ns, verb, resource), (verb, resource)
        assert can_i(kube_apiserver, user, apiserver_ns, "get", "configmaps/relayfleet-default-shardmap")
        assert can_i(kube_apiserver, user, apiserver_ns, "create", "relayrebalances.relayfleet.dev")
        assert can_i(kube_apiserver, user, spark_ns, "create", "pods")
        assert not can_i(kube_apiserver, user, spark_ns, "get", "secrets")
        operator = f"system:serviceaccount:{apiserver_ns}:relayfleet-operator"
        assert can_i(kube_apiserver, operator, spark_ns, "patch", "secrets/relayfleet-default-credentials")
        assert not can_i(kube_apiserver, operator, spark_ns, "get", "secrets/other")
        assert not can_i(kube_apiserver, operator, spark_ns, "create", "pods")

        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "escape"},
            "spec": {
                "serviceAccountName": "relayfleet-operator",
                "containers": [{"name": "c", "image": "x", "command": ["true"]}],
            },
        }
        proc = kube_apiserver.kubectl(
            "-n", apiserver_ns, "create", "-f", "-", f"--as={user}", input=json.dumps(pod), check=False
        )
        assert proc.returncode != 0
        assert "forbidden" in proc.stderr.lower(), proc.stderr

        cm = json.loads(
            kube_apiserver.kubectl(
                "-n", spark_ns, "get", "configmap", "relayfleet-spark-executor", "-o", "json"
            ).stdout
        )
        executor: dict[str, Any] = yaml.safe_load(cm["data"]["executor-pod.yaml"])
        executor["metadata"] = {"name": "exec-1"}
        executor["spec"]["containers"][0] |= {
            "image": "ghcr.io/relayfleet/relayfleet-spark:x",
            "command": ["true"],
        }
        # the controller-manager makes each namespace's "default" account; the bare API server has none
        kube_apiserver.kubectl("-n", spark_ns, "create", "serviceaccount", "default", check=False)
        made = kube_apiserver.kubectl(
            "-n", spark_ns, "create", "-f", "-", f"--as={user}", input=json.dumps(executor), check=False
        )
        assert made.returncode == 0, made.stderr
        bare = json.loads(json.dumps(executor))
        bare["metadata"]["name"] = "exec-2"
        del bare["spec"]["securityContext"], bare["spec"]["containers"][0]["securityContext"]
        refused = kube_apiserver.kubectl(
            "-n", spark_ns, "create", "-f", "-", f"--as={user}", input=json.dumps(bare), check=False
        )
        assert refused.returncode != 0
        assert 'violates PodSecurity "restricted' in refused.stderr, refused.stderr
    finally:
        kube_apiserver.kubectl("delete", "namespace", spark_ns, "--wait=false", check=False)
        for d in objs:
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                kube_apiserver.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], check=False)


@pytest.mark.parametrize("sets", [[], ["operator.watchAllNamespaces=true"]])
def test_kubernetes_validate_accepts_the_new_objects(sets: list[str]) -> None:
    for d in docs(*sets):
        if d["kind"] in ("Namespace", "Role", "RoleBinding") or d["metadata"]["name"].endswith(
            "spark-executor"
        ):
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
