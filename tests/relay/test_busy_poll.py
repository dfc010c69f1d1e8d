"""The loop's busy-poll window after I/O (relay/busy_poll.py): it polls for a bounded time
after an event, never while a batched store call is awaited, within its CPU budget, and the
loop sleeps again afterwards; the relay process runs with it when RELAY_BUSY_POLL_US is set."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay import busy_poll, metrics
from relay.settings import Settings
from relay.storage import keys as K
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore
from tests.support.fleet_harness import spawn_relay, stop_relays, wait_ready

REDIS = "/usr/bin/redis-server"


def windows(ended_by: str) -> float:
    return metrics.BUSY_POLL_WINDOWS.labels(ended_by).value


@pytest.fixture
async def installed() -> AsyncIterator[None]:
    yield
    busy_poll.install(asyncio.get_running_loop(), 0, 0.0)  # off again for every later test


async def test_a_window_polls_for_its_length_then_the_loop_sleeps(installed: None) -> None:
    busy_poll.install(asyncio.get_running_loop(), 30_000, 1.0)
    spun, ended = metrics.BUSY_POLL_SECONDS.value, windows("window")
    busy_poll.event()
    await asyncio.sleep(0.1)
    assert windows("window") == ended + 1
    assert 0.025 <= metrics.BUSY_POLL_SECONDS.value - spun <= 0.09
    # nothing happened since: the loop sleeps, the process takes (almost) no CPU
    cpu = time.process_time()
    await asyncio.sleep(0.3)
    assert time.process_time() - cpu < 0.05
    assert windows("window") == ended + 1


async def test_events_within_the_window_extend_it(installed: None) -> None:
    busy_poll.install(asyncio.get_running_loop(), 20_000, 1.0)
    spun, ended = metrics.BUSY_POLL_SECONDS.value, windows("window")
    busy_poll.event()
    for _ in range(4):
        await asyncio.sleep(0.01)
        busy_poll.event()
    await asyncio.sleep(0.08)
    assert windows("window") == ended + 1  # one window, not five
    assert metrics.BUSY_POLL_SECONDS.value - spun >= 0.055


async def test_no_polling_while_a_batched_store_call_is_awaited(installed: None) -> None:
    busy_poll.install(asyncio.get_running_loop(), 50_000, 1.0)
    spun, by_store = metrics.BUSY_POLL_SECONDS.value, windows("store")
    busy_poll.awaiting(1)
    busy_poll.event()
    await asyncio.sleep(0.06)
    assert windows("store") == by_store + 1
    assert metrics.BUSY_POLL_SECONDS.value - spun < 0.01
    busy_poll.awaiting(-1)
    assert busy_poll.awaited() == 0


async def test_the_budget_bounds_polling_to_a_share_of_a_core(installed: None) -> None:
    busy_poll.install(asyncio.get_running_loop(), 50_000, 0.2)  # a 20 ms burst, then 20 %
    spun, by_budget = metrics.BUSY_POLL_SECONDS.value, windows("budget")
    started = time.perf_counter()
    while time.perf_counter() - started < 0.3:  # I/O every 10 ms: unbounded, it never sleeps
        busy_poll.event()
        await asyncio.sleep(0.01)
    assert windows("budget") > by_budget
    assert 0.04 <= metrics.BUSY_POLL_SECONDS.value - spun <= 0.1  # ~20 ms + 20 % of 300


async def test_off_does_nothing(installed: None) -> None:
    busy_poll.install(asyncio.get_running_loop(), 0, 0.5)
    spun = metrics.BUSY_POLL_SECONDS.value
    busy_poll.event()
    busy_poll.awaiting(3)
    await asyncio.sleep(0.02)
    assert metrics.BUSY_POLL_SECONDS.value == spun
    assert busy_poll.awaited() == 0


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    server = LocalRedis(binary=REDIS).start()
    try:
        yield server
    finally:
        server.stop()


async def test_store_calls_awaited_are_counted_back_to_zero(
    installed: None, redis_server: LocalRedis
) -> None:
    busy_poll.install(asyncio.get_running_loop(), 2_000, 0.5)
    store = ShardStore("t", redis_server.url, QueueLimits(rate_count=10**6))
    await store.start()
    try:
        q = K.queue_keys(os.urandom(32), b"")
        await store.enqueue(q, EnqueueRequest(b"", b"", b"lone"), 1000)
        outcomes = await asyncio.gather(
            *(store.enqueue(q, EnqueueRequest(b"", b"", b"m%d" % i), 1000) for i in range(200))
        )
        assert len({o.seq for o in outcomes}) == 200
        assert busy_poll.awaited() == 0
        # calls in flight when the connection is lost are counted back too
        calls = [store.enqueue(q, EnqueueRequest(b"", b"", b"x%d" % i), 1000) for i in range(50)]
        pending = [asyncio.ensure_future(call) for call in calls]
        await asyncio.sleep(0)
        redis_server.stop()
        await asyncio.gather(*pending, return_exceptions=True)
        assert busy_poll.awaited() == 0
    finally:
        await store.close()


def test_settings_bound_the_window_and_the_share(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Settings.from_env()
    assert (d.busy_poll_us, d.busy_poll_share) == (0, 0.5)
    monkeypatch.setenv("RELAY_BUSY_POLL_US", "10000000")
    monkeypatch.setenv("RELAY_BUSY_POLL_SHARE", "3")
    s = Settings.from_env()
    assert (s.busy_poll_us, s.busy_poll_share) == (100_000, 1.0)
    monkeypatch.setenv("RELAY_BUSY_POLL_US", "-5")
    monkeypatch.setenv("RELAY_BUSY_POLL_SHARE", "-1")
    s = Settings.from_env()
    assert (s.busy_poll_us, s.busy_poll_share) == (0, 0.0)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metric(url: str, line_start: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_the_relay_process_polls_after_requests_and_sleeps_when_idle(
    redis_server: LocalRedis, tmp_path: Path
) -> None:
    env = {"RELAY_BUSY_POLL_US": "2000"}
    relay = spawn_relay(["--redis-url", redis_server.url], tmp_path, env=env)
    try:
        wait_ready(relay)
        for i in range(20):
            request = urllib.request.Request(
                relay.url + "/v1/queues/" + "A" * 43 + "/messages",
                data=b"m%d" % i,
                headers={"Content-Type": "application/octet-stream"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=5) as resp:
                assert resp.status == 201
        # idle (its periodic probes aside): it sleeps rather than polls (measured before the
        # scrape below, whose slot statistics sweep takes CPU of its own)
        time.sleep(0.2)
        cpu = _cpu_seconds(relay.proc.pid)
        time.sleep(1.0)
        assert _cpu_seconds(relay.proc.pid) - cpu < 0.1
        assert _metric(relay.url, 'relayfleet_busy_poll_windows_total{ended_by="window"}') >= 1
        assert _metric(relay.url, "relayfleet_busy_poll_seconds_total") > 0
    finally:
        stop_relays([relay])
