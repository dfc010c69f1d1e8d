"""The per-client quota (docs/api.md, "Client quota"): what one client may store per window,
across every recipient, on every storing route (enqueue, fan-out, inbox append).

A client is the enqueue token it presents when RELAY_ENQUEUE_TOKENS is on (a valid one),
else its source address: an IPv4 address, or an IPv6 /64 (one host holds a whole /64).
X-Forwarded-For names the client only when the TCP peer is one of RELAY_TRUSTED_PROXIES;
the rightmost address not itself a trusted proxy is the client.

Each client has a token bucket of RELAY_CLIENT_RATE_MESSAGES messages and
RELAY_CLIENT_RATE_BYTES payload bytes, refilled continuously over RELAY_CLIENT_RATE_WINDOW_MS:
a burst of a whole bucket, then the window's share per second. The check is O(1) (a dict
lookup and some arithmetic) and runs before the body is read where Content-Length says its
size, and always before Redis is touched. It is per relay process (docs/design-decisions.md:
a fleet of N relays admits up to N times a client's quota when its connections spread).

The table of clients is bounded: a bucket untouched for a window is full again, the same as
no entry, so those go first; past the bound the oldest entries go (their clients start over
with a full bucket, which only ever admits more, never less, than a full bucket would).
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Hashable
from typing import NamedTuple

from aiohttp import web

from relay import metrics
from relay.api.errors import ApiError
from relay.settings import Settings

MAX_CLIENTS = 32_768  # ~200 B an entry: ~6 MiB at most
_V6 = 1 << 64  # IPv6 /64 prefixes are keyed from here, above every IPv4 address
_UNIX = -(1 << 70)  # a peer without an address (a Unix socket): one client

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Refusal(NamedTuple):
    reason: str  # metrics.QUOTA_REASONS: client_messages | client_bytes
    retry_after_ms: int


def address_key(address: Address) -> int:
    """The client an address stands for: the IPv4 address, or the IPv6 address's /64."""
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped
        if mapped is None:
            return _V6 + (int(address) >> 64)
        address = mapped
    return int(address)


def parse_address(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text.strip().split("%", 1)[0])  # an IPv6 zone id is no part of it
    except ValueError:
        return None


class ClientQuota:
    """Token buckets per client (see the module docstring). `take` is the hot path."""

    __slots__ = (
        "_by_header",
        "_by_token",
        "_byte_cap",
        "_byte_rate",
        "_clients",
        "_max_clients",
        "_msg_cap",
        "_msg_rate",
        "_trusted",
        "_window_s",
        "enabled",
    )

    def __init__(self, settings: Settings, max_clients: int = MAX_CLIENTS) -> None:
        window_s = max(1, settings.client_rate_window_ms) / 1000
        self._window_s = window_s
        messages, size = settings.client_rate_messages, settings.client_rate_bytes
        self.enabled = messages > 0 or size > 0
        # 0 turns one bucket off: infinite and never refilled (inf - cost stays inf)
        self._msg_cap = float(messages) if messages > 0 else math.inf
        self._byte_cap = float(size) if size > 0 else math.inf
        self._msg_rate = messages / window_s if messages > 0 else 0.0
        self._byte_rate = size / window_s if size > 0 else 0.0
        self._clients: dict[Hashable, list[float]] = {}
        self._max_clients = max_clients
        self._trusted: tuple[Network, ...] = tuple(
            ipaddress.ip_network(cidr, strict=False) for cidr in settings.trusted_proxies
        )
        # a valid enqueue token is its own client (by its position: the table holds no secret)
        self._by_token = {token.encode(): -1 - i for i, token in enumerate(settings.enqueue_tokens)}
        self._by_header = {b"Bearer " + token: key for token, key in self._by_token.items()}

    # -- who is asking ---------------------------------------------------------------------
    def trusts(self, address: Address | None) -> bool:
        """Whether X-Forwarded-For from this TCP peer names the client."""
        if address is None or not self._trusted:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in net for net in self._trusted)

    def peer_key(self, peer: object) -> tuple[Address | None, int | None]:
        """A transport's peername as (address, client key); the key is None when the peer
        is a trusted proxy (each request's X-Forwarded-For then names the client)."""
        host = peer[0] if isinstance(peer, tuple) and peer and isinstance(peer[0], str) else None
        address = parse_address(host) if host is not None else None
        if address is None:
            return None, _UNIX
        return address, (None if self.trusts(address) else address_key(address))

    def forwarded_key(self, peer: Address | None, forwarded: str | None) -> int:
        """The client behind trusted proxy `peer`: the rightmost X-Forwarded-For address that
        is not a trusted proxy (one the proxies wrote), else the peer itself."""
        if forwarded:
            for part in reversed(forwarded.split(",")):
                address = parse_address(part)
                if address is None:
                    break  # not written by a proxy we trust: stop at the last good hop
                if not self.trusts(address):
                    return address_key(address)
        return _UNIX if peer is None else address_key(peer)

    def token_key(self, authorization: bytes | None) -> int | None:
        """The client a valid `Authorization: Bearer <token>` value names, else None."""
        if authorization is None or not self._by_header:
            return None
        key = self._by_header.get(authorization)
        if key is None and authorization[:7] == b"Bearer ":
            key = self._by_token.get(authorization[7:].strip())
        return key

    def client_of(self, request: web.Request) -> int:
        """The client an aiohttp request comes from (see the module docstring)."""
        if self._by_header:
            header = request.headers.get("Authorization")
            if header is not None and (key := self.token_key(header.encode("utf-8", "replace"))) is not None:
                return key
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        address, key = self.peer_key(peer)
        if key is None:
            forwarded = ",".join(request.headers.getall("X-Forwarded-For", ()))
            return self.forwarded_key(address, forwarded)
        return key

    # -- the buckets -----------------------------------------------------------------------
    def take(self, client: Hashable, count: int, size: int) -> Refusal | None:
        """Charge `count` messages of `size` payload bytes in all to `client`; None when
        admitted, else why not and when to retry (nothing charged). A cost over a whole
        bucket is charged as a whole bucket (it needs a full one), so it is never refused
        forever."""
        now = time.monotonic()
        entry = self._clients.get(client)
        msg_cap, byte_cap = self._msg_cap, self._byte_cap
        if entry is None:
            if len(self._clients) >= self._max_clients:
                self._prune(now)
            messages, size_left = msg_cap, byte_cap
            entry = self._clients[client] = [messages, size_left, now]
        else:
            elapsed = now - entry[2]
            messages = min(msg_cap, entry[0] + elapsed * self._msg_rate)
            size_left = min(byte_cap, entry[1] + elapsed * self._byte_rate)
        need_m = count if count < msg_cap else msg_cap
        need_b = size if size < byte_cap else byte_cap
        if messages >= need_m and size_left >= need_b:
            entry[0] = messages - need_m
            entry[1] = size_left - need_b
            entry[2] = now
            return None
        return self._refusal(messages, size_left, need_m, need_b)

    def ready(self, client: Hashable) -> Refusal | None:
        """Refused when `client` could not store even one small message now (checked before a
        body of unknown cost is read); nothing is charged."""
        entry = self._clients.get(client)
        if entry is None:
            return None
        elapsed = time.monotonic() - entry[2]
        messages = min(self._msg_cap, entry[0] + elapsed * self._msg_rate)
        size_left = min(self._byte_cap, entry[1] + elapsed * self._byte_rate)
        if messages >= 1 and size_left >= 1:
            return None
        return self._refusal(messages, size_left, 1, 1)

    def _refusal(self, messages: float, size_left: float, need_m: float, need_b: float) -> Refusal:
        wait_m = (need_m - messages) / self._msg_rate if messages < need_m else 0.0
        wait_b = (need_b - size_left) / self._byte_rate if size_left < need_b else 0.0
        reason = "client_messages" if wait_m >= wait_b else "client_bytes"
        return Refusal(reason, max(1, math.ceil(max(wait_m, wait_b) * 1000)))

    def _prune(self, now: float) -> None:
        """Make room: drop the buckets full again (untouched for a window), then, if the table
        is still over three quarters full, the oldest entries down to half (amortised O(1))."""
        clients = self._clients
        horizon = now - self._window_s
        for client in [c for c, entry in clients.items() if entry[2] <= horizon]:
            del clients[client]
        if len(clients) > self._max_clients * 3 // 4:
            for client in list(clients)[: len(clients) - self._max_clients // 2]:
                del clients[client]

    def __len__(self) -> int:
        return len(self._clients)


def refused(route: str, refusal: Refusal) -> ApiError:
    """The 429 for a refusal (counted in relayfleet_quota_refusals_total)."""
    metrics.quota_refused(route, refusal.reason)
    ms = refusal.retry_after_ms
    what = "messages" if refusal.reason == "client_messages" else "bytes"
    return ApiError(
        429,
        "client_rate_limited",
        f"this client stored too many {what} recently; retry later",
        {"Retry-After": str(max(1, math.ceil(ms / 1000)))},
        {"retryAfterMs": ms},
    )


def admit(quota: ClientQuota, request: web.Request, route: str, count: int, size: int) -> None:
    """Charge `count` messages of `size` bytes to the request's client, or raise the 429."""
    if (refusal := quota.take(quota.client_of(request), count, size)) is not None:
        raise refused(route, refusal)


def admit_ready(quota: ClientQuota, request: web.Request, route: str) -> None:
    """Before a body of not yet known cost is read: raise the 429 for a client whose bucket
    is empty (nothing charged)."""
    if (refusal := quota.ready(quota.client_of(request))) is not None:
        raise refused(route, refusal)


def admit_declared(quota: ClientQuota, request: web.Request, route: str, cap: int) -> bool:
    """An enqueue before its body is read: charged by its Content-Length when that is within
    `cap` (True), else only refused when the bucket is empty (False: charge the body's size
    once it is read)."""
    declared = request.content_length
    if declared is not None and declared <= cap:
        admit(quota, request, route, 1, declared)
        return True
    admit_ready(quota, request, route)
    return False
