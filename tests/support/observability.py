"""The chart's alert rules and dashboards as data for the observability tests: the rendered
PrometheusRule groups, every dashboard query, and the metric names an expression uses."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import yaml

from tests.support.chart import CHART, helm_binary

DASHBOARDS = sorted((CHART / "files" / "dashboards").glob("*.json"))
PROMETHEUS = "/usr/bin/prometheus"

# Grafana's interval variable has no meaning to Prometheus; the tests put a window in its place
# that covers several 1 s scrapes.
RATE_WINDOW = "30s"

METRIC_NAME = re.compile(r"\brelayfleet_[a-z0-9_]+\b")

# Series that a local fleet cannot produce: the operator runs only against Kubernetes, and the
# Spark jobs' summaries reach Prometheus through a Pushgateway. Here their names are checked
# against the real registries and their alerts by promtool rule unit tests; with data, by
# tests/operator/test_observability_operator.py and tests/spark_jobs/test_observability_spark.py.
NOT_LOCAL = ("relayfleet_operator_", "relayfleet_spark_job_")


def rendered_rule_groups() -> list[dict[str, Any]]:
    """The `groups` of the PrometheusRule exactly as the chart renders it (monitoring API present)."""
    helm = helm_binary()
    if helm is None:
        raise FileNotFoundError("helm not built yet: run hack/control-plane.sh (or set RELAYFLEET_HELM)")
    proc = subprocess.run(
        [
            helm,
            "template",
            "relayfleet",
            str(CHART),
            "--api-versions",
            "monitoring.coreos.com/v1",
            "--set",
            "metrics.prometheusRule.enabled=true",
            "--show-only",
            "templates/prometheusrule.yaml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (doc,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert doc["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = doc["spec"]["groups"]
    return groups


def alert_rules(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for g in groups for r in g["rules"] if "alert" in r]


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expression) of every target of every panel."""
    out = []
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        for panel in doc["panels"]:
            for target in panel.get("targets", ()):
                out.append((path.name, str(panel["title"]), str(target["expr"])))
    return out


DASHBOARD_VARIABLES = ("namespace", "fleet", "shard", "pod")


def promql(expr: str) -> str:
    """The expression as Grafana sends it with every variable at All (`.*`)."""
    expr = expr.replace("$__rate_interval", RATE_WINDOW)
    for name in DASHBOARD_VARIABLES:
        expr = expr.replace(f"${name}", ".*")
    return expr


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def local(expr: str) -> bool:
    return not any(name.startswith(NOT_LOCAL) for name in metric_names(expr))


def registry_names() -> set[str]:
    """Every sample name the relay, the operator and the Spark run summary can expose."""
    from prometheus_client import CollectorRegistry
    from relayfleet_operator import metrics as operator_metrics

    from relay import metrics as relay_metrics
    from spark_jobs.run_summary import RunSummary

    registries: list[CollectorRegistry] = [relay_metrics.REGISTRY, operator_metrics.REGISTRY]
    for job, figures in (
        ("retention", ("messages_removed", "bytes_removed", "queues_deleted", "queues_scanned")),
        ("rebalance", ("slots_proposed", "bytes_proposed", "max_over_mean_before", "max_over_mean_after")),
    ):
        run = RunSummary(job, figures={f: 1.0 for f in figures})
        registries.append(run.registry(ok=True, duration=1.0))
    names: set[str] = set()
    for reg in registries:
        for family in reg.collect():
            names.add(family.name)
            for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
                names.add(family.name + suffix)
    return names
