"""The loop's busy-poll window after I/O (relay/busy_poll.py): it polls for a bounded time
after an event, never while a batched store call is awaited, within its CPU budget, and the
loop sleeps again afterwards; the relay process runs with it when RELAY_BUSY_POLL_US is set."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay import busy_poll, metrics
from relay.settings import Settings
from relay.storage import keys as K
from relay.storage.pipeline import batched_awaited
from relay.storage.store import EnqueueOutcome, EnqueueRequest, QueueLimits, ShardStore
from tests.support.fleet_harness import spawn_relay, stop_relays, wait_ready

REDIS = "/usr/bin/redis-server"


def windows(ended_by: str) -> float:
    return metrics.BUSY_POLL_WINDOWS.labels(ended_by).value


def _idle_store() -> bool:
    return False


def install(window_us: int, share: float, store_busy: Callable[[], bool] = _idle_store) -> busy_poll.BusyPoll:
    busy_poll.install(asyncio.get_running_loop(), window_us, share, store_busy)
    assert busy_poll.active is not None
    return busy_poll.active


@pytest.fixture
async def installed() -> AsyncIterator[None]:
    yield
    busy_poll.install(asyncio.get_running_loop(), 0, 0.0, _idle_store)  # off again for every later test


async def test_a_window_polls_for_its_length_then_the_loop_sleeps(installed: None) -> None:
    poll = install(30_000, 1.0)
    spun, ended = metrics.BUSY_POLL_SECONDS.value, windows("window")
    poll.event()
    await asyncio.sleep(0.1)
    assert windows("window") == ended + 1
    assert 0.025 <= metrics.BUSY_POLL_SECONDS.value - spun <= 0.09
    # nothing happened since: the loop sleeps, the process takes (almost) no CPU
    cpu = time.process_time()
    await asyncio.sleep(0.3)
    assert time.process_time() - cpu < 0.05
    assert windows("window") == ended + 1


async def test_events_within_the_window_extend_it(installed: None) -> None:
    poll = install(20_000, 1.0)
    spun, ended = metrics.BUSY_POLL_SECONDS.value, windows("window")
    poll.event()
    for _ in range(4):
        await asyncio.sleep(0.01)
        poll.event()
    await asyncio.sleep(0.08)
    assert windows("window") == ended + 1  # one window, not five
    assert metrics.BUSY_POLL_SECONDS.value - spun >= 0.055


async def test_no_polling_while_a_batched_store_call_is_awaited(installed: None) -> None:
    store_busy = [True]
    poll = install(50_000, 1.0, lambda: store_busy[0])
    spun, by_store, ended = metrics.BUSY_POLL_SECONDS.value, windows("store"), windows("window")
    poll.event()
    await asyncio.sleep(0.06)
    assert windows("store") == by_store + 1
    assert metrics.BUSY_POLL_SECONDS.value - spun < 0.01
    store_busy[0] = False  # answered: the next event polls its whole window again
    poll.event()
    await asyncio.sleep(0.06)
    assert (windows("store"), windows("window")) == (by_store + 1, ended + 1)
    assert metrics.BUSY_POLL_SECONDS.value - spun >= 0.045


async def test_the_budget_bounds_polling_to_a_share_of_a_core(installed: None) -> None:
    poll = install(50_000, 0.2)  # a 20 ms burst, then 20 %
    spun, by_budget = metrics.BUSY_POLL_SECONDS.value, windows("budget")
    started = time.perf_counter()
    while time.perf_counter() - started < 0.3:  # I/O every 10 ms: unbounded, it never sleeps
        poll.event()
        await asyncio.sleep(0.01)
    assert windows("budget") > by_budget
    assert 0.04 <= metrics.BUSY_POLL_SECONDS.value - spun <= 0.1  # ~20 ms + 20 % of 300


async def test_off_installs_nothing(installed: None) -> None:
    install(2_000, 0.5)
    for window_us, share in ((0, 0.5), (2_000, 0.0)):
        busy_poll.install(asyncio.get_running_loop(), window_us, share, _idle_store)
        assert busy_poll.active is None  # what every I/O path checks before anything else


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    server = LocalRedis(binary=REDIS).start()
    try:
        yield server
    finally:
        server.stop()


async def _written(store: ShardStore, q: K.QueueKeys, n: int) -> list[asyncio.Task[EnqueueOutcome]]:
    """`n` enqueues at once, given the loop turns that write them as batches."""
    calls = [store.enqueue(q, EnqueueRequest(b"", b"", os.urandom(8)), 1000) for _ in range(n)]
    futures = [asyncio.ensure_future(call) for call in calls]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return futures


async def test_batched_store_calls_stop_the_polling_while_awaited(
    installed: None, redis_server: LocalRedis
) -> None:
    store = ShardStore("t", redis_server.url, QueueLimits(rate_count=10**6))
    await store.start()
    try:
        q = K.queue_keys(os.urandom(32), b"")
        await asyncio.sleep(0.01)  # the connection idle (ScriptBatcher.write_now)
        # a lone call on an idle connection is polled for
        lone = asyncio.ensure_future(store.enqueue(q, EnqueueRequest(b"", b"", b"lone"), 1000))
        for _ in range(3):  # the turns a batch would take to be written
            await asyncio.sleep(0)
        assert not lone.done()
        assert not batched_awaited()
        await lone
        # a burst is batched: no polling until every batch is answered
        poll = install(50_000, 1.0, batched_awaited)
        by_store = windows("store")
        burst = await _written(store, q, 200)
        assert batched_awaited()
        poll.event()
        outcomes = await asyncio.gather(*burst)
        assert len({o.seq for o in outcomes}) == 200
        assert not batched_awaited()
        assert windows("store") >= by_store + 1
        # calls in flight when the connection is lost are no longer awaited either
        pending = await _written(store, q, 50)
        assert batched_awaited()
        redis_server.stop()
        await asyncio.gather(*pending, return_exceptions=True)
        assert not batched_awaited()
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
