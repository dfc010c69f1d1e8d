"""Shared fixtures: real redis-server processes and in-process relays on real sockets."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay.api.context import CTX
from relay.app import build_app, start_fleet
from relay.fleet.routing import single_shard_map
from relay.fleet.sharding import ShardMap
from relay.settings import Settings
from tests.support.durations import load_durations, split_group
from tests.support.in_process_relay import RelayFactory, RelayTestServer, RunningRelay
from tests.support.shared_redis import SharedRedis

pytest_plugins = [
    "tests.support.k8s_cluster",
    "tests.support.spark_session",
    "tests.support.soak_option",
    "tests.support.operator_harness",
    "tests.support.didcomm_stock_agents",
    "tests.support.serial",
    "tests.support.xdist_groups",
    "tests.support.cpu_usage",
]

DEBIAN_REDIS = "/usr/bin/redis-server"

# Hypothesis keeps its caches (and any example database) outside the repository.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "relayfleet-hypothesis")
)

# Skip reasons that mean "a tool is missing" (not "opt-in", like --soak): on CI they fail.
_MISSING_TOOL = re.compile(
    r"not installed|apt-get install|not built|control-plane\.sh|extra is not installed", re.IGNORECASE
)


# A test that uses one of these session fixtures runs on the worker that holds it (pytest-xdist,
# --dist loadgroup): one control plane, one JVM, one agent toolchain per run, not one per worker.
# The first fixture named wins: a test using a SparkSession and the bare API server (the Spark jobs
# on Kubernetes) joins the Spark group, whose worker then also starts an API server (~10 s), rather
# than an API server's group starting a JVM of its own (~30 s, 1 GB).
_SHARED_BY_GROUP = {"spark": "spark", "kube_apiserver": "kube-apiserver", "kwok_cluster": "kwok"}


# Groups split in parts (tests/support/xdist_groups.py, split_group), each part a work unit that
# starts its own control plane or SparkSession on the worker it lands on (the k8s tests isolate
# themselves by namespace): in one part each, the kwok and API-server groups were each ~1/3 of
# the suite's wall time on one worker (docs/design-decisions.md, "The suite in parallel"). The
# Spark group is one part again: a second JVM (and the API server its Spark-on-Kubernetes test
# brings) cost more CPU than the split saved wall, the suite being bound by CPU on 2 cores.
_PARTS = {"kwok": 2, "kube-apiserver": 2}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    grouped: dict[str, list[pytest.Item]] = {}
    for item in items:
        names = getattr(item, "fixturenames", ())
        group = next((g for f, g in _SHARED_BY_GROUP.items() if f in names), None)
        if group is None and item.get_closest_marker("spark") is not None:
            group = "spark"  # the job's command line (main()) starts a session in the worker too
        if group is None and item.get_closest_marker("didcomm_agents") is not None:
            group = "didcomm-agents"
        if group is not None and item.get_closest_marker("xdist_group") is None:
            grouped.setdefault(group, []).append(item)
    seconds = load_durations()
    for group, members in grouped.items():
        parts = _PARTS.get(group, 1)
        part = split_group([i.nodeid for i in members], parts, seconds) if parts > 1 else {}
        for item in members:
            name = f"{group}-{part[item.nodeid] + 1}" if parts > 1 else group
            item.add_marker(pytest.mark.xdist_group(name))


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """With CI=true a test skipped for a missing tool fails instead: CI installs everything
    (hack/system-deps.sh), so such a skip means a test silently stopped running."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if not (rep.skipped and _on_ci()) or hasattr(rep, "wasxfail"):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    if _MISSING_TOOL.search(reason):
        rep.outcome = "failed"
        rep.longrepr = f"CI=true and a required tool is missing (install it, do not skip): {reason}"


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[SharedRedis]:
    """This worker's redis-server, reused test after test (tests/support/shared_redis.py)."""
    shared = SharedRedis()
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def redis_server(shared_redis: SharedRedis, request: pytest.FixtureRequest) -> Iterator[LocalRedis]:
    """A Debian redis-server (AOF on, noeviction) on a free port, as empty as a fresh one: the
    worker's shared server, reset after the test (or replaced if the test stopped or
    reconfigured it). A test may stop, kill or restart it."""
    server = shared_redis.take()
    try:
        yield server
    finally:
        shared_redis.give_back(request.node.nodeid)


@pytest.fixture
def two_redis(tmp_path: Path) -> Iterator[dict[str, LocalRedis]]:
    """Shards "a" and "b": two fresh Debian redis-servers, stopped afterwards."""
    servers = {n: LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / n)).start() for n in ("a", "b")}
    try:
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture
def r(redis_server: LocalRedis) -> Iterator[redis.Redis]:
    """A synchronous redis-py client of `redis_server`, closed after the test."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
async def relay_factory() -> AsyncIterator[RelayFactory]:
    """Start in-process relays (real aiohttp server on a real port) over given Redis shards."""
    running: list[RunningRelay] = []

    async def start(
        redis_url: str | None = None, shard_map: ShardMap | None = None, **overrides: object
    ) -> RunningRelay:
        settings = replace(Settings.from_env(auth="none"), **overrides)  # type: ignore[arg-type]
        smap = shard_map or single_shard_map(redis_url or "")
        fleet = await start_fleet(smap, settings, None)
        app = build_app(settings, fleet)
        server = RelayTestServer(app, settings)
        await server.start_server()
        app[CTX].ready = True
        relay = RunningRelay(str(server.make_url("")).rstrip("/"), app, fleet, server)
        running.append(relay)
        return relay

    yield start
    for relay in running:
        await relay.server.close()
        await relay.fleet.close()


@pytest.fixture
async def relay(redis_server: LocalRedis, relay_factory: RelayFactory) -> RunningRelay:
    return await relay_factory(redis_server.url)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
