"""The hot-path metric families (relay/loop_metrics.py) expose exactly what prometheus_client's
own Counter/Gauge/Histogram would after the same updates, and a real relay's /metrics shows
the hot-path series moved by exactly the requests it answered."""

from __future__ import annotations

import asyncio
import os
import random
import re

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from relay import metrics
from relay.loop_metrics import LoopCounter, LoopGauge, LoopHistogram
from relay.protocol import b64encode
from tests.support.in_process_relay import RunningRelay

_CREATED = re.compile(r"^(\w+_created(?:\{[^}]*\})?) \S+$")


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text exposition, line by line, with the `_created` times (when each series was
    first made) replaced: they differ between the twins by construction."""
    return [_CREATED.sub(r"\1 <t>", line) for line in generate_latest(registry).decode().splitlines()]


def test_loop_families_scrape_as_their_prometheus_client_twins() -> None:
    ours, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    bounds = [0.0005, 0.001, 0.0025, 0.01, 0.1, 1.0, 2.5, 60.0]
    counter = LoopCounter("t_requests_total", "requests", ["route", "status"], registry=ours)
    counter_ref = Counter("t_requests_total", "requests", ["route", "status"], registry=theirs)
    gauge = LoopGauge("t_waiters", "waiters", registry=ours)
    gauge_ref = Gauge("t_waiters", "waiters", registry=theirs)
    labelled = LoopHistogram("t_seconds", "latency", ["route"], buckets=bounds, registry=ours)
    labelled_ref = Histogram("t_seconds", "latency", ["route"], buckets=bounds, registry=theirs)
    bare = LoopHistogram("t_wake_seconds", "wake", buckets=bounds, registry=ours)
    bare_ref = Histogram("t_wake_seconds", "wake", buckets=bounds, registry=theirs)
    assert _exposition(ours) == _exposition(theirs)  # before any update: the unlabelled ones at 0

    rnd = random.Random(11)
    # exact bounds, values just around them, zero, past the last bound, and random ones
    amounts = [0.0, *bounds, *(b * 1.000001 for b in bounds), *(b * 0.999999 for b in bounds), 1e6]
    amounts += [rnd.uniform(0, 70) for _ in range(300)] + [rnd.uniform(0, 0.01) for _ in range(300)]
    for i, amount in enumerate(amounts):
        route, status = ("/a", "/b", "/c")[i % 3], ("201", "200", "429")[i % 2]
        counter.labels(route, status).inc(i % 5)
        counter_ref.labels(route, status).inc(i % 5)
        labelled.labels(route).observe(amount)
        labelled_ref.labels(route).observe(amount)
        bare.observe(amount)
        bare_ref.observe(amount)
        if i % 3:
            gauge.inc()
            gauge_ref.inc()
        else:
            gauge.dec(2)
            gauge_ref.dec(2)
    gauge.set(gauge.value + 0.5)
    gauge_ref.set(gauge.value)
    got = _exposition(ours)
    assert got == _exposition(theirs)
    assert sum(line.startswith("t_seconds_bucket") for line in got) == 3 * (len(bounds) + 1)
    a_201 = sum(i % 5 for i in range(len(amounts)) if i % 6 == 0)
    assert f't_requests_total{{route="/a",status="201"}} {float(a_201)}' in got


def test_counter_refuses_to_go_down() -> None:
    series = LoopCounter("t_down_total", "d", ["op"], registry=CollectorRegistry()).labels("x")
    try:
        series.inc(-1)
    except ValueError:
        assert series.value == 0.0
    else:
        raise AssertionError("a negative increment was taken")


def _scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_hot_path_series_on_metrics_after_requests(relay: RunningRelay) -> None:
    """Enqueues (fast path), a duplicate, reads and a woken long-poll (aiohttp routes): each
    hot-path series on /metrics moves by exactly what was done."""
    route = "/v1/queues/{recipient}/messages"
    r = b64encode(os.urandom(32))
    url = f"{relay.base_url}/v1/queues/{r}/messages"
    payloads = [b"a" * 10, b"b" * 300, b"c" * 4096]

    def post(status: str) -> tuple[str, frozenset[tuple[str, str]]]:
        labels = {"route": route, "method": "POST", "status": status}
        return "relayfleet_http_requests_total", frozenset(labels.items())

    def get(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return name, frozenset(labels.items())

    async with aiohttp.ClientSession() as http:

        async def scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
            async with http.get(relay.base_url + "/metrics") as resp:
                assert resp.status == 200
                return _scrape(await resp.text())

        before = await scrape()
        for p in payloads:
            async with http.post(url, data=p) as resp:
                assert resp.status == 201
        for _ in range(2):  # stored once, then a duplicate
            async with http.post(url, data=b"d" * 7, headers={"Idempotency-Key": "k1"}) as resp:
                pass
        assert resp.status == 200
        async with http.get(url) as resp:
            assert resp.status == 200
            assert len((await resp.json())["messages"]) == 4

        async def long_poll() -> int:
            async with http.get(url, params={"fromSeq": "5", "wait": "10"}) as resp:
                assert resp.status == 200
                return len((await resp.json())["messages"])

        poll = asyncio.ensure_future(long_poll())
        waiting = await scrape()
        for _ in range(100):
            if waiting[get("relayfleet_waiters")] == before[get("relayfleet_waiters")] + 1:
                break
            await asyncio.sleep(0.02)
            waiting = await scrape()
        assert waiting[get("relayfleet_waiters")] == before[get("relayfleet_waiters")] + 1
        async with http.post(url, data=b"e" * 33) as resp:
            assert resp.status == 201
        assert await poll == 1
        after = await scrape()

    def moved(key: tuple[str, frozenset[tuple[str, str]]]) -> float:
        return after[key] - before.get(key, 0.0)

    stored = [*payloads, b"d" * 7, b"e" * 33]
    assert moved(post("201")) == 5
    assert moved(post("200")) == 1
    assert moved(get("relayfleet_http_requests_total", route=route, method="GET", status="200")) == 2
    assert moved(get("relayfleet_messages_total", op="enqueued")) == 5
    assert moved(get("relayfleet_message_bytes_total", op="enqueued")) == sum(map(len, stored))
    assert moved(get("relayfleet_messages_total", op="duplicate")) == 1
    assert moved(get("relayfleet_messages_total", op="delivered")) == 5
    assert moved(get("relayfleet_message_bytes_total", op="delivered")) == sum(map(len, stored))
    assert moved(get("relayfleet_waiters")) == 0
    assert moved(get("relayfleet_wakeup_latency_seconds_count")) == 1
    assert moved(get("relayfleet_wakeup_latency_seconds_bucket", le="+Inf")) == 1
    assert 0 <= moved(get("relayfleet_wakeup_latency_seconds_sum")) < 10  # whole ms: may be 0
    duration = "relayfleet_http_request_duration_seconds"
    for method, count in (("POST", 6), ("GET", 2)):
        assert moved(get(f"{duration}_count", route=route, method=method)) == count
        assert moved(get(f"{duration}_bucket", route=route, method=method, le="+Inf")) == count
        buckets = [
            after[get(f"{duration}_bucket", route=route, method=method, le=le)]
            for le in [*(str(b) for b in metrics.REQUEST_SECONDS.bounds), "+Inf"]
        ]
        assert buckets == sorted(buckets)  # cumulative
        assert get(f"{duration}_created", route=route, method=method) in after
    # the woken long-poll waited: its GET took at least as long as the wait it counted
    get_sum = get(f"{duration}_sum", route=route, method="GET")
    assert moved(get_sum) >= moved(get("relayfleet_wakeup_latency_seconds_sum"))
