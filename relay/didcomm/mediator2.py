"""The DIDComm v2 mediator: Coordinate Mediation 2.0 (and 3.0's names), Message Pickup 3.0,
Routing 2.0 forward, trust ping 2.0 and the out-of-band 2.0 invitation, on the v1 mediator's
records, queues, leases and limits (relay/didcomm/records.py, mediator_pickup.py).

A v2 peer is its DID, not a key: the queue and records of a DID are those of `did_key(did)`, a
32-byte hash standing where v1 has a verkey, so v2 messages live in the same sharded queues
(slot migration, retention, quotas, poison isolation unchanged). Every message but a forward
must prove its sender (authcrypt, or a JWS by a key of its ``from`` DID): the proven DID is the
connection, created by its first mediate-request. A keylist entry naming the sender's own DID is
a proven registration (it takes the DID over from an unproven holder), as v1's own-key rule.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from relay import boundedjson, metrics
from relay.didcomm import jwm, peer2
from relay.didcomm import keys as dk
from relay.didcomm.envelope import shaped
from relay.didcomm.mediator import Caller, ForwardRefused, Mediator, forward_id
from relay.didcomm.mediator_pickup import MAX_IDS, LiveSession, message_id
from relay.didcomm.messages import MediatorError
from relay.didcomm.records import QUEUE_CHANNEL, Connection
from relay.storage.store import EnqueueRequest, Message

__all__ = ["HANDLED_TYPES", "Identity2", "Mediator2", "Outcome2", "did_key"]

BASE = "https://didcomm.org/"
FORWARD = "routing/2.0/forward"
PICKUP = "messagepickup/3.0/"
PROBLEM = BASE + "report-problem/2.0/problem-report"
MEDIATIONS = ("coordinate-mediation/2.0/", "coordinate-mediation/3.0/")
# Message types acted on: the only `type` label values of the metric besides v1's
HANDLED_TYPES = frozenset(
    {
        FORWARD,
        "trust-ping/2.0/ping",
        "discover-features/2.0/queries",
        "report-problem/2.0/problem-report",
        *(m + n for m in MEDIATIONS for n in ("mediate-request", "keylist-update", "keylist-query")),
        "coordinate-mediation/3.0/recipient-update",
        "coordinate-mediation/3.0/recipient-query",
        *(
            PICKUP + n
            for n in ("status-request", "delivery-request", "messages-received", "live-delivery-change")
        ),
        PICKUP + "delivery",
    }
)
PROTOCOLS = (
    "https://didcomm.org/coordinate-mediation/2.0",
    "https://didcomm.org/coordinate-mediation/3.0",
    "https://didcomm.org/messagepickup/3.0",
    "https://didcomm.org/routing/2.0",
    "https://didcomm.org/trust-ping/2.0",
    "https://didcomm.org/discover-features/2.0",
)
MAX_MESSAGE = 1 << 20
MAX_UPDATES = 1000
MAX_ATTACHMENTS = 16
ACCEPT = ["didcomm/v2"]


def did_key(did: str) -> bytes:
    """The 32 bytes a v2 DID's queue and records are keyed by (where v1 has a verkey)."""
    return hashlib.sha256(b"relayfleet didcomm v2 did\0" + peer2.did_of(did).encode()).digest()


@dataclass(frozen=True)
class Identity2:
    """The v2 mediator: a did:peer:2 of an X25519 and an Ed25519 key derived from the fleet's
    seed, with two DIDCommMessaging services, HTTP first (Identus posts to the first), then
    WebSocket. Same seed and URL, same DID on every relay."""

    did: str
    agreement: jwm.AgreementKey
    resolved: peer2.Resolved
    invitation_id: str

    @classmethod
    def from_v1(cls, seed: bytes, v1: dk.Identity) -> Identity2:
        secret = dk.derive(seed, b"v2 key agreement")
        auth = dk.KeyPair.from_seed(dk.derive(seed, b"v2 authentication"))
        public = jwm.AgreementKey.from_secret("", secret).public
        did = peer2.encode_peer2(public, auth.verkey, [v1.endpoint, v1.ws_endpoint], ACCEPT)
        inv = str(uuid.UUID(bytes=dk.derive(seed + did.encode(), b"v2 invitation")[:16], version=4))
        resolved = peer2.resolve(did)
        return cls(did, jwm.AgreementKey(resolved.agreement[0].kid, secret, public), resolved, inv)

    def lookup(self, kid: str) -> jwm.AgreementKey | None:
        key = self.resolved.key(kid)
        return self.agreement if key is not None and key.kid == self.agreement.kid else None


@dataclass
class Outcome2:
    type: str  # family/version/name for metrics
    reply: bytes | None = None
    return_route: bool = False
    connection: Connection | None = None


def _now_s() -> int:
    return int(time.time())


class Mediator2:
    """The v2 protocols, sharing the v1 mediator's records, Pickup, budget and queue service."""

    def __init__(self, v1: Mediator, identity: Identity2) -> None:
        self.v1 = v1
        self.identity = identity
        self.records = v1.records
        self.pickup = v1.pickup
        self.service = v1.service

    # -- the invitation ---------------------------------------------------------------------
    def invitation(self) -> dict[str, Any]:
        return {
            "type": BASE + "out-of-band/2.0/invitation",
            "id": self.identity.invitation_id,
            "from": self.identity.did,
            "body": {
                "goal_code": "request-mediate",
                "goal": "RequestMediate",
                "label": "relayfleet mediator",
                "accept": ACCEPT,
            },
        }

    def invitation_url(self) -> str:
        raw = json.dumps(self.invitation(), separators=(",", ":")).encode()
        return f"{self.v1.identity.endpoint}?_oob={dk.b64url(raw)}"

    # -- a message in ---------------------------------------------------------------------
    def open(self, raw: bytes) -> jwm.Opened:
        return jwm.unpack(raw, self.identity.lookup)

    def pack_for(self, doc: dict[str, Any], opened: jwm.Opened) -> bytes:
        """Authcrypt `doc` back to the key the request came from, naming our key as its sender
        named it (resolvers number did:peer:2 keys differently)."""
        if opened.sender_kid is not None:
            key = peer2.resolve(opened.sender_kid).key(opened.sender_kid)
        else:
            agreement = peer2.resolve(opened.sender_did).agreement if opened.sender_did else ()
            key = agreement[0] if agreement else None
        if key is None:
            raise MediatorError("the sender's DID names no key-agreement key", "bad_envelope")
        tagged = opened.tagged if opened.sender_kid is not None else True
        enc = opened.enc if opened.sender_kid is not None else "A256CBC-HS512"
        return jwm.pack(doc, key, self.identity.agreement, opened.recipient_kid, enc, tagged)

    async def handle(self, opened: jwm.Opened, session: LiveSession | None, caller: Caller) -> Outcome2:
        """Act on one opened message. Raises MediatorError (problem), ForwardRefused."""
        doc = opened.message
        mtype: str = doc["type"]
        name = mtype[len(BASE) :] if mtype.startswith(BASE) else ""
        # a mediate-request is answered in the response whatever it asks: its sender has no
        # endpoint yet (Veramo's stock request sets no return_route)
        wants = doc.get("return_route") in ("all", "thread") or name.endswith("/mediate-request")
        out = Outcome2(type=name or "other", return_route=wants)
        if name == FORWARD:
            caller.require_store()
            await self.forward(doc, opened.raw, caller)
            return out
        if len(opened.raw) > MAX_MESSAGE:
            raise MediatorError(f"the message exceeds {MAX_MESSAGE} bytes", "message_too_large", 413)
        sender = opened.sender_did
        if sender is None:
            raise MediatorError(
                f"{name or 'the message'} must be authcrypted or signed", "unknown_connection", 403
            )
        body = doc.get("body", {})
        if not isinstance(body, dict):
            raise MediatorError("body must be a JSON object")
        if name == "trust-ping/2.0/ping":
            if body.get("response_requested", True) is False:
                return out
            out.reply = self.pack_for(self.reply_from(doc, "trust-ping/2.0/ping-response", {}), opened)
            return out
        if name == "discover-features/2.0/queries":
            out.reply = self.pack_for(self.disclose(doc), opened)
            return out
        if name.endswith("/problem-report"):
            return out
        family = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
        if family not in (*MEDIATIONS, PICKUP):
            raise MediatorError(
                f"{mtype[:120]} is not a message this mediator handles", "unsupported_message_type"
            )
        short = name.rsplit("/", 1)[1]
        conn = await self.records.connection(did_key(sender))
        if family in MEDIATIONS and short == "mediate-request":
            answer = await self.mediate(doc, family, sender, conn, caller)
        elif conn is None or not conn.mediation:
            raise MediatorError(
                "mediation has not been granted to this DID; send mediate-request",
                "mediation_not_granted",
            )
        else:
            await self.records.touch(conn)
            out.connection = conn
            if family in MEDIATIONS:
                answer = await self.coordinate(doc, family, short, body, conn)
            else:
                answer = await self.pick(doc, short, body, conn, session, opened)
        out.reply = self.pack_for(answer, opened)
        return out

    @staticmethod
    def reply(doc: dict[str, Any], mtype: str, body: dict[str, Any]) -> dict[str, Any]:
        """A reply to `doc` in its thread (thid: its thid, else its id)."""
        out: dict[str, Any] = {"id": str(uuid.uuid4()), "type": BASE + mtype, "body": body}
        thid = doc.get("thid") if isinstance(doc.get("thid"), str) else doc.get("id")
        out["thid"] = thid
        sender = doc.get("from")
        if isinstance(sender, str):
            out["to"] = [sender]
        return out

    def reply_from(self, doc: dict[str, Any], mtype: str, body: dict[str, Any]) -> dict[str, Any]:
        out = self.reply(doc, mtype, body)
        out["from"] = self.identity.did
        out["created_time"] = _now_s()
        return out

    def problem(self, doc: dict[str, Any] | None, text: str, code: str) -> dict[str, Any]:
        """A report-problem 2.0 message about `doc` (pthid: its thread)."""
        report: dict[str, Any] = {
            "id": str(uuid.uuid4()),
            "type": PROBLEM,
            "from": self.identity.did,
            "body": {"code": code, "comment": text},
        }
        if doc is not None:
            thid = doc.get("thid") if isinstance(doc.get("thid"), str) else doc.get("id")
            report["pthid"] = thid
            if isinstance(doc.get("from"), str):
                report["to"] = [doc["from"]]
        return report

    # -- routing 2.0 ---------------------------------------------------------------------
    async def forward(self, doc: dict[str, Any], raw: bytes, caller: Caller) -> None:
        body = doc.get("body")
        nxt = body.get("next") if isinstance(body, dict) else None
        if not isinstance(nxt, str) or not nxt.startswith("did:") or len(nxt) > peer2.MAX_DID:
            raise MediatorError("forward body.next must be a DID", "bad_recipient")
        attachments = doc.get("attachments")
        if not isinstance(attachments, list) or not 0 < len(attachments) <= MAX_ATTACHMENTS:
            raise MediatorError(f"a forward needs 1 to {MAX_ATTACHMENTS} attachments", "bad_forward")
        payloads = [self._attached(a) for a in attachments]
        to = did_key(nxt)
        if await self.records.owner(to) is None:
            raise MediatorError(
                "forward next is not a DID registered with this mediator", "unknown_recipient", 404
            )
        mid = forward_id(doc.get("id"))
        if caller.charge is not None:  # the sender's client quota, as an enqueue's
            caller.charge(sum(len(p) for p in payloads))
        for i, payload in enumerate(payloads):
            key = f"didcomm2:{mid}:{i}" if mid else ""
            outcome = await self.service.enqueue(
                EnqueueRequest(
                    to, QUEUE_CHANNEL, payload, key, f"{mid}:{i}" if mid and len(payloads) > 1 else mid
                )
            )
            if outcome.kind not in ("stored", "duplicate"):
                raise ForwardRefused(outcome)

    def _attached(self, attachment: Any) -> bytes:
        """The packed message an attachment carries, as bytes to store: base64 decoded, a JSON
        member serialized compactly (a JWE's meaning is in its strings, not its spacing).
        Refused unless it is a JWE, so a delivery never meets what a recipient cannot open."""
        data = attachment.get("data") if isinstance(attachment, dict) else None
        if not isinstance(data, dict):
            raise MediatorError("a forward attachment needs data", "bad_forward")
        cap = self.v1.max_payload
        if "json" in data:
            doc = data["json"]
            payload = json.dumps(doc, separators=(",", ":")).encode()
        elif isinstance(data.get("base64"), str):
            try:
                payload = dk.b64decode_any(data["base64"], cap * 4 // 3 + 4)
            except dk.DidError:
                raise MediatorError("a forward attachment's base64 does not decode", "bad_forward") from None
            try:
                doc = boundedjson.loads(payload, cap, "the attachment")
            except boundedjson.JsonLimitError as exc:
                raise MediatorError(f"the forwarded message: {exc.text}", "bad_forward", exc.status) from None
        else:
            raise MediatorError("a forward attachment needs data.json or data.base64", "bad_forward")
        if len(payload) > cap:
            raise MediatorError(f"payload exceeds max size ({cap} bytes)", "payload_too_large", 413)
        try:
            shaped(doc)
        except ValueError as exc:
            raise MediatorError(f"the forwarded message is not a JWE: {exc}", "bad_forward") from None
        return payload

    # -- coordinate-mediation 2.0 / 3.0 ----------------------------------------------------------
    async def mediate(
        self, doc: dict[str, Any], family: str, sender: str, conn: Connection | None, caller: Caller
    ) -> dict[str, Any]:
        if conn is None:
            wait_s = self.v1.budget.admit(caller.client)
            if wait_s is not None:
                metrics.quota_refused("/v1/didcomm", "didcomm_connections")
                raise MediatorError(
                    "too many new DIDComm connections from this client; retry later",
                    "too_many_connections",
                    429,
                    wait_s,
                )
            conn = await self.records.save(self.records.new(did_key(sender), sender[:200], ""), fresh=True)
        if not conn.mediation:
            await self.records.save(replace(conn, mediation=True))
        # 2.0: one string (Identus leaves mediation at "requested" when it is a list); 3.0: a list
        # (Veramo takes routing_did[0])
        did = self.identity.did
        routing: str | list[str] = did if family == MEDIATIONS[0] else [did]
        return self.reply_from(doc, family + "mediate-grant", {"routing_did": routing})

    async def coordinate(
        self, doc: dict[str, Any], family: str, short: str, body: dict[str, Any], conn: Connection
    ) -> dict[str, Any]:
        if short in ("keylist-update", "recipient-update"):
            updates = body.get("updates")
            if not isinstance(updates, list) or not 0 < len(updates) <= MAX_UPDATES:
                raise MediatorError(f"{short} needs body.updates, a list of 1 to {MAX_UPDATES}")
            results = [await self._update(u, conn) for u in updates]
            return self.reply_from(doc, family + short + "-response", {"updated": results})
        if short in ("keylist-query", "recipient-query"):
            names = await self.records.names(conn)
            given = body.get("paginate")
            page: dict[str, Any] = given if isinstance(given, dict) else {}
            offset, limit = page.get("offset", 0), page.get("limit", len(names))
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, limit)):
                raise MediatorError("paginate offset and limit must be integers >= 0")
            shown = names[offset : offset + limit]
            entries = [{"recipient_did": n} for n in shown]
            pagination = {
                "count": len(shown),
                "offset": offset,
                "remaining": max(0, len(names) - offset - len(shown)),
            }
            if short == "recipient-query":
                return self.reply_from(doc, family + "recipient", {"dids": entries, "pagination": pagination})
            return self.reply_from(doc, family + "keylist", {"keys": entries, "pagination": pagination})
        raise MediatorError(
            f"{family}{short[:40]} is not a message the mediator accepts", "unsupported_message_type"
        )

    async def _update(self, update: Any, conn: Connection) -> dict[str, Any]:
        if not isinstance(update, dict) or update.get("action") not in ("add", "remove"):
            raise MediatorError("each update needs recipient_did and action add|remove")
        text = update.get("recipient_did")
        if (
            not isinstance(text, str)
            or not text.startswith("did:")
            or len(text) > peer2.MAX_DID
            or " " in text
        ):
            raise MediatorError("recipient_did must be a DID", "bad_recipient")
        did = peer2.did_of(text)
        key = did_key(did)
        if update["action"] == "add":
            # the sender's own DID is proven (did_key(sender) is the connection's key): add_key
            # takes it over from an unproven holder, as v1 does an agent's own verkey
            result = await self.records.add_key(conn, key)
            if result == "success":
                await self.records.name(conn, did, True)
        else:
            result = await self.records.remove_key(conn, key)
            await self.records.name(conn, did, False)
        return {"recipient_did": text, "action": update["action"], "result": result}

    # -- pickup 3.0 ------------------------------------------------------------------------
    async def queues(self, body: dict[str, Any], conn: Connection) -> list[bytes]:
        held = await self.records.keys(conn)
        wanted = body.get("recipient_did")
        if wanted is None:
            return held
        if not isinstance(wanted, str) or len(wanted) > peer2.MAX_DID:
            raise MediatorError("recipient_did must be a DID", "bad_recipient")
        key = did_key(wanted)
        if key not in held:
            raise MediatorError("recipient_did is not a DID this connection registered", "bad_recipient")
        return [key]

    async def status(
        self, doc: dict[str, Any], body: dict[str, Any], queues: list[bytes], live: bool, in_flight: int
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if isinstance(body.get("recipient_did"), str):
            fields["recipient_did"] = body["recipient_did"]
        fields.update(await self.pickup.counts(queues, live, in_flight))
        return self.reply_from(doc, PICKUP + "status", fields)

    async def pick(
        self,
        doc: dict[str, Any],
        short: str,
        body: dict[str, Any],
        conn: Connection,
        session: LiveSession | None,
        opened: jwm.Opened,
    ) -> dict[str, Any]:
        live = session is not None and session.live
        in_flight = session.in_flight() if session is not None and live else 0
        if short == "status-request":
            return await self.status(doc, body, await self.queues(body, conn), live, in_flight)
        if short == "delivery-request":
            limit = body.get("limit")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise MediatorError("delivery-request needs body.limit, an integer >= 1")
            queues = await self.queues(body, conn)
            batch = await self.pickup.take(queues, min(limit, 1000))
            if not batch:
                return await self.status(doc, body, queues, live, in_flight)
            return self.delivery(doc, body, batch)
        if short == "messages-received":
            ids = body.get("message_id_list")
            if not isinstance(ids, list) or len(ids) > MAX_IDS or not all(isinstance(i, str) for i in ids):
                raise MediatorError(
                    f"messages-received needs body.message_id_list, at most {MAX_IDS} strings"
                )
            held = await self.records.keys(conn)
            await self.pickup.acknowledge(ids, set(held))
            if session is not None:
                session.acked(ids)
            in_flight = session.in_flight() if session is not None and live else 0
            return await self.status(doc, {}, held, live, in_flight)
        if short == "live-delivery-change":
            want = body.get("live_delivery")
            if not isinstance(want, bool):
                raise MediatorError("live-delivery-change needs body.live_delivery, true or false")
            if session is None:
                if want:
                    return self.problem(
                        doc, "Connection does not support Live Delivery", "e.m.live-mode-not-supported"
                    )
            else:
                session.set_live(conn if want else None, self.live_render(conn, opened) if want else None)
            return await self.status(doc, {}, await self.records.keys(conn), want and session is not None, 0)
        raise MediatorError(
            f"{PICKUP}{short[:40]} is not a message the mediator accepts", "unsupported_message_type"
        )

    def delivery(
        self, doc: dict[str, Any] | None, body: dict[str, Any], batch: list[tuple[bytes, Message]]
    ) -> dict[str, Any]:
        attachments = [
            {
                "id": message_id(key, m.seq),
                "lastmod_time": m.received_ms // 1000,  # epoch seconds, a number (didcomm-rust)
                "data": {"json": boundedjson.loads(m.payload, None, "a payload")},
            }
            for key, m in batch
        ]
        fields: dict[str, Any] = {}
        if isinstance(body.get("recipient_did"), str):
            fields["recipient_did"] = body["recipient_did"]
        if doc is None:
            out: dict[str, Any] = {
                "id": str(uuid.uuid4()),
                "type": BASE + PICKUP + "delivery",
                "from": self.identity.did,
                "created_time": _now_s(),
                "body": fields,
            }
        else:
            out = self.reply_from(doc, PICKUP + "delivery", fields)
        out["attachments"] = attachments
        return out

    def live_render(
        self, conn: Connection, opened: jwm.Opened
    ) -> Callable[[list[tuple[bytes, Message]]], bytes]:
        """What live mode sends for a batch: a delivery packed for the DID that asked."""

        def render(batch: list[tuple[bytes, Message]]) -> bytes:
            doc = self.delivery(None, {}, batch)
            doc["to"] = [conn.did]
            return self.pack_for(doc, opened)

        return render

    # -- discover-features 2.0 --------------------------------------------------------------------
    def disclose(self, doc: dict[str, Any]) -> dict[str, Any]:
        body = doc.get("body")
        queries = body.get("queries") if isinstance(body, dict) else None
        if not isinstance(queries, list) or len(queries) > 20:
            raise MediatorError("queries must be a list of at most 20")
        found = []
        for q in queries:
            match = q.get("match") if isinstance(q, dict) and q.get("feature-type") == "protocol" else None
            if isinstance(match, str) and len(match) <= 200:
                found += [
                    {"feature-type": "protocol", "id": p} for p in PROTOCOLS if fnmatch.fnmatchcase(p, match)
                ]
        return self.reply_from(doc, "discover-features/2.0/disclose", {"disclosures": found})
