"""Fixtures of the attacker suite (`make hostile`, and part of `make test`).

`hostile_relay`: one relay for the whole suite, started as users start it, with a
short header timeout so slowloris tests finish quickly; `aiohttp_relay`: the same with
the enqueue fast path off. `relay_with(env, nofile)`:
a relay of its own for an attack that needs other settings (a memory ceiling, a
small open-files limit). Every relay logs at DEBUG; tests grep it for planted secrets.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from relayfleet_testing.localredis import LocalRedis

from tests.hostile.harness import HEADER_TIMEOUT_S, Relay, RelayWith, start_redis, start_relay


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.hostile)


@pytest.fixture(scope="session")
def hostile_redis() -> Iterator[LocalRedis]:
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def hostile_relay(hostile_redis: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    relay = start_relay(
        hostile_redis,
        tmp_path_factory.mktemp("hostile-relay"),
        {"RELAY_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)},
    )
    try:
        yield relay
    finally:
        relay.stop()
    # whatever every attack planted, none of it reached the log
    relay.assert_log_clean()


@pytest.fixture(scope="session")
def aiohttp_relay(hostile_redis: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    """The suite's relay with the enqueue fast path off: every request on aiohttp's guarded
    protocol (for the attacks both paths must answer alike)."""
    relay = start_relay(
        hostile_redis,
        tmp_path_factory.mktemp("aiohttp-relay"),
        {"RELAY_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "RELAY_HTTP_FASTPATH": "0"},
    )
    try:
        yield relay
    finally:
        relay.stop()
    relay.assert_log_clean()


@pytest.fixture
def relay_with(tmp_path: Path) -> Iterator[RelayWith]:
    """Start a relay (and its own redis-server) with extra environment / an open-files limit."""
    started: list[tuple[Relay, LocalRedis]] = []

    def start(env: Mapping[str, str] | None = None, nofile: int | None = None) -> Relay:
        redis = start_redis()
        try:
            relay = start_relay(redis, tmp_path / f"relay-{len(started)}", env, nofile)
        except BaseException:
            redis.stop()
            raise
        started.append((relay, redis))
        return relay

    yield start
    for relay, redis in started:
        relay.stop()
        redis.stop()
