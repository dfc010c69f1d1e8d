"""The mediator's state in Redis: connections, the keys each registered, who owns a key.

Each record lives in the slot of the key it is about (the slot a queue of that key with
the default channel has), in that slot's one DIDComm hash (storage/keys.slot_didcomm),
so any relay finds it, migration moves it with the slot, and a forward's ownership check
runs on the shard that then queues the message:

- ``c:<agent key>``   the connection whose agent sends from that key (JSON)
- ``r:<agent key>``   the recipient keys that connection registered (space-separated)
- ``k:<recipient>``   the agent key of the connection that registered it
- ``d:<recipient>``   the delivery lease of that key's queue (see Lease)
- ``n:<agent key>``   DIDComm v2: the recipient DIDs that connection registered (space-separated;
  a v2 peer's "key" is the hash of its DID, relay/didcomm/mediator2.did_key, and its queue that
  hash's), so keylist-query can name them
- ``p:<agent key>``   the push devices that connection set (RFC 0734/0699; JSON, see Device)
- ``w:<agent key>``   when its devices were last notified (ms; the fleet-wide push window)
A key's queue itself is (recipient, QUEUE_CHANNEL), in the mediator's own key space.
Keys appear as unpadded base64url of the 32 raw bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, replace

from relay import metrics
from relay.didcomm.keys import DidError, b64decode_any, b64url
from relay.service import QueueService
from relay.storage.keys import MEDIATOR_CHANNEL

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
    seen_ms: int = 0  # last activity written (0: a record from before idle expiry)

    def to_json(self) -> str:
        return json.dumps(
            {
                "did": self.did,
                "label": self.label,
                "mediation": self.mediation,
                "created": self.created_ms,
                "seen": self.seen_ms,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, key: bytes, raw: bytes) -> Connection:
        doc = json.loads(raw)
        return cls(
            key,
            str(doc["did"]),
            str(doc.get("label", "")),
            bool(doc["mediation"]),
            int(doc["created"]),
            int(doc.get("seen", 0)),
        )


@dataclass(frozen=True)
class Lease:
    """Messages of a queue handed out by a delivery and not yet acknowledged: every seq up to
    `cursor` still in the queue, not offered again until `expiry_ms`. Agents poll
    (status-request → delivery-request) faster than their acks arrive; without this each
    message went out many times. After the expiry everything unacknowledged goes out again (an
    agent that died before acking gets its messages back). What waits is what is above the
    cursor, counted in the queue itself (lua/status.lua), never a count kept here: a count
    beside the queue drifted when an ack and a delivery met (status said 0 with messages
    waiting, until the lease ran out). `raw` is the record as read, what a swap compares."""

    cursor: int
    expiry_ms: int
    raw: str = ""

    def active(self, now_ms: int) -> bool:
        return self.expiry_ms > now_ms

    def dump(self) -> str:
        # a third field, 0: relays before the count moved into the queue read 'cursor expiry held'
        return f"{self.cursor} {self.expiry_ms} 0"

    @classmethod
    def parse(cls, raw: bytes | None) -> Lease | None:
        """The lease in a record (None: none; an unreadable one as run out), `raw` kept for
        `Records.swap_lease`."""
        if not raw:
            return None
        fields = raw.split()
        if len(fields) < 2 or not all(f.isdigit() for f in fields[:2]):
            return cls(0, 0, raw.decode(errors="replace"))
        return cls(int(fields[0]), int(fields[1]), raw.decode())


PUSH_SERVICES = ("fcm", "apns")  # push-notifications-fcm/1.0, push-notifications-apns/1.0


@dataclass(frozen=True)
class Device:
    """Where a connection wants its push notifications: one per service at most (a set
    replaces the last), so a connection holds at most len(PUSH_SERVICES) devices."""

    service: str  # one of PUSH_SERVICES
    token: str
    platform: str | None = None  # fcm's device_platform; apns has none

    @staticmethod
    def parse_all(raw: bytes | None) -> dict[str, Device]:
        try:
            doc = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        out: dict[str, Device] = {}
        for service in PUSH_SERVICES:
            entry = doc.get(service) if isinstance(doc, dict) else None
            if isinstance(entry, dict) and isinstance(entry.get("t"), str):
                platform = entry.get("p")
                out[service] = Device(service, entry["t"], platform if isinstance(platform, str) else None)
        return out

    @staticmethod
    def dump_all(devices: dict[str, Device]) -> str:
        doc = {
            d.service: ({"t": d.token, "p": d.platform} if d.platform is not None else {"t": d.token})
            for d in devices.values()
        }
        return json.dumps(doc, separators=(",", ":"))


def now_ms() -> int:
    return int(time.time() * 1000)


class Records:
    """The records, with the limits of docs/protocols.md ("Limits"): at most `max_keys` keys a
    connection (0: no cap), and every connection and registration expires after `idle_ms`
    without its connection's activity (dc_*.lua's idle expiry; refreshed by `touch`)."""

    def __init__(self, service: QueueService, max_keys: int = 100, idle_ms: int = 30 * 86_400_000) -> None:
        self.service = service
        self.max_keys = max_keys
        self.idle_ms = max(1, idle_ms)
        # a connection's activity is written at most this often (a record per message would
        # double the mediator's writes); expiry is that much early at worst
        self.touch_ms = max(1, min(self.idle_ms // 10, 3_600_000))

    async def _get(self, key: bytes, field: str) -> bytes | None:
        now, idle = now_ms(), self.idle_ms
        (raw,) = await self.service.call(
            key, RECORD_CHANNEL, lambda r: r.store.record_get(r.keys.slot, (field,), now, idle)
        )
        return raw

    async def _set(self, key: bytes, pairs: tuple[tuple[str, str], ...], deletes: tuple[str, ...]) -> None:
        now, idle = now_ms(), self.idle_ms
        swept = await self.service.call(
            key, RECORD_CHANNEL, lambda r: r.store.record_set(r.keys.slot, pairs, deletes, now, idle)
        )
        if swept:
            metrics.DIDCOMM_RECORDS_EXPIRED.inc(swept)

    async def _claim(self, recipient: bytes, owner: str, add: bool, proven: bool = False) -> tuple[bool, str]:
        field, now, idle = "k:" + b64url(recipient), now_ms(), self.idle_ms
        return await self.service.call(
            recipient,
            RECORD_CHANNEL,
            lambda r: r.store.record_claim(r.keys.slot, field, owner, add, now, idle, proven),
        )

    async def _list(self, conn_key: bytes, add: bool, members: tuple[str, ...]) -> bool:
        field, cap = "r:" + b64url(conn_key), self.max_keys or (1 << 30)
        return await self.service.call(
            conn_key, RECORD_CHANNEL, lambda r: r.store.record_list(r.keys.slot, field, add, cap, members)
        )

    async def connection(self, key: bytes) -> Connection | None:
        """The live connection of this agent key (None once it expired)."""
        raw = await self._get(key, "c:" + b64url(key))
        return Connection.from_json(key, raw) if raw else None

    async def save(self, conn: Connection, fresh: bool = False) -> Connection:
        """Write the connection (its idle expiry starts afresh); `fresh`: a new connection,
        which starts with an empty keylist (not an expired one's)."""
        saved = replace(conn, seen_ms=now_ms())
        deletes = tuple(f + b64url(conn.key) for f in ("r:", "n:", "p:", "w:")) if fresh else ()
        await self._set(conn.key, (("c:" + b64url(conn.key), saved.to_json()),), deletes)
        return saved

    async def touch(self, conn: Connection) -> None:
        """The connection was active: push its expiry and its registrations' back, at most
        every `touch_ms`."""
        if now_ms() - conn.seen_ms < self.touch_ms:
            return
        await self.save(conn)
        owner = b64url(conn.key)
        keys = await self.keys(conn)
        results = await asyncio.gather(*(self._claim(k, owner, True) for k in keys))
        lost = tuple(b64url(k) for k, (ok, _) in zip(keys, results, strict=True) if not ok)
        if lost:  # taken over since (a proven owner): off this keylist
            await self._list(conn.key, False, lost)

    @staticmethod
    def new(key: bytes, did: str, label: str) -> Connection:
        return Connection(key, did, label, False, now_ms())

    async def keys(self, conn: Connection) -> list[bytes]:
        """The recipient keys the connection registered (its Pickup queues)."""
        raw = await self._get(conn.key, "r:" + b64url(conn.key))
        return [b64decode_any(m) for m in raw.decode().split()] if raw else []

    async def names(self, conn: Connection) -> list[str]:
        """The recipient DIDs a DIDComm v2 connection registered, in order."""
        raw = await self._get(conn.key, "n:" + b64url(conn.key))
        return raw.decode().split() if raw else []

    async def name(self, conn: Connection, did: str, add: bool) -> None:
        """Add or remove a recipient DID of the connection's 'n:' list (its hash's registration
        is `add_key`'s / `remove_key`'s)."""
        field, cap = "n:" + b64url(conn.key), self.max_keys or (1 << 30)
        await self.service.call(
            conn.key, RECORD_CHANNEL, lambda r: r.store.record_list(r.keys.slot, field, add, cap, (did,))
        )

    async def owner(self, recipient: bytes) -> bytes | None:
        """The connection a live registration of `recipient` belongs to."""
        raw = await self._get(recipient, "k:" + b64url(recipient))
        return b64decode_any(raw.decode()) if raw else None

    async def add_key(self, conn: Connection, recipient: bytes) -> str:
        """keylist-update 'add': 'success'; 'client_error' while another connection's
        registration of the key is alive (unless the key is this connection's own authcrypt
        key: a proven registration takes it over); 'server_error' when this connection holds
        `max_keys` already (counted as a quota refusal)."""
        owner, member = b64url(conn.key), b64url(recipient)
        if not await self._list(conn.key, True, (member,)):
            metrics.quota_refused("/v1/didcomm", "didcomm_keys")
            return "server_error"
        claimed, previous = await self._claim(recipient, owner, True, proven=recipient == conn.key)
        if not claimed:
            await self._list(conn.key, False, (member,))
            return "client_error"
        if previous:  # an expired or unproven holder's keylist no longer names it
            with contextlib.suppress(DidError):
                await self._list(b64decode_any(previous), False, (member,))
        return "success"

    async def remove_key(self, conn: Connection, recipient: bytes) -> str:
        owner, member = b64url(conn.key), b64url(recipient)
        await self._list(conn.key, False, (member,))
        released, _ = await self._claim(recipient, owner, False)
        return "success" if released else "client_error"

    async def lease(self, recipient: bytes) -> Lease | None:
        return Lease.parse(await self._get(recipient, "d:" + b64url(recipient)))

    async def swap_lease(self, recipient: bytes, seen: Lease | None, lease: Lease) -> bool:
        """Replace the queue's lease with `lease` only if it is still `seen` (None: none): of two
        deliveries that read one lease (two relays, or two requests on one), one takes the
        messages past it and the other finds the new lease (dc_swap.lua). False: it changed."""
        field, now, idle = "d:" + b64url(recipient), now_ms(), self.idle_ms
        expected, new = seen.raw if seen is not None else "", lease.dump()
        return await self.service.call(
            recipient,
            RECORD_CHANNEL,
            lambda r: r.store.record_swap(r.keys.slot, field, expected, new, now, idle),
        )

    async def devices(self, conn_key: bytes) -> dict[str, Device]:
        """The push devices the connection set, by service (none once it expired)."""
        return Device.parse_all(await self._get(conn_key, "p:" + b64url(conn_key)))

    async def set_device(self, conn_key: bytes, service: str, device: Device | None) -> None:
        """Set (or with None remove) the connection's device of `service`. Read, then write:
        two sets racing on one connection keep the last (a client sets them one at a time)."""
        field = "p:" + b64url(conn_key)
        devices = Device.parse_all(await self._get(conn_key, field))
        if device is None:
            devices.pop(service, None)
        else:
            devices[service] = device
        pairs = ((field, Device.dump_all(devices)),) if devices else ()
        await self._set(conn_key, pairs, () if devices else (field,))

    async def drop_device(self, conn_key: bytes, device: Device) -> bool:
        """Remove `device` if the connection still has it (a provider said the token is dead;
        a newer token set meanwhile stays). True when it was removed."""
        if (await self.devices(conn_key)).get(device.service) != device:
            return False
        await self.set_device(conn_key, device.service, None)
        return True

    async def push_window(self, conn_key: bytes, interval_ms: int) -> bool:
        """Take the connection's push window: True (and stamped now) when its devices were last
        notified `interval_ms` ago or more, fleet-wide."""
        field, now = "w:" + b64url(conn_key), now_ms()
        return await self.service.call(
            conn_key, RECORD_CHANNEL, lambda r: r.store.record_stamp(r.keys.slot, field, now, interval_ms)
        )
