"""Pickup 2.0 for the mediator: status, delivery-request, messages-received and
live-delivery-change. A delivered message stays in its queue until acknowledged; a lease per
queue keeps it from going out twice until `redeliver_ms` have passed without an ack."""

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
        """A status's fields (Pickup 2.0 and 3.0 share them): what waits in `queues`."""
        results, leases, elsewhere = await asyncio.gather(
            asyncio.gather(*(self.service.status(k, QUEUE_CHANNEL) for k in queues)),
            self.leases(queues),
            self.live_elsewhere(queues, live),
        )
        now = now_ms()
        leased = sum(lease.held for lease in leases.values() if lease.active(now))
        count = max(0, sum(r.count for r in results) - in_flight - leased)
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

    async def lease_out(self, batch: list[tuple[bytes, Message]], leases: dict[bytes, Lease]) -> None:
        """Record that `batch` went out: its queues' leases move past it."""
        now = now_ms()
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
        leases = await self.leases(keys)
        now = now_ms()
        updates = []
        for key, lease in leases.items():
            if not lease.active(now):
                continue
            held = max(0, lease.held - removed[key])
            updates.append(self.records.set_lease(key, Lease(lease.cursor, lease.expiry_ms, held)))
        await asyncio.gather(*updates)

    async def acknowledge(self, ids: list[str], held: set[bytes]) -> None:
        """messages-received: remove the listed messages of the queues `held` (others' ids are
        ignored) and take them out of their leases."""
        by_key: dict[bytes, list[int]] = {}
        for i in ids:
            parsed = parse_message_id(i)
            if parsed is not None and parsed[0] in held:
                by_key.setdefault(parsed[0], []).append(parsed[1])
        keys = list(by_key)
        counts = await asyncio.gather(
            *(self.service.ack(k, QUEUE_CHANNEL, None, sorted(by_key[k])) for k in keys)
        )
        await self.lease_back(dict(zip(keys, counts, strict=True)))

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
            leases = await self.leases(queues)
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
