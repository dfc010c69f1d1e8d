"""A Redis URL, parsed once, by redis-py.

Every connection to one Redis reads its URL with redis-py's own parser
(``redis.asyncio.ConnectionPool.from_url``, what ``Redis.from_url`` runs): the redis-py
clients and the hot path's hand-written connections (relay/storage/pipeline.py) take the
same options with the same meaning and defaults, and TLS is set up by redis-py's
``SSLConnection`` for both:

    rediss://user:pw@host:6380/2?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem
        &ssl_cert_reqs=required|optional|none&ssl_check_hostname=true|false&ssl_ca_path=/dir
    (or ssl_ca_data=<PEM, URL-encoded>: the CA itself, as the operator writes managed TLS shards)

`RedisTarget.from_url` also builds (without connecting) the connection redis-py would make,
so a URL it would refuse only at its first connection (an unknown option, an ``ssl_*``
option on a redis:// URL, a bad ``ssl_cert_reqs``) is refused when the configuration is
read: a typo must not quietly drop verification. Errors never carry the password or the
URL: URLs hold credentials.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.exceptions import RedisError


class RedisURLError(ValueError):
    """The URL cannot be used; the message names the problem, never the URL's secrets."""


class RedisConnectError(ConnectionError):
    """Connecting, the TLS handshake, AUTH or SELECT failed; the message is safe to log."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """One Redis node's URL and redis-py's reading of it (`options`: the keyword arguments
    redis-py's connections get from it)."""

    url: str = field(repr=False)
    options: Mapping[str, Any] = field(repr=False)
    tls: bool = False

    @classmethod
    def from_url(cls, url: str) -> RedisTarget:
        return _parse(url)

    @property
    def host(self) -> str:
        return str(self.options.get("host", "localhost"))

    @property
    def port(self) -> int:
        return int(self.options.get("port", 6379))

    @property
    def unix_path(self) -> str | None:
        path = self.options.get("path")
        return str(path) if path else None

    @property
    def db(self) -> int:
        return int(self.options.get("db", 0))

    @property
    def username(self) -> str | None:
        return self.options.get("username")

    @property
    def password(self) -> str | None:
        return self.options.get("password")

    @property
    def address(self) -> str:
        """host:port or the socket path: for logs and errors (no credentials)."""
        return self.unix_path if self.unix_path is not None else f"{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """redis-py's SSL context for this URL (built once), None without TLS."""
        return _context(self.url) if self.tls else None

    def client(self, **kwargs: Any) -> aioredis.Redis:
        """A redis-py asyncio client for this node (the same URL, read the same way)."""
        return aioredis.Redis.from_url(self.url, **kwargs)


@functools.lru_cache(maxsize=256)
def _parse(url: str) -> RedisTarget:
    try:
        pool = aioredis.ConnectionPool.from_url(url)
        conn = pool.make_connection()  # type: ignore[no-untyped-call]  # redis-py checks the options here (no I/O)
    except TypeError as exc:  # an option the connection class does not take
        raise RedisURLError(_unknown_option(url, str(exc))) from None
    except (ValueError, RedisError) as exc:  # redis-py's texts name the option, not its value
        raise RedisURLError(_safe(str(exc), url)) from None
    # redis-py ignores a path that is no number (the data would go to database 0)
    unix = isinstance(conn, UnixDomainSocketConnection)
    if urlsplit(url).path.strip("/") and not unix and "db" not in pool.connection_kwargs:
        raise RedisURLError("the database in a Redis URL must be a number")
    return RedisTarget(url, dict(pool.connection_kwargs), isinstance(conn, SSLConnection))


def _unknown_option(url: str, reason: str) -> str:
    parts = urlsplit(url)
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if f"'{name}'" in reason:
            if name.startswith("ssl_") and parts.scheme != "rediss":
                return f"{name[:40]} needs a rediss:// URL"
            return f"unknown Redis URL option {name[:40]!r}"
    return "unknown Redis URL option"


def _safe(reason: str, url: str) -> str:
    """redis-py's error text, unless it would repeat a part of the URL that may be secret."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    secrets = [s for s in (parts.password, query.get("password")) if s]
    if any(s in reason for s in secrets):
        return "malformed Redis URL"
    return reason[:200]


@functools.lru_cache(maxsize=32)
def _context(url: str) -> ssl.SSLContext:
    conn = aioredis.ConnectionPool.from_url(url).make_connection()  # type: ignore[no-untyped-call]
    assert isinstance(conn, SSLConnection)
    try:
        return conn.ssl_context.get()
    except (OSError, ssl.SSLError, ValueError, TypeError) as exc:  # ValueError: ssl_ca_data holds no
        # certificate; TypeError: ssl_keyfile without ssl_certfile
        raise RedisConnectError(f"TLS setup failed: {ssl_reason(exc)}") from None


def ssl_reason(exc: BaseException) -> str:
    """Why a TLS setup or handshake failed, in words safe to log."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verification failed ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        return "a certificate or key file does not exist"
    if isinstance(exc, PermissionError):
        return "a certificate or key file cannot be read"
    return type(exc).__name__


async def read_info(target: RedisTarget, section: str, timeout: float) -> dict[str, Any]:
    """One INFO section of `target` as redis-py parses it; RedisConnectError when it cannot
    be read (the reason safe to log), TimeoutError past `timeout`."""
    client = target.client(socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        info: dict[str, Any] = await client.info(section)
    except RedisError as exc:
        raise RedisConnectError(f"INFO on {target.address} failed: {type(exc).__name__}") from None
    finally:
        await client.aclose()
    return info
