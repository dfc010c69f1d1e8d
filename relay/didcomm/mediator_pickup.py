"""Pickup 2.0 for the mediator: status, delivery-request, messages-received and
live-delivery-change. A delivered message stays in its queue until acknowledged; a lease per
queue keeps it from going out twice until `redeliver_ms` have passed without an ack. The lease
is taken by compare-and-set and what waits is counted in the queue, so any number of relays
(and of requests on one) can serve one agent's polls (records.Lease)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from relay import boundedjson, metrics
from relay.didcomm import keys as dk
from relay.didcomm.envelope import shaped
from relay.didcomm.messages import MediatorError, reply
from relay.didcomm.records import QUEUE_CHANNEL, Connection, Lease, Records
from relay.presence import Presence
from relay.service import QueueService
from relay.storage.store import Message

__all__ = ["MAX_IDS", "LiveSession", "Pickup", "Render", "message_id", "packable", "parse_message_id"]

log = logging.getLogger("relay.didcomm")
MAX_IDS = 10_000
SWEEPS = 8  # reads per delivery while what is read holds messages that must be dropped
TAKES = 4  # tries of a delivery whose lease another delivery took meanwhile


Render = Callable[[list[tuple[bytes, Message]]], bytes]


class LiveSession(Protocol):
    """What a persistent transport (the DIDComm WebSocket) lets Pickup see and change."""

    def set_live(self, conn: Connection | None, render: Render | None = None) -> None:
        """Live mode on for `conn` (off for None); `render` packs a batch of deliveries (the
        protocol version's message; None: Pickup 2.0's)."""
        ...

    @property
    def live(self) -> bool: ...

    def acked(self, ids: Iterable[str]) -> None: ...

    def in_flight(self) -> int:
        """Messages delivered live and not yet acknowledged."""
        ...


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


def packable(payload: bytes) -> bool:
    """Whether an agent can take `payload` as a packed message (a JSON envelope): the one
    parse Pickup makes of a stored payload, bounded like every other (relay/boundedjson.py)."""
    try:
        shaped(boundedjson.loads(payload, None, "a payload"))
    except ValueError:  # JsonLimitError, EnvelopeError
        return False
    return True


def now_ms() -> int:
    return int(time.time() * 1000)


def rfc3339(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


class Pickup:
    def __init__(
        self, service: QueueService, records: Records, redeliver_ms: int, presence: Presence | None = None
    ) -> None:
        self.service = service
        self.presence = presence
        self.records = records
        self.redeliver_ms = redeliver_ms  # a delivered, unacknowledged message goes out again after

    async def queues(self, doc: dict[str, Any], conn: Connection) -> list[bytes]:
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
        body: dict[str, Any] = {}
        if isinstance(doc.get("recipient_key"), str):
            body["recipient_key"] = doc["recipient_key"]
        body.update(await self.counts(queues, live, in_flight))
        return reply(doc, prefix, "messagepickup/2.0/status", body)

    async def counts(self, queues: list[bytes], live: bool, in_flight: int = 0) -> dict[str, Any]:
        """A status's fields (Pickup 2.0 and 3.0 share them): what waits in `queues`, i.e. past
        each queue's active lease (counted by the queue's own shard: lua/status.lua)."""
        leases, elsewhere = await asyncio.gather(self.leases(queues), self.live_elsewhere(queues, live))
        now = now_ms()
        cursors = {k: lease.cursor for k, lease in leases.items() if lease.active(now)}
        results = await asyncio.gather(
            *(self.service.status(k, QUEUE_CHANNEL, cursors.get(k)) for k in queues)
        )
        count = max(0, sum(r.above for r in results) - in_flight)
        total = sum(r.bytes for r in results)
        oldest = min((r.oldest_ms for r in results if r.oldest_ms is not None), default=None)
        newest = max((r.newest_ms for r in results if r.newest_ms is not None), default=None)
        body: dict[str, Any] = {"message_count": count}
        body["longest_waited_seconds"] = max(0, int(time.time() - oldest / 1000)) if oldest is not None else 0
        if newest is not None:
            body["newest_received_time"] = rfc3339(newest)
        if oldest is not None:
            body["oldest_received_time"] = rfc3339(oldest)
        body["total_bytes"] = total
        body["live_delivery"] = live or elsewhere
        return body

    async def live_elsewhere(self, queues: list[bytes], live: bool) -> bool:
        """Whether a socket in live mode delivers one of `queues` on some relay of the fleet
        (asked only when the asking transport is not in live mode itself)."""
        if live or self.presence is None or not queues:
            return False
        presence = self.presence
        return any(await asyncio.gather(*(presence.live(k, QUEUE_CHANNEL) for k in queues)))

    async def leases(self, queues: list[bytes]) -> dict[bytes, Lease]:
        found = await asyncio.gather(*(self.records.lease(k) for k in queues))
        return {k: lease for k, lease in zip(queues, found, strict=True) if lease is not None}

    async def pending(
        self, queues: list[bytes], limit: int, leases: dict[bytes, Lease] | None = None
    ) -> list[tuple[bytes, Message]]:
        """Up to `limit` held packed messages of the queues, oldest first; past each active
        lease. Anything else met on the way is removed (`drop`) and the read done again."""
        now = now_ms()
        starts = {
            k: lease.cursor + 1 for k, lease in (leases or {}).items() if lease.active(now) and k in queues
        }
        for _ in range(SWEEPS):
            results = await asyncio.gather(
                *(self.service.read(k, QUEUE_CHANNEL, starts.get(k), limit, 0) for k in queues)
            )
            merged = [(k, m) for k, r in zip(queues, results, strict=True) for m in r.messages]
            merged.sort(key=lambda km: km[1].received_ms)
            batch = merged[:limit]
            unpackable = [(k, m) for k, m in batch if not packable(m.payload)]
            if not unpackable:
                break
            await self.drop(unpackable)
            dropped = {(k, m.seq) for k, m in unpackable}
            batch = [(k, m) for k, m in batch if (k, m.seq) not in dropped]
        return batch

    async def drop(self, unpackable: list[tuple[bytes, Message]]) -> None:
        """Remove what no agent could take as a packed message. Only forwards store in the
        mediator's key space and they store only packed messages, so this meets nothing unless
        Redis was written behind the relay's back; but a DIDComm agent fails a whole delivery on
        one attachment it cannot parse (Credo-ts does), then meets that one first in every
        delivery after: one such message would block the queue. Counted and logged (the
        count only), never silently."""
        per_key: dict[bytes, list[int]] = {}
        for key, m in unpackable:
            per_key.setdefault(key, []).append(m.seq)
        await asyncio.gather(*(self.service.ack(k, QUEUE_CHANNEL, None, seqs) for k, seqs in per_key.items()))
        metrics.DIDCOMM_MESSAGES.labels("messagepickup/2.0/delivery", "dropped").inc(len(unpackable))
        log.warning("didcomm pickup removed %d stored messages that are not packed messages", len(unpackable))

    async def take(self, queues: list[bytes], limit: int) -> list[tuple[bytes, Message]]:
        """A delivery-request's batch: up to `limit` messages past the queues' leases, each
        queue's lease moved past what is handed out of it. A lease another delivery moved since
        it was read is not taken: that queue's messages went to that delivery, and when none are
        left to this one it reads again (at most TAKES times; then nothing: the agent asks again)."""
        for _ in range(TAKES):
            leases = await self.leases(queues)
            batch = await self.pending(queues, limit, leases)
            if not batch:
                return []
            won = await self.lease_out(batch, leases)
            taken = [(k, m) for k, m in batch if k in won]
            if taken:
                return taken
        return []

    async def lease_out(self, batch: list[tuple[bytes, Message]], seen: dict[bytes, Lease]) -> set[bytes]:
        """Move each batch queue's lease past its part of `batch`, if the lease is still the one
        `seen`; the queues whose lease this moved."""
        expiry = now_ms() + self.redeliver_ms
        tops: dict[bytes, int] = {}
        for key, m in batch:
            tops[key] = max(tops.get(key, 0), m.seq)
        keys = list(tops)
        swapped = await asyncio.gather(
            *(self.records.swap_lease(k, seen.get(k), Lease(tops[k], expiry)) for k in keys)
        )
        return {k for k, ok in zip(keys, swapped, strict=True) if ok}

    async def acknowledge(self, ids: list[str], held: set[bytes]) -> None:
        """messages-received: remove the listed messages of the queues `held` (others' ids are
        ignored). Their lease needs no change: it covers seqs, and what it covers that is gone
        is simply no longer counted (`counts`)."""
        by_key: dict[bytes, list[int]] = {}
        for i in ids:
            parsed = parse_message_id(i)
            if parsed is not None and parsed[0] in held:
                by_key.setdefault(parsed[0], []).append(parsed[1])
        await asyncio.gather(
            *(self.service.ack(k, QUEUE_CHANNEL, None, sorted(seqs)) for k, seqs in by_key.items())
        )

    def delivery(
        self, doc: dict[str, Any] | None, prefix: str, batch: list[tuple[bytes, Message]]
    ) -> dict[str, Any]:
        # the stored bytes as they are (`pending` made sure each is a packed message)
        attachments = [
            {
                "@id": message_id(key, m.seq),
                "lastmod_time": rfc3339(m.received_ms),
                "data": {"base64": dk.b64url(m.payload)},
            }
            for key, m in batch
        ]
        body: dict[str, Any] = {}
        if doc is not None and isinstance(doc.get("recipient_key"), str):
            body["recipient_key"] = doc["recipient_key"]
        body["~attach"] = attachments
        if doc is None:
            return {"@type": prefix + "messagepickup/2.0/delivery", "@id": str(uuid.uuid4()), **body}
        return reply(doc, prefix, "messagepickup/2.0/delivery", body)

    async def handle(
        self, doc: dict[str, Any], prefix: str, short: str, conn: Connection, session: LiveSession | None
    ) -> dict[str, Any]:
        live = session is not None and session.live
        in_flight = session.in_flight() if session is not None and live else 0
        if short == "status-request":
            return await self.status(doc, prefix, await self.queues(doc, conn), live, in_flight)
        if short == "delivery-request":
            limit = doc.get("limit")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise MediatorError("delivery-request needs limit, an integer >= 1")
            queues = await self.queues(doc, conn)
            batch = await self.take(queues, min(limit, 1000))
            if not batch:
                return await self.status(doc, prefix, queues, live, in_flight)
            return self.delivery(doc, prefix, batch)
        if short == "messages-received":
            ids = doc.get("message_id_list")
            if not isinstance(ids, list) or len(ids) > MAX_IDS or not all(isinstance(i, str) for i in ids):
                raise MediatorError(
                    f"messages-received needs message_id_list, a list of at most {MAX_IDS} strings"
                )
            held = set(await self.records.keys(conn))
            await self.acknowledge(ids, held)
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
                    return reply(doc, prefix, "notification/1.0/problem-report", body)
            else:
                session.set_live(conn if want else None)
            return await self.status(doc, prefix, await self.records.keys(conn), want and session is not None)
        raise MediatorError(
            f"messagepickup/2.0/{short[:40]} is not a message the mediator accepts",
            "unsupported_message_type",
        )
