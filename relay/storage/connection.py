"""Opening a connection to one Redis: the URL parsed once, then connect + TLS + AUTH + SELECT.

The hot-path clients speak RESP themselves (relay/storage/pipeline.py, wakeups.py);
redis-py clients (migrator, maintenance, scripts loading) read the same URL with
`redis.Redis.from_url`. So that both agree on what a URL means, the query options
accepted here are redis-py's names and defaults:

    rediss://user:pw@host:6380/2?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem
        &ssl_cert_reqs=required|optional|none&ssl_check_hostname=true|false&ssl_ca_path=/dir
    (or ssl_ca_data=<PEM, URL-encoded>: the CA itself, as the operator writes managed TLS shards)

`ssl_cert_reqs` defaults to `required` and `ssl_check_hostname` to true (as redis-py);
without `ssl_ca_certs` / `ssl_ca_path` the system trust store is used. An unknown
`ssl_*` option is a configuration error (a typo must not quietly drop verification).
Errors never carry the password or the URL: URLs hold credentials.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import hiredis

from relay.storage.resp import Conn, encode, parse_info

CertReqs = Literal["required", "optional", "none"]

_CERT_REQS: dict[str, ssl.VerifyMode] = {
    "required": ssl.CERT_REQUIRED,
    "optional": ssl.CERT_OPTIONAL,
    "none": ssl.CERT_NONE,
}
_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n", ""}
_TLS_OPTIONS = {
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
}
# redis-py URL options that tune its own pool; meaningless to a single raw connection
_IGNORED_OPTIONS = {
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "retry_on_timeout",
    "max_connections",
    "health_check_interval",
    "timeout",
    "client_name",
}


class RedisURLError(ValueError):
    """The URL cannot be used; the message names the problem, never the URL's secrets."""


class RedisConnectError(ConnectionError):
    """Connecting, the TLS handshake, AUTH or SELECT failed; the message is safe to log."""


@dataclass(frozen=True, slots=True)
class TlsOptions:
    ca_file: str | None = None
    ca_path: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    cert_reqs: CertReqs = "required"
    check_hostname: bool = True
    ca_data: str | None = field(default=None, repr=False)  # PEM text (the operator puts it in URLs)

    def context(self) -> ssl.SSLContext:
        """An SSL context for these options (built once per distinct option set)."""
        return _context(self)


@functools.lru_cache(maxsize=32)
def _context(opts: TlsOptions) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=opts.ca_file, capath=opts.ca_path, cadata=opts.ca_data)
        # check_hostname must be switched off before verification can be lowered
        ctx.check_hostname = opts.check_hostname and opts.cert_reqs != "none"
        ctx.verify_mode = _CERT_REQS[opts.cert_reqs]
        if opts.cert_file:
            ctx.load_cert_chain(opts.cert_file, opts.key_file)
    except (OSError, ssl.SSLError, ValueError) as exc:  # ValueError: ssl_ca_data holds no certificate
        raise RedisConnectError(f"TLS setup failed: {_ssl_reason(exc)}") from None
    return ctx


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where one Redis is and how to log in to it, parsed once from its URL."""

    host: str = "127.0.0.1"
    port: int = 6379
    unix_path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: TlsOptions | None = None

    @classmethod
    def from_url(cls, url: str) -> RedisTarget:
        return _parse(url)

    @property
    def address(self) -> str:
        """host:port or the socket path: for logs and errors (no credentials)."""
        if self.unix_path is not None:
            return self.unix_path
        return f"{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.context()


@functools.lru_cache(maxsize=256)
def _parse(url: str) -> RedisTarget:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise RedisURLError("malformed Redis URL (bad host or port)") from None
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise RedisURLError("a Redis URL must start with redis://, rediss:// or unix://")
    db_text = parts.path.lstrip("/") if scheme != "unix" else ""
    query: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        query[name] = value
    if "db" in query:
        db_text = query.pop("db")
    if db_text and not db_text.isdigit():
        raise RedisURLError("the database in a Redis URL must be a number")
    tls = _tls_options(query) if scheme == "rediss" else None
    leftover = {name for name in query if name not in _IGNORED_OPTIONS}
    if scheme != "rediss":
        stray = leftover & _TLS_OPTIONS
        if stray:
            raise RedisURLError(f"{sorted(stray)[0]} needs a rediss:// URL")
    unknown = sorted(leftover - _TLS_OPTIONS)
    if unknown:
        raise RedisURLError(f"unknown Redis URL option {unknown[0][:40]!r}")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    if scheme == "unix":
        if not parts.path:
            raise RedisURLError("a unix:// Redis URL needs a socket path")
        return RedisTarget(unix_path=parts.path, db=int(db_text or 0), username=username, password=password)
    return RedisTarget(
        host=parts.hostname or "127.0.0.1",
        port=port or 6379,
        db=int(db_text or 0),
        username=username,
        password=password,
        tls=tls,
    )


def _tls_options(query: dict[str, str]) -> TlsOptions:
    reqs = query.get("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise RedisURLError("ssl_cert_reqs must be required, optional or none")
    check = query.get("ssl_check_hostname", "true").lower()
    if check not in _TRUE | _FALSE:
        raise RedisURLError("ssl_check_hostname must be true or false")
    if query.get("ssl_keyfile") and not query.get("ssl_certfile"):
        raise RedisURLError("ssl_keyfile needs ssl_certfile")
    return TlsOptions(
        ca_file=query.get("ssl_ca_certs") or None,
        ca_path=query.get("ssl_ca_path") or None,
        cert_file=query.get("ssl_certfile") or None,
        key_file=query.get("ssl_keyfile") or None,
        cert_reqs=reqs,  # type: ignore[arg-type]  # checked against _CERT_REQS above
        check_hostname=check in _TRUE,
        ca_data=query.get("ssl_ca_data") or None,
    )


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verification failed ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        return "a certificate or key file does not exist"
    if isinstance(exc, PermissionError):
        return "a certificate or key file cannot be read"
    return type(exc).__name__


def login_commands(target: RedisTarget) -> list[tuple[str, bytes]]:
    """The commands a new connection sends before its first real one, with a safe label each.
    The PING proves the connection works end to end: with TLS 1.3 a server that refuses our
    client certificate says so only after the client's handshake has finished."""
    steps: list[tuple[str, bytes]] = []
    if target.password is not None:
        who = (target.username,) if target.username else ()
        steps.append(("AUTH", encode("AUTH", *who, target.password)))
    if target.db:
        steps.append(("SELECT", encode("SELECT", target.db)))
    steps.append(("PING", encode("PING")))
    return steps


async def open_connection(
    target: RedisTarget, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A logged-in stream pair to `target`; RedisConnectError, or TimeoutError past `timeout`."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**16, loop=loop)
    transport, proto = await open_protocol(
        target, lambda: asyncio.StreamReaderProtocol(reader, loop=loop), timeout
    )
    return reader, asyncio.StreamWriter(transport, proto, reader, loop)


P = TypeVar("P", bound=asyncio.BaseProtocol)


async def _connect_tcp(
    loop: asyncio.AbstractEventLoop, target: RedisTarget
) -> tuple[asyncio.Transport, _Login]:
    """create_connection to each address of `target.host` in turn, resolved here first. The
    loop is never handed a name: uvloop's create_connection resolves it in a future that a
    cancelled connect (our timeout, while DNS hangs) leaves behind, and its gaierror is then
    logged as "Future exception was never retrieved". loop.getaddrinfo cancels cleanly."""
    ctx = target.ssl_context()
    infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    failure: OSError = OSError(f"{target.host} has no address")
    for family, _, proto, _, sockaddr in infos:
        try:
            return await loop.create_connection(
                _Login,
                str(sockaddr[0]),
                target.port,
                family=family,
                proto=proto,
                ssl=ctx,
                server_hostname=target.host if ctx is not None else None,
            )
        except ssl.SSLError:
            raise
        except OSError as exc:
            failure = exc
    raise failure


async def open_protocol(
    target: RedisTarget, factory: Callable[[], P], timeout: float
) -> tuple[asyncio.Transport, P]:
    """Connect (TLS if the URL says so), log in, then hand the transport to a protocol made by
    `factory`; RedisConnectError, or TimeoutError past `timeout`. The transport is never left
    open on failure."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        try:
            if target.unix_path is not None:
                transport, login = await loop.create_unix_connection(_Login, target.unix_path)
            else:
                transport, login = await _connect_tcp(loop, target)
        except ssl.SSLError as exc:
            reason = _ssl_reason(exc)
            raise RedisConnectError(f"TLS handshake with {target.address} failed: {reason}") from None
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise RedisConnectError(f"cannot connect to {target.address}: {reason}") from None
        try:
            await login.run(target, transport)
        except BaseException:
            transport.abort()
            raise
    proto = factory()
    transport.set_protocol(proto)
    proto.connection_made(transport)
    return transport, proto


class _Login(asyncio.Protocol):
    """Sends the login commands and checks their replies, before the real protocol takes over."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._replies: asyncio.Queue[object] = asyncio.Queue()

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                self._replies.put_nowait(reply)
        except hiredis.ProtocolError:
            self._replies.put_nowait(RedisConnectError("the server does not speak RESP"))

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, ssl.SSLError):
            reason = f"TLS {_ssl_reason(exc)}"
        else:
            reason = "the connection was closed" if exc is None else type(exc).__name__
        self._replies.put_nowait(RedisConnectError(reason))

    async def run(self, target: RedisTarget, transport: asyncio.BaseTransport) -> None:
        steps = login_commands(target)
        cast(asyncio.Transport, transport).write(b"".join(cmd for _, cmd in steps))
        for label, _ in steps:
            reply = await self._replies.get()
            if isinstance(reply, RedisConnectError):
                hint = ""
                if target.tls is not None and target.tls.cert_file is None:
                    # a server demanding a client certificate often just resets (TLS 1.3)
                    hint = "; if the server requires a client certificate, set ssl_certfile and ssl_keyfile"
                raise RedisConnectError(f"{label} on {target.address}: {reply}{hint}")
            if isinstance(reply, hiredis.ReplyError):
                # Redis's own error text (WRONGPASS, NOAUTH, ERR DB index...) holds no secret
                raise RedisConnectError(f"{label} on {target.address} refused: {str(reply)[:120]}")
        if not self._replies.empty():
            raise RedisConnectError(f"{target.address} sent replies nobody asked for")


async def read_info(target: RedisTarget, section: str, timeout: float) -> dict[str, str]:
    """One INFO section of `target` as a dict (relay/storage/resp.py parses it);
    RedisConnectError when it cannot be read, TimeoutError past `timeout`."""
    reader, writer = await open_connection(target, timeout)
    conn = Conn(reader, writer)
    try:
        async with asyncio.timeout(timeout):
            reply = await conn.call("INFO", section)
    finally:
        conn.close()
    if not isinstance(reply, bytes):
        raise RedisConnectError(f"INFO on {target.address} refused: {str(reply)[:120]}")
    return parse_info(reply)
