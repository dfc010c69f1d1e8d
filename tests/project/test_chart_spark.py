"""The Spark CronJobs as the chart renders them (helm template): where the driver listens and
what executors connect to, what each Pod asks of the node, and what Spark may do in the API."""

from __future__ import annotations

import re
import subprocess
import uuid
from typing import Any

import pytest

from tests.support.chart import CHART, HELM, needs_helm, render

pytestmark = needs_helm

JOBS = ("retention", "rebalance")


def cronjobs(*sets: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in render(*sets, include_crds=False) if d["kind"] == "CronJob"}


def driver(cronjob: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    return container


def spark_conf(cronjob: dict[str, Any]) -> dict[str, str]:
    args = driver(cronjob)["args"]
    pairs = [args[i + 1] for i, a in enumerate(args) if a == "--conf"]
    return dict(p.split("=", 1) for p in pairs)


def quantity_cpu(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_executors_are_handed_the_driver_pod_ip_not_a_wildcard() -> None:
    """In client mode executors connect to the driver's bind address when Spark uses the
    driver's Pod IP (spark.kubernetes.executor.useDriverPodIP): 0.0.0.0 there made every
    executor fail with "Failed to connect to /0.0.0.0:7078"."""
    for job in JOBS:
        cj = cronjobs()[f"relayfleet-{job}-default"]
        conf = spark_conf(cj)
        assert conf["spark.driver.bindAddress"] == conf["spark.driver.host"] == "$(POD_IP)"
        assert "0.0.0.0" not in " ".join(driver(cj)["args"])
        env = {e["name"]: e for e in driver(cj)["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def expand(value: str, env: dict[str, str]) -> str:
    """A container argument as the kubelet expands it: $(NAME) from the container's env."""
    return re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], value)


def test_two_drivers_in_one_namespace_name_their_executors_apart() -> None:
    """Executor Pods are "<podNamePrefix>-exec-<n>": a prefix fixed per fleet made a second
    driver of the same CronJob (a scheduled run beside a manual one) hit AlreadyExists on the
    first one's executor names. The prefix comes from the driver Pod's UID (downward API)."""
    for fleet in ("default", "f" * 32):  # the schema's longest fleet name
        for job in JOBS:
            (cj,) = [c for n, c in cronjobs(f"spark.fleets={{{fleet}}}").items() if job in n]
            env = {e["name"]: e for e in driver(cj)["env"]}
            assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
            prefix = spark_conf(cj)["spark.kubernetes.executor.podNamePrefix"]
            names = set()
            for _ in range(2):  # two driver Pods of that CronJob, each with the UID the API gives it
                pod_env = {"POD_UID": str(uuid.uuid4()), "POD_NAMESPACE": "relay"}
                expanded = expand(prefix, pod_env)
                # Spark's own check: a DNS label, at most 47 long (63 - "-exec-" - a 10-digit id)
                assert len(expanded) <= 47, expanded
                assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", expanded), expanded
                names.add(f"{expanded}-exec-1")
            assert len(names) == 2, names
            labels = [
                v for k, v in spark_conf(cj).items() if k.startswith("spark.kubernetes.executor.label.")
            ]
            assert fleet in labels


def test_spark_requests_fit_a_small_node_by_default_and_follow_the_values() -> None:
    """Executors asked for spark.executor.cores whole CPUs each (1): on a 2-CPU node beside a
    fleet they stayed Pending. Their CPU request is a value of the chart, 250m by default."""
    cj = cronjobs()["relayfleet-retention-default"]
    conf = spark_conf(cj)
    assert conf["spark.kubernetes.executor.request.cores"] == "250m"
    assert "spark.kubernetes.executor.limit.cores" not in conf
    assert (conf["spark.executor.memory"], conf["spark.executor.memoryOverhead"]) == ("512m", "384m")
    executors = int(conf["spark.executor.instances"])
    driver_cpu = quantity_cpu(driver(cj)["resources"]["requests"]["cpu"])
    total = driver_cpu + executors * quantity_cpu(conf["spark.kubernetes.executor.request.cores"])
    assert total <= 1.0, f"one job asks for {total} CPUs"

    conf = spark_conf(
        cronjobs(
            "spark.executor.requestCores=500m",
            "spark.executor.limitCores=1",
            "spark.executor.instances=3",
            "spark.executor.memory=2g",
        )["relayfleet-rebalance-default"]
    )
    assert conf["spark.kubernetes.executor.request.cores"] == "500m"
    assert conf["spark.kubernetes.executor.limit.cores"] == "1"
    assert (conf["spark.executor.instances"], conf["spark.executor.memory"]) == ("3", "2g")


@pytest.mark.parametrize("bad", ["spark.executor.requestCores=lots", "spark.executor.memoryOverhead=1GiB"])
def test_the_values_schema_refuses_bad_spark_sizes(bad: str) -> None:
    assert HELM is not None
    proc = subprocess.run(
        [HELM, "template", "relayfleet", str(CHART), "--set", bad],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr


def test_the_spark_role_lets_spark_clean_up_its_services() -> None:
    """Spark deletes its application's Services when it stops: a 403 ended every job."""
    (role,) = [
        d
        for d in render(include_crds=False)
        if d["kind"] == "Role"
        and d["metadata"]["name"] == "relayfleet-spark"
        and d["metadata"]["namespace"].endswith("-spark")  # its own namespace, where Spark runs
    ]
    verbs = {
        v
        for r in role["rules"]
        if "services" in r["resources"] and r["apiGroups"] == [""]
        for v in r["verbs"]
    }
    assert {"delete", "deletecollection", "list"} <= verbs
    assert "create" not in verbs  # client mode creates none
