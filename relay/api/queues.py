"""Queue views: enqueue, read (long-poll), ack, drain, status. Parse → call → respond."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from aiohttp import web

from relay.api import bulk, params, quota
from relay.api.context import ctx
from relay.api.errors import ApiError, bad_request, json_response
from relay.storage.keys import MEDIATOR_CHANNEL
from relay.storage.store import EnqueueOutcome, EnqueueRequest, Message, ReadResult

routes = web.RouteTableDef()
ENQUEUE_ROUTE = "/v1/queues/{recipient}/messages"  # the route template (metrics label)
ACK_MAX_BODY = 1 << 20
DRAIN_MAX_BODY = 1 << 16  # a drain has no body to speak of; any is signed


def enqueue_error(outcome: EnqueueOutcome) -> ApiError | None:
    """The contract's answer for a refused enqueue, or None when it was stored."""
    if outcome.kind == "conflict":
        return ApiError(
            409, "idempotency_conflict", "Idempotency-Key was already used with a different payload"
        )
    if outcome.kind == "rate_limited":
        ms = outcome.retry_after_ms
        headers, extra = {"Retry-After": str(max(1, math.ceil(ms / 1000)))}, {"retryAfterMs": ms}
        if outcome.reason:  # the recipient's rate across its channels
            return ApiError(
                429,
                "recipient_rate_limited",
                "too many messages for this recipient across its channels; retry later",
                headers,
                extra,
            )
        return ApiError(429, "rate_limited", "too many messages for this queue; retry later", headers, extra)
    if outcome.kind == "full":
        return _full(outcome.reason)
    return None


def _full(reason: str) -> ApiError:
    """A 507 for enqueue.lua's and rcpt_admit.lua's refusal reasons (docs/api.md)."""
    if reason in ("recipient messages", "recipient bytes"):
        what = "messages" if reason == "recipient messages" else "payload bytes"
        return ApiError(
            507,
            "recipient_full",
            f"the recipient holds its cap of {what} across its channels; nothing was stored",
        )
    if reason == "channels":
        return ApiError(
            507,
            "too_many_channels",
            "the recipient holds messages in its cap of channels; read or drain one first",
        )
    if reason == "reserve":
        return ApiError(
            507,
            "storage_reserve",
            "the shard is nearly full and this queue is large; only small queues store now",
        )
    return ApiError(507, "queue_full", f"queue is full ({reason} cap reached)")


def message_json(m: Message) -> dict[str, Any]:
    return {
        "seq": m.seq,
        "payload": params.b64encode(m.payload),
        "receivedAt": params.rfc3339_ms(m.received_ms),
        "messageId": m.message_id,
    }


def next_seq(result: ReadResult, from_seq: int | None) -> int:
    if result.messages:
        return result.messages[-1].seq + 1
    return from_seq if from_seq is not None else result.last_seq + 1


def read_bytes(
    result: ReadResult, from_seq: int | None, drained: bool = False, ready: bulk.Prepared | None = None
) -> bytes:
    """The JSON answer of a read (or drain) not worth streaming: {"messages": [...], "nextSeq",
    "epoch"[, "more"]} (relay/api/bulk.py shapes it, streamed or not; `ready`: its message's
    text made while Redis stored it, bulk.answer_bytes)."""
    more = result.more if drained else None
    return bulk.answer_bytes(result.messages, next_seq(result, from_seq), result.epoch, more, ready)


async def read_response(
    request: web.Request, result: ReadResult, from_seq: int | None, drained: bool = False
) -> web.StreamResponse:
    """The read/drain answer; a big one is streamed (relay/api/bulk.py), same bytes."""
    if bulk.worth_streaming(result.messages):
        more = result.more if drained else None
        return await bulk.stream_read(
            request, result.messages, next_seq(result, from_seq), result.epoch, more
        )
    return web.Response(body=read_bytes(result, from_seq, drained), content_type="application/json")


@routes.post(ENQUEUE_ROUTE)
async def enqueue(request: web.Request) -> web.Response:
    c = ctx(request)
    recipient = params.recipient_key(request.match_info["recipient"])
    channel = params.channel_of(request)
    key = params.idempotency_key(request)
    c.auth.verify_enqueue(request, ENQUEUE_ROUTE)
    limiter = c.quota  # the per-client quota: charged before the body is read where it can be
    charged = limiter is None or quota.admit_declared(limiter, request, ENQUEUE_ROUTE, c.settings.max_payload)
    payload = await params.payload(request, c.settings.max_payload)
    if not charged:
        assert limiter is not None
        quota.admit(limiter, request, ENQUEUE_ROUTE, 1, len(payload))
    # the app cancels handlers whose client left (for long-polls); the bookkeeping of a
    # stored message (metrics, push notification) runs on Redis's reply, not in this handler
    outcome = await c.service.enqueue(EnqueueRequest(recipient, channel, payload, key))
    status, body = enqueue_answer(outcome)
    return web.Response(status=status, body=body, content_type="application/json")


def enqueue_answer(outcome: EnqueueOutcome) -> tuple[int, bytes]:
    """(status, JSON body) of an enqueue Redis answered; ApiError for a refused one.
    Shared by this handler and the HTTP fast path (relay/http/fastpath.py)."""
    # exactly what orjson writes for {"seq": n, "duplicate": b}, shaped directly
    kind = outcome.kind
    if kind != "stored":
        if kind == "duplicate":
            return 200, b'{"seq":%d,"duplicate":true}' % outcome.seq
        if (err := enqueue_error(outcome)) is not None:
            raise err
    return 201, b'{"seq":%d,"duplicate":false}' % outcome.seq


@routes.get("/v1/queues/{recipient}/messages")
async def read(request: web.Request) -> web.StreamResponse:
    c = ctx(request)
    recipient = params.recipient_key(request.match_info["recipient"])
    channel = params.channel_of(request)
    start, lim, wait = (
        params.from_seq(request),
        params.limit(request, c.settings),
        params.wait(request, c.settings),
    )
    await c.auth.verify(request, recipient)
    result = await c.service.read(recipient, channel, start, lim, wait)
    return await read_response(request, result, start)


@routes.post("/v1/queues/{recipient}/drain")
async def drain(request: web.Request) -> web.StreamResponse:
    c = ctx(request)
    recipient = params.recipient_key(request.match_info["recipient"])
    channel = params.channel_of(request)
    lim, wait = params.limit(request, c.settings), params.wait(request, c.settings)
    body = await params.raw_body(request, DRAIN_MAX_BODY)
    await c.auth.verify(request, recipient, body)
    result = await c.service.drain(recipient, channel, lim, wait)
    return await read_response(request, result, None, drained=True)


MAX_ACK_SEQS = 10_000
_SEQ = {"type": "integer", "maximum": params.MAX_SEQ}
# the ack body parse_ack takes, described for relay/api/openapi.py from the same bounds: one of
# the two fields, never both (other fields are ignored)
ACK_BODY: dict[str, Any] = {
    "type": "object",
    "oneOf": [
        {"required": ["upToSeq"], "not": {"required": ["seqs"]}},
        {"required": ["seqs"], "not": {"required": ["upToSeq"]}},
    ],
    "properties": {
        "upToSeq": {**_SEQ, "minimum": 0, "description": "deletes every seq <= upToSeq"},
        "seqs": {"type": "array", "maxItems": MAX_ACK_SEQS, "items": {**_SEQ, "minimum": 1}},
    },
}


def parse_ack(doc: Any) -> tuple[int | None, list[int] | None]:
    if not isinstance(doc, dict) or (("upToSeq" in doc) == ("seqs" in doc)):
        raise bad_request('ack body must be {"upToSeq": N} or {"seqs": [N, ...]}')
    if "upToSeq" in doc:
        n = params.json_int(doc["upToSeq"])
        if n is None or not 0 <= n <= params.MAX_SEQ:
            raise bad_request("upToSeq must be an integer >= 0")
        return n, None
    seqs = doc["seqs"]
    if not isinstance(seqs, list) or len(seqs) > MAX_ACK_SEQS:
        raise _bad_seqs()
    found = set()
    for s in seqs:
        n = params.json_int(s)
        if n is None or not 1 <= n <= params.MAX_SEQ:
            raise _bad_seqs()
        found.add(n)
    return None, sorted(found)


def _bad_seqs() -> ApiError:
    return bad_request(f"seqs must be a list of at most {MAX_ACK_SEQS} integers >= 1")


@routes.post("/v1/queues/{recipient}/ack")
async def ack(request: web.Request) -> web.Response:
    c = ctx(request)
    recipient = params.recipient_key(request.match_info["recipient"])
    channel = params.channel_of(request)
    doc, raw = await params.json_body(request, ACK_MAX_BODY)
    await c.auth.verify(request, recipient, raw)
    up_to, seqs = parse_ack(doc)
    removed = await asyncio.shield(c.service.ack(recipient, channel, up_to, seqs))
    return json_response({"removed": removed})


@routes.get("/v1/queues/{recipient}/status")
async def status(request: web.Request) -> web.Response:
    c = ctx(request)
    recipient = params.recipient_key(request.match_info["recipient"])
    channel = params.channel_of(request)
    await c.auth.verify(request, recipient)
    # live anywhere in the fleet (relay/presence.py), asked beside the queue's own figures
    st, live = await asyncio.gather(c.service.status(recipient, channel), c.presence.live(recipient, channel))
    now = time.time()
    return json_response(
        {
            "message_count": st.count,
            "total_bytes": st.bytes,
            "oldest_received_time": params.rfc3339_ms(st.oldest_ms) if st.oldest_ms is not None else None,
            "newest_received_time": params.rfc3339_ms(st.newest_ms) if st.newest_ms is not None else None,
            "longest_waited_seconds": max(0, int(now - st.oldest_ms / 1000))
            if st.oldest_ms is not None
            else None,
            "live_delivery": live,
            "nextSeq": st.last_seq + 1,
            "epoch": st.epoch,
        }
    )


@routes.get("/v1/queues/{recipient}/channels")
async def channels(request: web.Request) -> web.Response:
    """The recipient's channels (the default one, "", first) and what each holds: signed like
    every queue read. Creates no Redis state for an unknown recipient. The DIDComm mediator's
    queue of the key (forwards to it, when a connection registered it) is listed too, marked
    "mediated": it counts against the recipient's quotas, but only Pickup reads it."""
    c = ctx(request)
    recipient = params.recipient_key(request.match_info["recipient"])
    await c.auth.verify(request, recipient)
    found = await c.service.channels(recipient)
    return json_response(
        {
            "channels": [
                {
                    "channel": params.b64encode(ch),
                    "message_count": st.count,
                    "total_bytes": st.bytes,
                    "mediated": ch == MEDIATOR_CHANNEL,
                }
                for ch, st in found
            ],
            "message_count": sum(st.count for _, st in found),
            "total_bytes": sum(st.bytes for _, st in found),
        }
    )
