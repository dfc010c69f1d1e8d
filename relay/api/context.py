"""What every view needs, stored once on the aiohttp application."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from relay.api.auth import Authenticator
from relay.memguard import MemoryGuard
from relay.service import QueueService
from relay.settings import Settings


@dataclass
class LiveRegistry:
    """Live WebSocket connections of this process, one per queue (newest wins)."""

    by_queue: dict[tuple[bytes, bytes], web.WebSocketResponse] = field(default_factory=dict)


@dataclass
class Context:
    settings: Settings
    service: QueueService
    auth: Authenticator
    live: LiveRegistry = field(default_factory=LiveRegistry)
    memory: MemoryGuard = field(default_factory=lambda: MemoryGuard(None))
    ready: bool = False


CTX = web.AppKey("relayfleet_context", Context)


def ctx(request: web.Request) -> Context:
    return request.app[CTX]
