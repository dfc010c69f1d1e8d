"""A real Prometheus (Debian package) scrapes a real local fleet (`relayfleet dev`, 2 Redis
shards) every second with the chart's rendered alert rules. Traffic runs; then every dashboard
query and every alert expression is evaluated through Prometheus's HTTP API, and stopping a
shard's redis-server makes RelayfleetShardRedisDown fire.

Only one thing differs from the chart: RelayfleetShardRedisDown's `for` is cut from 1m to 2s so
the test stays bounded; its expression is the chart's, unchanged. Expressions over operator and
Spark-job series (which a local fleet does not produce) are evaluated too but not required to
return data here: tests/operator/test_observability_operator.py (the real operator) and
tests/spark_jobs/test_observability_spark.py (the real jobs through a Pushgateway) give them data.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from relay.client import RelayClient, RelayError
from tests.support.observability import (
    alert_rules,
    dashboard_queries,
    local,
    metric_names,
    promql,
    rendered_rule_groups,
)
from tests.support.procs import RELAYFLEET
from tests.support.prometheus import (
    FAST_ALERT,
    NEEDS_PROMETHEUS,
    Proc,
    Prometheus,
    free_port,
    run_prometheus,
    wait_until,
)

pytestmark = [*NEEDS_PROMETHEUS, pytest.mark.timeout(150)]


@dataclass
class Fleet:
    url: str
    shards: dict[str, str]


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    port = free_port()
    env = {
        **os.environ,
        "RELAY_SHARD_HEALTH_INTERVAL_S": "0.5",  # shard_up flips within a scrape or two
        "RELAY_SHARD_STATS_INTERVAL_S": "1",
        "RELAY_RATE_LIMIT": "20",  # so a burst of enqueues gets 429s
        "PYTHONUNBUFFERED": "1",
    }
    cli = RELAYFLEET
    popen = subprocess.Popen(
        [*cli, "dev", "--shards", "2", "--no-demo", "--port", str(port), "--auth", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    proc = Proc(popen)
    try:
        line = proc.wait_for("redis shard(s):", 30)
        proc.wait_for("relay ready", 30)
        shards = dict(part.strip().split("=", 1) for part in line.split(":", 1)[1].split(","))
        yield Fleet(f"http://127.0.0.1:{port}", shards)
    finally:
        proc.stop()


@pytest.fixture
def prometheus(fleet: Fleet, tmp_path: Path) -> Iterator[Prometheus]:
    with run_prometheus(tmp_path, [fleet.url.removeprefix("http://")]) as prom:
        yield prom


def recipient(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


async def traffic(url: str, stop: asyncio.Event) -> dict[str, int]:
    """Enqueue / read / ack across many queues (both shards), long-polls woken by enqueues,
    bad requests (4xx) and bursts past the rate limit (429) until told to stop."""
    counts = {"enqueued": 0, "errors": 0, "limited": 0}
    async with RelayClient(url) as c:
        round_no = 0
        while not stop.is_set():
            round_no += 1
            for i in range(16):
                r = recipient(i)
                try:
                    await c.enqueue(r, b"m" * 200)
                    counts["enqueued"] += 1
                    batch = await c.read(r, limit=10)
                    if batch.messages:
                        await c.ack(r, up_to_seq=batch.messages[-1].seq)
                except RelayError:
                    counts["errors"] += 1  # 503 once a shard is stopped: that's the point
            waiter = asyncio.ensure_future(c.read(recipient(100 + round_no % 4), wait=5))
            await asyncio.sleep(0.05)
            with contextlib.suppress(RelayError):
                await c.enqueue(recipient(100 + round_no % 4), b"wake")
            with contextlib.suppress(RelayError):
                await asyncio.wait_for(waiter, 6)
            with contextlib.suppress(RelayError):
                await c.request("POST", "/v1/queues/not-a-key/messages", b"x")
            if round_no % 5 == 1:
                for _ in range(25):
                    try:
                        await c.enqueue(recipient(999), b"burst")
                    except RelayError as exc:
                        counts["limited"] += exc.status == 429
            await asyncio.sleep(0.05)
    return counts


def test_dashboards_and_alerts_against_a_real_prometheus(fleet: Fleet, prometheus: Prometheus) -> None:
    # maxmemory on shard a, so the memory ratio (alert and panel) has a denominator.
    with redis.Redis.from_url(fleet.shards["a"]) as a:
        a.config_set("maxmemory", str(256 << 20))

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["counts"] = loop.run_until_complete(traffic(fleet.url, stop))
        except BaseException as exc:
            result["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        # Traffic is flowing and scraped; the slot statistics show it.
        wait_until("messages held", lambda: prometheus.query("sum(relayfleet_shard_queues) > 0"), 25)
        wait_until("429s", lambda: prometheus.query("sum(rate(relayfleet_rate_limited_total[30s])) > 0"), 20)

        # Stop shard b's Redis: enqueues to its queues now fail (5xx), and the alert fires.
        with redis.Redis.from_url(fleet.shards["b"]) as b, contextlib.suppress(redis.ConnectionError):
            b.shutdown(nosave=True)
        t0 = time.monotonic()
        firing = wait_until(
            f"{FAST_ALERT} firing",
            lambda: [
                a
                for a in prometheus.get("/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == FAST_ALERT and a["state"] == "firing"
            ],
            25,
        )
        fired_after = time.monotonic() - t0
        assert [a["labels"]["shard"] for a in firing] == ["b"]
        assert firing[0]["annotations"]["runbook_url"].endswith("#relayfleetshardredisdown")
        wait_until(
            "5xx",
            lambda: prometheus.query('sum(rate(relayfleet_http_requests_total{status=~"5.."}[30s])) > 0'),
            15,
        )

        # Every dashboard query: valid, and with data unless it reads operator/Spark series.
        empty: list[str] = []
        checked = 0
        for dashboard, title, expr in dashboard_queries():
            rows = prometheus.query(promql(expr))
            checked += 1
            if local(expr) and not rows:
                empty.append(f"{dashboard} / {title}: {expr}")
            if local(expr):
                for name in metric_names(expr):
                    if not prometheus.query(f"count({name})"):
                        empty.append(f"{dashboard} / {title}: no series named {name}")
        assert empty == []

        # Every alert expression: valid; each local one has data once its comparison is taken off
        # (the signal the threshold applies to), and every series it names exists.
        for rule in alert_rules(rendered_rule_groups()):
            expr = rule["expr"]
            prometheus.query(expr)  # parses and evaluates
            if not local(expr):
                continue
            signal_expr = re.sub(r"\s*(==|>|<)\s*[0-9.]+\s*$", "", expr)
            assert prometheus.query(signal_expr), f"{rule['alert']}: {signal_expr} returned nothing"
            for name in metric_names(expr):
                assert prometheus.query(f"count({name})"), f"{rule['alert']}: no series named {name}"
        print(f"\n{checked} dashboard queries checked; {FAST_ALERT} fired {fired_after:.1f}s after the stop")
    finally:
        loop.call_soon_threadsafe(stop.set)
        runner.join(30)
        loop.close()
    assert "error" not in result, result.get("error")
    counts = result["counts"]
    assert counts["enqueued"] > 100
    assert counts["limited"] > 0
