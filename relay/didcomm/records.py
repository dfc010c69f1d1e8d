"""The mediator's state in Redis: connections, the keys each registered, who owns a key.

Each record lives in the slot of the key it is about (the slot a queue of that key with
the default channel has), in that slot's one DIDComm hash (storage/keys.slot_didcomm),
so any relay finds it, migration moves it with the slot, and a forward's ownership check
runs on the shard that then queues the message:

- ``c:<agent key>``   the connection whose agent sends from that key (JSON)
- ``r:<agent key>``   the recipient keys that connection registered (space-separated)
- ``k:<recipient>``   the agent key of the connection that registered it
- ``d:<recipient>``   the delivery lease of that key's queue (see Lease)
A key's queue itself is (recipient, QUEUE_CHANNEL), in the mediator's own key space.
Keys appear as unpadded base64url of the 32 raw bytes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from relay.didcomm.keys import b64decode_any, b64url
from relay.service import QueueService
from relay.storage.keys import MEDIATOR_CHANNEL

MAX_KEYS_PER_CONNECTION = 1000
# Where a record lives: the slot of (its key, RECORD_CHANNEL). Unchanged since the mediator's
# queues moved to their own key space, so connections and keylists carry over an upgrade.
RECORD_CHANNEL = b""
# The mediator's queues: never the HTTP API's (relay/storage/keys.MEDIATOR_CHANNEL).
QUEUE_CHANNEL = MEDIATOR_CHANNEL


@dataclass(frozen=True)
class Connection:
    key: bytes  # the agent's verkey: the connection's id
    did: str  # the agent's DID for this connection
    label: str
    mediation: bool  # mediate-grant sent
    created_ms: int

    def to_json(self) -> str:
        return json.dumps(
            {"did": self.did, "label": self.label, "mediation": self.mediation, "created": self.created_ms},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, key: bytes, raw: bytes) -> Connection:
        doc = json.loads(raw)
        return cls(
            key, str(doc["did"]), str(doc.get("label", "")), bool(doc["mediation"]), int(doc["created"])
        )


@dataclass(frozen=True)
class Lease:
    """Messages of a queue handed out by a delivery and not yet acknowledged: every seq up to
    `cursor`, `held` of them still in the queue, not offered again until `expiry_ms`. Agents
    poll (status-request → delivery-request) faster than their acks arrive; without this each
    message went out many times. After the expiry everything unacknowledged goes out again (an
    agent that died before acking gets its messages back)."""

    cursor: int
    expiry_ms: int
    held: int

    def active(self, now_ms: int) -> bool:
        return self.expiry_ms > now_ms

    @classmethod
    def parse(cls, raw: bytes | None) -> Lease | None:
        try:
            cursor, expiry, held = (int(x) for x in raw.split()) if raw else (0, 0, 0)
        except ValueError:
            return None
        return cls(cursor, expiry, held) if raw else None


class Records:
    def __init__(self, service: QueueService) -> None:
        self.service = service

    async def connection(self, key: bytes) -> Connection | None:
        field = "c:" + b64url(key)
        (raw,) = await self.service.call(
            key, RECORD_CHANNEL, lambda r: r.store.record_get(r.keys.slot, (field,))
        )
        return Connection.from_json(key, raw) if raw else None

    async def save(self, conn: Connection) -> None:
        pair = ("c:" + b64url(conn.key), conn.to_json())
        await self.service.call(
            conn.key, RECORD_CHANNEL, lambda r: r.store.record_set(r.keys.slot, (pair,), ())
        )

    @staticmethod
    def new(key: bytes, did: str, label: str) -> Connection:
        return Connection(key, did, label, False, int(time.time() * 1000))

    async def keys(self, conn: Connection) -> list[bytes]:
        """The recipient keys the connection registered (its Pickup queues)."""
        field = "r:" + b64url(conn.key)
        (raw,) = await self.service.call(
            conn.key, RECORD_CHANNEL, lambda r: r.store.record_get(r.keys.slot, (field,))
        )
        return [b64decode_any(m) for m in raw.decode().split()] if raw else []

    async def owner(self, recipient: bytes) -> bytes | None:
        field = "k:" + b64url(recipient)
        (raw,) = await self.service.call(
            recipient, RECORD_CHANNEL, lambda r: r.store.record_get(r.keys.slot, (field,))
        )
        return b64decode_any(raw.decode()) if raw else None

    async def add_key(self, conn: Connection, recipient: bytes) -> str:
        """keylist-update 'add': 'success', 'client_error' (another connection holds the key)
        or 'server_error' (this connection holds MAX_KEYS_PER_CONNECTION already)."""
        owner, member = b64url(conn.key), b64url(recipient)
        claimed = await self.service.call(
            recipient, RECORD_CHANNEL, lambda r: r.store.record_claim(r.keys.slot, "k:" + member, owner, True)
        )
        if not claimed:
            return "client_error"
        listed = await self.service.call(
            conn.key,
            RECORD_CHANNEL,
            lambda r: r.store.record_list(
                r.keys.slot, "r:" + owner, True, MAX_KEYS_PER_CONNECTION, (member,)
            ),
        )
        if not listed:
            await self.service.call(
                recipient,
                RECORD_CHANNEL,
                lambda r: r.store.record_claim(r.keys.slot, "k:" + member, owner, False),
            )
            return "server_error"
        return "success"

    async def remove_key(self, conn: Connection, recipient: bytes) -> str:
        owner, member = b64url(conn.key), b64url(recipient)
        await self.service.call(
            conn.key,
            RECORD_CHANNEL,
            lambda r: r.store.record_list(
                r.keys.slot, "r:" + owner, False, MAX_KEYS_PER_CONNECTION, (member,)
            ),
        )
        released = await self.service.call(
            recipient,
            RECORD_CHANNEL,
            lambda r: r.store.record_claim(r.keys.slot, "k:" + member, owner, False),
        )
        return "success" if released else "client_error"

    async def lease(self, recipient: bytes) -> Lease | None:
        field = "d:" + b64url(recipient)
        (raw,) = await self.service.call(
            recipient, RECORD_CHANNEL, lambda r: r.store.record_get(r.keys.slot, (field,))
        )
        return Lease.parse(raw)

    async def set_lease(self, recipient: bytes, lease: Lease | None) -> None:
        """Replace the queue's lease (last writer wins: a race costs a duplicate delivery)."""
        field = "d:" + b64url(recipient)
        pairs = ((field, f"{lease.cursor} {lease.expiry_ms} {lease.held}"),) if lease is not None else ()
        deletes = () if lease is not None else (field,)
        await self.service.call(
            recipient, RECORD_CHANNEL, lambda r: r.store.record_set(r.keys.slot, pairs, deletes)
        )
