"""Multi-recipient fan-out (``POST /v1/messages``): one payload, queued for each recipient independently.

Each recipient gets its own result in request order, exactly what a single
enqueue would have answered (one may be rate limited while others succeed).
Only a malformed request as a whole is refused with a 4xx.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from aiohttp import web

from relay.api import params, quota
from relay.api.context import Context, ctx
from relay.api.errors import ApiError, bad_request, json_response
from relay.api.queues import enqueue_error
from relay.service import Unavailable
from relay.storage.store import EnqueueRequest, StoreRejected

log = logging.getLogger("relay.fanout")

routes = web.RouteTableDef()
ROUTE = "/v1/messages"

MAX_RECIPIENTS = 1000
_MESSAGE_ID = re.compile(params.PRINTABLE_128)
# the body fanout() takes, described for relay/api/openapi.py from the same bounds; an entry of
# recipients that is not a key is not refused as a whole: it gets its own 400 result
BODY: dict[str, Any] = {
    "type": "object",
    "required": ["recipients", "payload"],
    "properties": {
        "recipients": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_RECIPIENTS,
            "items": {"description": f"a recipient ({params.RECIPIENT.description}); else its result is 400"},
        },
        "channel": {"type": ["string", "null"], "pattern": params.CHANNEL.pattern},
        "payload": {"type": "string", "minLength": 2, "pattern": params.B64URL},
        "messageId": {
            "type": ["string", "null"],
            "pattern": params.printable(0, 128),
            "description": "1-128 printable characters; empty or null: none",
        },
    },
}


def body_cap(max_payload: int) -> int:
    """The JSON body's bytes: the payload's base64, the recipients' and some room around them."""
    return max_payload * 4 // 3 + MAX_RECIPIENTS * 64 + 4096


def _payload(text: Any, cap: int) -> bytes:
    if not isinstance(text, str):
        raise bad_request("payload must be a base64url string (no padding)", "bad_payload")
    try:
        data = params.b64decode(text)
    except ValueError:
        raise bad_request("payload must be base64url without padding", "bad_payload") from None
    return params.payload_within(data, cap)


def _check_fanout(count: int, text: Any, budget: int) -> None:
    """413 when recipients x payload bytes exceeds the fan-out budget: checked on the
    base64 text's length, before anything is decoded or any recipient is looked at."""
    if isinstance(text, str) and count * (len(text) * 3 // 4) > budget:
        raise ApiError(
            413,
            "fanout_too_large",
            f"recipients x payload size exceeds the fan-out budget ({budget} bytes); nothing was stored",
        )


def _failed(text: Any, status: int, code: str, error: str, **extra: Any) -> dict[str, Any]:
    return {"recipient": text, "status": status, "error": error, "code": code, **extra}


async def _one(c: Context, text: Any, channel: bytes, payload: bytes, message_id: str) -> dict[str, Any]:
    try:
        # a non-string fails as an undecodable key does
        recipient = params.recipient_key(text if isinstance(text, str) else "!")
        outcome = await c.service.enqueue(EnqueueRequest(recipient, channel, payload, message_id, message_id))
        if (err := enqueue_error(outcome)) is not None:
            raise err
    except ApiError as exc:
        return _failed(text, exc.status, exc.code, exc.text, **exc.extra)
    except Unavailable as exc:
        return _failed(text, 503, exc.code, f"temporarily unavailable: {exc.reason}")
    except StoreRejected:
        return _failed(text, 507, "storage_full", "the shard is out of memory; nothing was stored")
    duplicate = outcome.kind == "duplicate"
    status = 200 if duplicate else 201
    return {"recipient": text, "status": status, "seq": outcome.seq, "duplicate": duplicate}


@routes.post(ROUTE)
async def fanout(request: web.Request) -> web.Response:
    c = ctx(request)
    cap = c.settings.max_payload
    doc = await params.storing_json_body(request, ROUTE, body_cap(cap))
    if not isinstance(doc, dict):
        raise bad_request('body must be {"recipients": [...], "payload": "<base64url>", ...}')
    recipients = doc.get("recipients")
    if not isinstance(recipients, list) or not 1 <= len(recipients) <= MAX_RECIPIENTS:
        raise bad_request(f"recipients must be a list of 1-{MAX_RECIPIENTS} base64url keys", "bad_recipients")
    channel_text = doc.get("channel", "")
    if channel_text is None:
        channel_text = ""
    if not isinstance(channel_text, str):
        raise bad_request("channel must be base64url (no padding) of at most 64 bytes", "bad_channel")
    channel = params.channel_value(channel_text)
    message_id = doc.get("messageId", "")
    if message_id is None:
        message_id = ""
    if not isinstance(message_id, str) or (message_id and not _MESSAGE_ID.fullmatch(message_id)):
        raise bad_request("messageId must be 1-128 printable ASCII characters", "bad_message_id")
    _check_fanout(len(recipients), doc.get("payload"), c.settings.max_fanout_bytes)
    payload = _payload(doc.get("payload"), cap)
    if (limiter := c.quota) is not None:  # every recipient's copy counts: all or nothing, before Redis
        quota.admit(limiter, request, ROUTE, len(recipients), len(recipients) * len(payload))
    results = await asyncio.gather(*(_one(c, r, channel, payload, message_id) for r in recipients))
    return json_response({"results": list(results)})
