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
- RFC 9112 rules the parser lets through: HTTP/1.0 with Transfer-Encoding is 400 and
  closes, an Expect other than 100-continue is 417 JSON (GuardedServer.handle).

Built on aiohttp's public API only (docs/design-decisions.md): a web.Server subclass that
AppRunner's `server` property hands the sites, the request factory, RequestHandler's
public methods.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiohttp import StreamReader, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpVersion11, RawRequestMessage

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
    the fast path's (relay/http/fastpath.py FastConnection)."""

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
        # armed for the header timeout; entries that made progress are dropped lazily. An
        # OrderedDict: shedding takes the oldest, which a dict finds by skipping the slots its
        # earlier deletions left (10.8 against 0.5 us a shed at 10,000 connections, one
        # process); an arm or a disarm costs ~35 ns more (a timer's, not every request's)
        self.pending: OrderedDict[Connection, None] = OrderedDict()

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
            conn, _ = self.pending.popitem(last=False)
            if conn.waiting_for_headers():
                return conn
        return None

    def _oldest_idle(self, newcomer: Connection) -> Connection | None:
        for conn in self.open:  # only walked at the cap, with no slowloris left to shed
            if conn is not newcomer and conn.idle():
                return conn
        return None


class GuardedRequestHandler(web.RequestHandler):
    """aiohttp's protocol plus the header timeout, the connection cap and JSON parse errors.

    Built on the protocol's public methods only: it learns that a header block is complete
    from the server's request factory (GuardedServer.make_request) and that its request
    is answered from finish_response, so it reads none of aiohttp's private state.
    """

    __slots__ = ("_armed_heads", "_closing", "_guard", "_header_timer", "_heads", "_in_request")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._header_timer: asyncio.TimerHandle | None = None
        self._heads = 0  # complete header blocks handed to a request
        self._armed_heads = 0
        self._in_request = False  # from a request's head until its answer is written
        self._closing = False

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
        # While a request is handled, or with a timer running, nothing to do: the usual
        # path costs these reads.
        if self._header_timer is None and not self._in_request and data and not self._closing:
            self._arm()

    def request_started(self) -> None:
        """A complete header block became a request (called by GuardedServer.make_request)."""
        self._heads += 1
        self._in_request = True

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._in_request = False

    def force_close(self) -> None:
        self._closing = True
        super().force_close()

    def _arm(self) -> None:
        self._armed_heads = self._heads
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
            and not self._in_request
            and self._heads == self._armed_heads
            and not self._closing
        )

    def idle(self) -> bool:
        """Between requests on a keep-alive connection: nothing being handled."""
        return self.transport is not None and not self._in_request and not self._closing

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
        return refusal(status, code, text)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp passes request-derived text in args/exc_info; keep the type only
        exc = kw.get("exc_info")
        name = type(exc).__name__ if isinstance(exc, BaseException) else "error"
        log.error("HTTP layer error: %s", name)


def refusal(status: int, code: str, text: str) -> web.Response:
    """A request refused by the HTTP layer: counted, JSON, and the connection closed after it."""
    metrics.REJECTED.labels(code).inc()
    response = error_response(status, code, text)
    response.force_close()
    return response


def head_refusal(request: web.BaseRequest) -> web.Response | None:
    """RFC 9112 rules aiohttp's parser lets through, checked on every head it parses (the fast
    path hands such heads to it): None when the head is fine. No header value is echoed."""
    headers = request.headers
    # (an HTTP/1.1 head without Host never gets here: aiohttp's parser refuses it, "missing_host")
    if request.version < HttpVersion11 and "Transfer-Encoding" in headers:
        # RFC 9112 section 6.1: the framing cannot be trusted; answer and close
        return refusal(400, "bad_transfer_encoding", "Transfer-Encoding is not allowed in HTTP/1.0")
    expect = headers.get("Expect")
    if expect is not None and expect.lower() != "100-continue":
        return refusal(417, "expectation_failed", "the only expectation supported is 100-continue")
    return None


# The fast path's protocol factory (relay/http/fastpath.py), set on the app by build_app
# when RELAY_HTTP_FASTPATH is on: connections start there and are handed to aiohttp's.
FastFactory = Callable[["GuardedServer"], asyncio.Protocol]
FAST_PROTOCOL: web.AppKey[FastFactory] = web.AppKey("relayfleet_fast_protocol")

# aiohttp's per-line limit (request line, each header line), named so the fast path keeps the
# same one: a head it would pass with a longer line is handed to aiohttp, which refuses it.
MAX_LINE = 8190


class GuardedServer(web.Server):
    """The server whose protocols the sites start: GuardedRequestHandler, or, with the fast path
    on, fast-path connections that hand themselves to one for anything but a clean enqueue.

    It serves the application through the public attributes of the server aiohttp's AppRunner
    made for it (its request handler and request factory), each head checked first."""

    def __init__(
        self,
        app_server: web.Server,
        guard: ConnectionGuard,
        fast: FastFactory | None,
        handler_kwargs: dict[str, Any],
    ) -> None:
        self.app_handler = app_server.request_handler
        self.app_request_factory = app_server.request_factory
        super().__init__(
            self.handle,
            request_factory=self.make_request,
            handler_cancellation=app_server.handler_cancellation,
            loop=guard.loop,
        )
        self.guard = guard
        self.fast = fast
        self.handler_kwargs = handler_kwargs

    def make_request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        cast(GuardedRequestHandler, protocol).request_started()
        return self.app_request_factory(message, payload, protocol, writer, task)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        refused = head_refusal(request)
        if refused is not None:
            return refused
        return await self.app_handler(request)

    # asyncio's protocol factory: any protocol does (aiohttp types it narrower)
    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self.fast is not None:
            return self.fast(self)
        return self.aiohttp_protocol()

    def aiohttp_protocol(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self, loop=self.guard.loop, guard=self.guard, **self.handler_kwargs)

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
            if not isinstance(conn, web.RequestHandler):
                conn.shed()
        await super().shutdown(timeout)


NO_CEIL_S = 3600.0  # above any server timer's length: none is rounded to a whole second

# AppRunner's and Server's own arguments; the rest are the protocol's (RequestHandler's)
_RUNNER_ARGS = ("handle_signals", "shutdown_timeout", "access_log_class", "handler_cancellation")


class GuardedAppRunner(web.AppRunner):
    """aiohttp's AppRunner (application startup, shutdown and cleanup) whose sites serve through
    a GuardedServer: its public `server` property is the one sites start listening with."""

    def __init__(self, app: web.Application, settings: Settings, **kwargs: Any) -> None:
        given = runner_kwargs(settings, kwargs)
        self._handler_kwargs = {k: v for k, v in given.items() if k not in _RUNNER_ARGS}
        super().__init__(app, **{k: v for k, v in given.items() if k in _RUNNER_ARGS})
        self._settings = settings
        self._shutdown_timeout_s = float(given.get("shutdown_timeout", 60.0))
        self._guarded: GuardedServer | None = None

    async def setup(self) -> None:
        await super().setup()
        app_server = super().server
        assert app_server is not None
        guard = ConnectionGuard(self._settings, asyncio.get_running_loop())
        self._guarded = GuardedServer(app_server, guard, self.app.get(FAST_PROTOCOL), self._handler_kwargs)

    @property
    def server(self) -> GuardedServer | None:
        return self._guarded

    async def shutdown(self) -> None:
        # called by cleanup() between the sites' closing and the app's cleanup: our server's
        # connections are drained around the application's shutdown, as aiohttp does its own
        guarded = self._guarded
        if guarded is not None:
            guarded.pre_shutdown()
        await super().shutdown()
        if guarded is not None:
            await guarded.shutdown(self._shutdown_timeout_s)

    async def cleanup(self) -> None:
        await super().cleanup()
        self._guarded = None


def runner_kwargs(settings: Settings, given: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(given)
    kwargs.update(
        access_log=None,  # an access line names the path: recipient keys, channels
        keepalive_timeout=settings.keepalive_timeout_s,
        auto_decompress=False,  # never inflate a request body (compressed bodies get 415)
        max_line_size=MAX_LINE,
        max_field_size=MAX_LINE,
        # aiohttp rounds timers longer than this up to a whole second; on the server only the
        # WebSocket heartbeat uses it (relay/api/live.py, ~20 s): rounded, every socket whose
        # ping falls due within one second pings in the same loop turn (10,000 sockets: a
        # 30-50 ms stall each second)
        timeout_ceil_threshold=NO_CEIL_S,
    )
    return kwargs


def make_runner(app: web.Application, settings: Settings, **kwargs: Any) -> GuardedAppRunner:
    return GuardedAppRunner(app, settings, **kwargs)
