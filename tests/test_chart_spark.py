"""The Spark CronJobs as the chart renders them (helm template): where the driver listens and
what executors connect to, what each Pod asks of the node, and what Spark may do in the API."""

from __future__ import annotations

from typing import Any

from tests.support.chart import needs_helm, render

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
