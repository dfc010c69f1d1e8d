"""The OpenAPI 3.1 document of the HTTP API (docs/api.md), served at /v1/openapi.json.

Generated from the definitions that parse requests, never a copy of them: each parameter is
the declaration its parser checks values against (relay/api/params.py: pattern, refusal code
and text), each JSON request body the schema declared beside its parser (queues.ACK_BODY,
fanout.BODY, inbox.APPEND_BODY, pickup.BODY), each size cap the one the handler enforces.
Written here is only what the answers show: their shapes and the statuses each route answers.
tests/relay/api/test_openapi.py runs schemathesis from this document against a live relay.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from relay.api import didcomm, fanout, inbox, params, pickup, queues
from relay.settings import Settings
from relay.storage.keys import MEDIATOR_CHANNEL, b64

routes = web.RouteTableDef()

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out = _json(_ref("Error"), description)
    if headers:
        out["headers"] = headers
    return out


_RETRY_AFTER = {"Retry-After": {"description": "whole seconds, at least 1", "schema": {"type": "string"}}}
_UPGRADE = {"Upgrade": {"schema": {"type": "string"}}}
_E400 = _error("malformed request (bad recipient, channel, parameter or body)")
_E401 = _error(
    "missing or invalid signature or token",
    {"WWW-Authenticate": {"description": "Relay-Ed25519, or Bearer", "schema": {"type": "string"}}},
)
_E413 = _error("body over its size cap (payload_too_large); fan-out over its byte budget (fanout_too_large)")
_E415 = _error("unsupported_encoding: request bodies must not be compressed (Content-Encoding)")
_E426 = _error("websocket_required: not a WebSocket upgrade request", _UPGRADE)
_E429 = _error(
    "rate_limited (the queue's rate), client_rate_limited (the per-client quota) or"
    " recipient_rate_limited (the recipient's, across its channels);"
    " retryAfterMs tells when to retry",
    _RETRY_AFTER,
)
_E503 = _error(
    "shard unavailable or slot migrating past the deadline, or the relay is overloaded (memory guard); retry",
    _RETRY_AFTER,
)
_E507 = _error(
    "queue_full (depth or byte cap), recipient_full (the recipient's caps across its channels),"
    " too_many_channels (the recipient's channel cap), storage_reserve (the shard is within its"
    " reserve and this queue is large) or storage_full (shard out of memory)"
)
_SIGNED: list[dict[str, list[str]]] = [{"relayEd25519": []}]
_STORING: list[dict[str, list[str]]] = [{}, {"enqueueToken": []}]  # the token only when tokens are on
_NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}
_SEQ = {"type": "integer", "minimum": 1}
_COUNT = {"type": "integer", "minimum": 0}
_B64URL = {"type": "string", "pattern": params.B64URL}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


_MESSAGES = {"type": "array", "items": _ref("Message")}
SCHEMAS: dict[str, Any] = {
    "Error": _object(
        ["error", "code"],
        error={"type": "string"},
        code={"type": "string", "pattern": "^[a-z0-9_]+$"},
        retryAfterMs=_COUNT,
    ),
    "EnqueueResult": _object(["seq", "duplicate"], seq=_SEQ, duplicate={"type": "boolean"}),
    "Message": _object(
        ["seq", "payload", "receivedAt", "messageId"],
        seq=_SEQ,
        payload=_B64URL,
        receivedAt={"type": "string", "format": "date-time"},
        messageId={"type": ["string", "null"]},
    ),
    "ReadResult": _object(
        ["messages", "nextSeq", "epoch"], messages=_MESSAGES, nextSeq=_COUNT, epoch={"type": "string"}
    ),
    "DrainResult": _object(
        ["messages", "nextSeq", "epoch", "more"],
        messages=_MESSAGES,
        nextSeq=_COUNT,
        epoch={"type": "string"},
        more={"type": "boolean"},
    ),
    "AckRequest": queues.ACK_BODY,
    "AckResult": _object(["removed"], removed=_COUNT),
    "Status": _object(
        [
            "message_count",
            "total_bytes",
            "oldest_received_time",
            "newest_received_time",
            "longest_waited_seconds",
            "live_delivery",
            "nextSeq",
            "epoch",
        ],
        message_count=_COUNT,
        total_bytes=_COUNT,
        oldest_received_time=_NULLABLE_TIME,
        newest_received_time=_NULLABLE_TIME,
        longest_waited_seconds={"type": ["integer", "null"], "minimum": 0},
        live_delivery={"type": "boolean"},
        nextSeq=_SEQ,
        epoch={"type": "string"},
    ),
    "ChannelList": _object(
        ["channels", "message_count", "total_bytes"],
        channels={
            "type": "array",
            "description": 'the default channel ("") first, then the registered non-default channels',
            "items": _object(
                ["channel", "message_count", "total_bytes"],
                channel={
                    "type": "string",
                    "description": "a channel of the HTTP API, or (mediated) the DIDComm mediator's",
                    "anyOf": [{"pattern": params.CHANNEL.pattern}, {"const": b64(MEDIATOR_CHANNEL)}],
                },
                message_count=_COUNT,
                total_bytes=_COUNT,
                mediated={
                    "type": "boolean",
                    "description": "the DIDComm mediator's queue of this key (forwards to it):"
                    " counted in the recipient's quotas and totals, read only by DIDComm Pickup"
                    " (the HTTP API refuses its channel, 400 bad_channel)",
                },
            ),
        },
        message_count=_COUNT,
        total_bytes=_COUNT,
    ),
    "FanoutRequest": fanout.BODY,
    "FanoutResponse": _object(
        ["results"],
        results={
            "type": "array",
            "items": _object(
                ["recipient", "status"],
                recipient={"description": "the recipients entry, as sent"},
                status={"type": "integer", "enum": [200, 201, 400, 409, 413, 429, 503, 507]},
                seq=_SEQ,
                duplicate={"type": "boolean"},
                error={"type": "string"},
                code={"type": "string"},
                retryAfterMs=_COUNT,
            ),
        },
    ),
    "DidcommEnvelope": {
        "description": "DIDComm v1 encryption envelope (Aries RFC 0019)",
        **_object(
            ["protected", "iv", "ciphertext", "tag"],
            protected={"type": "string", "description": "base64url JSON: enc, typ JWM/1.0, alg, recipients"},
            iv={"type": "string"},
            ciphertext={"type": "string"},
            tag={"type": "string"},
        ),
    },
    "DidcommInvitation": _object(
        ["invitation", "invitation_url"],
        invitation=_object(
            ["@type", "@id", "handshake_protocols", "services"],
            **{
                "@type": {"const": "https://didcomm.org/out-of-band/1.1/invitation"},
                "@id": {"type": "string"},
                "label": {"type": "string"},
                "accept": {"type": "array", "items": {"type": "string"}},
                "handshake_protocols": {"type": "array", "items": {"type": "string"}},
                "services": {"type": "array", "items": {"type": "object"}},
            },
        ),
        invitation_url={"type": "string", "format": "uri"},
    ),
    "DidcommV2Message": {
        "description": "a DIDComm v2 message: a JWE (general JSON: protected, recipients, iv,"
        " ciphertext, tag), a JWS (payload, signatures) or a plaintext message (id, type, body)",
        "type": "object",
    },
    "DidcommV2Invitation": _object(
        ["invitation", "invitation_url", "did"],
        invitation=_object(
            ["type", "id", "from", "body"],
            type={"const": "https://didcomm.org/out-of-band/2.0/invitation"},
            id={"type": "string"},
            **{"from": {"type": "string"}},
            body={"type": "object"},
        ),
        invitation_url={"type": "string", "format": "uri"},
        did={"type": "string"},
    ),
    "PickupRequest": {
        "description": "a Pickup 2.0 message (RFC 0685), plaintext DIDComm JSON",
        **pickup.BODY,
    },
    "PickupReply": {
        "description": "status, delivery, or (live-delivery-change true over HTTP) problem-report",
        **_object(
            ["@type", "@id"],
            **{
                "@id": {"type": "string"},
                "@type": {"type": "string"},
                "~thread": {
                    "type": "object",
                    "properties": {"thid": {"type": "string"}, "pthid": {"type": "string"}},
                },
                "recipient_key": {"type": "string"},
                "message_count": _COUNT,
                "longest_waited_seconds": _COUNT,
                "newest_received_time": {"type": "string", "format": "date-time"},
                "oldest_received_time": {"type": "string", "format": "date-time"},
                "total_bytes": _COUNT,
                "live_delivery": {"type": "boolean"},
                "~attach": {
                    "type": "array",
                    "items": _object(
                        ["@id", "data"],
                        **{
                            "@id": {"type": "string", "description": "the message's seq, as a string"},
                            "data": _object(["base64"], base64=_B64URL),
                        },
                    ),
                },
                "description": {"type": "string"},
            },
        ),
    },
    "InboxAppend": inbox.APPEND_BODY,
    "InboxStored": _object(["seq", "storedAt"], seq=_SEQ, storedAt={"type": "string", "format": "date-time"}),
    "InboxMessages": _object(
        ["messages", "nextSeq"],
        messages={
            "type": "array",
            "items": _object(
                ["seq", "messageId", "ciphertext", "createdAt"],
                seq=_SEQ,
                messageId={"type": ["string", "null"]},
                ciphertext=_B64URL,
                createdAt={"type": "string", "format": "date-time"},
            ),
        },
        nextSeq=_COUNT,
    ),
}


def _body(content: dict[str, Any], max_bytes: int, required: bool = True, what: str = "") -> dict[str, Any]:
    """A request body and the cap its handler reads it under (x-max-bytes; RELAY_MAX_PAYLOAD at
    its default where the cap follows it)."""
    return {
        "required": required,
        "description": f"{what}at most {max_bytes} bytes; more: 413 payload_too_large",
        "x-max-bytes": max_bytes,
        "content": content,
    }


def _json_body(name: str, max_bytes: int) -> dict[str, Any]:
    return _body({JSON: {"schema": _ref(name)}}, max_bytes)


def _op(
    op_id: str,
    summary: str,
    responses: dict[str, Any],
    *,
    parameters: tuple[params.Param, ...] = (),
    body: dict[str, Any] | None = None,
    security: list[dict[str, list[str]]] | None = None,
    description: str = "",
) -> dict[str, Any]:
    """One operation, its parameters as their parsers declare them."""
    out: dict[str, Any] = {"operationId": op_id, "summary": summary}
    if description:
        out["description"] = description
    if security is not None:
        out["security"] = security
    if parameters:
        out["parameters"] = [p.openapi() for p in parameters]
    if body is not None:
        out["requestBody"] = body
    out["responses"] = responses
    return out


_QUEUE = (params.RECIPIENT, params.CHANNEL)
_LIVE_FRAMES = (
    "Upgrade to WebSocket. The server sends "
    '{"type":"message","seq","payload","receivedAt","messageId"} for the backlog from fromSeq, '
    'then {"type":"empty"}, then each new message as it arrives. The client sends '
    '{"type":"ack","upToSeq":N} (or {"type":"ack","seqs":[...]}); nothing is deleted without an '
    "ack. Text frames holding a Pickup 2.0 message are answered in-band. A newer live connection "
    "to the same queue closes the older one with close code 4409."
)
_INBOUND = (
    "Authcrypt or Anoncrypt (RFC 0019) for the mediator's connection or routing key; "
    "docs/protocols.md lists the protocols. A forward is queued for its registered recipient "
    "key under the enqueue limits and rate limits, idempotent by its @id. The reply comes in "
    "the response when the message asks for ~transport.return_route all; otherwise 202. "
    "DIDComm v2 (application/didcomm-encrypted+json, -signed+json, -plain+json): Coordinate "
    "Mediation 2.0/3.0, Pickup 3.0 and Routing 2.0, replies when return_route is all."
)
_MAX_PAYLOAD = Settings.max_payload  # RELAY_MAX_PAYLOAD's default (docs/api.md, "Defaults")
_OCTETS = "application/octet-stream"
_BINARY = {"type": "string", "format": "binary"}

PATHS: dict[str, Any] = {
    queues.ENQUEUE_ROUTE: {
        "post": _op(
            "enqueue",
            "store one message (stored before the answer: immediately readable)",
            {
                "201": _json(_ref("EnqueueResult"), "stored"),
                "200": _json(_ref("EnqueueResult"), "a repeat of an earlier enqueue (same Idempotency-Key)"),
                "400": _E400,
                "401": _E401,
                "409": _error("idempotency_conflict: the key was used with a different payload"),
                "413": _E413,
                "415": _E415,
                "429": _E429,
                "503": _E503,
                "507": _E507,
            },
            parameters=(*_QUEUE, params.IDEMPOTENCY_KEY),
            body=_body(
                {_OCTETS: {"schema": {**_BINARY, "minLength": 1, "maxLength": _MAX_PAYLOAD}}}, _MAX_PAYLOAD
            ),
            security=_STORING,
        ),
        "get": _op(
            "read",
            "non-destructive read from fromSeq, with optional long-poll",
            {
                "200": _json(_ref("ReadResult"), "messages (possibly none)"),
                "400": _E400,
                "401": _E401,
                "503": _E503,
            },
            parameters=(*_QUEUE, params.FROM_SEQ, params.LIMIT, params.WAIT),
            security=_SIGNED,
        ),
    },
    "/v1/queues/{recipient}/ack": {
        "post": _op(
            "ack",
            "delete acknowledged messages (idempotent)",
            {
                "200": _json(_ref("AckResult"), "removed count"),
                "400": _E400,
                "401": _E401,
                "413": _E413,
                "415": _E415,
                "503": _E503,
            },
            parameters=_QUEUE,
            body=_json_body("AckRequest", queues.ACK_MAX_BODY),
            security=_SIGNED,
        )
    },
    "/v1/queues/{recipient}/drain": {
        "post": _op(
            "drain",
            "atomic read-and-delete (quicprochat fetch / fetchWait)",
            {
                "200": _json(_ref("DrainResult"), "messages removed from the queue"),
                "400": _E400,
                "401": _E401,
                "413": _E413,
                "415": _E415,
                "503": _E503,
            },
            parameters=(*_QUEUE, params.LIMIT, params.WAIT),
            body=_body(
                {_OCTETS: {"schema": _BINARY}}, queues.DRAIN_MAX_BODY, False, "none needed; any is signed; "
            ),
            security=_SIGNED,
        )
    },
    "/v1/queues/{recipient}/status": {
        "get": _op(
            "status",
            "O(1) queue summary",
            {"200": _json(_ref("Status"), "queue status"), "400": _E400, "401": _E401, "503": _E503},
            parameters=_QUEUE,
            security=_SIGNED,
        )
    },
    "/v1/queues/{recipient}/channels": {
        "get": _op(
            "channels",
            "the recipient's channels and what each holds (signed)",
            {
                "200": _json(_ref("ChannelList"), "the channels, the default one first"),
                "400": _E400,
                "401": _E401,
                "503": _E503,
            },
            parameters=(params.RECIPIENT,),
            security=_SIGNED,
        )
    },
    "/v1/queues/{recipient}/live": {
        "get": _op(
            "live",
            "WebSocket live delivery",
            {
                "101": {"description": "switching to WebSocket"},
                "400": _E400,
                "401": _E401,
                "426": _E426,
                "503": _E503,
            },
            parameters=(*_QUEUE, params.FROM_SEQ),
            security=_SIGNED,
            description=_LIVE_FRAMES,
        )
    },
    fanout.ROUTE: {
        "post": _op(
            "fanout",
            "queue one payload for many recipients, each independently",
            {
                "200": _json(_ref("FanoutResponse"), "one result per recipient, in request order"),
                "400": _E400,
                "401": _E401,
                "413": _E413,
                "415": _E415,
                "429": _error(
                    "client_rate_limited: every recipient's copy counts against the client quota;"
                    " nothing was stored",
                    _RETRY_AFTER,
                ),
            },
            body=_json_body("FanoutRequest", fanout.body_cap(_MAX_PAYLOAD)),
            security=_STORING,
        )
    },
    "/v1/didcomm/pickup": {
        "post": _op(
            "pickup",
            "DIDComm Pickup 2.0 (RFC 0685)",
            {
                "200": _json(_ref("PickupReply"), "the mediator's reply"),
                "400": _E400,
                "401": _E401,
                "413": _E413,
                "415": _E415,
                "503": _E503,
            },
            parameters=(params.CHANNEL,),
            body=_json_body("PickupRequest", pickup.MAX_BODY),
            security=_SIGNED,
            description="The queue is the message's recipient_key or, without one, the key of the"
            " Authorization header; the signature must be by that key.",
        )
    },
    "/v1/didcomm/invitation": {
        "get": _op(
            "didcommInvitation",
            "The fleet's DIDComm mediator invitation (Out-of-Band 1.1)",
            {
                "200": _json(_ref("DidcommInvitation"), "the invitation and its ?oob= URL"),
                "404": _error("didcomm_disabled: this relay has no mediator seed"),
            },
            description="Handshake protocols DID Exchange 1.1 and 1.0; services: RELAY_PUBLIC_URL +"
            " /v1/didcomm and its WebSocket /v1/didcomm/ws; recipient key: the mediator's did:key."
            " Every relay given the same seed (RELAY_DIDCOMM_SEED_FILE) and public URL serves the"
            " same invitation.",
        )
    },
    "/v1/didcomm/v2/invitation": {
        "get": _op(
            "didcommV2Invitation",
            "The fleet's DIDComm v2 mediator invitation (Out-of-Band 2.0)",
            {
                "200": _json(
                    _ref("DidcommV2Invitation"), "the invitation, its ?_oob= URL and the mediator's DID"
                ),
                "404": _error("didcomm_disabled: this relay has no mediator seed"),
            },
            description="from: the mediator's did:peer:2, whose DIDCommMessaging services are"
            " RELAY_PUBLIC_URL + /v1/didcomm (first) and its WebSocket /v1/didcomm/ws (second)."
            " Every relay given the same seed and public URL serves the same DID.",
        )
    },
    "/v1/didcomm": {
        "post": _op(
            "didcommInbound",
            "A DIDComm v1 packed envelope, or a DIDComm v2 message, for the mediator",
            {
                "200": {
                    "description": "the reply, packed (Authcrypt) for the sender",
                    "content": {
                        didcomm.REPLY_TYPE: {"schema": _ref("DidcommEnvelope")},
                        "application/didcomm-encrypted+json": {"schema": _ref("DidcommV2Message")},
                    },
                },
                "202": {"description": "accepted; no reply (or none was asked for)"},
                "400": _error("bad_envelope (undecryptable), bad_didcomm_message, bad_recipient, ..."),
                "401": _error("unauthorized: a forward without the enqueue token (RELAY_ENQUEUE_TOKENS on)"),
                "403": _error("unknown_connection: not authcrypted by a connection's key (or it expired)"),
                "404": _error("unknown_recipient (a forward to an unregistered key) or didcomm_disabled"),
                "409": _error("a forward @id reused for a different message"),
                "413": _E413,
                "415": _error("unsupported_media_type, or unsupported_encoding (a compressed body)"),
                "429": _E429,  # rate_limited (a forward), too_many_connections (a DID Exchange request)
                "503": _E503,
                "507": _E507,
            },
            body=_body(
                {
                    **{t: {"schema": _ref("DidcommEnvelope")} for t in didcomm.CONTENT_TYPES},
                    **{t: {"schema": _ref("DidcommV2Message")} for t in didcomm.V2_CONTENT_TYPES},
                },
                didcomm.envelope_cap(_MAX_PAYLOAD),
            ),
            description=_INBOUND,
        )
    },
    "/v1/didcomm/ws": {
        "get": _op(
            "didcommWebSocket",
            "WebSocket carrying DIDComm v1 packed envelopes both ways",
            {
                "101": {"description": "switching to WebSocket"},
                "404": _error("didcomm_disabled"),
                "426": _E426,
                "503": _E503,
            },
            description="Each frame (text or binary) is one packed envelope; return-routed replies"
            " come back on the socket as binary frames. Pickup 2.0 live-delivery-change true makes"
            " the mediator send delivery messages as forwards arrive; they are deleted only on"
            " messages-received.",
        )
    },
    inbox.APPEND_ROUTE: {
        "post": _op(
            "inboxAppend",
            "tunnl3d inbox append (idempotent by messageId)",
            {
                "201": _json(_ref("InboxStored"), "stored"),
                "200": _json(_ref("InboxStored"), "this messageId was stored before: its seq"),
                "400": _E400,
                "401": _E401,
                "413": _E413,
                "415": _E415,
                "429": _E429,
                "503": _E503,
                "507": _E507,
            },
            parameters=(params.INBOX_ID,),
            body=_json_body("InboxAppend", inbox.body_cap(_MAX_PAYLOAD)),
            security=_STORING,
        )
    },
    "/v1/inbox/messages": {
        "get": _op(
            "inboxRead",
            "tunnl3d inbox read (never deletes; retention removes)",
            {"200": _json(_ref("InboxMessages"), "messages (possibly none)"), "400": _E400, "503": _E503},
            parameters=(params.INBOX_ID, params.FROM_SEQ, params.LIMIT),
        )
    },
    "/healthz": {
        "get": _op("healthz", "liveness", {"200": _json(_object([], status={"const": "ok"}), "alive")})
    },
    "/readyz": {
        "get": _op(
            "readyz",
            "readiness: map loaded, not stopping, a shard owning slots answers; detail per shard",
            {"200": _json(_object([], status={"const": "ready"}), "ready"), "503": _error("not ready")},
        )
    },
    "/metrics": {
        "get": _op(
            "metrics",
            "Prometheus metrics",
            {"200": {"description": "text exposition format", "content": {"text/plain": {}}}},
        )
    },
    "/v1/openapi.json": {
        "get": _op("openapi", "this document", {"200": _json({"type": "object"}, "OpenAPI 3.1 document")})
    },
}


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "relayfleet",
            "version": "1",
            "description": "Sharded store-and-forward relay for end-to-end-encrypted messaging. "
            "JSON binary fields are base64url without padding; every 4xx/5xx body is "
            '{"error": text, "code": snake_case, ...}.',
        },
        "paths": PATHS,
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {
                "relayEd25519": {
                    "type": "http",
                    "scheme": "Relay-Ed25519",
                    "description": (
                        "Authorization: Relay-Ed25519 key=<b64url pubkey>, ts=<unix s>, nonce=<b64url 16 B>, "
                        'sig=<b64url 64 B>; sig signs "relay-v1\\n" METHOD "\\n" PATH_AND_QUERY "\\n" ts '
                        '"\\n" nonce "\\n" hex(sha256(body)). key must be the queue\'s recipient; '
                        "ts within 300 s; each nonce is accepted once."
                    ),
                },
                "enqueueToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "required for enqueue and fan-out only when RELAY_ENQUEUE_TOKENS is set",
                },
            },
        },
    }


_BODY = orjson.dumps(document())


@routes.get("/v1/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=_BODY, content_type=JSON)
