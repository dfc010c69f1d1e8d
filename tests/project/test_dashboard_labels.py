"""The dashboard and the alert rules against the series the code exports: every label a panel
filters or groups by exists on the series it names (the labels each metric is declared with in
relay/metrics.py, the operator's metrics.py and the Spark run summary, plus the ones the scrape
adds: servicemonitor.yaml); every panel has a description, 0/1 flags are state panels, each axis
has one unit (slots and bytes never share one); rules group by namespace, fleet and shard and
their summaries name all three."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import pytest
import yaml

from tests.support.chart import CHART, ROOT
from tests.support.observability import DASHBOARDS, alert_rules

METRIC_MODULES = [ROOT / "relay" / "metrics.py", ROOT / "operator" / "relayfleet_operator" / "metrics.py"]
KINDS = {"Counter", "Gauge", "Histogram", "Summary", "LoopCounter", "LoopGauge", "LoopHistogram"}
SELECTOR = re.compile(r"\b(relayfleet_[a-z0-9_]+)\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# what every scrape adds (Prometheus and the Prometheus Operator's defaults)
SCRAPE = {"instance", "job", "namespace", "pod", "service", "endpoint", "container"}
FLAG_METRICS = {
    "relayfleet_shard_up",
    "relayfleet_shard_aof_enabled",
    "relayfleet_shard_persistence_ok",
    "relayfleet_wakeup_subscriber_up",
    "relayfleet_spark_job_success",
}


def declared_labels() -> dict[str, set[str]]:
    """Metric name -> the label names its definition declares (module-level Counter/Gauge/...)."""
    out: dict[str, set[str]] = {}
    for path in METRIC_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) in KINDS and node.args):
                continue
            name = ast.literal_eval(node.args[0])
            labels: list[str] = []
            if len(node.args) > 2:
                labels = ast.literal_eval(node.args[2])
            for kw in node.keywords:
                if kw.arg == "labelnames":
                    labels = ast.literal_eval(kw.value)
            out[name] = set(labels)
    return out


def relabelled() -> set[str]:
    """The target labels the relays' ServiceMonitor adds (fleet, relay_shard)."""
    text = (CHART / "templates" / "servicemonitor.yaml").read_text()
    return set(re.findall(r"targetLabel:\s*(\w+)", text))


def series_labels() -> dict[str, set[str]]:
    from spark_jobs.run_summary import RunSummary

    labels: dict[str, set[str]] = {}
    for name, own in declared_labels().items():
        added = SCRAPE | (relabelled() if not name.startswith("relayfleet_operator_") else set())
        labels[name] = own | added
        if name.endswith("_total"):
            labels[name.removesuffix("_total")] = labels[name]
    for job in ("retention", "rebalance"):
        figures = ("messages_removed", "queues_deleted", "slots_proposed", "max_over_mean_before")
        registry = RunSummary(job, figures={f: 1.0 for f in figures}).registry(ok=True, duration=1.0)
        for family in registry.collect():
            for sample in family.samples:  # pushed: the Pushgateway keeps its job and instance
                labels[sample.name] = set(sample.labels) | {"job", "instance"}
    return labels


def labels_of(name: str, known: dict[str, set[str]]) -> set[str]:
    for suffix, extra in (("", set()), ("_bucket", {"le"}), ("_sum", set()), ("_count", set())):
        base = name.removesuffix(suffix) if suffix else name
        if (not suffix or name.endswith(suffix)) and base in known:
            return known[base] | extra
    raise AssertionError(f"{name}: no metric of that name is exported")


def panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in DASHBOARDS:
        todo = list(json.loads(path.read_text())["panels"])
        while todo:
            panel = todo.pop(0)
            out.append(panel)
            todo.extend(panel.get("panels") or [])
    return out


def test_every_declared_metric_is_found() -> None:
    known = declared_labels()
    assert len(known) > 30
    assert known["relayfleet_shard_map_epoch"] == set()
    assert known["relayfleet_shard_up"] == {"shard"}
    assert {"fleet", "relay_shard"} <= relabelled()


@pytest.mark.parametrize("panel", [p for p in panels() if p["type"] != "row"], ids=lambda p: p["title"])
def test_panel_filters_and_groups_match_the_series_labels(panel: dict[str, Any]) -> None:
    known = series_labels()
    for target in panel["targets"]:
        expr = target["expr"]
        names = [m.group(1) for m in SELECTOR.finditer(expr)]
        assert names, expr
        for match in SELECTOR.finditer(expr):
            have = labels_of(match.group(1), known)
            used = set(MATCHER.findall(match.group(2) or ""))
            assert used <= have, f"{panel['title']}: {match.group(1)} has no label {sorted(used - have)}"
        everywhere = set.intersection(*(labels_of(n, known) for n in names))
        for clause in BY.findall(expr):
            grouped = {label.strip() for label in clause.split(",") if label.strip()}
            assert grouped <= everywhere, f"{panel['title']}: grouped by {sorted(grouped - everywhere)}"


def test_every_panel_has_a_description() -> None:
    missing = [p["title"] for p in panels() if not str(p.get("description", "")).strip()]
    assert not missing


def test_flags_are_state_panels() -> None:
    for panel in panels():
        if panel["type"] == "row":
            continue
        names = {m.group(1) for t in panel["targets"] for m in SELECTOR.finditer(t["expr"])}
        if names and names <= FLAG_METRICS:
            assert panel["type"] in ("state-timeline", "stat"), panel["title"]
            mappings = panel["fieldConfig"]["defaults"]["mappings"]
            assert {"0", "1"} <= set(mappings[0]["options"]), panel["title"]


def _kind(name: str) -> str:
    if "bytes" in name:
        return "bytes"
    if "slots" in name:
        return "slots"
    return "other"


def test_one_unit_per_axis_and_slots_never_with_bytes() -> None:
    for panel in panels():
        if panel["type"] != "timeseries":
            continue
        defaults = panel["fieldConfig"]["defaults"]
        base = (defaults.get("unit"), defaults.get("custom", {}).get("axisPlacement", "auto"))
        axes: dict[tuple[Any, Any], set[str]] = {}
        for target in panel["targets"]:
            unit, placement = base
            for override in panel["fieldConfig"].get("overrides", []):
                if override["matcher"] == {"id": "byFrameRefID", "options": target["refId"]}:
                    props = {p["id"]: p["value"] for p in override["properties"]}
                    if props.get("unit", unit) != unit:
                        assert props.get("custom.axisPlacement", placement) != placement, panel["title"]
                    unit = props.get("unit", unit)
                    placement = props.get("custom.axisPlacement", placement)
            kinds = axes.setdefault((unit, placement), set())
            kinds |= {_kind(m.group(1)) for m in SELECTOR.finditer(target["expr"])}
        for axis, kinds in axes.items():
            assert not {"slots", "bytes"} <= kinds, f"{panel['title']}: slots and bytes on one axis {axis}"
        units = [unit for unit, _ in axes]
        placements = [placement for _, placement in axes]
        assert len(set(placements)) == len(placements), f"{panel['title']}: two units on one axis"
        assert len(set(units)) == len(units) or len(axes) == 1


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    return alert_rules(doc["groups"])


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_rules_group_by_namespace_fleet_and_shard_and_say_so(rule: dict[str, Any]) -> None:
    known = series_labels()
    names = {m.group(1) for m in SELECTOR.finditer(rule["expr"])}
    labelled = set.intersection(*(labels_of(n, known) for n in names))
    wanted = [label for label in ("namespace", "fleet", "shard") if label in labelled]
    if "fleet" not in wanted:
        return  # the operator's fleet-wide and the Spark jobs' series: nothing to tell apart
    clauses = BY.findall(rule["expr"])
    assert clauses, f"{rule['alert']} aggregates without by (...)"
    for clause in clauses:
        grouped = {label.strip() for label in clause.split(",")}
        assert set(wanted) <= grouped, f"{rule['alert']}: by ({clause}) misses {set(wanted) - grouped}"
    for label in wanted:
        assert f"$labels.{label}" in rule["annotations"]["summary"], (
            f"{rule['alert']}: summary names no {label}"
        )
