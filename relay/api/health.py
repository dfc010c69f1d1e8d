"""Liveness, readiness and the Prometheus endpoint."""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from relay import metrics
from relay.api.context import ctx
from relay.api.errors import error_response, json_response

routes = web.RouteTableDef()


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    c = ctx(request)
    fleet = c.service.fleet
    if not c.ready or c.service.closing:
        return error_response(503, "not_ready", "relay is starting or shutting down")
    stores = list(fleet.stores.values())
    answers = await asyncio.gather(*(s.ping() for s in stores))
    down = [s.name for s, ok in zip(stores, answers, strict=True) if not ok]
    for s, ok in zip(stores, answers, strict=True):
        metrics.SHARD_UP.labels(s.name).set(1 if ok else 0)
    subs_down = [name for name, hub in fleet.hubs.items() if not hub.healthy]
    if down or subs_down:
        return error_response(
            503,
            "not_ready",
            "some shards are not answering",
            extra={
                "shardsDown": down,
                "subscribersDown": subs_down,
                # why, per shard: the failing step and reason (TLS verification, AUTH...), no URL
                "reasons": {s.name: s.last_error for s, ok in zip(stores, answers, strict=True) if not ok}
                | {name: fleet.hubs[name].last_error for name in subs_down if name not in down},
            },
        )
    return json_response({"status": "ready", "shardMapEpoch": fleet.map.epoch, "shards": len(stores)})


@routes.get("/metrics")
async def prometheus(request: web.Request) -> web.Response:
    fleet = ctx(request).service.fleet
    for name, hub in fleet.hubs.items():
        metrics.SUBSCRIBER_UP.labels(name).set(1 if hub.healthy else 0)
    resp = web.Response(body=generate_latest(metrics.REGISTRY))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp
