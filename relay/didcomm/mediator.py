"""The mediator's protocols: one plaintext DIDComm v1 message in, at most one reply out.

Out-of-Band 1.1 (the invitation), DID Exchange 1.0/1.1, trust ping 1.0, coordinate-mediation
1.0, routing 1.0 forward, Pickup 2.0 and discover-features 1.0. Every message but a forward
and a DID Exchange request must come authcrypted from the key of a connection. Replies copy
the request's ``@type`` prefix (``https://didcomm.org/`` or the legacy ``did:sov:…;spec/``).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from relay.didcomm import keys as dk
from relay.didcomm.attachments import AttachmentError, attached_document, signed_attachment
from relay.didcomm.envelope import Unpacked, pack, parse, unpack
from relay.didcomm.records import CHANNEL, Connection, Lease, Records
from relay.service import QueueService
from relay.storage.store import EnqueueOutcome, Message

PREFIXES = ("https://didcomm.org/", "did:sov:BzCbsNYhMrjHiqZDTUASHg;spec/")
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
)
ROLES = {
    "didexchange": ["responder"],
    "out-of-band": ["sender"],
    "trust_ping": ["receiver"],
    "coordinate-mediation": ["mediator"],
    "routing": ["mediator"],
    "messagepickup": ["mediator"],
    "discover-features": ["responder"],
}
MAX_MESSAGE = 1 << 20  # a plaintext protocol message (forwards excepted) is small
MAX_IDS = 10_000
MAX_UPDATES = 1000
MAX_MESSAGE_ID = 100


class MediatorError(Exception):
    """A message the mediator will not act on: a problem-report to a known sender, else 4xx JSON."""

    def __init__(self, text: str, code: str = "bad_didcomm_message", status: int = 400) -> None:
        super().__init__(text)
        self.text = text
        self.code = code
        self.status = status


class ForwardRefused(Exception):
    """The forward's enqueue was refused (rate limit, full queue, conflict): the caller maps
    the outcome exactly as for any enqueue."""

    def __init__(self, outcome: EnqueueOutcome) -> None:
        super().__init__(outcome.kind)
        self.outcome = outcome


class LiveSession(Protocol):
    """What a persistent transport (the DIDComm WebSocket) lets Pickup see and change."""

    def set_live(self, conn: Connection | None) -> None: ...

    @property
    def live(self) -> bool: ...

    def acked(self, ids: Iterable[str]) -> None: ...

    def in_flight(self) -> int:
        """Messages delivered live and not yet acknowledged."""
        ...


@dataclass
class Outcome:
    """What handling one envelope produced."""

    type: str  # family/version/name, for metrics and logs
    reply: bytes | None = None  # a packed envelope for the sender
    return_route: bool = False
    connection: Connection | None = None
    sender: bytes | None = None
    extra: list[bytes] = field(default_factory=list)


def message_id(key: bytes, seq: int) -> str:
    """A Pickup attachment id: which queue (recipient key) and which message of it."""
    return f"{dk.b64url(key)}.{seq}"


def parse_message_id(text: str) -> tuple[bytes, int] | None:
    key, _, seq = text.partition(".")
    if len(key) != 43 or not seq.isascii() or not seq.isdigit() or len(seq) > 18:
        return None
    try:
        return dk.b64decode_any(key), int(seq)
    except dk.DidError:
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _rfc3339(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def _thread_of(doc: dict[str, Any]) -> tuple[str | None, str | None]:
    thread = doc.get("~thread")
    if not isinstance(thread, dict):
        return None, None
    thid, pthid = thread.get("thid"), thread.get("pthid")
    return (thid if isinstance(thid, str) else None), (pthid if isinstance(pthid, str) else None)


class Mediator:
    def __init__(
        self, identity: dk.Identity, service: QueueService, max_payload: int, redeliver_s: float = 10.0
    ) -> None:
        self.redeliver_ms = int(
            redeliver_s * 1000
        )  # a delivered, unacknowledged message goes out again after
        self.identity = identity
        self.service = service
        self.records = Records(service)
        self.max_payload = max_payload

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
                    "id": "#inline-0",
                    "type": "did-communication",
                    "recipientKeys": [ident.connection.did_key],
                    "routingKeys": [],
                    "serviceEndpoint": endpoint,
                }
                for endpoint in (ident.endpoint, ident.ws_endpoint)
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

    async def handle(self, opened: Unpacked, session: LiveSession | None) -> Outcome:
        """Act on one opened envelope. Raises MediatorError (problem), ForwardRefused."""
        doc, prefix, name = self._parse(opened.message)
        transport = doc.get("~transport")
        rr = transport.get("return_route") if isinstance(transport, dict) else None
        out = Outcome(type=name, return_route=rr in ("all", "thread"), sender=opened.sender)
        if name == "routing/1.0/forward":
            await self.forward(doc)
            return out
        if opened.sender is None:
            raise MediatorError(f"{name} must be authcrypted", "unknown_connection", 403)
        if name in ("didexchange/1.1/request", "didexchange/1.0/request"):
            reply = await self.did_exchange(doc, prefix, name[: -len("request")], opened.sender)
            out.reply = self.pack_for(reply, opened.sender)
            return out
        conn = await self.records.connection(opened.sender)
        if conn is None:
            raise MediatorError(
                "no connection with this sender; connect through the invitation first",
                "unknown_connection",
                403,
            )
        out.connection = conn
        answer = await self._on_connection(doc, prefix, name, conn, session)
        if answer is not None:
            out.reply = self.pack_for(answer, conn.key)
        return out

    def _parse(self, message: bytes) -> tuple[dict[str, Any], str, str]:
        try:
            doc = json.loads(message)
        except (ValueError, UnicodeDecodeError):
            raise MediatorError("the message is not JSON") from None
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
            return self._reply(doc, prefix, "trust_ping/1.0/ping_response", {})
        if family == "coordinate-mediation/1.0":
            return await self.coordinate(doc, prefix, short, conn)
        if family == "messagepickup/2.0":
            return await self.pickup(doc, prefix, short, conn, session)
        if name == "discover-features/1.0/query":
            return self.disclose(doc, prefix)
        if name == "notification/1.0/problem-report" or name.endswith("/problem-report"):
            return None  # an agent telling us something went wrong: nothing to answer
        raise MediatorError(f"{name} is not a message this mediator handles", "unsupported_message_type")

    def _reply(self, doc: dict[str, Any], prefix: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        thid, _ = _thread_of(doc)
        reply: dict[str, Any] = {"@type": prefix + name, "@id": str(uuid.uuid4())}
        thread = thid or doc.get("@id")
        if thread:
            reply["~thread"] = {"thid": thread}
        reply.update(body)
        return reply

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
    async def forward(self, doc: dict[str, Any]) -> None:
        try:
            to = dk.verkey_from(doc.get("to"))
        except dk.DidError as exc:
            raise MediatorError(f"forward 'to': {exc}", "bad_recipient") from None
        msg = doc.get("msg")
        if isinstance(msg, dict):
            payload = json.dumps(msg, separators=(",", ":")).encode()
        elif isinstance(msg, str) and msg:
            payload = msg.encode()
        else:
            raise MediatorError("forward 'msg' must be a packed message", "bad_forward")
        if len(payload) > self.max_payload:
            raise MediatorError(
                f"payload exceeds max size ({self.max_payload} bytes)", "payload_too_large", 413
            )
        if await self.records.owner(to) is None:
            raise MediatorError(
                "forward 'to' is not a key registered with this mediator", "unknown_recipient", 404
            )
        # the forward's @id makes a resent forward a duplicate, as Idempotency-Key does
        mid = doc.get("@id")
        if not (isinstance(mid, str) and 0 < len(mid) <= MAX_MESSAGE_ID and mid.isprintable()):
            mid = ""
        outcome = await self.service.enqueue(to, CHANNEL, payload, "didcomm:" + mid if mid else "", mid)
        if outcome.kind not in ("stored", "duplicate"):
            raise ForwardRefused(outcome)

    # -- DID Exchange ---------------------------------------------------------------------
    async def did_exchange(
        self, doc: dict[str, Any], prefix: str, family: str, sender: bytes
    ) -> dict[str, Any]:
        _, pthid = _thread_of(doc)
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
            await self.records.save(conn)
        request_id = doc.get("@id")
        thid, _ = _thread_of(doc)
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
                await self.records.save(Connection(conn.key, conn.did, conn.label, True, conn.created_ms))
            grant = {"endpoint": self.identity.endpoint, "routing_keys": [self.identity.routing.did_key]}
            return self._reply(doc, prefix, family + "mediate-grant", grant)
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
            return self._reply(doc, prefix, family + "keylist-update-response", {"updated": results})
        if short == "keylist-query":
            held = await self.records.keys(conn)
            body: dict[str, Any] = {
                "keys": [{"recipient_key": dk.did_key(k)} for k in held],
                "pagination": {"count": len(held), "offset": 0, "remaining": 0},
            }
            return self._reply(doc, prefix, family + "keylist", body)
        raise MediatorError(
            f"coordinate-mediation/1.0/{short[:40]} is not a message the mediator accepts",
            "unsupported_message_type",
        )

    # -- Pickup 2.0 -------------------------------------------------------------------------
    async def _queues(self, doc: dict[str, Any], conn: Connection) -> list[bytes]:
        held = await self.records.keys(conn)
        key = doc.get("recipient_key")
        if key is None:
            return held
        try:
            wanted = dk.verkey_from(key)
        except dk.DidError as exc:
            raise MediatorError(f"recipient_key: {exc}", "bad_recipient") from None
        if wanted not in held:
            raise MediatorError("recipient_key is not a key this connection registered", "bad_recipient")
        return [wanted]

    async def status(
        self, doc: dict[str, Any], prefix: str, queues: list[bytes], live: bool, in_flight: int = 0
    ) -> dict[str, Any]:
        """A Pickup status. Live deliveries awaiting their ack (`in_flight`) are not counted as
        waiting: an agent that asked for a count's worth would get them twice."""
        results, leases = await asyncio.gather(
            asyncio.gather(*(self.service.status(k, CHANNEL) for k in queues)), self._leases(queues)
        )
        now = _now_ms()
        leased = sum(lease.held for lease in leases.values() if lease.active(now))
        count = max(0, sum(r.count for r in results) - in_flight - leased)
        total = sum(r.bytes for r in results)
        oldest = min((r.oldest_ms for r in results if r.oldest_ms is not None), default=None)
        newest = max((r.newest_ms for r in results if r.newest_ms is not None), default=None)
        body: dict[str, Any] = {}
        if isinstance(doc.get("recipient_key"), str):
            body["recipient_key"] = doc["recipient_key"]
        body["message_count"] = count
        body["longest_waited_seconds"] = max(0, int(time.time() - oldest / 1000)) if oldest is not None else 0
        if newest is not None:
            body["newest_received_time"] = _rfc3339(newest)
        if oldest is not None:
            body["oldest_received_time"] = _rfc3339(oldest)
        body["total_bytes"] = total
        body["live_delivery"] = live
        return self._reply(doc, prefix, "messagepickup/2.0/status", body)

    async def _leases(self, queues: list[bytes]) -> dict[bytes, Lease]:
        found = await asyncio.gather(*(self.records.lease(k) for k in queues))
        return {k: lease for k, lease in zip(queues, found, strict=True) if lease is not None}

    async def pending(
        self, queues: list[bytes], limit: int, leases: dict[bytes, Lease] | None = None
    ) -> list[tuple[bytes, Message]]:
        """Up to `limit` held messages of the queues, oldest first; past each active lease."""
        now = _now_ms()
        starts = {
            k: lease.cursor + 1 for k, lease in (leases or {}).items() if lease.active(now) and k in queues
        }
        results = await asyncio.gather(
            *(self.service.read(k, CHANNEL, starts.get(k), limit, 0) for k in queues)
        )
        merged = [(k, m) for k, r in zip(queues, results, strict=True) for m in r.messages]
        merged.sort(key=lambda km: km[1].received_ms)
        return merged[:limit]

    async def lease_out(self, batch: list[tuple[bytes, Message]], leases: dict[bytes, Lease]) -> None:
        """Record that `batch` went out: its queues' leases move past it."""
        now = _now_ms()
        per_key: dict[bytes, list[int]] = {}
        for key, m in batch:
            per_key.setdefault(key, []).append(m.seq)
        updates = []
        for key, seqs in per_key.items():
            old = leases.get(key)
            held = old.held if old is not None and old.active(now) else 0
            updates.append(
                self.records.set_lease(key, Lease(max(seqs), now + self.redeliver_ms, held + len(seqs)))
            )
        await asyncio.gather(*updates)

    async def lease_back(self, removed: dict[bytes, int]) -> None:
        """Acknowledged messages leave their queue's lease."""
        keys = [k for k, n in removed.items() if n > 0]
        leases = await self._leases(keys)
        now = _now_ms()
        updates = []
        for key, lease in leases.items():
            if not lease.active(now):
                continue
            held = max(0, lease.held - removed[key])
            updates.append(self.records.set_lease(key, Lease(lease.cursor, lease.expiry_ms, held)))
        await asyncio.gather(*updates)

    def delivery(
        self, doc: dict[str, Any] | None, prefix: str, batch: list[tuple[bytes, Message]]
    ) -> dict[str, Any]:
        attachments = []
        for key, m in batch:
            data: dict[str, Any]
            try:
                parsed = json.loads(m.payload)
                data = {"json": parsed} if isinstance(parsed, dict) else {"base64": dk.b64url(m.payload)}
            except (ValueError, UnicodeDecodeError):
                data = {"base64": dk.b64url(m.payload)}
            attachments.append(
                {"@id": message_id(key, m.seq), "lastmod_time": _rfc3339(m.received_ms), "data": data}
            )
        body: dict[str, Any] = {}
        if doc is not None and isinstance(doc.get("recipient_key"), str):
            body["recipient_key"] = doc["recipient_key"]
        body["~attach"] = attachments
        if doc is None:
            return {"@type": prefix + "messagepickup/2.0/delivery", "@id": str(uuid.uuid4()), **body}
        return self._reply(doc, prefix, "messagepickup/2.0/delivery", body)

    async def pickup(
        self, doc: dict[str, Any], prefix: str, short: str, conn: Connection, session: LiveSession | None
    ) -> dict[str, Any]:
        live = session is not None and session.live
        in_flight = session.in_flight() if session is not None and live else 0
        if short == "status-request":
            return await self.status(doc, prefix, await self._queues(doc, conn), live, in_flight)
        if short == "delivery-request":
            limit = doc.get("limit")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise MediatorError("delivery-request needs limit, an integer >= 1")
            queues = await self._queues(doc, conn)
            leases = await self._leases(queues)
            batch = await self.pending(queues, min(limit, 1000), leases)
            if not batch:
                return await self.status(doc, prefix, queues, live, in_flight)
            await self.lease_out(batch, leases)
            return self.delivery(doc, prefix, batch)
        if short == "messages-received":
            ids = doc.get("message_id_list")
            if not isinstance(ids, list) or len(ids) > MAX_IDS or not all(isinstance(i, str) for i in ids):
                raise MediatorError(
                    f"messages-received needs message_id_list, a list of at most {MAX_IDS} strings"
                )
            held = set(await self.records.keys(conn))
            by_key: dict[bytes, list[int]] = {}
            for i in ids:
                parsed = parse_message_id(i)
                if parsed is not None and parsed[0] in held:
                    by_key.setdefault(parsed[0], []).append(parsed[1])
            keys = list(by_key)
            counts = await asyncio.gather(
                *(self.service.ack(k, CHANNEL, None, sorted(by_key[k])) for k in keys)
            )
            await self.lease_back(dict(zip(keys, counts, strict=True)))
            if session is not None:
                session.acked(ids)
            in_flight = session.in_flight() if session is not None and live else 0
            return await self.status(doc, prefix, sorted(held), live, in_flight)
        if short == "live-delivery-change":
            want = doc.get("live_delivery")
            if not isinstance(want, bool):
                raise MediatorError("live-delivery-change needs live_delivery, true or false")
            if session is None:
                if want:
                    text = "Connection does not support Live Delivery"
                    body = {"description": {"en": text, "code": "live_delivery_not_supported"}}
                    return self._reply(doc, prefix, "notification/1.0/problem-report", body)
            else:
                session.set_live(conn if want else None)
            return await self.status(doc, prefix, await self.records.keys(conn), want and session is not None)
        raise MediatorError(
            f"messagepickup/2.0/{short[:40]} is not a message the mediator accepts",
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
        return self._reply(doc, prefix, "discover-features/1.0/disclose", {"protocols": protocols})
