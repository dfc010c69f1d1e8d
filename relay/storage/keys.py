"""Every Redis key and channel name relayfleet uses is built here, and only here.

All keys of one slot share the hash tag ``{rf<slot>}``: a queue's keys, the slot's
queue index, its state (fence) and its statistics. So one Lua script never
crosses a hash tag, migration moves a slot by moving one tag's keys, and a shard
could itself be a Redis Cluster without changing a script.
"""

from __future__ import annotations

import base64
import functools
from dataclasses import dataclass

from relay.fleet.sharding import slot_of

PREFIX = "rf"
# The Redis run the relays last saw ("<run_id>:<ms>"); the scripts read it by this literal name.
SHARD_BOOT = f"{PREFIX}:boot"
# Which relay process reads this shard's slot statistics for the metrics (a lease, so a
# fleet of N relays sweeps each shard once, not N times).
SHARD_STATS_LEASE = f"{PREFIX}:stats-lease"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def slot_tag(slot: int) -> str:
    return f"{PREFIX}:{{rf{slot}}}"


def slot_state(slot: int) -> str:
    """String: absent = owned; 'migrating', 'importing' or 'moved <shard> <epoch>'."""
    return f"{slot_tag(slot)}:state"


def slot_index(slot: int) -> str:
    """Set of queue ids that have keys in this slot."""
    return f"{slot_tag(slot)}:queues"


def slot_stats(slot: int) -> str:
    """Hash: msgs, bytes, enq (total), wstart/wcur/wprev (enqueues per minute window)."""
    return f"{slot_tag(slot)}:stats"


def slot_nonces(slot: int) -> str:
    """Sorted set of used auth nonces (member 'key.nonce', score = expiry ms)."""
    return f"{slot_tag(slot)}:nonces"


def slot_key_pattern(slot: int) -> str:
    """Glob matching every key of the slot (used only to verify migrations)."""
    return f"{PREFIX}:{{rf{slot}}}:*"


QUEUE_SUFFIXES = ("meta", "msgs", "idem", "idemx", "rate")


@dataclass(frozen=True, slots=True)
class QueueKeys:
    slot: int
    qid: str
    meta: str  # hash: seq, epoch, bytes, created
    msgs: str  # stream: id = "<seq>-0", fields p (payload), t (received ms), m (messageId)
    idem: str  # hash: idempotency key -> "<seq>:<digest>"
    idemx: str  # sorted set: idempotency key -> expiry ms
    rate: str  # sorted set: seq -> enqueue time ms (sliding window)
    wake: str  # pub/sub channel announcing new messages of this queue
    state: str
    index: str
    stats: str

    def all_keys(self) -> tuple[str, ...]:
        return (self.meta, self.msgs, self.idem, self.idemx, self.rate)


# Hot queues are looked up on every request; the names never change, so cache them.
@functools.lru_cache(maxsize=8192)
def queue_id(recipient: bytes, channel: bytes) -> str:
    return f"{b64(recipient)}.{b64(channel)}"


@functools.lru_cache(maxsize=8192)
def queue_keys_for_id(slot: int, qid: str) -> QueueKeys:
    base = f"{slot_tag(slot)}:q:{qid}"
    return QueueKeys(
        slot=slot,
        qid=qid,
        meta=f"{base}:meta",
        msgs=f"{base}:msgs",
        idem=f"{base}:idem",
        idemx=f"{base}:idemx",
        rate=f"{base}:rate",
        wake=f"{base}:wake",
        state=slot_state(slot),
        index=slot_index(slot),
        stats=slot_stats(slot),
    )


def queue_keys(recipient: bytes, channel: bytes) -> QueueKeys:
    return queue_keys_for_id(slot_of(recipient, channel), queue_id(recipient, channel))
