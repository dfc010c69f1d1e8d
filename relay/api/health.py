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


# Under the kubelet's default probe timeout (1 s): a shard that does not answer in time is
# reported down, never a probe that times out (which would take this Pod out of service).
_READY_WAIT_S = 0.8
_PINGS: set[asyncio.Task[bool]] = set()  # pings still running after a readiness answer


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Ready when this Pod can serve: the shard map is loaded, it is not shutting down, and at
    least one shard owning slots answers. A shard that is down costs only the queues in its
    slots (they answer 503), never the Pod's readiness: the body says which, per shard."""
    c = ctx(request)
    fleet = c.service.fleet
    if not c.ready or c.service.closing:
        return error_response(503, "not_ready", "relay is starting or shutting down")
    stores = list(fleet.stores.values())
    pings = [asyncio.ensure_future(s.ping()) for s in stores]
    _PINGS.update(pings)
    for task in pings:
        task.add_done_callback(_PINGS.discard)
    if pings:
        await asyncio.wait(pings, timeout=_READY_WAIT_S)
    up = {s.name: p.done() and not p.cancelled() and p.result() for s, p in zip(stores, pings, strict=True)}
    for name, ok in up.items():
        metrics.SHARD_UP.labels(name).set(1 if ok else 0)
    slots = fleet.map.slot_counts()
    down = [name for name, ok in up.items() if not ok]
    subs_down = [name for name, hub in fleet.hubs.items() if not hub.healthy]
    reasons = {
        s.name: (s.last_error or "unavailable") if pings[i].done() else f"no answer within {_READY_WAIT_S}s"
        for i, s in enumerate(stores)
        if not up[s.name]
    } | {name: fleet.hubs[name].last_error for name in subs_down if name not in down}
    detail = {
        "shardMapEpoch": fleet.map.epoch,
        "shards": len(stores),
        "shardsDown": down,
        "subscribersDown": subs_down,
        # why, per shard: the failing step and reason (TLS verification, AUTH...), no URL
        "reasons": reasons,
        "slotsUnavailable": sum(slots.get(name, 0) for name in down),
        "perShard": {
            name: {"up": ok, "slots": slots.get(name, 0), "subscriber": name not in subs_down}
            for name, ok in up.items()
        },
    }
    if not any(ok and slots.get(name, 0) for name, ok in up.items()):
        return error_response(503, "not_ready", "no shard that owns slots answers", extra=detail)
    return json_response({"status": "ready", **detail})


@routes.get("/metrics")
async def prometheus(request: web.Request) -> web.Response:
    fleet = ctx(request).service.fleet
    for name, hub in fleet.hubs.items():
        metrics.SUBSCRIBER_UP.labels(name).set(1 if hub.healthy else 0)
    resp = web.Response(body=generate_latest(metrics.REGISTRY))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp
