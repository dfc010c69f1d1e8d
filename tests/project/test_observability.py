"""Static checks of the chart's observability: the rendered PrometheusRule passes `promtool check
rules` and promtool rule unit tests, every metric name the rules and dashboards use exists in a
real registry, every alert is documented. The rules and dashboards as data are
tests/support/observability.py (shared with the live tests against a real Prometheus)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from relayfleet_testing.localredis import LocalRedis

from tests.support.chart import CHART, ROOT, helm_binary, needs_helm
from tests.support.in_process_relay import RelayFactory
from tests.support.observability import (
    DASHBOARDS,
    alert_rules,
    dashboard_queries,
    metric_names,
    registry_names,
    rendered_rule_groups,
)

PROMTOOL = "/usr/bin/promtool"
DEBIAN_REDIS = "/usr/bin/redis-server"


needs_promtool = pytest.mark.skipif(not os.path.exists(PROMTOOL), reason="apt-get install prometheus")


@needs_helm
@needs_promtool
def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    groups = rendered_rule_groups()
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    proc = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in proc.stdout


@needs_helm
def test_every_alert_is_complete_and_in_the_runbook() -> None:
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    anchors = {line[3:].strip().lower() for line in runbook.splitlines() if line.startswith("## ")}
    alerts = alert_rules(rendered_rule_groups())
    names = {a["alert"] for a in alerts}
    for wanted in (
        "RelayfleetShardRedisDown",
        "RelayfleetShardMemoryHigh",
        "RelayfleetWakeupLatencyHigh",
        "RelayfleetErrorRatioHigh",
        "RelayfleetRebalanceStuck",
        "RelayfleetRetentionJobFailing",
        "RelayfleetRetentionJobNotRun",
        "RelayfleetOperatorReconcileErrors",
    ):
        assert wanted in names
    for a in alerts:
        ann = a["annotations"]
        assert ann["summary"], a["alert"]
        assert ann["description"], a["alert"]
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert ann["runbook_url"].endswith("docs/runbook.md#" + a["alert"].lower()), a["alert"]
        assert a["alert"].lower() in anchors, f"docs/runbook.md has no section '## {a['alert']}'"


def test_every_metric_name_exists() -> None:
    """No typo'd names, including the operator's and the Spark jobs' (which a local fleet lacks)."""
    known = registry_names()
    used = {n for _, _, e in dashboard_queries() for n in metric_names(e)}
    used |= {
        n
        for a in alert_rules(yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"])
        for n in metric_names(a["expr"])
    }
    assert used
    assert sorted(used - known) == []


def test_rebalance_figures_match_the_job() -> None:
    """The rebalance figures the dashboard shows are the ones the job sets."""
    source = (ROOT / "spark_jobs" / "rebalance.py").read_text() + (
        ROOT / "spark_jobs" / "retention.py"
    ).read_text()
    for _, _, expr in dashboard_queries():
        for name in metric_names(expr):
            if name.startswith("relayfleet_spark_job_") and name not in (
                "relayfleet_spark_job_success",
                "relayfleet_spark_job_duration_seconds",
                "relayfleet_spark_job_last_success_timestamp_seconds",
                "relayfleet_spark_job_last_run_timestamp_seconds",
            ):
                figure = name.removeprefix("relayfleet_spark_job_")
                assert figure in source or f'"{figure}"' in (ROOT / "spark_jobs" / "retention.py").read_text()


def test_dashboard_is_well_formed() -> None:
    assert DASHBOARDS
    ids: set[int] = set()
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        assert doc["uid"]
        assert doc["title"]
        for panel in doc["panels"]:
            assert panel["id"] not in ids
            ids.add(panel["id"])
            if panel["type"] != "row":
                assert panel["targets"], panel["title"]
    titles = " ".join(t for _, t, _ in dashboard_queries()).lower()
    for wanted in (
        "messages per second",
        "latency p50 / p99",
        "waiters",
        "4xx / 5xx",
        "429",
        "memory",
        "migrating",
    ):
        assert wanted in titles


# promtool rule unit tests: the alerts whose series a local fleet can't produce (operator,
# Spark), plus the shard alerts, against synthetic series with the rendered rules.
# (series, [(eval minute, alert, labels of the one expected alert or None for none)])
_UNIT_CASES: list[tuple[list[tuple[str, str]], list[tuple[int, str, dict[str, str] | None]]]] = [
    (
        [
            ('relayfleet_shard_up{namespace="n", fleet="f", shard="a", instance="r1"}', "1 1 0x10"),
            ('relayfleet_shard_up{namespace="n", fleet="f", shard="a", instance="r2"}', "1x12"),
            # another fleet's shard "a", up: not merged with the first
            ('relayfleet_shard_up{namespace="n", fleet="g", shard="a", instance="r3"}', "1x12"),
        ],
        [
            (1, "RelayfleetShardRedisDown", None),
            (10, "RelayfleetShardRedisDown", {"namespace": "n", "fleet": "f", "shard": "a"}),
        ],
    ),
    (
        [
            ("relayfleet_operator_rebalances_active", "1x90"),
            ('relayfleet_operator_slots_moved_total{fleet="main"}', "0 64 128 128x87"),
            ('relayfleet_operator_errors_total{kind="RelayShard", error="ApiError"}', "0+1x40"),
        ],
        [
            (20, "RelayfleetRebalanceStuck", None),
            (80, "RelayfleetRebalanceStuck", {}),
            (30, "RelayfleetOperatorReconcileErrors", {"kind": "RelayShard"}),
        ],
    ),
    (
        [
            ('relayfleet_spark_job_success{spark_job="retention"}', "1 1 0x300"),
            ('relayfleet_spark_job_last_run_timestamp_seconds{spark_job="retention"}', "0 60 120x300"),
            ('relayfleet_spark_job_last_success_timestamp_seconds{spark_job="retention"}', "0 60x300"),
        ],
        [
            (60, "RelayfleetRetentionJobFailing", {}),
            (60, "RelayfleetRetentionJobNotRun", None),
            (300, "RelayfleetRetentionJobNotRun", {}),
        ],
    ),
    ([], [(40, "RelayfleetRetentionJobNotRun", {"spark_job": "retention"})]),
    (
        [
            ('relayfleet_operator_redis_replicas_online{namespace="n", fleet="f", shard="r"}', "2 2 0x10"),
            ('relayfleet_operator_redis_min_replicas{namespace="n", fleet="f", shard="r"}', "1x12"),
            (
                'relayfleet_operator_last_backup_timestamp_seconds{namespace="n", fleet="f", shard="r"}',
                "0x2000",
            ),
        ],
        [
            (1, "RelayfleetShardReplicasBelowMinimum", None),
            (6, "RelayfleetShardReplicasBelowMinimum", {"namespace": "n", "fleet": "f", "shard": "r"}),
            (60, "RelayfleetShardBackupMissing", None),
            (1560 + 20, "RelayfleetShardBackupMissing", None),  # over 26 h, not yet for 30 min
            (1560 + 40, "RelayfleetShardBackupMissing", {"namespace": "n", "fleet": "f", "shard": "r"}),
        ],
    ),
]


def _expand(text: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)


def _unit_tests(groups: list[dict[str, Any]]) -> dict[str, Any]:
    rules = {r["alert"]: r for r in alert_rules(groups)}
    tests = []
    for series, checks in _UNIT_CASES:
        alert_tests = []
        for minute, name, labels in checks:
            expected = []
            if labels is not None:
                rule = rules[name]
                expected.append(
                    {
                        "exp_labels": {**rule["labels"], **labels},
                        "exp_annotations": {k: _expand(v, labels) for k, v in rule["annotations"].items()},
                    }
                )
            alert_tests.append({"eval_time": f"{minute}m", "alertname": name, "exp_alerts": expected})
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": alert_tests,
            }
        )
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


@needs_helm
@needs_promtool
def test_alert_rules_unit(tmp_path: Path) -> None:
    groups = rendered_rule_groups()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(_unit_tests(groups)))
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_run_summary_push_failure_is_logged_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    from spark_jobs.run_summary import RunSummary

    RunSummary("retention", pushgateway="http://127.0.0.1:1", active=True).finish(0)
    err = capsys.readouterr().err
    assert 'retention: run summary {"durationSeconds"' in err
    assert "retention: cannot push the run summary to http://127.0.0.1:1" in err
    RunSummary("retention", pushgateway="http://127.0.0.1:1").finish(0)  # --help: no run, no output
    assert capsys.readouterr().err == ""


def _render(*args: str) -> list[dict[str, Any]]:
    helm = helm_binary()
    assert helm is not None
    sets = ",".join(
        f"metrics.{k}.enabled=true" for k in ("serviceMonitor", "prometheusRule", "grafanaDashboard")
    )
    proc = subprocess.run(
        [helm, "template", "r", str(CHART), "--set", sets, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@needs_helm
def test_monitoring_objects_need_the_monitoring_api() -> None:
    kinds = [d["kind"] for d in _render()]
    assert "ServiceMonitor" not in kinds
    assert "PrometheusRule" not in kinds
    docs = _render("--api-versions", "monitoring.coreos.com/v1")
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sorted(m["metadata"]["name"] for m in monitors) == ["r-relayfleet-operator", "r-relayfleet-relays"]
    assert [d["kind"] for d in docs].count("PrometheusRule") == 1
    (dash,) = [d for d in docs if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["relayfleet.json"])["uid"] == "relayfleet-overview"
    off = _render(
        "--api-versions", "monitoring.coreos.com/v1", "--set", "metrics.prometheusRule.enabled=false"
    )
    assert "PrometheusRule" not in [d["kind"] for d in off]


def _sample(text: str, name: str, labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_wakeup_reconnects_total_counts_a_real_reconnect(
    relay_factory: RelayFactory, http: aiohttp.ClientSession
) -> None:
    """docs/runbook.md tells on-call to watch relayfleet_wakeup_reconnects_total: it rises when
    the shard's redis-server restarts and the wakeup subscriber connects again."""
    name, labels = "relayfleet_wakeup_reconnects_total", 'shard="default"'
    server = LocalRedis(binary=DEBIAN_REDIS).start()
    try:
        relay = await relay_factory(server.url)
        hub = relay.fleet.hubs["default"]
        before = _sample(await (await http.get(relay.base_url + "/metrics")).text(), name, labels)
        assert hub.healthy
        await asyncio.to_thread(server.stop, signal.SIGKILL)
        for _ in range(100):
            if not hub.healthy:
                break
            await asyncio.sleep(0.05)
        assert not hub.healthy
        await asyncio.to_thread(server.start)
        after = before
        for _ in range(100):  # the subscriber retries with a backoff of at most 2 s
            after = _sample(await (await http.get(relay.base_url + "/metrics")).text(), name, labels)
            if after > before and hub.healthy:
                break
            await asyncio.sleep(0.1)
        assert after == before + 1
    finally:
        server.stop()
