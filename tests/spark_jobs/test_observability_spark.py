"""The Spark jobs' side of the dashboard and rules: the real retention and rebalance jobs
(their `main()` with a CronJob's arguments, in the worker's shared SparkSession: a JVM of their
own each is what test_retention_command_line runs) push their run summaries to a real
Pushgateway (Debian prometheus-pushgateway), which a real Prometheus scrapes with the chart's
rendered rules. Every dashboard query over `relayfleet_spark_job_*` returns data; a failed
retention run makes RelayfleetRetentionJobFailing's expression true while the last success
timestamp is kept."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.observability import (
    alert_rules,
    dashboard_queries,
    metric_names,
    promql,
    rendered_rule_groups,
)
from tests.support.prometheus import NEEDS_PROMETHEUS, Proc, free_port, run_prometheus, wait_until
from tests.support.spark_session import FleetFactory, Seed, recipient_on, seed

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PUSHGATEWAY = "/usr/bin/prometheus-pushgateway"

pytestmark = [
    *NEEDS_PROMETHEUS,
    pytest.mark.skipif(not os.path.exists(PUSHGATEWAY), reason="apt-get install prometheus-pushgateway"),
    # Two Spark jobs and a Prometheus take tens of seconds on an idle 2-core machine and several
    # times that while other suites share it; the deadlines only guard against a hang.
    pytest.mark.timeout(1200),
]

WAIT_S = 60  # for the Pushgateway to start and for Prometheus's 1 s scrapes: many even when starved


def spark_only(expr: str) -> bool:
    names = metric_names(expr)
    return bool(names) and all(n.startswith("relayfleet_spark_job_") for n in names)


@pytest.fixture
def pushgateway() -> Iterator[str]:
    port = free_port()
    proc = Proc(
        subprocess.Popen(
            [PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/-/ready", timeout=1) as resp:
                if resp.status == 200:
                    break
            assert time.monotonic() < deadline, "\n".join(proc.lines)
            time.sleep(0.2)
        yield url
    finally:
        proc.stop()


def test_spark_summaries_through_a_pushgateway(
    spark: SparkSession,
    redis_fleet: FleetFactory,
    pushgateway: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spark_jobs import rebalance, retention

    fleet = redis_fleet(["a", "b"])
    rng = random.Random(7)
    now = int(time.time() * 1000)
    seeds = []
    for shard in ("a", "b"):
        for _ in range(3):
            r = recipient_on(fleet, shard, rng)
            seeds += [Seed(r, b"", b"p" * 10, now - 3 * 3_600_000 + i) for i in range(4)]
    seed(fleet, seeds)
    shard_map = tmp_path / "map.json"
    shard_map.write_text(fleet.dumps())

    common = ["--shard-map", str(shard_map), "--master", "local[2]", "--quiet", "--pushgateway", pushgateway]
    assert retention.main([*common, "--max-age", "3600"]) == 0
    ok = capsys.readouterr().err
    assert "retention: run summary {" in ok
    assert '"messages_removed": 24.0' in ok
    assert rebalance.main([*common, "--dry-run"]) == 0
    plan = capsys.readouterr().err
    assert "cannot push" not in ok + plan

    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    with run_prometheus(prom_dir, [pushgateway.removeprefix("http://")]) as prom:
        wait_until(
            "summaries scraped",
            lambda: len(prom.query("relayfleet_spark_job_success")) == 2,
            WAIT_S,
        )
        for name in (
            "relayfleet_spark_job_duration_seconds",
            "relayfleet_spark_job_last_run_timestamp_seconds",
        ):
            assert len(prom.query(f"{name} > 0")) == 2, name  # each job pushed its own
        empty, checked = [], 0
        for dashboard, title, expr in dashboard_queries():
            if spark_only(expr):
                checked += 1
                if not prom.query(promql(expr)):
                    empty.append(f"{dashboard} / {title}: {expr}")
        assert empty == []
        assert checked >= 6
        removed = prom.query('max(relayfleet_spark_job_messages_removed{spark_job="retention"})')
        assert float(removed[0]["value"][1]) == 24
        for rule in alert_rules(rendered_rule_groups()):
            if spark_only(rule["expr"]):
                assert prom.query(rule["expr"]) == [], rule["alert"]  # a healthy run: quiet

        # A failed run (a shard map that does not parse) is pushed as such; the last success stays.
        shard_map.write_text("{not json")
        assert retention.main(common) == 2
        # bad input answers with exactly one line (CLI contract); the failure is still pushed
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
        failing = next(
            r for r in alert_rules(rendered_rule_groups()) if r["alert"] == "RelayfleetRetentionJobFailing"
        )
        wait_until("failure scraped", lambda: prom.query(failing["expr"]), WAIT_S)
        assert prom.query('relayfleet_spark_job_last_success_timestamp_seconds{spark_job="retention"}')
