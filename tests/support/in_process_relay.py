"""In-process relays for the tests: the app on a real aiohttp server and port, over real Redis shards,
served by the relay's own connection layer (relay.http.serving) as `relayfleet serve` runs it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from relay.api.context import CTX
from relay.client import RelayClient
from relay.fleet.routing import ShardRouter
from relay.http.serving import make_runner
from relay.settings import Settings


class RelayTestServer(TestServer):
    """aiohttp's TestServer on the relay's own connection layer (relay.http.serving), as `serve` runs it."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        super().__init__(app, host="127.0.0.1")
        self._settings = settings

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        return make_runner(self.app, self._settings, **kwargs)


@dataclass
class RunningRelay:
    base_url: str
    app: web.Application
    fleet: ShardRouter
    server: TestServer

    @property
    def settings(self) -> Settings:
        return self.app[CTX].settings

    def client(self, private_key: bytes | None = None) -> RelayClient:
        return RelayClient(self.base_url, private_key)


RelayFactory = Callable[..., Awaitable[RunningRelay]]
