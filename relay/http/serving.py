"""The HTTP connection layer: aiohttp's protocol, hardened for hostile clients.

- Parse errors (malformed request line, bad chunk size, control characters in a
  header, oversized headers, HTTP/1.0 body without a length) are answered 400 as
  JSON {"error","code"}, and logged by exception type only: never the offending bytes.
- Header timeout: a connection closes unless a complete header block arrives within
  `header_timeout_s` of it opening, or of the first byte of a new request on an idle
  keep-alive connection (slowloris). aiohttp has none; one timer per armed window
  does it, and the only per-request cost is a few attribute reads in data_received.
- Keep-alive idle timeout (aiohttp's own timer) at `keepalive_timeout_s`.
- A cap on open client connections below the open-files limit: past it, the oldest
  connection still waiting for its headers (else the oldest idle keep-alive one) is
  closed to make room, so a crowd of dribbling sockets cannot starve /healthz of fds.
- Request bodies are never decompressed (auto_decompress off); params refuses them 415.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from relay import metrics
from relay.api.errors import error_response
from relay.http.parse_errors import describe_parse_error
from relay.settings import Settings

log = logging.getLogger("relay.http.serving")

# fds kept free for Redis connections, wakeup subscriptions, DNS, files, accept()
FD_RESERVE = 128


def connection_cap(settings: Settings) -> int:
    """Client connections allowed at once: the setting, else the open-files limit minus a reserve."""
    if settings.max_connections > 0:
        return settings.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(16, soft - FD_RESERVE)


def raise_nofile_limit() -> int:
    """Soft open-files limit up to the hard one (what a server wants; Python starts at the soft)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class Connection(Protocol):
    """What the guard needs of a client connection: aiohttp's (GuardedRequestHandler) or
    the enqueue fast path's (relay/http/fastpath.py FastConnection)."""

    def waiting_for_headers(self) -> bool: ...

    def idle(self) -> bool: ...

    def shed(self) -> None: ...

    def drain(self) -> None:
        """At shutdown: take no new request; close once the answers owed are written."""

    def busy(self) -> bool:
        """At shutdown: answers still owed that the server must wait for."""


class ConnectionGuard:
    """Open client connections of one server, and which of them wait for headers."""

    __slots__ = ("cap", "header_timeout_s", "keepalive_timeout_s", "loop", "open", "pending")

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop) -> None:
        self.cap = connection_cap(settings)
        self.header_timeout_s = settings.header_timeout_s
        self.keepalive_timeout_s = settings.keepalive_timeout_s
        self.loop = loop
        self.open: dict[Connection, None] = {}  # insertion order = age
        # armed for the header timeout; entries that made progress are dropped lazily
        self.pending: dict[Connection, None] = {}

    def opened(self, conn: Connection) -> None:
        self.open[conn] = None
        if len(self.open) > self.cap:
            self._make_room(conn)

    def closed(self, conn: Connection) -> None:
        self.open.pop(conn, None)
        self.pending.pop(conn, None)

    def arm(self, conn: Connection, due: Callable[[], None]) -> asyncio.TimerHandle:
        """Start `conn`'s header timeout: `due` runs when it ends (call `timed_out` there)."""
        self.pending[conn] = None
        return self.loop.call_later(self.header_timeout_s, due)

    def timed_out(self, conn: Connection) -> None:
        """`conn`'s header timeout ended: it no longer counts as armed."""
        self.pending.pop(conn, None)

    def _make_room(self, newcomer: Connection) -> None:
        victim = self._oldest_waiting_for_headers() or self._oldest_idle(newcomer)
        metrics.CONNECTIONS_SHED.inc()
        (victim or newcomer).shed()

    def _oldest_waiting_for_headers(self) -> Connection | None:
        while self.pending:
            conn = next(iter(self.pending))
            del self.pending[conn]
            if conn.waiting_for_headers():
                return conn
        return None

    def _oldest_idle(self, newcomer: Connection) -> Connection | None:
        for conn in self.open:  # only walked at the cap, with no slowloris left to shed
            if conn is not newcomer and conn.idle():
                return conn
        return None


class GuardedRequestHandler(RequestHandler):
    """aiohttp's protocol plus the header timeout, the connection cap and JSON parse errors."""

    __slots__ = ("_armed_count", "_guard", "_header_timer")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._header_timer: asyncio.TimerHandle | None = None
        self._armed_count = 0

    # -- header timeout ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()
        self._guard.opened(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Bytes of a new request on an idle connection, headers not complete yet: arm.
        # While a request is handled (no waiter) or once a header block is parsed
        # (waiter done), nothing to do: the usual path costs these three reads.
        if self._header_timer is None:
            waiter = self._waiter
            if waiter is not None and not waiter.done() and data:
                self._arm()

    def _arm(self) -> None:
        self._armed_count = self._request_count
        self._header_timer = self._guard.arm(self, self._headers_due)

    def _headers_due(self) -> None:
        self._header_timer = None
        self._guard.timed_out(self)
        if self.waiting_for_headers():
            metrics.HEADER_TIMEOUTS.inc()
            log.debug("closed a connection that sent no complete request headers in time")
            self.force_close()

    def waiting_for_headers(self) -> bool:
        """No complete header block since the timer was armed (and still connected)."""
        return (
            self.transport is not None
            and not self._upgraded
            and self._request_count == self._armed_count
            and not self._force_close
        )

    def idle(self) -> bool:
        """Between requests on a keep-alive connection: nothing being handled."""
        waiter = self._waiter
        return self.transport is not None and waiter is not None and not waiter.done()

    def shed(self) -> None:
        log.debug("closed a connection to stay under the connection cap (%d)", self._guard.cap)
        self.force_close()

    def drain(self) -> None:
        pass  # aiohttp's own shutdown closes its connections once their handlers are done

    def busy(self) -> bool:
        return False  # waited for by aiohttp's own shutdown

    # -- errors: JSON, logged without request bytes -------------------------------------
    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot answer the error")
        if status == 500:
            code, text = "internal_error", "internal error"
            log.error("request failed in the HTTP layer: %s", type(exc).__name__ if exc else "unknown")
        elif status == 504:
            code, text = "timeout", "request timed out"
        else:
            code, text = describe_parse_error(exc)
            log.debug("refused a malformed request (%s): %s", code, type(exc).__name__)
        metrics.REJECTED.labels(code).inc()
        response = error_response(status, code, text)
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp passes request-derived text in args/exc_info; keep the type only
        exc = kw.get("exc_info")
        name = type(exc).__name__ if isinstance(exc, BaseException) else "error"
        log.error("HTTP layer error: %s", name)


# The enqueue fast path's protocol factory (relay/http/fastpath.py), set on the app by build_app
# when RELAY_HTTP_FASTPATH is on: connections start there and are handed to aiohttp's.
FastFactory = Callable[["GuardedServer"], asyncio.Protocol]
FAST_PROTOCOL: web.AppKey[FastFactory] = web.AppKey("relayfleet_fast_protocol")


class GuardedServer(web.Server):
    """aiohttp's Server handing out GuardedRequestHandler protocols (or, with the fast path
    on, fast-path connections that hand themselves to one for anything but an enqueue)."""

    guard: ConnectionGuard
    fast: FastFactory | None

    # asyncio's protocol factory: any protocol does (aiohttp types it narrower)
    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self.fast is not None:
            return self.fast(self)
        return self.aiohttp_protocol()

    def aiohttp_protocol(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, guard=self.guard, **self._kwargs)

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        for conn in list(self.guard.open):
            conn.drain()

    async def shutdown(self, timeout: float | None = None) -> None:
        # fast-path connections may owe answers Redis has not given yet: wait for them as
        # aiohttp waits for its handlers (its own are waited for by super()), then close
        loop = self.guard.loop
        deadline = loop.time() + (timeout or 0.0)
        while any(c.busy() for c in self.guard.open) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # polled at shutdown only: no event per request to keep
        for conn in list(self.guard.open):
            if not isinstance(conn, RequestHandler):
                conn.shed()
        await super().shutdown(timeout)


class GuardedAppRunner(web.AppRunner):
    def __init__(self, app: web.Application, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **runner_kwargs(settings, kwargs))
        self._settings = settings

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GuardedServer  # same object, our protocol factory
        assert isinstance(server, GuardedServer)
        server.guard = ConnectionGuard(self._settings, asyncio.get_running_loop())
        server.fast = self._app.get(FAST_PROTOCOL)
        return server


def runner_kwargs(settings: Settings, given: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(given)
    kwargs.update(
        access_log=None,  # an access line names the path: recipient keys, channels
        keepalive_timeout=settings.keepalive_timeout_s,
        auto_decompress=False,  # never inflate a request body (compressed bodies get 415)
    )
    return kwargs


def make_runner(app: web.Application, settings: Settings, **kwargs: Any) -> GuardedAppRunner:
    return GuardedAppRunner(app, settings, **kwargs)
