"""Least privilege on the real node: what the Spark jobs' ServiceAccount may do, whether the
executors' Pod template passes Pod Security "restricted" where it is enforced, and whom the
operator's Redis NetworkPolicy admits.

A7: the API server answers `kubectl auth can-i --as=system:serviceaccount:<spark ns>:<sa>`
(impersonation by the cluster admin, as a SubjectAccessReview would) and a real `create pod`
as that ServiceAccount in the release namespace is Forbidden. A8: the executor Pod template
(the chart's ConfigMap) is created as a real Pod, as the Spark ServiceAccount, in the Spark
namespace that enforces "restricted"; the same Pod without it is refused (the check is live).
The real Spark Jobs' executors are checked in test_user_path.py. A9: the node's network is
the bridge CNI plugin, which does not enforce NetworkPolicies (docs/e2e.md): a connection
from an intruder Pod would succeed whatever the policy says. So the policy the operator wrote
is evaluated against the API instead: its peers' namespace and Pod selectors are run as label
selectors over the cluster's real namespaces and Pods, an intruder Pod with the operator's
labels in another namespace among them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from e2e.env import FLEET, RELEASE, Env
from e2e.probes import shard, wait_for

SPARK_SA = f"{RELEASE}-spark"
# (verb, resource) the Spark ServiceAccount must NOT have in the release namespace
FORBIDDEN_IN_RELEASE_NS = [
    ("create", "pods"),
    ("delete", "persistentvolumeclaims"),
    ("get", "secrets"),
    ("list", "secrets"),
    ("create", "serviceaccounts"),
    ("list", "pods"),
    ("delete", "pods"),
]
# what it needs there (the shard map by name, RelayShards, RelayRebalance proposals)
ALLOWED_IN_RELEASE_NS = [
    ("get", f"configmaps/relayfleet-{FLEET}-shardmap"),
    ("list", "relayshards.relayfleet.dev"),
    ("create", "relayrebalances.relayfleet.dev"),
    ("patch", "relayrebalances.relayfleet.dev"),
]
# what client mode needs in its own namespace
ALLOWED_IN_SPARK_NS = [("create", "pods"), ("delete", "pods"), ("watch", "pods"), ("delete", "services")]
FORBIDDEN_IN_SPARK_NS = [("get", "secrets"), ("create", "secrets")]
RESULTS: dict[str, Any] = {}


def sa_user(e2e: Env) -> str:
    return f"system:serviceaccount:{e2e.spark_namespace}:{SPARK_SA}"


def can_i(e2e: Env, namespace: str, verb: str, resource: str) -> bool:
    proc = e2e.cluster.kubectl(
        "auth", "can-i", verb, resource, "-n", namespace, f"--as={sa_user(e2e)}", check=False
    )
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), (verb, resource, proc.stdout, proc.stderr)
    return answer == "yes"


def operator_available(e2e: Env) -> bool:
    dep: Any = e2e.get("deployment", f"{RELEASE}-operator")
    return bool(dep) and (dep.get("status") or {}).get("availableReplicas") == 1


def test_spark_service_account_cannot_create_pods_or_touch_claims_or_secrets_of_the_release(e2e: Env) -> None:
    wait_for("operator available", lambda: operator_available(e2e), timeout=120)
    release, spark = e2e.namespace, e2e.spark_namespace
    matrix = {
        f"{release}: {verb} {res}": can_i(e2e, release, verb, res)
        for verb, res in FORBIDDEN_IN_RELEASE_NS + ALLOWED_IN_RELEASE_NS
    }
    matrix |= {
        f"{spark}: {verb} {res}": can_i(e2e, spark, verb, res)
        for verb, res in ALLOWED_IN_SPARK_NS + FORBIDDEN_IN_SPARK_NS
    }
    RESULTS["can-i"] = matrix
    print(json.dumps(matrix, indent=1))
    for verb, res in FORBIDDEN_IN_RELEASE_NS:
        assert not matrix[f"{release}: {verb} {res}"], (verb, res)
    for verb, res in ALLOWED_IN_RELEASE_NS:
        assert matrix[f"{release}: {verb} {res}"], (verb, res)
    for verb, res in ALLOWED_IN_SPARK_NS:
        assert matrix[f"{spark}: {verb} {res}"], (verb, res)
    for verb, res in FORBIDDEN_IN_SPARK_NS:
        assert not matrix[f"{spark}: {verb} {res}"], (verb, res)

    # A real create, as the ServiceAccount: a Pod that would mount the operator's token.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "spark-sa-escape"},
        "spec": {
            "serviceAccountName": f"{RELEASE}-operator",
            "containers": [{"name": "c", "image": "ghcr.io/relayfleet/relayfleet:any", "command": ["true"]}],
        },
    }
    proc = e2e.cluster.kubectl(
        "-n", release, "create", "-f", "-", f"--as={sa_user(e2e)}", input=json.dumps(pod), check=False
    )
    assert proc.returncode != 0
    assert "Forbidden" in proc.stderr or "forbidden" in proc.stderr, proc.stderr
    assert e2e.get("pod", "spark-sa-escape") is None
    RESULTS["create pod as spark SA in release ns"] = proc.stderr.strip().splitlines()[-1][:200]


def spark_image(e2e: Env) -> str:
    cj: Any = e2e.spark().get("cronjob", f"{RELEASE}-retention-{FLEET}")
    image: str = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


def executor_pod(e2e: Env, name: str) -> dict[str, Any]:
    """A Pod as Spark builds an executor: the chart's template, the Spark image, a command."""
    cm: Any = e2e.spark().get("configmap", f"{RELEASE}-spark-executor")
    pod: dict[str, Any] = yaml.safe_load(cm["data"]["executor-pod.yaml"])
    pod["metadata"] = {"name": name, "labels": {"spark-role": "executor", "relayfleet.dev/fleet": FLEET}}
    pod["spec"]["restartPolicy"] = "Never"
    (container,) = pod["spec"]["containers"]
    container |= {"image": spark_image(e2e), "imagePullPolicy": "IfNotPresent", "command": ["true"]}
    return pod


def test_executor_pod_template_is_admitted_where_restricted_is_enforced(e2e: Env) -> None:
    ns: Any = e2e.cluster.kubectl("get", "namespace", e2e.spark_namespace, "-o", "json").stdout
    labels = json.loads(ns)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted", labels
    spark = e2e.spark()
    name = f"executor-template-{uuid.uuid4().hex[:6]}"
    pod = executor_pod(e2e, name)
    created = spark.cluster.kubectl(
        "-n", spark.namespace, "create", "-f", "-", f"--as={sa_user(e2e)}", input=json.dumps(pod), check=False
    )
    assert created.returncode == 0, created.stderr
    assert "would violate PodSecurity" not in created.stderr  # no warning either
    admitted: Any = spark.get("pod", name)
    assert admitted is not None
    RESULTS["executor securityContext"] = {
        "pod": admitted["spec"]["securityContext"],
        "container": admitted["spec"]["containers"][0]["securityContext"],
    }
    spark.kubectl("delete", "pod", name, "--wait=false", check=False)

    # The check is live: the Pod Spark built before the template (no securityContext) is refused.
    bare = executor_pod(e2e, f"{name}-bare")
    bare["spec"].pop("securityContext")
    bare["spec"]["containers"][0].pop("securityContext")
    refused = spark.cluster.kubectl(
        "-n",
        spark.namespace,
        "create",
        "-f",
        "-",
        f"--as={sa_user(e2e)}",
        input=json.dumps(bare),
        check=False,
    )
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted' in refused.stderr, refused.stderr


def selector(match: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(match.items()))


def admitted_pods(e2e: Env, policy: dict[str, Any]) -> set[tuple[str, str]]:
    """(namespace, pod) of every Pod of the cluster one of the policy's peers selects, the
    selectors run by the API server as label selectors (what a NetworkPolicy plugin does)."""
    out: set[tuple[str, str]] = set()
    own = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            assert set(peer) <= {"namespaceSelector", "podSelector"}, peer
            if "namespaceSelector" in peer:
                ns_sel = selector(peer["namespaceSelector"].get("matchLabels") or {})
                args = ["get", "namespaces", "-o", "json", *(["-l", ns_sel] if ns_sel else [])]
                docs = json.loads(e2e.cluster.kubectl(*args).stdout)["items"]
                namespaces = [d["metadata"]["name"] for d in docs]
            else:
                namespaces = [own]
            pod_sel = selector(peer["podSelector"].get("matchLabels") or {})
            for ns in namespaces:
                args = ["get", "pods", "-n", ns, "-o", "json", *(["-l", pod_sel] if pod_sel else [])]
                for p in json.loads(e2e.cluster.kubectl(*args).stdout)["items"]:
                    out.add((ns, p["metadata"]["name"]))
    return out


@pytest.mark.timeout(300)
def test_redis_network_policy_admits_this_releases_pods_of_this_namespace_only(e2e: Env) -> None:
    e2e.kubectl("apply", "-f", "-", input=shard("a"))
    policy: Any = wait_for(
        "the shard's Redis NetworkPolicy", lambda: e2e.get("networkpolicy", "relayfleet-a-redis")
    )
    operator_pod = e2e.pods("app.kubernetes.io/component=operator")[0]
    operator_labels = operator_pod["metadata"]["labels"]

    intruder_ns = f"rf-e2e-intruder-{uuid.uuid4().hex[:6]}"
    e2e.cluster.kubectl("create", "namespace", intruder_ns)
    try:
        # A Pod anyone with Pod rights in another namespace can make: the operator's labels.
        intruder = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "looks-like-the-operator", "labels": operator_labels},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "c",
                        "image": operator_pod["spec"]["containers"][0]["image"],
                        "command": ["true"],
                    }
                ],
            },
        }
        e2e.cluster.kubectl("-n", intruder_ns, "create", "-f", "-", input=json.dumps(intruder))
        after = admitted_pods(e2e, policy)
        # What main's policy (b799dbc) admitted: the operator's two labels in any namespace.
        before_policy = json.loads(json.dumps(policy))
        for peer in before_policy["spec"]["ingress"][0]["from"]:
            if peer["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "operator":
                peer["namespaceSelector"] = {}
                peer["podSelector"] = {
                    "matchLabels": {
                        "app.kubernetes.io/name": "relayfleet",
                        "app.kubernetes.io/component": "operator",
                    }
                }
        before = admitted_pods(e2e, before_policy)
        RESULTS["networkpolicy"] = {
            "peers": policy["spec"]["ingress"][0]["from"],
            "intruder admitted before": (intruder_ns, "looks-like-the-operator") in before,
            "intruder admitted after": (intruder_ns, "looks-like-the-operator") in after,
        }
        print(json.dumps(RESULTS["networkpolicy"], indent=1))
        assert (intruder_ns, "looks-like-the-operator") in before  # the hole was real
        assert (intruder_ns, "looks-like-the-operator") not in after
        assert (e2e.namespace, operator_pod["metadata"]["name"]) in after  # migrations still reach Redis
        assert {ns for ns, _ in after} <= {e2e.namespace, e2e.spark_namespace}, after
        spark_peers = [p for p in policy["spec"]["ingress"][0]["from"] if "namespaceSelector" in p]
        assert {"kubernetes.io/metadata.name": e2e.spark_namespace} in [
            p["namespaceSelector"]["matchLabels"] for p in spark_peers
        ]
    finally:
        e2e.cluster.kubectl("delete", "namespace", intruder_ns, "--wait=false", check=False)


def test_the_operator_keeps_a_copy_of_the_credentials_in_the_spark_namespace(e2e: Env) -> None:
    """The Spark jobs' only Secret: the fleet's credentials, copied by the operator."""
    e2e.kubectl("apply", "-f", "-", input=shard("a"))

    def same() -> bool:
        source, copy = (
            e2e.get("secret", f"relayfleet-{FLEET}-credentials"),
            e2e.spark().get("secret", f"relayfleet-{FLEET}-credentials"),
        )
        return bool(source and copy and source.get("data") and source["data"] == copy.get("data"))

    wait_for("the credentials copy in the Spark namespace", same, timeout=120)
    names = e2e.spark().kubectl("get", "secrets", "-o", "name").stdout.split()
    assert names == [f"secret/relayfleet-{FLEET}-credentials"], names


def test_print_results() -> None:
    print(json.dumps(RESULTS, indent=1, default=str))
