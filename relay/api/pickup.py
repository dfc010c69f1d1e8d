"""DIDComm Pickup Protocol 2.0 (Aries RFC 0685) over HTTP and on the live WebSocket.

Messages are plaintext DIDComm JSON. The queue is the message's ``recipient_key``
(base64url of the 32-byte Ed25519 key, or a ``did:key`` of one), or, when the
message carries none, the key of the request's Authorization header. Replies
copy the request's ``@type`` prefix (``https://didcomm.org/`` or the legacy
``did:sov:…;spec/``) so old and new agents both recognise them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from relay.api import params
from relay.api.auth import parse_header
from relay.api.context import Context, ctx
from relay.api.errors import ApiError, bad_request, json_response
from relay.didcomm import keys as dk
from relay.didcomm.messages import PREFIXES
from relay.storage.store import StatusResult

routes = web.RouteTableDef()

PROTOCOL = "messagepickup/2.0/"
PROBLEM_REPORT = "notification/1.0/problem-report"
NAMES = ("status-request", "delivery-request", "messages-received", "live-delivery-change")
MAX_BODY = 1 << 20
MAX_IDS = 10_000
_DID_KEY = "did:key:"
DID_KEY_PATTERN = "^did:key:z6Mk[1-9A-HJ-NP-Za-km-z]{44}$"  # multicodec ed25519-pub + 32 bytes, base58
# the body pickup() takes, described for relay/api/openapi.py from the same names and bounds;
# each message type reads its own field (checked only there), ~transport and others are ignored
_NEEDS: dict[str, tuple[str, dict[str, Any]]] = {
    "delivery-request": ("limit", {"type": "integer", "minimum": 1}),
    "messages-received": (
        "message_id_list",
        {"type": "array", "maxItems": MAX_IDS, "items": {"type": "string"}},
    ),
    "live-delivery-change": ("live_delivery", {"type": "boolean"}),
}
BODY: dict[str, Any] = {
    "type": "object",
    "required": ["@type"],
    "properties": {
        "@id": {"type": ["string", "null"]},
        "@type": {"enum": [f"{prefix}{PROTOCOL}{name}" for prefix in PREFIXES for name in NAMES]},
        "recipient_key": {
            "type": "string",
            "description": "the queue: base64url of the 32-byte key, or an Ed25519 did:key"
            " (absent: the key of the Authorization header)",
            "anyOf": [{"pattern": params.RECIPIENT.pattern}, {"pattern": DID_KEY_PATTERN}],
        },
        "~thread": {"description": "its thid, when a string, threads the reply"},
    },
    "allOf": [
        {
            "if": {"properties": {"@type": {"enum": [f"{prefix}{PROTOCOL}{name}" for prefix in PREFIXES]}}},
            "then": {"required": [field], "properties": {field: schema}},
        }
        for name, (field, schema) in _NEEDS.items()
    ],
}


class PickupError(Exception):
    """A Pickup message the mediator cannot act on (HTTP: 400; WebSocket: a problem-report)."""

    def __init__(self, text: str, code: str = "bad_pickup_message") -> None:
        super().__init__(text)
        self.text = text
        self.code = code


class LiveControl(Protocol):
    """What a persistent transport (the live WebSocket) lets Pickup see and change."""

    @property
    def live_delivery(self) -> bool: ...

    def set_live_delivery(self, on: bool) -> None: ...

    def acked(self, seqs: list[int]) -> None: ...


@dataclass(frozen=True, slots=True)
class PickupMessage:
    prefix: str  # e.g. "https://didcomm.org/"
    name: str  # one of NAMES
    id: str | None
    thid: str | None  # the thread this message belongs to (~thread.thid), if it says
    recipient_key: str | None  # exactly as sent, echoed in replies
    doc: dict[str, Any]

    @property
    def reply_thread(self) -> dict[str, str] | None:
        """~thread of a reply: the request's thread, or the request itself starts one."""
        thid = self.thid or self.id
        return {"thid": thid} if thid else None


def recipient_from_key(text: str) -> bytes:
    """The queue's 32-byte key from a base64url key or an Ed25519 did:key."""
    if text.startswith(_DID_KEY):
        try:
            return dk.verkey_from(text)
        except dk.DidError:
            raise PickupError("recipient_key did:key must name an Ed25519 key", "bad_recipient") from None
    try:
        return params.recipient_key(text)
    except ApiError as exc:
        raise PickupError(exc.text, exc.code) from None


def parse_message(doc: Any) -> PickupMessage:
    if not isinstance(doc, dict):
        raise PickupError("a Pickup message must be a JSON object")
    mtype = doc.get("@type")
    if not isinstance(mtype, str):
        raise PickupError("@type must be a string")
    for prefix in PREFIXES:
        if mtype.startswith(prefix + PROTOCOL):
            name = mtype[len(prefix + PROTOCOL) :]
            break
    else:
        raise PickupError("@type is not a messagepickup/2.0 message", "unsupported_message_type")
    if name not in NAMES:
        raise PickupError(
            f"messagepickup/2.0/{name[:40]} is not a message the mediator accepts", "unsupported_message_type"
        )
    mid = doc.get("@id")
    if mid is not None and not isinstance(mid, str):
        raise PickupError("@id must be a string")
    thread = doc.get("~thread")
    thid = thread.get("thid") if isinstance(thread, dict) else None
    key = doc.get("recipient_key")
    if key is not None and not isinstance(key, str):
        raise PickupError("recipient_key must be a string", "bad_recipient")
    return PickupMessage(prefix, name, mid, thid if isinstance(thid, str) else None, key, doc)


def problem_report(prefix: str, offending_id: str | None, description: str) -> dict[str, Any]:
    report: dict[str, Any] = {"@type": prefix + PROBLEM_REPORT, "@id": str(uuid.uuid4())}
    if offending_id:
        report["~thread"] = {"pthid": offending_id}
    report["description"] = description
    return report


def _status_doc(msg: PickupMessage, st: StatusResult, live: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {"@id": str(uuid.uuid4()), "@type": msg.prefix + PROTOCOL + "status"}
    if (thread := msg.reply_thread) is not None:
        doc["~thread"] = thread
    if msg.recipient_key is not None:
        doc["recipient_key"] = msg.recipient_key
    doc["message_count"] = st.count
    doc["longest_waited_seconds"] = (
        max(0, int(time.time() - st.oldest_ms / 1000)) if st.oldest_ms is not None else 0
    )
    # received times exist only while something is held: omitted (not null) when empty,
    # because agents validate them as strings
    if st.newest_ms is not None:
        doc["newest_received_time"] = params.rfc3339_ms(st.newest_ms)
    if st.oldest_ms is not None:
        doc["oldest_received_time"] = params.rfc3339_ms(st.oldest_ms)
    doc["total_bytes"] = st.bytes
    doc["live_delivery"] = live
    return doc


def _limit(doc: dict[str, Any], cap: int) -> int:
    limit = params.json_int(doc.get("limit"))
    if limit is None or limit < 1:
        raise PickupError("delivery-request needs limit, an integer >= 1")
    return min(limit, cap)


def _received_seqs(doc: dict[str, Any]) -> list[int]:
    ids = doc.get("message_id_list")
    if not isinstance(ids, list) or len(ids) > MAX_IDS or not all(isinstance(i, str) for i in ids):
        raise PickupError(f"messages-received needs message_id_list, a list of at most {MAX_IDS} strings")
    # ids are the attachment @ids we handed out (seqs); anything else names nothing we hold
    return sorted({int(i) for i in ids if i.isascii() and i.isdigit() and 0 < len(i) <= 18})


async def answer(
    c: Context, msg: PickupMessage, recipient: bytes, channel: bytes, control: LiveControl | None
) -> dict[str, Any]:
    """The mediator's reply to one Pickup message for the queue (recipient, channel)."""
    service = c.service

    async def live_now() -> bool:
        if control is not None:
            return control.live_delivery  # the asking socket is the queue's one live connection
        return await c.presence.live(recipient, channel)  # on any relay of the fleet

    async def status() -> dict[str, Any]:
        st, live = await asyncio.gather(service.status(recipient, channel), live_now())
        return _status_doc(msg, st, live)

    if msg.name == "status-request":
        return await status()
    if msg.name == "delivery-request":
        limit = _limit(msg.doc, c.settings.max_limit)
        result = await service.read(recipient, channel, None, limit, 0)
        if not result.messages:
            return await status()  # RFC: nothing to deliver → a status, at once
        delivery: dict[str, Any] = {"@id": str(uuid.uuid4())}
        if (thread := msg.reply_thread) is not None:
            delivery["~thread"] = thread
        delivery["@type"] = msg.prefix + PROTOCOL + "delivery"
        if msg.recipient_key is not None:
            delivery["recipient_key"] = msg.recipient_key
        delivery["~attach"] = [
            {"@id": str(m.seq), "data": {"base64": params.b64encode(m.payload)}} for m in result.messages
        ]
        return delivery
    if msg.name == "messages-received":
        seqs = _received_seqs(msg.doc)
        if seqs:
            await service.ack(recipient, channel, None, seqs)
            if control is not None:
                control.acked(seqs)
        return await status()
    # live-delivery-change
    want = msg.doc.get("live_delivery")
    if not isinstance(want, bool):
        raise PickupError("live-delivery-change needs live_delivery, true or false")
    if control is None:
        if want:
            return problem_report(msg.prefix, msg.id, "Connection does not support Live Delivery")
        return await status()
    control.set_live_delivery(want)
    return await status()


def _header_key(request: web.Request) -> bytes:
    header = request.headers.get("Authorization")
    if not header:
        raise bad_request("the message has no recipient_key and the request is not signed", "bad_recipient")
    return parse_header(header).key


@routes.post("/v1/didcomm/pickup")
async def pickup(request: web.Request) -> web.Response:
    c = ctx(request)
    channel = params.channel_of(request)
    doc, raw = await params.json_body(request, MAX_BODY)
    try:
        msg = parse_message(doc)
        recipient = recipient_from_key(msg.recipient_key) if msg.recipient_key is not None else None
    except PickupError as exc:
        raise bad_request(exc.text, exc.code) from None
    if recipient is None:
        recipient = _header_key(request)
    await c.auth.verify(request, recipient, raw)
    try:
        reply = await answer(c, msg, recipient, channel, None)
    except PickupError as exc:
        raise bad_request(exc.text, exc.code) from None
    return json_response(reply)
