"""The DIDComm mediator's endpoints: the invitations (v1 and v2), packed messages over HTTP, and
the WebSocket (return-routed replies, Pickup 2.0 / 3.0 live mode). Parse → relay.didcomm →
respond. One front door for both versions: the media type decides (v2's
application/didcomm-encrypted+json, -signed+json, -plain+json; v1's didcomm-envelope-enc and
ssi-agent-wire), and for plain application/json or a WebSocket frame the body's own shape (`is_v2`).

Logs and metrics name only the message type and the result: never a key, DID, label or
payload. Without RELAY_DIDCOMM_SEED_FILE the mediator is off and these paths answer 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import weakref
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TypeVar

from aiohttp import WSCloseCode, WSMsgType, web

from relay import metrics
from relay.api import params
from relay.api.context import CTX, ctx
from relay.api.errors import ApiError, json_response, unauthorized
from relay.api.queues import enqueue_error
from relay.api.quota import ClientQuota, admit
from relay.didcomm import jwm
from relay.didcomm import keys as dk
from relay.didcomm.envelope import EnvelopeError
from relay.didcomm.mediator import HANDLED_TYPES, Caller, ForwardRefused, Mediator, Outcome
from relay.didcomm.mediator2 import HANDLED_TYPES as V2_TYPES
from relay.didcomm.mediator2 import Identity2, Mediator2, Outcome2
from relay.didcomm.mediator_pickup import Render, message_id, parse_message_id
from relay.didcomm.messages import MediatorError
from relay.didcomm.records import QUEUE_CHANNEL, Connection
from relay.didcomm.sweep import RecordSweep
from relay.service import Unavailable
from relay.storage.store import Message

_O = TypeVar("_O", Outcome, Outcome2)

log = logging.getLogger("relay.didcomm")
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})

routes = web.RouteTableDef()

MEDIATOR = web.AppKey("relayfleet_didcomm_mediator", Mediator)
MEDIATOR2 = web.AppKey("relayfleet_didcomm_mediator2", Mediator2)
SOCKETS = web.AppKey("relayfleet_didcomm_sockets", weakref.WeakSet[web.WebSocketResponse])
CLIENTS = web.AppKey("relayfleet_didcomm_clients", ClientQuota)
SWEEP = web.AppKey("relayfleet_didcomm_sweep", RecordSweep)
CONTENT_TYPES = ("application/didcomm-envelope-enc", "application/ssi-agent-wire", "application/json")
REPLY_TYPE = "application/didcomm-envelope-enc"
V2_CONTENT_TYPES = (jwm.ENCRYPTED, jwm.SIGNED, jwm.PLAIN)
# members only a v2 message has outside base64 (a v1 envelope's recipients hide in `protected`)
V2_MARKERS = (b'"recipients"', b'"encrypted_key"', b'"signatures"', b'"type"')
HEARTBEAT_S = 20.0
REREAD_S = 30.0  # live mode: a wakeup is a hint, re-read this often without one
LIVE_WINDOW = 100  # live mode: messages delivered and not yet acknowledged, at most
LIVE_BATCH = 20  # messages per live delivery message
KEYS_POLL_S = 2.0  # live mode with no registered key yet: look again this often
OWN_LABELS = frozenset({"envelope", "unknown", "message", "messagepickup/2.0/delivery", "v2-envelope"})


def envelope_cap(max_payload: int) -> int:
    """A forward carries a whole packed message: its base64 and JSON around it."""
    return max_payload * 4 // 3 + 65536


def _count(mtype: str, result: str) -> None:
    """Labels from a bounded set only: a client-named type that is not ours counts as "other"."""
    label = mtype if mtype in HANDLED_TYPES or mtype in V2_TYPES or mtype in OWN_LABELS else "other"
    metrics.DIDCOMM_MESSAGES.labels(label, result).inc()


def _mediator(request: web.Request) -> Mediator:
    m = request.app.get(MEDIATOR)
    if m is None:
        raise ApiError(
            404, "didcomm_disabled", "this relay has no DIDComm mediator (RELAY_DIDCOMM_SEED_FILE)"
        )
    return m


@routes.get("/v1/didcomm/invitation")
async def invitation(request: web.Request) -> web.Response:
    m = _mediator(request)
    return json_response({"invitation": m.invitation(), "invitation_url": m.invitation_url()})


@routes.get("/v1/didcomm/v2/invitation")
async def invitation_v2(request: web.Request) -> web.Response:
    _mediator(request)
    m2 = request.app[MEDIATOR2]
    return json_response(
        {"invitation": m2.invitation(), "invitation_url": m2.invitation_url(), "did": m2.identity.did}
    )


def is_v2(raw: bytes) -> bool:
    """Whether a body sent as plain JSON (or a WebSocket frame) is a DIDComm v2 message."""
    head = raw[:65536]
    return any(marker in head for marker in V2_MARKERS)


def client_of(request: web.Request) -> int:
    """The client a DIDComm connection budget counts against: the per-client quota's identity
    (relay/api/quota.py: the enqueue token's holder, else the source address, through
    RELAY_TRUSTED_PROXIES' X-Forwarded-For), whether or not that quota's limits are on."""
    return request.app[CLIENTS].client_of(request)


def caller_of(request: web.Request) -> Caller:
    """Who is calling: its client, and whether it may store (a valid enqueue token, or none
    configured: RELAY_ENQUEUE_TOKENS governs forwards as it governs enqueues)."""
    c = ctx(request)
    quota = c.quota
    charge = None
    if quota is not None:

        def charge(size: int) -> None:
            admit(quota, request, "/v1/didcomm", 1, size)

    try:
        c.auth.verify_enqueue_header(request.headers.get("Authorization"))
    except ApiError:
        return Caller(client_of(request), False, charge)
    return Caller(client_of(request), True, charge)


def _refusal(exc: MediatorError) -> ApiError:
    if exc.status == 401:
        return unauthorized(exc.text, "Bearer")
    if exc.status == 429:
        wait = max(1, math.ceil(exc.retry_after_s))
        return ApiError(429, exc.code, exc.text, {"Retry-After": str(wait)}, {"retryAfterMs": wait * 1000})
    return ApiError(exc.status, exc.code, exc.text)


async def _handle(m: Mediator, raw: bytes, session: DidcommSocket | None, caller: Caller) -> Outcome:
    """Open and act on one envelope; errors as ApiError (the WebSocket turns them into frames)."""
    try:
        opened = m.open(raw)
    except EnvelopeError as exc:
        _count("envelope", "undecryptable")
        raise ApiError(exc.status, exc.code, str(exc)) from None
    return await _acted(m.handle(opened, session, caller), "routing/1.0/forward")


async def _handle2(m2: Mediator2, raw: bytes, session: DidcommSocket | None, caller: Caller) -> Outcome2:
    """Open and act on one v2 message; errors as ApiError, as `_handle`'s."""
    try:
        opened = m2.open(raw)
    except jwm.JwmError as exc:
        _count("v2-envelope", exc.code)
        raise ApiError(exc.status, exc.code, exc.text) from None
    return await _acted(m2.handle(opened, session, caller), "routing/2.0/forward")


async def _acted(acting: Awaitable[_O], forward_type: str) -> _O:
    """A mediator's answer to an opened message (v1 or v2), counted; its refusals as ApiError."""
    try:
        outcome = await acting
    except MediatorError as exc:
        _count("unknown" if exc.code == "unsupported_message_type" else "message", exc.code)
        raise _refusal(exc) from None
    except ForwardRefused as exc:
        _count(forward_type, "refused")
        err = enqueue_error(exc.outcome)
        raise err if err is not None else ApiError(503, "unavailable", "the forward was not stored") from None
    _count(outcome.type, "ok")
    return outcome


@routes.post("/v1/didcomm")
async def inbound(request: web.Request) -> web.Response:
    c = ctx(request)
    m = _mediator(request)
    kind = request.content_type
    if kind not in CONTENT_TYPES and kind not in V2_CONTENT_TYPES:
        raise ApiError(
            415,
            "unsupported_media_type",
            "send a packed DIDComm envelope (application/didcomm-envelope-enc, or v2's "
            "application/didcomm-encrypted+json)",
        )
    raw = await params.payload(request, envelope_cap(c.settings.max_payload))
    if kind in V2_CONTENT_TYPES or (kind == "application/json" and is_v2(raw)):
        outcome2 = await _handle2(request.app[MEDIATOR2], raw, None, caller_of(request))
        if outcome2.reply is not None and outcome2.return_route:
            return web.Response(status=200, body=outcome2.reply, content_type=jwm.ENCRYPTED)
        return web.Response(status=202)
    outcome = await _handle(m, raw, None, caller_of(request))
    if outcome.reply is not None and outcome.return_route:
        return web.Response(status=200, body=outcome.reply, content_type=REPLY_TYPE)
    return web.Response(status=202)


class DidcommSocket:
    """One agent's WebSocket: replies to return-routed messages, and Pickup 2.0 live mode
    (deliver as messages arrive, delete only on messages-received)."""

    def __init__(
        self, m: Mediator, ws: web.WebSocketResponse, caller: Caller, m2: Mediator2 | None = None
    ) -> None:
        self.m = m
        self.m2 = m2
        self.render: Render | None = None  # live mode's packing (None: Pickup 2.0's)
        self.caller = caller  # as the upgrade request showed it
        self.ws = ws
        self.live_conn: Connection | None = None
        self.live_task: asyncio.Task[None] | None = None
        self.inflight: set[str] = set()
        self.poke = asyncio.Event()  # an ack or a keylist change: look again now
        # live mode: the presence leases held on the connection's keys' queues (relay/presence.py)
        self.token = os.urandom(16).hex()
        self.leased: set[bytes] = set()

    # -- mediator_pickup.LiveSession -----------------------------------------------------
    @property
    def live(self) -> bool:
        return self.live_conn is not None

    def set_live(self, conn: Connection | None, render: Render | None = None) -> None:
        if self.live_task is not None:
            self.live_task.cancel()
            self.live_task = None
        if conn is None:
            self._lease(set())
        self.live_conn = conn
        self.render = render
        self.inflight.clear()
        if conn is not None:
            self.live_task = asyncio.get_running_loop().create_task(self._live(conn))

    def acked(self, ids: Iterable[str]) -> None:
        self.inflight.difference_update(ids)
        self.poke.set()

    def in_flight(self) -> int:
        return len(self.inflight)

    # -- frames -------------------------------------------------------------------------
    async def on_frame(self, raw: bytes) -> None:
        if self.m2 is not None and is_v2(raw):
            await self.on_frame2(self.m2, raw)
            return
        try:
            outcome = await _handle(self.m, raw, self, self.caller)
        except ApiError as exc:
            await self.ws.send_json({"error": exc.text, "code": exc.code})
            return
        if outcome.type.startswith("coordinate-mediation/"):
            self.poke.set()  # the keylist may have changed
        if outcome.reply is not None and outcome.return_route:
            await self.ws.send_bytes(outcome.reply)

    async def on_frame2(self, m2: Mediator2, raw: bytes) -> None:
        """A v2 message: its reply goes back on the socket (text frames: Identus reads text),
        return_route or not, since the socket is the only way back this mediator has."""
        try:
            outcome = await _handle2(m2, raw, self, self.caller)
        except ApiError as exc:
            await self.ws.send_json({"error": exc.text, "code": exc.code})
            return
        if outcome.type.startswith("coordinate-mediation/"):
            self.poke.set()
        if outcome.reply is not None:
            await self.ws.send_str(outcome.reply.decode())

    # -- live mode ----------------------------------------------------------------------
    async def _live(self, conn: Connection) -> None:
        try:
            while True:
                await self._live_round(conn)
        except asyncio.CancelledError:
            raise
        except ConnectionError:
            return
        except Unavailable:
            await self.ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"shard unavailable; reconnect")
        except Exception as exc:  # never a traceback into the socket; the type only
            log.error("didcomm live delivery failed: %s", type(exc).__name__)
            await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")

    async def _live_round(self, conn: Connection) -> None:
        """Subscribe to every registered key's queue, then read, deliver what is new, wait."""
        m = self.m
        queues = await m.records.keys(conn)
        self._lease(set(queues))
        if not queues:
            self.poke.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.poke.wait(), KEYS_POLL_S)
            return
        fleet = m.service.fleet
        with contextlib.ExitStack() as stack:
            waiters = []
            for key in queues:
                route = fleet.route(key, QUEUE_CHANNEL)
                waiters.append(stack.enter_context(route.hub.waiting(route.keys.wake)))
            await asyncio.gather(*(w.ready(1.0) for w in waiters))  # subscribed before reading
            self.poke.clear()
            limit = len(self.inflight) + max(1, min(LIVE_WINDOW - len(self.inflight), LIVE_BATCH))
            held = await m.pickup.pending(queues, limit)
            self._forget_acknowledged(held, limit)
            room = LIVE_WINDOW - len(self.inflight)
            if room > 0:
                fresh = [(k, msg) for k, msg in held if message_id(k, msg.seq) not in self.inflight]
                fresh = fresh[: min(room, LIVE_BATCH)]
                if fresh:
                    if self.render is not None:  # Pickup 3.0: a v2 message, as text
                        await self.ws.send_str(self.render(fresh).decode())
                        _count("messagepickup/3.0/delivery", "live")
                    else:
                        delivery = m.pickup.delivery(None, "https://didcomm.org/", fresh)
                        await self.ws.send_bytes(m.pack_for(delivery, conn.key))
                        _count("messagepickup/2.0/delivery", "live")
                    self.inflight.update(message_id(k, msg.seq) for k, msg in fresh)
                    return  # more may be waiting: read again at once
            tasks = [asyncio.ensure_future(w.wait(REREAD_S)) for w in waiters]
            tasks.append(asyncio.ensure_future(self.poke.wait()))
            try:
                await asyncio.wait(tasks, timeout=REREAD_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _forget_acknowledged(self, held: list[tuple[bytes, Message]], limit: int) -> None:
        """Live deliveries acknowledged elsewhere (over HTTP, as Identus does, or through another
        relay) leave the window: an in-flight message the read should have met and did not is
        gone. The read returns each queue's oldest held messages in order, so it covers every
        seq up to the highest it returned of that queue, or everything when it came back short
        of `limit`. Without this, a window filled by messages acknowledged over HTTP stalled."""
        if not self.inflight:
            return
        present = {message_id(k, msg.seq) for k, msg in held}
        top: dict[bytes, int] = {}
        for k, msg in held:
            top[k] = max(top.get(k, -1), msg.seq)
        complete = len(held) < limit
        gone = set()
        for i in self.inflight - present:
            parsed = parse_message_id(i)
            if parsed is None or complete or parsed[1] <= top.get(parsed[0], -1):
                gone.add(i)
        self.inflight -= gone

    def _lease(self, keys: set[bytes]) -> None:
        """Hold presence leases on exactly `keys`' queues: status.live_delivery through any relay
        says live while this socket is in live mode (no takeover between DIDComm sockets:
        Pickup 2.0 has none, the leases only tell presence)."""
        presence = self.m.presence
        if presence is None:
            return
        for key in self.leased - keys:
            presence.drop(key, QUEUE_CHANNEL, self.token)
        for key in keys - self.leased:
            presence.hold(key, QUEUE_CHANNEL, self.token)
        self.leased = keys

    async def close(self) -> None:
        self.set_live(None)


@routes.get("/v1/didcomm/ws")
async def websocket(request: web.Request) -> web.StreamResponse:
    c = ctx(request)
    m = _mediator(request)
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=envelope_cap(c.settings.max_payload))
    if not ws.can_prepare(request).ok:
        raise ApiError(
            426, "websocket_required", "this endpoint speaks WebSocket only", {"Upgrade": "websocket"}
        )
    if c.service.closing:
        raise Unavailable("relay shutting down")
    await ws.prepare(request)
    request.app[SOCKETS].add(ws)
    session = DidcommSocket(m, ws, caller_of(request), request.app.get(MEDIATOR2))
    metrics.LIVE_CONNECTIONS.inc()
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                await session.on_frame(msg.data.encode())
            elif msg.type == WSMsgType.BINARY:
                await session.on_frame(msg.data)
            else:
                break
    except ConnectionError:
        pass
    except Unavailable:
        await ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"shard unavailable; reconnect")
    except Exception as exc:  # after the upgrade nothing may reach the HTTP middleware
        log.error("didcomm websocket failed: %s", type(exc).__name__)
        await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")
    finally:
        await session.close()
        metrics.LIVE_CONNECTIONS.dec()
        if not ws.closed:
            await ws.close()
    return ws


def load_seed(seed_file: str) -> bytes:
    with open(seed_file, "rb") as fh:
        return dk.read_seed(fh.read(4096))


async def _sweeping(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.get_running_loop().create_task(app[SWEEP].run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _close_all(app: web.Application) -> None:
    sockets: weakref.WeakSet[web.WebSocketResponse] = app[SOCKETS]
    for ws in list(sockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"relay shutting down")


def setup(app: web.Application) -> None:
    app[SOCKETS] = weakref.WeakSet()
    app.on_shutdown.append(_close_all)
    c = app[CTX]
    app[CLIENTS] = c.quota or ClientQuota(c.settings)
    s = c.settings
    if not s.didcomm_seed_file:
        return
    public = s.public_url or f"http://{s.host}:{s.port}"
    if not s.public_url and s.host in WILDCARD_HOSTS:
        log.warning(
            "the DIDComm mediator advertises %s, which agents cannot reach: --host %s listens on "
            "every address; set --public-url (RELAY_PUBLIC_URL) to the URL agents use",
            public,
            s.host,
        )
    try:
        seed = load_seed(s.didcomm_seed_file)
        identity = dk.Identity.from_seed(seed, public)
    except (OSError, dk.DidError) as exc:
        raise SystemExit(f"relayfleet: RELAY_DIDCOMM_SEED_FILE: {exc}") from None
    mediator = app[MEDIATOR] = Mediator(
        identity,
        c.service,
        s.max_payload,
        s.didcomm_redeliver_s,
        s.didcomm_max_keys_per_connection,
        s.didcomm_idle_expiry_s,
        s.didcomm_max_connections_per_client,
        c.presence,
    )
    app[MEDIATOR2] = Mediator2(mediator, Identity2.from_v1(seed, identity))
    if s.didcomm_sweep_interval_s > 0:  # expired records leave Redis without a write to their slot
        app[SWEEP] = RecordSweep(c.service.fleet, s.didcomm_sweep_interval_s)
        app.cleanup_ctx.append(_sweeping)
