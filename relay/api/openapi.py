"""The OpenAPI 3.1 document of the HTTP API (docs/api.md), served at /v1/openapi.json.

Written by hand next to the views it describes; tests/relay/api/test_openapi.py runs
generated requests against a live relay and checks every answer against it.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from relay.api import pickup
from relay.didcomm.messages import PREFIXES
from relay.storage.keys import MEDIATOR_CHANNEL, b64

routes = web.RouteTableDef()

_B64 = "[A-Za-z0-9_-]"
RECIPIENT_PATTERN = f"^{_B64}{{43}}$"  # base64url, no padding, of exactly 32 bytes
# base64url of 0-64 bytes: whole groups, then 2 or 3 characters (never 1)
CHANNEL_PATTERN = f"^(?:(?:{_B64}{{4}}){{0,20}}(?:{_B64}{{2,3}})?|(?:{_B64}{{4}}){{21}}(?:{_B64}{{2}})?)$"
B64_PATTERN = f"^(?:{_B64}{{4}})*(?:{_B64}{{2,3}})?$"
PRINTABLE_128 = "^[\\x20-\\x7e]{1,128}$"
DID_KEY_PATTERN = "^did:key:z6Mk[1-9A-HJ-NP-Za-km-z]{44}$"
MAX_SEQ = 2**53 - 1  # sequence numbers stay exact in every JSON parser


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _json_body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out = _json(_ref("Error"), description)
    if headers:
        out["headers"] = headers
    return out


_RETRY_AFTER = {"Retry-After": {"description": "whole seconds, at least 1", "schema": {"type": "string"}}}
_WWW_AUTH = {"WWW-Authenticate": {"description": "Relay-Ed25519, or Bearer", "schema": {"type": "string"}}}

_E400 = _error("malformed request (bad recipient, channel, parameter or body)")
_E401 = _error("missing or invalid signature or token", _WWW_AUTH)
_E413 = _error("body over its size cap (payload_too_large); fan-out over its byte budget (fanout_too_large)")
_E415 = _error("unsupported_encoding: request bodies must not be compressed (Content-Encoding)")
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

_P_RECIPIENT = {
    "name": "recipient",
    "in": "path",
    "required": True,
    "description": "the queue owner's Ed25519 public key, base64url without padding (32 bytes)",
    "schema": {"type": "string", "pattern": RECIPIENT_PATTERN},
}
_P_CHANNEL = {
    "name": "channel",
    "in": "query",
    "required": False,
    "description": "base64url of 0-64 bytes; absent or empty is the default channel",
    "schema": {"type": "string", "pattern": CHANNEL_PATTERN},
}
_P_FROM_SEQ = {
    "name": "fromSeq",
    "in": "query",
    "required": False,
    "description": "first seq wanted (default: the oldest held); digits only, larger values are clamped",
    "schema": {"type": "integer", "minimum": 0, "maximum": MAX_SEQ},
}
_P_LIMIT = {
    "name": "limit",
    "in": "query",
    "required": False,
    "description": "at most this many messages (default 100; digits only; above 1000 is clamped to 1000)",
    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_SEQ},
}
_P_WAIT = {
    "name": "wait",
    "in": "query",
    "required": False,
    "description": "long-poll seconds when nothing is there (fractional; above 60 is clamped to 60)",
    "schema": {"type": "number", "minimum": 0, "maximum": 3600},
}
_P_INBOX = {
    "name": "X-Inbox-ID",
    "in": "header",
    "required": True,
    "description": "opaque inbox capability (never logged; hashed before use)",
    "schema": {"type": "string", "pattern": "^[\\x21-\\x7e]{1,512}$"},
}

_SIGNED: list[dict[str, list[str]]] = [{"relayEd25519": []}]
_ENQUEUE_SECURITY: list[dict[str, list[str]]] = [{}, {"enqueueToken": []}]

_NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error", "code"],
        "properties": {
            "error": {"type": "string"},
            "code": {"type": "string", "pattern": "^[a-z0-9_]+$"},
            "retryAfterMs": {"type": "integer", "minimum": 0},
        },
    },
    "EnqueueResult": {
        "type": "object",
        "required": ["seq", "duplicate"],
        "properties": {"seq": {"type": "integer", "minimum": 1}, "duplicate": {"type": "boolean"}},
    },
    "Message": {
        "type": "object",
        "required": ["seq", "payload", "receivedAt", "messageId"],
        "properties": {
            "seq": {"type": "integer", "minimum": 1},
            "payload": {"type": "string", "pattern": B64_PATTERN},
            "receivedAt": {"type": "string", "format": "date-time"},
            "messageId": {"type": ["string", "null"]},
        },
    },
    "ReadResult": {
        "type": "object",
        "required": ["messages", "nextSeq", "epoch"],
        "properties": {
            "messages": {"type": "array", "items": _ref("Message")},
            "nextSeq": {"type": "integer", "minimum": 0},
            "epoch": {"type": "string"},
        },
    },
    "DrainResult": {
        "type": "object",
        "required": ["messages", "nextSeq", "epoch", "more"],
        "properties": {
            "messages": {"type": "array", "items": _ref("Message")},
            "nextSeq": {"type": "integer", "minimum": 0},
            "epoch": {"type": "string"},
            "more": {"type": "boolean"},
        },
    },
    "AckRequest": {
        "oneOf": [
            {
                "type": "object",
                "required": ["upToSeq"],
                "properties": {"upToSeq": {"type": "integer", "minimum": 0, "maximum": MAX_SEQ}},
                "additionalProperties": False,
            },
            {
                "type": "object",
                "required": ["seqs"],
                "properties": {
                    "seqs": {
                        "type": "array",
                        "maxItems": 10000,
                        "items": {"type": "integer", "minimum": 1, "maximum": MAX_SEQ},
                    }
                },
                "additionalProperties": False,
            },
        ]
    },
    "AckResult": {
        "type": "object",
        "required": ["removed"],
        "properties": {"removed": {"type": "integer", "minimum": 0}},
    },
    "Status": {
        "type": "object",
        "required": [
            "message_count",
            "total_bytes",
            "oldest_received_time",
            "newest_received_time",
            "longest_waited_seconds",
            "live_delivery",
            "nextSeq",
            "epoch",
        ],
        "properties": {
            "message_count": {"type": "integer", "minimum": 0},
            "total_bytes": {"type": "integer", "minimum": 0},
            "oldest_received_time": _NULLABLE_TIME,
            "newest_received_time": _NULLABLE_TIME,
            "longest_waited_seconds": {"type": ["integer", "null"], "minimum": 0},
            "live_delivery": {"type": "boolean"},
            "nextSeq": {"type": "integer", "minimum": 1},
            "epoch": {"type": "string"},
        },
    },
    "ChannelList": {
        "type": "object",
        "required": ["channels", "message_count", "total_bytes"],
        "properties": {
            "channels": {
                "type": "array",
                "description": 'the default channel ("") first, then the registered non-default channels',
                "items": {
                    "type": "object",
                    "required": ["channel", "message_count", "total_bytes"],
                    "properties": {
                        "channel": {
                            "type": "string",
                            "description": "a channel of the HTTP API, or (mediated) the DIDComm mediator's",
                            "anyOf": [{"pattern": CHANNEL_PATTERN}, {"const": b64(MEDIATOR_CHANNEL)}],
                        },
                        "message_count": {"type": "integer", "minimum": 0},
                        "total_bytes": {"type": "integer", "minimum": 0},
                        "mediated": {
                            "type": "boolean",
                            "description": "the DIDComm mediator's queue of this key (forwards to it):"
                            " counted in the recipient's quotas and totals, read only by DIDComm Pickup"
                            " (the HTTP API refuses its channel, 400 bad_channel)",
                        },
                    },
                },
            },
            "message_count": {"type": "integer", "minimum": 0},
            "total_bytes": {"type": "integer", "minimum": 0},
        },
    },
    "FanoutRequest": {
        "type": "object",
        "required": ["recipients", "payload"],
        "properties": {
            "recipients": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1000,
                "items": {"type": "string", "pattern": RECIPIENT_PATTERN},
            },
            "channel": {"type": "string", "pattern": CHANNEL_PATTERN},
            "payload": {"type": "string", "minLength": 2, "pattern": B64_PATTERN},
            "messageId": {"type": "string", "pattern": PRINTABLE_128},
        },
    },
    "FanoutResult": {
        "type": "object",
        "required": ["recipient", "status"],
        "properties": {
            "recipient": {"description": "the recipients entry, as sent"},
            "status": {"type": "integer", "enum": [200, 201, 400, 409, 413, 429, 503, 507]},
            "seq": {"type": "integer", "minimum": 1},
            "duplicate": {"type": "boolean"},
            "error": {"type": "string"},
            "code": {"type": "string"},
            "retryAfterMs": {"type": "integer", "minimum": 0},
        },
    },
    "FanoutResponse": {
        "type": "object",
        "required": ["results"],
        "properties": {"results": {"type": "array", "items": _ref("FanoutResult")}},
    },
    "DidcommEnvelope": {
        "type": "object",
        "description": "DIDComm v1 encryption envelope (Aries RFC 0019)",
        "required": ["protected", "iv", "ciphertext", "tag"],
        "properties": {
            "protected": {
                "type": "string",
                "description": "base64url JSON: enc, typ JWM/1.0, alg, recipients",
            },
            "iv": {"type": "string"},
            "ciphertext": {"type": "string"},
            "tag": {"type": "string"},
        },
    },
    "DidcommInvitation": {
        "type": "object",
        "required": ["invitation", "invitation_url"],
        "properties": {
            "invitation": {
                "type": "object",
                "required": ["@type", "@id", "handshake_protocols", "services"],
                "properties": {
                    "@type": {"const": "https://didcomm.org/out-of-band/1.1/invitation"},
                    "@id": {"type": "string"},
                    "label": {"type": "string"},
                    "accept": {"type": "array", "items": {"type": "string"}},
                    "handshake_protocols": {"type": "array", "items": {"type": "string"}},
                    "services": {"type": "array", "items": {"type": "object"}},
                },
            },
            "invitation_url": {"type": "string", "format": "uri"},
        },
    },
    "PickupRequest": {
        "description": "a Pickup 2.0 message (RFC 0685), plaintext DIDComm JSON; ~transport is ignored",
        "type": "object",
        "required": ["@type"],
        "properties": {
            "@id": {"type": "string"},
            "@type": {
                "type": "string",
                "enum": [f"{prefix}messagepickup/2.0/{name}" for prefix in PREFIXES for name in pickup.NAMES],
            },
            "recipient_key": {
                "type": "string",
                "description": "base64url of the 32-byte key, or an Ed25519 did:key",
                "anyOf": [{"pattern": RECIPIENT_PATTERN}, {"pattern": DID_KEY_PATTERN}],
            },
            "limit": {"type": "integer", "minimum": 1, "description": "delivery-request: required"},
            "message_id_list": {
                "type": "array",
                "maxItems": 10000,
                "items": {"type": "string"},
                "description": "messages-received: required",
            },
            "live_delivery": {"type": "boolean", "description": "live-delivery-change: required"},
            "~thread": {"type": "object", "properties": {"thid": {"type": "string"}}},
        },
    },
    "PickupReply": {
        "description": "status, delivery, or (live-delivery-change true over HTTP) problem-report",
        "type": "object",
        "required": ["@type", "@id"],
        "properties": {
            "@id": {"type": "string"},
            "@type": {"type": "string"},
            "~thread": {
                "type": "object",
                "properties": {"thid": {"type": "string"}, "pthid": {"type": "string"}},
            },
            "recipient_key": {"type": "string"},
            "message_count": {"type": "integer", "minimum": 0},
            "longest_waited_seconds": {"type": "integer", "minimum": 0},
            "newest_received_time": {"type": "string", "format": "date-time"},
            "oldest_received_time": {"type": "string", "format": "date-time"},
            "total_bytes": {"type": "integer", "minimum": 0},
            "live_delivery": {"type": "boolean"},
            "~attach": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["@id", "data"],
                    "properties": {
                        "@id": {"type": "string", "description": "the message's seq, as a string"},
                        "data": {
                            "type": "object",
                            "required": ["base64"],
                            "properties": {"base64": {"type": "string", "pattern": B64_PATTERN}},
                        },
                    },
                },
            },
            "description": {"type": "string"},
        },
    },
    "InboxAppend": {
        "type": "object",
        "required": ["messageId", "ciphertext"],
        "properties": {
            "messageId": {"type": "string", "pattern": PRINTABLE_128},
            "ciphertext": {
                "type": "string",
                "minLength": 2,
                "pattern": B64_PATTERN,
                "description": "base64url (padding tolerated)",
            },
        },
    },
    "InboxStored": {
        "type": "object",
        "required": ["seq", "storedAt"],
        "properties": {
            "seq": {"type": "integer", "minimum": 1},
            "storedAt": {"type": "string", "format": "date-time"},
        },
    },
    "InboxMessages": {
        "type": "object",
        "required": ["messages", "nextSeq"],
        "properties": {
            "messages": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["seq", "messageId", "ciphertext", "createdAt"],
                    "properties": {
                        "seq": {"type": "integer", "minimum": 1},
                        "messageId": {"type": ["string", "null"]},
                        "ciphertext": {"type": "string", "pattern": B64_PATTERN},
                        "createdAt": {"type": "string", "format": "date-time"},
                    },
                },
            },
            "nextSeq": {"type": "integer", "minimum": 0},
        },
    },
}

_QUEUE_PARAMS = [_P_RECIPIENT, _P_CHANNEL]

PATHS: dict[str, Any] = {
    "/v1/queues/{recipient}/messages": {
        "post": {
            "operationId": "enqueue",
            "summary": "store one message (stored before the answer: immediately readable)",
            "security": _ENQUEUE_SECURITY,
            "parameters": [
                *_QUEUE_PARAMS,
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "pattern": PRINTABLE_128},
                },
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {
                        "schema": {"type": "string", "format": "binary", "minLength": 1, "maxLength": 5242880}
                    }
                },
            },
            "responses": {
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
        },
        "get": {
            "operationId": "read",
            "summary": "non-destructive read from fromSeq, with optional long-poll",
            "security": _SIGNED,
            "parameters": [*_QUEUE_PARAMS, _P_FROM_SEQ, _P_LIMIT, _P_WAIT],
            "responses": {
                "200": _json(_ref("ReadResult"), "messages (possibly none)"),
                "400": _E400,
                "401": _E401,
                "503": _E503,
            },
        },
    },
    "/v1/queues/{recipient}/ack": {
        "post": {
            "operationId": "ack",
            "summary": "delete acknowledged messages (idempotent)",
            "security": _SIGNED,
            "parameters": _QUEUE_PARAMS,
            "requestBody": _json_body("AckRequest"),
            "responses": {
                "200": _json(_ref("AckResult"), "removed count"),
                "400": _E400,
                "401": _E401,
                "413": _E413,
                "415": _E415,
                "503": _E503,
            },
        }
    },
    "/v1/queues/{recipient}/drain": {
        "post": {
            "operationId": "drain",
            "summary": "atomic read-and-delete (quicprochat fetch / fetchWait)",
            "security": _SIGNED,
            "parameters": [*_QUEUE_PARAMS, _P_LIMIT, _P_WAIT],
            "responses": {
                "200": _json(_ref("DrainResult"), "messages removed from the queue"),
                "400": _E400,
                "401": _E401,
                "413": _E413,
                "415": _E415,
                "503": _E503,
            },
        }
    },
    "/v1/queues/{recipient}/status": {
        "get": {
            "operationId": "status",
            "summary": "O(1) queue summary",
            "security": _SIGNED,
            "parameters": _QUEUE_PARAMS,
            "responses": {
                "200": _json(_ref("Status"), "queue status"),
                "400": _E400,
                "401": _E401,
                "503": _E503,
            },
        }
    },
    "/v1/queues/{recipient}/channels": {
        "get": {
            "operationId": "channels",
            "summary": "the recipient's channels and what each holds (signed)",
            "security": _SIGNED,
            "parameters": [_P_RECIPIENT],
            "responses": {
                "200": _json(_ref("ChannelList"), "the channels, the default one first"),
                "400": _E400,
                "401": _E401,
                "503": _E503,
            },
        }
    },
    "/v1/queues/{recipient}/live": {
        "get": {
            "operationId": "live",
            "summary": "WebSocket live delivery",
            "description": (
                "Upgrade to WebSocket. The server sends "
                '{"type":"message","seq","payload","receivedAt","messageId"} for the backlog from fromSeq, '
                'then {"type":"empty"}, then each new message as it arrives. The client sends '
                '{"type":"ack","upToSeq":N} (or {"type":"ack","seqs":[...]}); nothing is deleted without an '
                "ack. Text frames holding a Pickup 2.0 message are answered in-band. A newer live connection "
                "to the same queue closes the older one with close code 4409."
            ),
            "security": _SIGNED,
            "parameters": [*_QUEUE_PARAMS, _P_FROM_SEQ],
            "responses": {
                "101": {"description": "switching to WebSocket"},
                "400": _E400,
                "401": _E401,
                "426": _error("not a WebSocket upgrade request", {"Upgrade": {"schema": {"type": "string"}}}),
                "503": _E503,
            },
        }
    },
    "/v1/messages": {
        "post": {
            "operationId": "fanout",
            "summary": "queue one payload for many recipients, each independently",
            "security": _ENQUEUE_SECURITY,
            "requestBody": _json_body("FanoutRequest"),
            "responses": {
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
        }
    },
    "/v1/didcomm/pickup": {
        "post": {
            "operationId": "pickup",
            "summary": "DIDComm Pickup 2.0 (RFC 0685)",
            "description": (
                "The queue is the message's recipient_key or, without one, the key of the Authorization "
                "header; the signature must be by that key."
            ),
            "security": _SIGNED,
            "parameters": [_P_CHANNEL],
            "requestBody": _json_body("PickupRequest"),
            "responses": {
                "200": _json(_ref("PickupReply"), "the mediator's reply"),
                "400": _E400,
                "401": _E401,
                "413": _E413,
                "415": _E415,
                "503": _E503,
            },
        }
    },
    "/v1/didcomm/invitation": {
        "get": {
            "operationId": "didcommInvitation",
            "summary": "The fleet's DIDComm mediator invitation (Out-of-Band 1.1)",
            "description": (
                "Handshake protocols DID Exchange 1.1 and 1.0; services: RELAY_PUBLIC_URL + /v1/didcomm and "
                "its WebSocket /v1/didcomm/ws; recipient key: the mediator's did:key. Every relay given the "
                "same seed (RELAY_DIDCOMM_SEED_FILE) and public URL serves the same invitation."
            ),
            "responses": {
                "200": _json(_ref("DidcommInvitation"), "the invitation and its ?oob= URL"),
                "404": _error("didcomm_disabled: this relay has no mediator seed"),
            },
        }
    },
    "/v1/didcomm": {
        "post": {
            "operationId": "didcommInbound",
            "summary": "A DIDComm v1 packed envelope for the mediator",
            "description": (
                "Authcrypt or Anoncrypt (RFC 0019) for the mediator's connection or routing key; "
                "docs/protocols.md lists the protocols. A forward is queued for its registered recipient "
                "key under the enqueue limits and rate limits, idempotent by its @id. The reply comes in "
                "the response when the message asks for ~transport.return_route all; otherwise 202."
            ),
            "requestBody": {
                "required": True,
                "content": {
                    t: {"schema": _ref("DidcommEnvelope")}
                    for t in ("application/didcomm-envelope-enc", "application/ssi-agent-wire")
                },
            },
            "responses": {
                "200": {
                    "description": "the reply, packed (Authcrypt) for the sender",
                    "content": {"application/didcomm-envelope-enc": {"schema": _ref("DidcommEnvelope")}},
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
        }
    },
    "/v1/didcomm/ws": {
        "get": {
            "operationId": "didcommWebSocket",
            "summary": "WebSocket carrying DIDComm v1 packed envelopes both ways",
            "description": (
                "Each frame (text or binary) is one packed envelope; return-routed replies come back on the "
                "socket as binary frames. Pickup 2.0 live-delivery-change true makes the mediator send "
                "delivery messages as forwards arrive; they are deleted only on messages-received."
            ),
            "responses": {
                "101": {"description": "switching to WebSocket"},
                "404": _error("didcomm_disabled"),
                "426": _error("not a WebSocket upgrade request", {"Upgrade": {"schema": {"type": "string"}}}),
                "503": _E503,
            },
        }
    },
    "/v1/inbox/append": {
        "post": {
            "operationId": "inboxAppend",
            "summary": "tunnl3d inbox append (idempotent by messageId)",
            "parameters": [_P_INBOX],
            "security": _ENQUEUE_SECURITY,
            "requestBody": _json_body("InboxAppend"),
            "responses": {
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
        }
    },
    "/v1/inbox/messages": {
        "get": {
            "operationId": "inboxRead",
            "summary": "tunnl3d inbox read (never deletes; retention removes)",
            "parameters": [_P_INBOX, _P_FROM_SEQ, _P_LIMIT],
            "responses": {
                "200": _json(_ref("InboxMessages"), "messages (possibly none)"),
                "400": _E400,
                "503": _E503,
            },
        }
    },
    "/healthz": {
        "get": {
            "operationId": "healthz",
            "summary": "liveness",
            "responses": {
                "200": _json({"type": "object", "properties": {"status": {"const": "ok"}}}, "alive")
            },
        }
    },
    "/readyz": {
        "get": {
            "operationId": "readyz",
            "summary": "readiness: map loaded, not stopping, a shard owning slots answers; detail per shard",
            "responses": {
                "200": _json({"type": "object", "properties": {"status": {"const": "ready"}}}, "ready"),
                "503": _error("not ready"),
            },
        }
    },
    "/metrics": {
        "get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics",
            "responses": {"200": {"description": "text exposition format", "content": {"text/plain": {}}}},
        }
    },
    "/v1/openapi.json": {
        "get": {
            "operationId": "openapi",
            "summary": "this document",
            "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1 document")},
        }
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
    return web.Response(body=_BODY, content_type="application/json")
