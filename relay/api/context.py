"""What every view needs, stored once on the aiohttp application."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from relay.api.auth import Authenticator
from relay.api.quota import ClientQuota
from relay.http.memguard import MemoryGuard
from relay.presence import Presence
from relay.service import QueueService
from relay.settings import Settings


class LiveConnection(Protocol):
    """What the registry needs of a live session (relay/api/live.py LiveSession)."""

    @property
    def ws(self) -> web.WebSocketResponse: ...

    def displace(self) -> None:
        """A newer connection took the queue over: close with 4409."""


@dataclass
class LiveRegistry:
    """Live WebSocket connections of this process, one per queue (newest wins). Whether a
    queue is live anywhere in the fleet is `Context.presence`'s to answer."""

    by_queue: dict[tuple[bytes, bytes], LiveConnection] = field(default_factory=dict)

    def take_over(self, key: tuple[bytes, bytes], conn: LiveConnection) -> None:
        """Register `conn` as the queue's live connection; an older one is told it was displaced."""
        old = self.by_queue.get(key)
        self.by_queue[key] = conn
        if old is not None and old is not conn:
            old.displace()

    def release(self, key: tuple[bytes, bytes], conn: LiveConnection) -> None:
        """Forget `conn` unless a newer connection already took the queue over."""
        if self.by_queue.get(key) is conn:
            del self.by_queue[key]


@dataclass
class Context:
    settings: Settings
    service: QueueService
    auth: Authenticator
    live: LiveRegistry = field(default_factory=LiveRegistry)
    memory: MemoryGuard = field(default_factory=lambda: MemoryGuard(None))
    quota: ClientQuota | None = None  # the per-client quota; None when its limits are off
    ready: bool = False
    # fleet-wide presence: live sockets and waiting long-polls on any relay (relay/presence.py)
    presence: Presence = field(init=False)

    def __post_init__(self) -> None:
        self.presence = Presence(self.service, self.settings.presence_ttl_s)


CTX = web.AppKey("relayfleet_context", Context)


def ctx(request: web.Request) -> Context:
    return request.app[CTX]
