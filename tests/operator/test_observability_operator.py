"""The operator's side of the dashboard and rules, against the real operator: it runs on the
kwok cluster (tests/support/k8s_cluster.py) and joins a second shard with an automatic rebalance, while
a real Prometheus scrapes its /metrics with the chart's rendered rules. Every dashboard query
and alert expression over `relayfleet_operator_*` series is then evaluated; each dashboard
query returns data, except those over relayfleet_operator_errors_total, which has a series
only once an error happened (none does in a healthy run: asserted)."""

from __future__ import annotations

from pathlib import Path

from tests.support.observability import (
    alert_rules,
    dashboard_queries,
    metric_names,
    promql,
    rendered_rule_groups,
)
from tests.support.operator_harness import (
    KwokFleet,
)
from tests.support.prometheus import NEEDS_PROMETHEUS, run_prometheus, wait_until

pytestmark = [*NEEDS_PROMETHEUS]

ERRORS = "relayfleet_operator_errors_total"


def operator_only(expr: str) -> bool:
    names = metric_names(expr)
    return bool(names) and all(n.startswith("relayfleet_operator_") for n in names)


def test_operator_queries_against_a_real_prometheus(kwok_fleet: KwokFleet, tmp_path: Path) -> None:
    fleet = kwok_fleet
    fleet.redis("a", "b")
    fleet.seed("a", queues=20, per_queue=2)  # data for the join to move (bytes moved)
    fleet.operator.start()
    with run_prometheus(tmp_path, [f"127.0.0.1:{fleet.operator.metrics_port}"]) as prom:
        fleet.auto_rebalanced_join()
        wait_until(
            "slots moved, scraped",
            lambda: prom.query("min(count_over_time(relayfleet_operator_bytes_moved_total[1h])) > 2"),
            20,
        )
        # the counters of what this run did moved (docs/observability.md names each)
        for moved in (
            "relayfleet_operator_reconciles_total",
            "relayfleet_operator_reconcile_duration_seconds_count",
            "relayfleet_operator_migrations_total",
            "relayfleet_operator_slots_moved_total",
            "relayfleet_operator_bytes_moved_total",
        ):
            assert prom.query(f"sum({moved}) > 0"), moved
        assert prom.query("max(relayfleet_operator_shard_map_epoch) > 1")  # the join rewrote the map

        checked, empty = 0, []
        for dashboard, title, expr in dashboard_queries():
            if not operator_only(expr):
                continue
            checked += 1
            rows = prom.query(promql(expr))
            if not rows and ERRORS not in expr:
                empty.append(f"{dashboard} / {title}: {expr}")
        assert empty == []
        assert checked >= 6
        assert prom.query(f"count({ERRORS})") == []  # a healthy run: no error series at all

        for rule in alert_rules(rendered_rule_groups()):
            if operator_only(rule["expr"]):
                prom.query(rule["expr"])  # parses and evaluates against real operator series
        firing = [a for a in prom.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]
        assert firing == []
