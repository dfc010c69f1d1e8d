"""tunnl3d-compatible inbox API: append and read by an ``X-Inbox-ID`` capability.

An inbox is an ordinary queue whose recipient is sha256 of a domain prefix and the
inbox id, so it gets the queue machinery (sequence numbers, rate limit, caps,
sharding, retention) and the id itself is never stored, used as a key or logged.
Appends are idempotent by messageId (any payload: tunnl3d returns the existing
seq); reads never delete; retention removes old messages.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from aiohttp import web

from relay.api import params, quota
from relay.api.context import ctx
from relay.api.errors import bad_request, json_response
from relay.api.queues import enqueue_error
from relay.service import now_ms
from relay.storage.store import EnqueueRequest

routes = web.RouteTableDef()
APPEND_ROUTE = "/v1/inbox/append"

HEADER = params.INBOX_ID.name
_DOMAIN = b"relayfleet/inbox/v1\x00"  # keeps inbox queues apart from every other use of sha256
_MESSAGE_ID = re.compile(params.PRINTABLE_128)
_X = params.B64
# the body append() takes, described for relay/api/openapi.py from the same patterns
APPEND_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["messageId", "ciphertext"],
    "properties": {
        "messageId": {"type": "string", "pattern": params.PRINTABLE_128},
        "ciphertext": {
            "type": "string",
            "minLength": 2,
            "pattern": f"^(?:{_X}{{4}})*(?:{_X}{{2}}(?:==)?|{_X}{{3}}=?)?$",
            "description": "base64url (correct padding tolerated)",
        },
    },
}


def inbox_recipient(inbox_id: str) -> bytes:
    """The 32-byte pseudo-recipient whose queue holds the inbox."""
    return hashlib.sha256(_DOMAIN + inbox_id.encode("ascii")).digest()


def _inbox(request: web.Request) -> bytes:
    raw = request.headers.get(HEADER)
    if raw is None:
        raise bad_request(f"the {HEADER} header is required", "bad_inbox_id")
    if not params.INBOX_ID.regex.fullmatch(raw):
        raise bad_request(params.INBOX_ID.error, params.INBOX_ID.code)
    return inbox_recipient(raw)


def body_cap(max_payload: int) -> int:
    """The JSON body's bytes: the ciphertext's base64 and some room around it."""
    return max_payload * 4 // 3 + 4096


def _ciphertext(text: Any, cap: int) -> bytes:
    if not isinstance(text, str):
        raise bad_request("ciphertext must be a base64url string", "bad_ciphertext")
    unpadded = text.rstrip("=")
    try:
        # correct padding is tolerated on input (some encoders add it); answers never carry it
        if unpadded != text and (len(text) % 4 or len(text) - len(unpadded) > 2):
            raise ValueError("bad padding")
        data = params.b64decode(unpadded)
    except ValueError:
        raise bad_request("ciphertext must be base64url", "bad_ciphertext") from None
    return params.payload_within(data, cap)


@routes.post(APPEND_ROUTE)
async def append(request: web.Request) -> web.Response:
    c = ctx(request)
    recipient = _inbox(request)
    cap = c.settings.max_payload
    # a storing route: the enqueue token when those are on (reads stay X-Inbox-ID alone)
    doc = await params.storing_json_body(request, APPEND_ROUTE, body_cap(cap))
    if not isinstance(doc, dict):
        raise bad_request('body must be {"messageId": "...", "ciphertext": "<base64url>"}')
    message_id = doc.get("messageId")
    if not isinstance(message_id, str) or not _MESSAGE_ID.fullmatch(message_id):
        raise bad_request("messageId must be 1-128 printable ASCII characters", "bad_message_id")
    payload = _ciphertext(doc.get("ciphertext"), cap)
    if (limiter := c.quota) is not None:
        quota.admit(limiter, request, APPEND_ROUTE, 1, len(payload))
    stored_ms = now_ms()  # the createdAt the message is stored with, so storedAt = createdAt
    outcome = await c.service.enqueue(
        EnqueueRequest(
            recipient, b"", payload, idempotency_key=message_id, message_id=message_id,
            any_payload_is_duplicate=True, now_ms=stored_ms,
        )
    )  # fmt: skip
    if (err := enqueue_error(outcome)) is not None:
        raise err
    if outcome.kind == "duplicate":  # a retry: the first append's stored time
        stored_at = await _stored_at(request, recipient, outcome.seq)
        return json_response({"seq": outcome.seq, "storedAt": stored_at})
    return json_response({"seq": outcome.seq, "storedAt": params.rfc3339_ms(stored_ms)}, 201)


async def _stored_at(request: web.Request, recipient: bytes, seq: int) -> str:
    """When the first append with this messageId was stored (now, if it has expired since)."""
    found = await ctx(request).service.read(recipient, b"", seq, 1, 0)
    if found.messages and found.messages[0].seq == seq:
        return params.rfc3339_ms(found.messages[0].received_ms)
    return params.rfc3339_ms(now_ms())


@routes.get("/v1/inbox/messages")
async def messages(request: web.Request) -> web.Response:
    c = ctx(request)
    recipient = _inbox(request)
    start, lim = params.from_seq(request), params.limit(request, c.settings)
    result = await c.service.read(recipient, b"", start, lim, 0)
    if result.messages:
        next_seq = result.messages[-1].seq + 1
    else:
        next_seq = start if start is not None else result.last_seq + 1
    return json_response(
        {
            "messages": [
                {
                    "seq": m.seq,
                    "messageId": m.message_id,
                    "ciphertext": params.b64encode(m.payload),
                    "createdAt": params.rfc3339_ms(m.received_ms),
                }
                for m in result.messages
            ],
            "nextSeq": next_seq,
        }
    )
