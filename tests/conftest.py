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
from tests.support.in_process_relay import RelayFactory, RelayTestServer, RunningRelay

pytest_plugins = [
    "tests.support.k8s_cluster",
    "tests.support.spark_session",
    "tests.support.soak_option",
    "tests.support.operator_harness",
    "tests.support.didcomm_stock_agents",
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


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    """A fresh Debian redis-server (AOF on, noeviction) on a free port, stopped by pid."""
    server = LocalRedis(binary=DEBIAN_REDIS if os.path.exists(DEBIAN_REDIS) else "").start()
    try:
        yield server
    finally:
        server.stop()


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
