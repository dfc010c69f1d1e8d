"""The aiohttp application: routes, error/metrics middleware, startup and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from aiohttp import hdrs, web
from yarl import URL

from relay import metrics, push, shard_health
from relay.api import didcomm, fanout, health, inbox, live, openapi, pickup, queues
from relay.api.auth import Authenticator
from relay.api.context import CTX, Context
from relay.api.errors import overloaded
from relay.api.failures import code_of, error_for
from relay.api.quota import ClientQuota
from relay.devicepush import wiring as devicepush
from relay.fleet.routing import MapSource, ShardRouter
from relay.fleet.sharding import ShardMap
from relay.http import logsafe
from relay.http.fastpath import FAST_ENDPOINT, FastConnection, FastEndpoint
from relay.http.memguard import CLAIM, MemoryGuard, ceiling_bytes
from relay.http.serving import FAST_PROTOCOL, make_runner, raise_nofile_limit
from relay.metrics import RouteSeries
from relay.service import QueueService
from relay.settings import Settings

log = logging.getLogger("relay.app")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"})


def _overloaded() -> web.Response:
    return overloaded().response()


def observed(handler: Handler, guard: MemoryGuard | None = None) -> Handler:
    """`handler` answering every failure as a JSON error and counting the request.

    With `guard`, new work is refused (503 overloaded) while the memory guard is over
    its threshold: one attribute read per request.

    What an app middleware would do, wrapped around each route's handler at
    registration instead: aiohttp builds a per-request middleware chain (and adds a
    current-app fixer) for any app with middlewares, which cost ~3 µs per enqueue.
    """
    by_method: dict[str, RouteSeries] = {}  # one route: its label children, resolved once

    async def observe(request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        response: web.StreamResponse
        try:
            if guard is not None and guard.over:
                response = _overloaded()
            else:
                response = await handler(request)
        except asyncio.CancelledError:  # the client left (handler cancellation)
            if guard is not None and guard.claimed:
                guard.release(request.get(CLAIM, 0))
            raise
        except Exception as exc:  # every failure becomes a JSON error, never a traceback
            response = error_for(exc)
        if guard is not None and guard.claimed:  # a big body's claim ends with its request
            guard.release(request.get(CLAIM, 0))
        status = response.status
        if status >= 400 and isinstance(response, web.Response) and response.body is not None:
            metrics.REJECTED.labels(code_of(response)).inc()
        # a client may send any token as its method: unknown ones share one series
        method = request.method if request.method in METHODS else "other"
        series = by_method.get(method)
        if series is None:
            resource = request.match_info.route.resource
            label = (
                "unmatched" if resource is None or isinstance(resource, _Unmatched) else resource.canonical
            )
            series = by_method[method] = RouteSeries(label, method)
        series.count(status)
        series.observe(time.perf_counter() - start)
        return response

    return observe


class _Unmatched(web.AbstractResource):
    """Registered last, it takes every request no route matched and answers the JSON
    404 / 405 (with Allow), counted as route "unmatched": what the error middleware did
    for aiohttp's own not-found answers. It has no routes, so the route table (and the
    OpenAPI check against it) does not list it."""

    def __init__(self, router: web.UrlDispatcher) -> None:
        super().__init__()
        self._router = router
        self._route = web.ResourceRoute(hdrs.METH_ANY, observed(self._refuse), self)

    @property
    def canonical(self) -> str:
        return "/"  # indexed under "/": tried only after every more specific resource

    def url_for(self, **kwargs: str) -> URL:
        raise RuntimeError("the unmatched-request resource has no URL")

    def add_prefix(self, prefix: str) -> None:
        pass  # matches whatever is left, under any prefix

    def get_info(self) -> Any:  # aiohttp's TypedDict for this is private
        return {}

    def raw_match(self, path: str) -> bool:
        return False  # never reused by add_resource for a new path

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Iterator[web.AbstractRoute]:
        return iter(())

    async def resolve(self, request: web.Request) -> tuple[web.UrlMappingMatchInfo | None, set[str]]:
        return web.UrlMappingMatchInfo({}, self._route), set()

    async def _refuse(self, request: web.Request) -> web.StreamResponse:
        # the router's own walk stopped here, so gather the methods the path allows again
        allowed: set[str] = set()
        for resource in self._router.resources():
            if resource is not self:
                allowed |= (await resource.resolve(request))[1]
        if allowed:
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        raise web.HTTPNotFound()


def build_app(settings: Settings, fleet: ShardRouter) -> web.Application:
    app = web.Application(client_max_size=settings.max_payload * 2)
    service = QueueService(fleet, settings)
    guard = MemoryGuard(ceiling_bytes(settings.max_rss_mb))
    quota = ClientQuota(settings)
    context = Context(
        settings=settings,
        service=service,
        auth=Authenticator(settings, service),
        memory=guard,
        quota=quota if quota.enabled else None,
    )
    app[CTX] = context
    logsafe.install()
    app.on_startup.append(_start_guard)
    app.on_cleanup.append(_stop_guard)
    app.cleanup_ctx.append(_renewing_presence)
    _add_observed(app, queues.routes, guard)  # first: the hottest routes are matched first
    _add_observed(app, health.routes)  # health, readiness and metrics answer even when overloaded
    # the protocols' endpoints, in matching order, each module's lifecycle set up after its routes
    _add_observed(app, live.routes, guard)
    live.setup(app)
    for routes in (pickup.routes, didcomm.routes):
        _add_observed(app, routes, guard)
    didcomm.setup(app)
    for routes in (inbox.routes, fanout.routes, openapi.routes):
        _add_observed(app, routes, guard)
    push.setup(app)  # no endpoints: hooks the queue service (webhooks for offline queues)
    devicepush.setup(app)  # likewise, for the mediator's keys: their connections' devices
    shard_health.setup(app)  # no endpoints: the shard monitor's background task
    app.router.register_resource(_Unmatched(app.router))
    if settings.http_fastpath:
        endpoint = app[FAST_ENDPOINT] = FastEndpoint(context)
        app[FAST_PROTOCOL] = lambda server: FastConnection(server, endpoint)
    return app


async def _start_guard(app: web.Application) -> None:
    app[CTX].memory.start()


async def _stop_guard(app: web.Application) -> None:
    app[CTX].memory.stop()


async def _renewing_presence(app: web.Application) -> AsyncIterator[None]:
    """The presence leases' renewal (relay/presence.py) for the app's life; at the end the
    releases of the closed sockets are given their moment to reach Redis."""
    presence = app[CTX].presence
    task = asyncio.get_running_loop().create_task(presence.run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await presence.close()


def _add_observed(app: web.Application, routes: web.RouteTableDef, guard: MemoryGuard | None = None) -> None:
    for definition in routes:
        if not isinstance(definition, web.RouteDef):
            raise TypeError(f"only handler routes are served, not {definition!r}")
        d = definition
        web.RouteDef(d.method, d.path, observed(d.handler, guard), d.kwargs).register(app.router)


async def start_fleet(shard_map: ShardMap, settings: Settings, source: MapSource | None) -> ShardRouter:
    fleet = ShardRouter(shard_map, settings.limits, settings.credentials_dir)
    await fleet.start(source)
    return fleet


def begin_shutdown(app: web.Application) -> None:
    """Readiness false, waiters answered; in-flight requests still finish."""
    c = app[CTX]
    c.ready = False
    c.service.closing = True
    for hub in c.service.fleet.hubs.values():
        hub.wake_all()


async def serve(
    settings: Settings, shard_map: ShardMap, source: MapSource | None, drain_delay_s: float = 0.0
) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    logsafe.install()
    nofile = raise_nofile_limit()
    fleet = await start_fleet(shard_map, settings, source)
    app = build_app(settings, fleet)
    if settings.auth == "none":
        log.warning("authentication is disabled (--auth none): for local development only")
    # handler_cancellation: a long-poll whose client left unregisters at once, not when its wait ends
    runner = make_runner(app, settings, shutdown_timeout=settings.shutdown_grace_s, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True, backlog=4096)
    await site.start()
    app[CTX].ready = True
    # what startup loaded lives as long as the process: out of the cyclic collector's full
    # passes, which otherwise walk it all and stall every request (waiters' answers too)
    gc.freeze()
    log.info(
        "relay listening on http://%s:%d (shard map epoch %d, open-files limit %d)",
        settings.host,
        settings.port,
        shard_map.epoch,
        nofile,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: readiness off, answering waiters")
    begin_shutdown(app)
    if drain_delay_s > 0:
        await asyncio.sleep(drain_delay_s)  # let load balancers see readiness go false
    await runner.cleanup()
    await fleet.close()
    metrics.WAITERS.set(0)
