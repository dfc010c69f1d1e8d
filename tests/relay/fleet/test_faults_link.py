"""Fault: the relay↔Redis link cut and restored (a TCP proxy the test controls), under load.

Shows: while the link is down requests fail fast with 503 + Retry-After (reset: at once;
blackhole: within the client's socket timeout), long-polls end by their wait plus that
timeout, nothing hangs; once restored, writes succeed again, the wakeup subscriber
reconnects (a long-poll wakes on a new message, not at its timeout), and the recorded
history holds every guarantee.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis

from tests.support.faults import call, report, start_relay, stop_relay
from tests.support.fleet_harness import DEBIAN_REDIS, QueueSpec, Workload, _q, make_queues
from tests.support.tcp_proxy import tcp_proxy

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

FAST_S = 2.0  # a 'reset' link must be reported this fast
BLACKHOLE_S = 9.0  # reply timeout (5 s) + reconnect (2 s connect timeout) + slack on a loaded box


async def _probe_down(
    http: aiohttp.ClientSession, url: str, q: QueueSpec, limit_s: float
) -> dict[str, float]:
    """While the link is down: an enqueue and a long-poll both end in time, as 503 + Retry-After."""
    enq, poll = await asyncio.gather(
        call(http, "POST", url + q.path("messages"), b"x", **{"Idempotency-Key": "probe"}),
        call(http, "GET", url + _q(q.path("messages"), {"wait": 2})),
    )
    for what, (status, doc, headers, took) in (("enqueue", enq), ("long-poll", poll)):
        assert status in (503, 200), f"{what} while cut: {status} {doc}"
        if status == 503:
            assert int(headers["Retry-After"]) >= 1, headers
            assert doc["code"], doc
        assert took < limit_s + (2.0 if what == "long-poll" else 0.0), f"{what} took {took:.2f}s"
    assert enq[0] == 503, enq
    return {"enqueue_s": enq[3], "longpoll_s": poll[3]}


async def _until_stored(http: aiohttp.ClientSession, url: str, q: QueueSpec, key: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        status, _doc, _h, _t = await call(
            http, "POST", url + q.path("messages"), b"y", **{"Idempotency-Key": key}
        )
        if status in (200, 201):
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise AssertionError("writes did not recover within 30 s of restoring the link")


async def _wakeup_latency(http: aiohttp.ClientSession, url: str, q: QueueSpec) -> float:
    """A long-poll (wait 20 s) on an empty queue must wake when a message lands."""
    status, doc, _h, _t = await call(http, "GET", url + q.path("status"))
    assert status == 200, doc
    poll = asyncio.ensure_future(
        call(http, "GET", url + _q(q.path("messages"), {"fromSeq": doc["nextSeq"], "wait": 20}))
    )
    await asyncio.sleep(0.5)  # the waiter is registered
    t0 = time.monotonic()
    status, _doc, _h, _t = await call(http, "POST", url + q.path("messages"), b"wake")
    assert status == 201
    status, got, _h, _t = await poll
    latency = time.monotonic() - t0
    assert status == 200, got
    assert got["messages"], got
    assert latency < 3.0, f"long-poll woke after {latency:.2f}s: the wakeup subscriber did not recover"
    return latency


async def test_link_cut_and_restored_under_load(tmp_path: Path) -> None:
    redis = LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / "redis")).start()
    try:
        with tcp_proxy(redis.port) as proxy:
            relay = start_relay(tmp_path, f"redis://127.0.0.1:{proxy.port}/0")
            try:
                # read+ack queues only, as in the relay-kill and Redis-kill tests: a drain whose
                # reply the cut loses has still removed its messages (docs/reliability.md,
                # at-most-once drains), which the checker would rightly count as lost.
                queues = make_queues(6, seed=11, drain_share=0.0)
                probe_q = make_queues(1, seed=99)[0]
                wake_q = make_queues(1, seed=98)[0]
                work = Workload([relay.url], queues, producers=3, seed=5, max_wait_s=2.0)
                numbers: dict[str, object] = {}
                async with aiohttp.ClientSession() as http, work.running():
                    await work.until_stored(30)
                    numbers["wakeup_before_s"] = round(await _wakeup_latency(http, relay.url, wake_q), 3)
                    for how, limit in (("reset", FAST_S), ("blackhole", BLACKHOLE_S)):
                        proxy.cut(how)
                        await asyncio.sleep(0.3)
                        took = await _probe_down(http, relay.url, probe_q, limit)
                        await work.until_refused(5)  # the load keeps hitting the cut link
                        proxy.restore()
                        rec = await _until_stored(http, relay.url, probe_q, f"rec-{how}")
                        wake = await _wakeup_latency(http, relay.url, wake_q)
                        numbers[f"{how}_enqueue_503_s"] = round(took["enqueue_s"], 2)
                        numbers[f"{how}_longpoll_end_s"] = round(took["longpoll_s"], 2)
                        numbers[f"{how}_write_recovery_s"] = round(rec, 2)
                        numbers[f"{how}_wakeup_after_s"] = round(wake, 3)
                        await work.until_stored(20)
                verdict = work.verdict(tmp_path)
                report("link-cut", verdict, **numbers, retryable_503=verdict.counts.get("retryable_503", 0))
                assert verdict.ok, verdict.render()
                assert verdict.counts.get("retryable_503", 0) > 0  # the load did meet the cut
                assert relay.proc.poll() is None
            finally:
                stop_relay(relay)
    finally:
        redis.stop()
