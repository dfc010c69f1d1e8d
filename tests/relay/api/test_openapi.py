"""The OpenAPI document matches the implementation.

schemathesis generates requests from the document (valid ones, then invalid
ones) and sends them to a real relay over a real redis-server. Valid requests
must get answers the document describes (status, content type, headers, body
schema); no request at all may get a 5xx. The relay runs on its own event loop
in a thread, so schemathesis' synchronous client can call it; `wait` is capped
at 50 ms there so generated long-polls stay short. RELAY_FUZZ_EXAMPLES sets the
examples per operation and mode (default 40: the whole run takes seconds).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from relayfleet_testing.localredis import LocalRedis, free_port
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from relay.api.context import CTX
from relay.api.openapi import document
from relay.app import build_app, start_fleet
from relay.fleet.routing import ShardRouter, single_shard_map
from relay.settings import Settings

EXAMPLES = int(os.environ.get("RELAY_FUZZ_EXAMPLES", "40"))
SCHEMA = schemathesis.openapi.from_dict(document())


def _operations() -> list[Any]:
    out = []
    for result in SCHEMA.get_all_operations():
        if isinstance(result, Err):
            raise result.err()  # the document itself is broken
        out.append(result.ok())
    return out


OPERATIONS = _operations()
# operations with something to get wrong (the others take no input)
WITH_INPUT = [op for op in OPERATIONS if op.path_parameters or op.query or op.headers or op.body]
POSITIVE_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


class RelayThread:
    """A relay (real aiohttp server on a real port) on its own event loop in a thread."""

    def __init__(self, redis_url: str, settings: Settings) -> None:
        self.redis_url = redis_url
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="relay", daemon=True)
        self.runner: web.AppRunner | None = None
        self.fleet: ShardRouter | None = None
        self.base_url = f"http://127.0.0.1:{settings.port}"

    def start(self) -> RelayThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self) -> None:
        self.fleet = await start_fleet(single_shard_map(self.redis_url), self.settings, None)
        app = build_app(self.settings, self.fleet)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.settings.port).start()
        app[CTX].ready = True

    async def _stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.fleet is not None:
            await self.fleet.close()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@schemathesis.serializer("application/didcomm-envelope-enc", "application/ssi-agent-wire")
def _didcomm_body(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    # a DIDComm envelope travels as JSON under its own media type; json, not orjson, so the
    # integers past 64 bits that generation draws are sent too
    return json.dumps(value).encode()


@pytest.fixture(scope="module")
def relay_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    redis_server = LocalRedis(
        binary="/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else ""
    )
    redis_server.start()
    seed = tmp_path_factory.mktemp("didcomm") / "seed"  # the mediator on: its paths are fuzzed too
    seed.write_text(os.urandom(32).hex())
    settings = Settings(port=free_port(), auth="none", max_wait_s=0.05, didcomm_seed_file=str(seed))
    relay = RelayThread(redis_server.url, settings)
    try:
        relay.start()
        yield relay.base_url
    finally:
        relay.stop()
        redis_server.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


def run_generated(
    operation: Any, mode: GenerationMode, base_url: str, http: requests.Session, checks: list[Any]
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests every run: a failure is reproducible
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: Any) -> None:
        response = case.call(base_url=base_url, session=http, timeout=15)
        case.validate_response(response, checks=checks)

    one()


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_valid_requests_get_documented_answers(
    operation: Any, relay_url: str, http: requests.Session
) -> None:
    run_generated(operation, GenerationMode.POSITIVE, relay_url, http, POSITIVE_CHECKS)


@pytest.mark.parametrize("operation", WITH_INPUT, ids=[op.label for op in WITH_INPUT])
def test_invalid_requests_never_get_a_5xx(operation: Any, relay_url: str, http: requests.Session) -> None:
    run_generated(operation, GenerationMode.NEGATIVE, relay_url, http, [not_a_server_error])


BOUNDARY = [pytest.param(op, id=op.label) for op in WITH_INPUT]


@pytest.mark.parametrize("operation", BOUNDARY)
def test_boundary_values_never_get_a_5xx(operation: Any, relay_url: str, http: requests.Session) -> None:
    """schemathesis' coverage phase: each parameter's edges (min, max, lengths, types) one by one."""
    cases = SCHEMA.iter_coverage_cases(
        operation,
        generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        generation_config=SCHEMA.config.generation_for(operation=operation, phase="coverage"),
    )
    n = 0
    for n, case in enumerate(cases, 1):  # noqa: B007 (n counts after the loop)
        response = case.call(base_url=relay_url, session=http, timeout=15)
        case.validate_response(response, checks=[not_a_server_error])
    assert n > 0


def test_served_document_is_the_valid_openapi_31_document(relay_url: str, http: requests.Session) -> None:
    served = http.get(relay_url + "/v1/openapi.json", timeout=10)
    assert served.status_code == 200
    assert served.headers["Content-Type"].startswith("application/json")
    doc = served.json()
    assert doc == document()
    assert doc["openapi"] == "3.1.0"
    SCHEMA.validate()  # against the OpenAPI 3.1 meta-schema


def test_every_route_is_documented_and_every_documented_path_exists(relay_url: str) -> None:
    app = build_app(
        Settings(auth="none"), ShardRouter(single_shard_map("redis://127.0.0.1:1/0"), Settings().limits)
    )
    served: set[tuple[str, str]] = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if route.method != "HEAD" and path:
            served.add((route.method.lower(), path))
    documented = {(method, path) for path, ops in document()["paths"].items() for method in ops}
    assert served == documented
    assert all(path.startswith(("/v1/", "/healthz", "/readyz", "/metrics")) for _, path in documented)
