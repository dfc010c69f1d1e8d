"""RouteSeries updates its series' plain values (relay/metrics.py): a scrape must read exactly
what prometheus_client's own Counter.inc / Histogram.observe would have left."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from relay import metrics
from relay.metrics import RouteSeries


def test_route_series_scrapes_as_prometheus_client_methods() -> None:
    reference = CollectorRegistry()
    counter = Counter("ref_requests_total", "h", ["route", "method", "status"], registry=reference)
    histogram = Histogram(
        "ref_request_duration_seconds",
        "h",
        ["route", "method"],
        buckets=metrics.REQUEST_SECONDS.bounds,
        registry=reference,
    )
    series = RouteSeries("/test/route-series", "POST")
    rnd = random.Random(7)
    bounds = list(metrics.REQUEST_SECONDS.bounds)
    # exact bounds, values just around them, zero, and values past the last bound
    amounts = [0.0, *bounds, *(b * 1.000001 for b in bounds), *(b * 0.999999 for b in bounds), 1e6]
    amounts += [rnd.uniform(0, 70) for _ in range(500)] + [rnd.uniform(0, 0.01) for _ in range(500)]
    for i, amount in enumerate(amounts):
        status = (201, 200, 400, 503)[i % 4]
        series.count(status)
        series.observe(amount)
        counter.labels("/test/route-series", "POST", str(status)).inc()
        histogram.labels("/test/route-series", "POST").observe(amount)

    def ours(text: str) -> list[str]:
        return sorted(
            line.replace("relayfleet_http_requests_total", "ref_requests_total").replace(
                "relayfleet_http_request_duration_seconds", "ref_request_duration_seconds"
            )
            for line in text.splitlines()
            if "/test/route-series" in line and "_created" not in line
        )

    theirs = sorted(
        line
        for line in generate_latest(reference).decode().splitlines()
        if "route=" in line and "_created" not in line
    )
    assert ours(generate_latest(metrics.REGISTRY).decode()) == theirs
    assert len(theirs) == 4 + len(bounds) + 1 + 2  # 4 statuses; buckets, +Inf, count, sum
