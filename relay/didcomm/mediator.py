"""The mediator's protocols: one plaintext DIDComm v1 message in, at most one reply out.

Out-of-Band 1.1 (the invitation), DID Exchange 1.0/1.1, trust ping 1.0, coordinate-mediation
1.0, routing 1.0 forward, Pickup 2.0, discover-features 1.0 and push-notifications-fcm 1.0 /
push-notifications-apns 1.0. Every message but a forward
and a DID Exchange request must come authcrypted from the key of a connection. Replies copy
the request's ``@type`` prefix (``https://didcomm.org/`` or the legacy ``did:sov:…;spec/``).
"""

from __future__ import annotations

import fnmatch
import json
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

from relay import boundedjson, metrics
from relay.didcomm import keys as dk
from relay.didcomm.attachments import AttachmentError, attached_document, signed_attachment
from relay.didcomm.envelope import Unpacked, pack, parse, shaped, unpack
from relay.didcomm.limits import ConnectionBudget
from relay.didcomm.mediator_pickup import LiveSession, Pickup
from relay.didcomm.mediator_push import FAMILIES as PUSH_FAMILIES
from relay.didcomm.mediator_push import PushSettings
from relay.didcomm.messages import PREFIXES, MediatorError, reply, thread_of
from relay.didcomm.records import QUEUE_CHANNEL, Connection, Records
from relay.presence import Presence
from relay.service import QueueService
from relay.storage.store import EnqueueOutcome, EnqueueRequest

HANDSHAKES = ("https://didcomm.org/didexchange/1.1", "https://didcomm.org/didexchange/1.0")
PROTOCOLS = (
    "https://didcomm.org/out-of-band/1.1",
    "https://didcomm.org/didexchange/1.1",
    "https://didcomm.org/didexchange/1.0",
    "https://didcomm.org/trust_ping/1.0",
    "https://didcomm.org/coordinate-mediation/1.0",
    "https://didcomm.org/routing/1.0",
    "https://didcomm.org/messagepickup/2.0",
    "https://didcomm.org/discover-features/1.0",
    "https://didcomm.org/push-notifications-fcm/1.0",
    "https://didcomm.org/push-notifications-apns/1.0",
)
ROLES = {
    "didexchange": ["responder"],
    "out-of-band": ["sender"],
    "trust_ping": ["receiver"],
    "coordinate-mediation": ["mediator"],
    "routing": ["mediator"],
    "messagepickup": ["mediator"],
    "discover-features": ["responder"],
    "push-notifications-fcm": ["notification-sender"],
    "push-notifications-apns": ["notification-sender"],
}
MAX_MESSAGE = 1 << 20  # a plaintext protocol message (forwards excepted) is small
FORWARD_ROOM = 65536  # a forward's plaintext: its packed message plus the routing fields
FORWARD = "routing/1.0/forward"
# The message types the mediator acts on: the only values of the metric's `type` label
# (anything else a client names, a problem-report of any family included, counts as "other").
HANDLED_TYPES = frozenset(
    {
        FORWARD,
        "didexchange/1.1/request",
        "didexchange/1.0/request",
        "didexchange/1.1/complete",
        "didexchange/1.0/complete",
        "trust_ping/1.0/ping",
        "coordinate-mediation/1.0/mediate-request",
        "coordinate-mediation/1.0/keylist-update",
        "coordinate-mediation/1.0/keylist-query",
        "messagepickup/2.0/status-request",
        "messagepickup/2.0/delivery-request",
        "messagepickup/2.0/messages-received",
        "messagepickup/2.0/live-delivery-change",
        "discover-features/1.0/query",
        "notification/1.0/problem-report",
        "push-notifications-fcm/1.0/set-device-info",
        "push-notifications-fcm/1.0/get-device-info",
        "push-notifications-apns/1.0/set-device-info",
        "push-notifications-apns/1.0/get-device-info",
    }
)
MAX_UPDATES = 1000
MAX_MESSAGE_ID = 100


def forward_id(value: Any) -> str:
    """A forward's message id (v1 `@id`, v2 `id`) when a queue may keep it: printable, at most
    MAX_MESSAGE_ID characters; else "" (the forward is stored without one). It makes a resent
    forward a duplicate, as Idempotency-Key does."""
    if isinstance(value, str) and 0 < len(value) <= MAX_MESSAGE_ID and value.isprintable():
        return value
    return ""


class ForwardRefused(Exception):
    """The forward's enqueue was refused (rate limit, full queue, conflict): the caller maps
    the outcome exactly as for any enqueue."""

    def __init__(self, outcome: EnqueueOutcome) -> None:
        super().__init__(outcome.kind)
        self.outcome = outcome


@dataclass
class Outcome:
    """What handling one envelope produced."""

    type: str  # family/version/name, for metrics and logs
    reply: bytes | None = None  # a packed envelope for the sender
    return_route: bool = False
    connection: Connection | None = None
    sender: bytes | None = None
    extra: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Caller:
    """Who sent an envelope, as the transport saw it: the client (relay/api/didcomm.client_of)
    and whether the request or WebSocket upgrade carried a valid enqueue token (True when
    RELAY_ENQUEUE_TOKENS is off); `charge` takes a forward's bytes from the client's quota
    (RELAY_CLIENT_*: raises the transport's 429 when it is used up; None: no quota)."""

    client: Hashable = ""
    may_store: bool = True
    charge: Callable[[int], None] | None = None

    def require_store(self) -> None:
        """A forward (v1 or v2) needs the enqueue token when RELAY_ENQUEUE_TOKENS is on."""
        if not self.may_store:
            metrics.quota_refused("/v1/didcomm", "enqueue_token")
            raise MediatorError("a forward requires a valid bearer token", "unauthorized", 401)


class Mediator:
    def __init__(
        self,
        identity: dk.Identity,
        service: QueueService,
        max_payload: int,
        redeliver_s: float = 10.0,
        max_keys: int = 100,
        idle_expiry_s: float = 30 * 86400.0,
        connections_per_client: int = 100,
        presence: Presence | None = None,
    ) -> None:
        self.redeliver_ms = int(
            redeliver_s * 1000
        )  # a delivered, unacknowledged message goes out again after
        self.identity = identity
        self.service = service
        self.records = Records(service, max_keys, int(idle_expiry_s * 1000))
        self.budget = ConnectionBudget(connections_per_client)
        # fleet-wide presence (relay/presence.py): Pickup's live_delivery, the live mode's leases
        self.presence = presence
        self.pickup = Pickup(service, self.records, self.redeliver_ms, presence)
        self.push = PushSettings(self.records)
        self.max_payload = max_payload
        self.max_plaintext = max(MAX_MESSAGE, max_payload + FORWARD_ROOM)

    # -- the invitation -------------------------------------------------------------------
    def invitation(self) -> dict[str, Any]:
        ident = self.identity
        return {
            "@type": "https://didcomm.org/out-of-band/1.1/invitation",
            "@id": ident.invitation_id,
            "label": "relayfleet mediator",
            "accept": ["didcomm/aip1", "didcomm/aip2;env=rfc19"],
            "handshake_protocols": list(HANDSHAKES),
            "services": [
                {
                    "id": f"#inline-{i}",  # unique within the invitation: agents key services by id
                    "type": "did-communication",
                    "recipientKeys": [ident.connection.did_key],
                    "routingKeys": [],
                    "serviceEndpoint": endpoint,
                }
                for i, endpoint in enumerate((ident.endpoint, ident.ws_endpoint))
            ],
        }

    def invitation_url(self) -> str:
        raw = json.dumps(self.invitation(), separators=(",", ":")).encode()
        return f"{self.identity.endpoint}?oob={dk.b64url(raw)}"

    # -- an envelope in --------------------------------------------------------------------
    def open(self, raw: bytes) -> Unpacked:
        return unpack(parse(raw), self.identity.keypair_for)

    def pack_for(self, doc: dict[str, Any], recipient: bytes) -> bytes:
        return pack(json.dumps(doc, separators=(",", ":")).encode(), [recipient], self.identity.connection)

    async def handle(
        self, opened: Unpacked, session: LiveSession | None, caller: Caller = Caller()
    ) -> Outcome:
        """Act on one opened envelope. Raises MediatorError (problem), ForwardRefused."""
        doc, prefix, name = self._parse(opened.message)
        transport = doc.get("~transport")
        rr = transport.get("return_route") if isinstance(transport, dict) else None
        out = Outcome(type=name, return_route=rr in ("all", "thread"), sender=opened.sender)
        if name == FORWARD:
            caller.require_store()
            await self.forward(doc, opened.message, caller)
            return out
        if len(opened.message) > MAX_MESSAGE:
            raise MediatorError(f"the message exceeds {MAX_MESSAGE} bytes", "message_too_large", 413)
        if opened.sender is None:
            raise MediatorError(f"{name} must be authcrypted", "unknown_connection", 403)
        if name in ("didexchange/1.1/request", "didexchange/1.0/request"):
            reply = await self.did_exchange(doc, prefix, name[: -len("request")], opened.sender, caller)
            out.reply = self.pack_for(reply, opened.sender)
            return out
        conn = await self.records.connection(opened.sender)
        if conn is None:
            raise MediatorError(
                "no connection with this sender; connect through the invitation first",
                "unknown_connection",
                403,
            )
        await self.records.touch(conn)
        out.connection = conn
        answer = await self._on_connection(doc, prefix, name, conn, session)
        if answer is not None:
            out.reply = self.pack_for(answer, conn.key)
        return out

    def _parse(self, message: bytes) -> tuple[dict[str, Any], str, str]:
        try:
            doc = boundedjson.loads(message, self.max_plaintext, "the message")
        except boundedjson.JsonLimitError as exc:
            raise MediatorError(exc.text, exc.code, exc.status) from None
        if not isinstance(doc, dict):
            raise MediatorError("the message must be a JSON object")
        mtype = doc.get("@type")
        if not isinstance(mtype, str):
            raise MediatorError("@type must be a string")
        if not isinstance(doc.get("@id", ""), str):
            raise MediatorError("@id must be a string")
        for prefix in PREFIXES:
            if mtype.startswith(prefix):
                name = mtype[len(prefix) :]
                if name.count("/") == 2 and len(name) <= 80:
                    return doc, prefix, name
        raise MediatorError("@type is not a DIDComm v1 message type", "unsupported_message_type")

    async def _on_connection(
        self, doc: dict[str, Any], prefix: str, name: str, conn: Connection, session: LiveSession | None
    ) -> dict[str, Any] | None:
        family = name.rsplit("/", 1)[0]
        short = name.rsplit("/", 1)[1]
        if family in ("didexchange/1.1", "didexchange/1.0") and short == "complete":
            return None
        if name == "trust_ping/1.0/ping":
            if doc.get("response_requested", True) is False:
                return None
            return reply(doc, prefix, "trust_ping/1.0/ping_response", {})
        if family == "coordinate-mediation/1.0":
            return await self.coordinate(doc, prefix, short, conn)
        if family == "messagepickup/2.0":
            return await self.pickup.handle(doc, prefix, short, conn, session)
        if name == "discover-features/1.0/query":
            return self.disclose(doc, prefix)
        if family in PUSH_FAMILIES and short != "problem-report":
            return await self.push.handle(doc, prefix, family, short, conn)
        if name == "notification/1.0/problem-report" or name.endswith("/problem-report"):
            return None  # an agent telling us something went wrong: nothing to answer
        raise MediatorError(f"{name} is not a message this mediator handles", "unsupported_message_type")

    def problem_report(self, doc_id: str | None, text: str, code: str) -> dict[str, Any]:
        report: dict[str, Any] = {
            "@type": PREFIXES[0] + "notification/1.0/problem-report",
            "@id": str(uuid.uuid4()),
            "description": {"en": text, "code": code},
        }
        if doc_id:
            report["~thread"] = {"thid": doc_id}
        return report

    # -- routing 1.0 ----------------------------------------------------------------------
    async def forward(self, doc: dict[str, Any], message: bytes, caller: Caller = Caller()) -> None:
        try:
            to = dk.verkey_from(doc.get("to"))
        except dk.DidError as exc:
            raise MediatorError(f"forward 'to': {exc}", "bad_recipient") from None
        payload = self._forwarded(doc.get("msg"), message)
        if await self.records.owner(to) is None:
            raise MediatorError(
                "forward 'to' is not a key registered with this mediator", "unknown_recipient", 404
            )
        mid = forward_id(doc.get("@id"))
        if caller.charge is not None:  # the sender's client quota, as an enqueue's
            caller.charge(len(payload))
        outcome = await self.service.enqueue(
            EnqueueRequest(to, QUEUE_CHANNEL, payload, "didcomm:" + mid if mid else "", mid)
        )
        if outcome.kind not in ("stored", "duplicate"):
            raise ForwardRefused(outcome)

    def _forwarded(self, msg: Any, message: bytes) -> bytes:
        """What a forward queues: its packed message as the bytes it arrived as (the member's
        JSON text, or the string's UTF-8), refused here unless it has an envelope's shape, so
        nothing a recipient cannot take is stored; delivery never parses it."""
        if isinstance(msg, str) and msg:
            payload = msg.encode("utf-8")
        elif isinstance(msg, dict):
            payload = boundedjson.member_as_sent(message, "msg") or b""
        else:
            raise MediatorError("forward 'msg' must be a packed message", "bad_forward")
        if len(payload) > self.max_payload:
            raise MediatorError(
                f"payload exceeds max size ({self.max_payload} bytes)", "payload_too_large", 413
            )
        try:
            shaped(boundedjson.loads(payload, self.max_payload, "it") if isinstance(msg, str) else msg)
        except ValueError as exc:  # EnvelopeError, JsonLimitError
            raise MediatorError(f"forward 'msg' is not a packed message: {exc}", "bad_forward") from None
        return payload

    # -- DID Exchange ---------------------------------------------------------------------
    async def did_exchange(
        self, doc: dict[str, Any], prefix: str, family: str, sender: bytes, caller: Caller
    ) -> dict[str, Any]:
        _, pthid = thread_of(doc)
        if pthid not in (self.identity.invitation_id, self.identity.did):
            raise MediatorError(
                "the request does not answer this mediator's invitation (~thread.pthid)",
                "request_not_accepted",
            )
        their_did = doc.get("did")
        try:
            attached = attached_document(doc.get("did_doc~attach"))
        except AttachmentError as exc:
            raise MediatorError(str(exc), "request_not_accepted") from None
        try:
            their_keys = dk.keys_of_did(their_did, attached)
        except dk.DidError as exc:
            raise MediatorError(f"the request's DID: {exc}", "request_not_accepted") from None
        if sender not in their_keys:
            raise MediatorError(
                "the request must be packed by a key of the requester's DID", "request_not_accepted"
            )
        label = doc.get("label")
        conn = self.records.new(sender, str(their_did), label[:200] if isinstance(label, str) else "")
        known = await self.records.connection(sender)
        if known is None or known.did != conn.did:  # a resent request keeps its grant
            wait_s = self.budget.admit(caller.client)
            if wait_s is not None:
                metrics.quota_refused("/v1/didcomm", "didcomm_connections")
                raise MediatorError(
                    "too many new DIDComm connections from this client; retry later",
                    "too_many_connections",
                    429,
                    wait_s,
                )
            await self.records.save(conn, fresh=known is None)
        request_id = doc.get("@id")
        thid, _ = thread_of(doc)
        did = self.identity.did
        return {
            "@type": prefix + family + "response",
            "@id": str(uuid.uuid4()),
            "~thread": {"thid": thid or request_id, "pthid": pthid},
            "did": did,
            "did_rotate~attach": signed_attachment(self.identity.connection, did.encode(), "text/string"),
        }

    # -- coordinate-mediation 1.0 -----------------------------------------------------------
    async def coordinate(
        self, doc: dict[str, Any], prefix: str, short: str, conn: Connection
    ) -> dict[str, Any]:
        family = "coordinate-mediation/1.0/"
        if short == "mediate-request":
            if not conn.mediation:
                await self.records.save(replace(conn, mediation=True))
            grant = {"endpoint": self.identity.endpoint, "routing_keys": [self.identity.routing.did_key]}
            return reply(doc, prefix, family + "mediate-grant", grant)
        if not conn.mediation:
            raise MediatorError(
                "mediation has not been granted on this connection; send mediate-request",
                "mediation_not_granted",
            )
        if short == "keylist-update":
            updates = doc.get("updates")
            if not isinstance(updates, list) or not 0 < len(updates) <= MAX_UPDATES:
                raise MediatorError(f"keylist-update needs updates, a list of 1 to {MAX_UPDATES}")
            results = []
            for u in updates:
                if not isinstance(u, dict) or u.get("action") not in ("add", "remove"):
                    raise MediatorError("each update needs recipient_key and action add|remove")
                text = u.get("recipient_key")
                try:
                    key = dk.verkey_from(text)
                except dk.DidError as exc:
                    raise MediatorError(f"recipient_key: {exc}", "bad_recipient") from None
                if u["action"] == "add":
                    result = await self.records.add_key(conn, key)
                else:
                    result = await self.records.remove_key(conn, key)
                results.append({"recipient_key": text, "action": u["action"], "result": result})
            return reply(doc, prefix, family + "keylist-update-response", {"updated": results})
        if short == "keylist-query":
            held = await self.records.keys(conn)
            body: dict[str, Any] = {
                "keys": [{"recipient_key": dk.did_key(k)} for k in held],
                "pagination": {"count": len(held), "offset": 0, "remaining": 0},
            }
            return reply(doc, prefix, family + "keylist", body)
        raise MediatorError(
            f"coordinate-mediation/1.0/{short[:40]} is not a message the mediator accepts",
            "unsupported_message_type",
        )

    # -- discover-features 1.0 ----------------------------------------------------------------
    def disclose(self, doc: dict[str, Any], prefix: str) -> dict[str, Any]:
        query = doc.get("query")
        if not isinstance(query, str) or len(query) > 200:
            raise MediatorError("query must be a string")
        protocols = []
        for pid in PROTOCOLS:
            pid_here = pid if prefix == PREFIXES[0] else prefix + pid[len(PREFIXES[0]) :]
            if fnmatch.fnmatchcase(pid, query) or fnmatch.fnmatchcase(pid_here, query):
                family = pid[len(PREFIXES[0]) :].split("/", 1)[0]
                protocols.append({"pid": pid_here, "roles": ROLES.get(family, [])})
        return reply(doc, prefix, "discover-features/1.0/disclose", {"protocols": protocols})
