"""In-process relays for the tests: the app on a real aiohttp server and port, over real Redis shards,
served by the relay's own connection layer (relay.http.serving) as `relayfleet serve` runs it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from relay.api.context import CTX
from relay.client import RelayClient
from relay.fleet.routing import ShardRouter
from relay.http.serving import make_runner
from relay.settings import Settings


class RelayTestServer:
    """The app on a real port, served by the relay's own connection layer (relay.http.serving)
    as `relayfleet serve` runs it; started and stopped through aiohttp's public runner and
    site API (what aiohttp's TestServer does, without overriding its private runner hook)."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        self.runner = make_runner(app, settings, handler_cancellation=True)
        self.port = 0
        self.closed = False

    async def start_server(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    def make_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def close(self) -> None:
        if not self.closed:  # idempotent, as TestServer.close
            self.closed = True
            await self.runner.cleanup()


@dataclass
class RunningRelay:
    base_url: str
    app: web.Application
    fleet: ShardRouter
    server: RelayTestServer

    @property
    def settings(self) -> Settings:
        return self.app[CTX].settings

    def client(self, private_key: bytes | None = None) -> RelayClient:
        return RelayClient(self.base_url, private_key)


RelayFactory = Callable[..., Awaitable[RunningRelay]]
