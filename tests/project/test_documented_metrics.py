"""Every metric docs/observability.md and docs/runbook.md name is exported and moved by the event
it counts. The relay's are moved here, table-driven: a real relay over a real redis-server, each
event made to happen, then /metrics scraped. The operator's and the Spark jobs' need a cluster or
a Spark session: MOVED_BY names the test that moves each of them, and that test must name it."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from relayfleet_testing.localredis import LocalRedis

from relay import metrics
from relay.client import RelayError
from relay.fleet.sharding import slot_of
from relay.protocol import b64encode
from relay.shard_health import MONITOR, ShardHealth
from relay.storage import keys as K
from relay.storage.limits import QueueLimits
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.observability import registry_names

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/observability.md", "docs/runbook.md")
# a whole name: not a prefix such as `relayfleet_operator_*` or `relayfleet_<job>`, nor a path
_NAME = re.compile(r"(?<![/\w])relayfleet_[a-z0-9_]*[a-z0-9](?![a-z0-9_]*[*<…/])")
HERE = "tests/project/test_documented_metrics.py::test_relay_metrics_move_with_the_events_they_count"
SHARDS = "tests/relay/test_observability_shards.py::test_totals_memory_and_down"
OPERATOR = "tests/operator/test_observability_operator.py::test_operator_queries_against_a_real_prometheus"
REDIS_HA = "tests/relay/storage/test_redis_ha.py::test_replication_and_backup_figures_become_operator_metrics"
DIDCOMM = "tests/relay/didcomm/test_didcomm_mediator.py::test_24_byte_nonces_metrics_and_websocket_errors"
SPARK = "tests/spark_jobs/test_observability_spark.py::test_spark_summaries_through_a_pushgateway"
DEVICE_PUSH = (
    "tests/relay/didcomm/test_didcomm_push_delivery.py"
    "::test_a_burst_of_five_makes_one_notification_per_provider_without_the_payload"
)
FLOW_CONTROL = "tests/hostile/test_flow_control.py::test_refusals_over_the_ceiling_let_go_of_held_bytes"

# metric -> the test that makes its event happen and checks the metric moved
MOVED_BY: dict[str, str] = {
    **dict.fromkeys(("relayfleet_device_push_total", "relayfleet_device_push_bursts_total"), DEVICE_PUSH),
    **dict.fromkeys(
        (
            "relayfleet_http_requests_total",
            "relayfleet_http_request_duration_seconds",
            "relayfleet_messages_total",
            "relayfleet_message_bytes_total",
            "relayfleet_rejected_total",
            "relayfleet_rate_limited_total",
            "relayfleet_waiters",
            "relayfleet_live_connections",
            "relayfleet_wakeup_latency_seconds",
            "relayfleet_redis_errors_total",
            "relayfleet_wakeup_subscriber_up",
            "relayfleet_shard_map_epoch",
            "relayfleet_shard_map_reloads_total",
            "relayfleet_internal_retries_total",
            "relayfleet_shard_up",
            "relayfleet_shard_slots_migrating",
            "relayfleet_shard_stats_duration_seconds",
            "relayfleet_shard_stats_last_success_timestamp_seconds",
        ),
        HERE,
    ),
    **dict.fromkeys(
        (
            "relayfleet_shard_memory_used_bytes",
            "relayfleet_shard_memory_max_bytes",
            "relayfleet_shard_aof_enabled",
            "relayfleet_shard_persistence_ok",
            "relayfleet_shard_messages",
            "relayfleet_shard_bytes",
            "relayfleet_shard_queues",
            "relayfleet_shard_enqueues_per_minute",
            "relayfleet_shard_slots",
        ),
        SHARDS,
    ),
    "relayfleet_http_read_pauses_total": HERE,
    "relayfleet_wakeup_reconnects_total": (
        "tests/project/test_observability.py::test_wakeup_reconnects_total_counts_a_real_reconnect"
    ),
    "relayfleet_http_held_bytes": FLOW_CONTROL,
    "relayfleet_live_frames_total": (
        "tests/relay/api/test_live_woken.py::test_frames_from_the_wakeup_have_the_next_seqs_and_are_acked_as_usual"
    ),
    **dict.fromkeys(
        (
            "relayfleet_presence_leases",
            "relayfleet_presence_writes_total",
            "relayfleet_presence_checks_total",
        ),
        "tests/relay/fleet/test_presence_fleet.py::test_status_is_fleet_wide_moves_with_its_slot_and_lapses_when_the_holder_dies",
    ),
    **dict.fromkeys(
        ("relayfleet_live_displaced_total", "relayfleet_live_takeover_wait_seconds"),
        "tests/relay/fleet/test_presence_fleet.py::test_displacement_across_relays_under_load_keeps_the_history",
    ),
    "relayfleet_didcomm_messages_total": DIDCOMM,
    "relayfleet_quota_refusals_total": (
        "tests/relay/api/test_client_quota.py::test_bytes_quota_refuses_one_client_not_another"
    ),
    "relayfleet_didcomm_records_expired_total": (
        "tests/relay/didcomm/test_didcomm_mediator.py::test_records_expire_when_idle_and_free_their_keys"
    ),
    **dict.fromkeys(
        (
            "relayfleet_operator_reconciles_total",
            "relayfleet_operator_reconcile_duration_seconds",
            "relayfleet_operator_migrations_total",
            "relayfleet_operator_slots_moved_total",
            "relayfleet_operator_bytes_moved_total",
            "relayfleet_operator_shard_map_epoch",
        ),
        OPERATOR,
    ),
    "relayfleet_operator_errors_total": (
        "tests/operator/test_operator_logic.py::test_an_invalid_spec_is_counted_as_an_operator_error"
    ),
    **dict.fromkeys(
        (
            "relayfleet_operator_redis_replicas_online",
            "relayfleet_operator_redis_replica_lag_bytes",
            "relayfleet_operator_redis_primary_changes_total",
            "relayfleet_operator_last_backup_timestamp_seconds",
        ),
        REDIS_HA,
    ),
    **dict.fromkeys(
        (
            "relayfleet_spark_job_success",
            "relayfleet_spark_job_duration_seconds",
            "relayfleet_spark_job_last_run_timestamp_seconds",
            "relayfleet_spark_job_last_success_timestamp_seconds",
        ),
        SPARK,
    ),
}
# Documented and exported, and no test moves them yet (the residue, said out loud; a metric
# that gets a test moves from here to MOVED_BY).
NOT_MOVED_YET = {
    "relayfleet_operator_rebalances_active",  # 1 while a rebalance executes, no test catches it then
}


def documented() -> set[str]:
    return {n for doc in DOCS for n in _NAME.findall((ROOT / doc).read_text())}


def test_every_documented_metric_is_exported() -> None:
    names = documented()
    assert len(names) >= 40
    assert sorted(names - registry_names()) == []


def _function_source(node_id: str) -> str:
    path, name = node_id.split("::")
    text = (ROOT / path).read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"{node_id}: no such test")


def _constants() -> dict[str, str]:
    """Each relay and operator metric's name -> the constant the code counts it through."""
    from relayfleet_operator import metrics as operator_metrics

    out: dict[str, str] = {}
    for module in (metrics, operator_metrics):
        for attr, value in vars(module).items():
            describe = getattr(value, "describe", None)
            if attr.isupper() and describe is not None:
                for family in describe():
                    out.setdefault(family.name, attr)
                    out.setdefault(family.name + "_total", attr)
    return out


def test_every_documented_metric_has_a_test_that_moves_it() -> None:
    names = documented()
    assert sorted(names - set(MOVED_BY) - NOT_MOVED_YET) == [], "documented, and no test moves it"
    assert sorted(set(MOVED_BY) - names) == [], "MOVED_BY names a metric the docs do not"
    assert names >= NOT_MOVED_YET
    assert not NOT_MOVED_YET & set(MOVED_BY)
    constants = _constants()
    for name, node_id in MOVED_BY.items():
        # the test, or the table it runs (a test module's own), names the metric
        source = _function_source(node_id) if node_id != HERE else Path(__file__).read_text()
        constant = constants.get(name)
        named = name in source or (constant is not None and f".{constant}" in source)
        assert named, f"{node_id} does not name {name}"


# --- the relay's metrics, moved by their events on a real relay ------------------------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(relay: RunningRelay) -> Samples:
    async with aiohttp.ClientSession() as http, http.get(relay.base_url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, labels: dict[str, str]) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@dataclass
class World:
    relay: RunningRelay
    redis_server: LocalRedis
    monitor: ShardHealth
    shard: str


Event = Callable[[World], Awaitable[Samples | None]]  # a scrape taken DURING the event, if any


async def enqueue_three(w: World) -> None:
    async with w.relay.client() as c:
        for _ in range(3):
            await c.enqueue(os.urandom(32), b"m" * 100)
    return None


async def malformed_recipient(w: World) -> None:
    url = w.relay.base_url + "/v1/queues/not-a-key/messages"
    async with aiohttp.ClientSession() as http, http.post(url, data=b"x") as resp:
        assert resp.status == 400
    return None


async def over_the_rate_limit(w: World) -> None:
    r = os.urandom(32)
    async with w.relay.client() as c:
        for _ in range(2):  # the relay's limit: 2 per window
            await c.enqueue(r, b"x")
        with pytest.raises(RelayError, match="429"):
            await c.enqueue(r, b"x")
    return None


async def a_woken_long_poll(w: World) -> Samples:
    r = os.urandom(32)
    waiting = value(await scrape(w.relay), "relayfleet_waiters", {})
    async with w.relay.client() as c, w.relay.client() as sender:
        poll = asyncio.create_task(c.read(r, wait=20))
        deadline = time.monotonic() + 10
        while value(during := await scrape(w.relay), "relayfleet_waiters", {}) <= waiting:
            assert time.monotonic() < deadline, "the long-poll never waited"
            await asyncio.sleep(0.02)
        await sender.enqueue(r, b"wake")
        assert [m.payload for m in (await asyncio.wait_for(poll, 10)).messages] == [b"wake"]
    return during


async def pipelined_enqueues(w: World) -> None:
    """More requests in one write than the fast path owes answers for at once: it stops reading."""
    path = f"/v1/queues/{b64encode(os.urandom(32))}/messages"
    one = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nx".encode()
    host, port = w.relay.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(one * 100)
        got = b""
        while got.count(b"HTTP/1.1 ") < 100:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            assert chunk, got[-200:]
            got += chunk
        assert got.count(b"HTTP/1.1 201 ") == 2  # the queue's rate limit: 2 per window
    finally:
        writer.close()
    return None


async def an_open_live_socket(w: World) -> Samples:
    async with w.relay.client() as c, c.live(os.urandom(32)):
        return await scrape(w.relay)


async def a_slot_migrating_for_a_moment(w: World) -> None:
    r = os.urandom(32)
    state = K.slot_state(slot_of(r, b""))
    with redis.Redis.from_url(w.redis_server.url) as direct:
        direct.set(state, "migrating")
        async with w.relay.client() as c:
            sent = asyncio.create_task(c.enqueue(r, b"held"))
            await asyncio.sleep(0.3)
            direct.delete(state)
            assert await asyncio.wait_for(sent, 10) == (1, False)
    return None


async def a_newer_map(w: World) -> None:
    fleet = w.relay.fleet
    assert await fleet.install(replace(fleet.map, epoch=fleet.map.epoch + 1))
    return None


async def a_statistics_round(w: World) -> None:
    with redis.Redis.from_url(w.redis_server.url) as direct:
        direct.set(K.slot_state(9), "importing")
    await scrape(w.relay)  # slot statistics are read for a scrape
    await w.monitor.tick()
    return None


async def redis_stopped(w: World) -> None:
    w.redis_server.stop()
    await w.monitor.tick()
    for _ in range(200):  # the hub notices its connection is gone
        if not w.relay.fleet.hubs[w.shard].healthy:
            break
        await asyncio.sleep(0.05)
    async with w.relay.client() as c:
        with pytest.raises(RelayError, match="503"):
            await c.enqueue(os.urandom(32), b"x")
    return None


SHARD = "default"  # relay_factory's one-shard map (relay.fleet.routing.single_shard_map)
Check = Callable[[float, float], bool]
UP: Check = lambda before, after: after > before  # noqa: E731
ONE: Check = lambda before, after: after == 1  # noqa: E731
ZERO: Check = lambda before, after: after == 0  # noqa: E731


@dataclass(frozen=True)
class DURING:
    """A check of the scrape taken during the event (a gauge of something open), not after it."""

    check: Check


ROWS: list[tuple[Event, str, dict[str, str], Check | DURING]] = [
    (enqueue_three, "relayfleet_http_requests_total", {"status": "201"}, UP),
    (enqueue_three, "relayfleet_http_request_duration_seconds_count", {"method": "POST"}, UP),
    (enqueue_three, "relayfleet_messages_total", {"op": "enqueued"}, lambda b, a: a - b == 3),
    (enqueue_three, "relayfleet_message_bytes_total", {"op": "enqueued"}, lambda b, a: a - b == 300),
    (enqueue_three, "relayfleet_wakeup_subscriber_up", {"shard": SHARD}, ONE),
    (malformed_recipient, "relayfleet_rejected_total", {}, UP),
    (pipelined_enqueues, "relayfleet_http_read_pauses_total", {"reason": "answers_owed"}, UP),
    (over_the_rate_limit, "relayfleet_rate_limited_total", {}, lambda b, a: a - b == 1),
    (a_woken_long_poll, "relayfleet_waiters", {}, DURING(lambda b, a: a >= b + 1)),
    (a_woken_long_poll, "relayfleet_wakeup_latency_seconds_count", {}, UP),
    (an_open_live_socket, "relayfleet_live_connections", {}, DURING(lambda b, a: a >= b + 1)),
    (a_slot_migrating_for_a_moment, "relayfleet_internal_retries_total", {"reason": "migrating"}, UP),
    (a_newer_map, "relayfleet_shard_map_epoch", {}, lambda b, a: a == b + 1),
    (a_newer_map, "relayfleet_shard_map_reloads_total", {}, lambda b, a: a == b + 1),
    (a_statistics_round, "relayfleet_shard_up", {"shard": SHARD}, ONE),
    (a_statistics_round, "relayfleet_shard_slots_migrating", {"shard": SHARD}, ONE),
    (a_statistics_round, "relayfleet_shard_stats_duration_seconds_count", {}, UP),
    (a_statistics_round, "relayfleet_shard_stats_last_success_timestamp_seconds", {"shard": SHARD}, UP),
    (redis_stopped, "relayfleet_shard_up", {"shard": SHARD}, ZERO),
    (redis_stopped, "relayfleet_wakeup_subscriber_up", {"shard": SHARD}, ZERO),
    (redis_stopped, "relayfleet_redis_errors_total", {"shard": SHARD, "kind": "unavailable"}, UP),
]


async def test_relay_metrics_move_with_the_events_they_count(
    redis_server: LocalRedis, relay_factory: RelayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAY_SHARD_HEALTH_INTERVAL_S", "3600")  # the ticks below are the only ones
    relay = await relay_factory(redis_server.url, limits=QueueLimits(rate_count=2), request_deadline_s=1.0)
    await asyncio.wait_for(relay.app[MONITOR].first_round.wait(), 10)
    (shard,) = relay.fleet.stores
    assert shard == SHARD
    world = World(relay, redis_server, ShardHealth(relay.fleet, health_s=1.0, stats_s=0.0), shard)
    failed: list[str] = []
    events = list(dict.fromkeys(event for event, *_ in ROWS))  # in order, each once
    for event in events:
        before = await scrape(relay)
        during = await event(world)
        after = await scrape(relay)
        for row_event, name, labels, check in ROWS:
            if row_event is event:
                seen = after
                if isinstance(check, DURING):
                    assert during is not None, event.__name__
                    seen, check = during, check.check
                b, a = value(before, name, labels), value(seen, name, labels)
                if not check(b, a):
                    failed.append(f"{event.__name__}: {name}{labels} {b} -> {a}")
    assert failed == []
