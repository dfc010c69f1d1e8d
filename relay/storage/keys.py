"""Every Redis key and channel name relayfleet uses is built here, and only here.

All keys of one slot share the hash tag ``{rf<slot>}``: a queue's keys, the slot's
queue index, its state (fence) and its statistics. So one Lua script never
crosses a hash tag for its declared keys, and migration moves a slot by moving one
tag's keys. Two shard-wide keys have no tag and the scripts read them undeclared:
``SHARD_BOOT`` and ``SHARD_SEQ_FLOOR`` (they describe the Redis process, not a slot).
That is sound on a shard that is one standalone Redis (with replicas), as every shard
is; a shard that were itself a Redis Cluster would need one such mark per hash tag
(declaring them would not help: a key outside the tag is CROSSSLOT either way). See
lua/_prelude.lua.
"""

from __future__ import annotations

import base64
import functools

from relay.fleet.sharding import slot_of

PREFIX = "rf"
# The Redis run the relays last saw ("<run_id>:<ms>"); the scripts read it by this literal name.
SHARD_BOOT = f"{PREFIX}:boot"
# Where new queues' seqs start after a restore from a backup (see relay/backup/restoring.py); the
# scripts read it by this literal name.
SHARD_SEQ_FLOOR = f"{PREFIX}:seq-floor"
# Which relay process reads this shard's slot statistics for the metrics (a lease, so a
# fleet of N relays sweeps each shard once, not N times).
SHARD_STATS_LEASE = f"{PREFIX}:stats-lease"
# Which relay process sweeps this shard's expired DIDComm records this round
# (relay/didcomm/sweep.py; a lease shorter than a round, so a fleet sweeps each shard once a
# round, not once per relay, and a holder that died is replaced the next round).
SHARD_DIDCOMM_SWEEP_LEASE = f"{PREFIX}:didcomm-sweep-lease"
# Pub/sub channel on a migration's source shard: "the shard map moved slots off this shard,
# reload it". Every relay's wakeup subscriber listens, so long-polls on queues that have no
# Redis state yet (never written: not in any slot index, so no per-queue wakeup reaches
# them) follow their slot to the new shard at once instead of at the next map poll.
SHARD_MAP_MOVED = f"{PREFIX}:map-moved"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64decode(text: str) -> bytes:
    """The bytes of a `b64` name part."""
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# A slot's hash tag, %-formatted with the slot's number (the enqueue hot path formats its
# slot's keys from it in one go, storage/store.py).
SLOT_TAG = PREFIX + ":{rf%d}"


def slot_tag(slot: int) -> str:
    return SLOT_TAG % slot


def slot_state(slot: int) -> str:
    """String: absent = owned; 'migrating', 'importing' or 'moved <shard> <epoch>'."""
    return f"{slot_tag(slot)}:state"


def slot_index(slot: int) -> str:
    """Set of queue ids that have keys in this slot."""
    return f"{slot_tag(slot)}:queues"


def slot_stats(slot: int) -> str:
    """Hash: msgs, bytes, w<minute start ms> (enqueues in that minute; this one and the last
    are kept) and wlast (the newest such minute),
    qgen (bumped whenever trim.lua deletes a queue; seeds a new queue's epoch)."""
    return f"{slot_tag(slot)}:stats"


def slot_nonces(slot: int) -> str:
    """Sorted set of used auth nonces (member 'key.nonce', score = expiry ms)."""
    return f"{slot_tag(slot)}:nonces"


def slot_key_pattern(slot: int) -> str:
    """Glob matching every key of the slot (used only to verify migrations)."""
    return f"{PREFIX}:{{rf{slot}}}:*"


# A queue's own keys are "<QueueKeys.base>:<suffix>" (the enqueue hot path encodes them from
# the base and these, storage/store.py); its wakeup channel is "<base>:<WAKE_SUFFIX>".
QUEUE_SUFFIXES = ("meta", "msgs", "idem", "idemx", "rate")
# enqueue.lua copies a stream that has just got its first entry to "<msgs>:compact" and renames
# the copy back, within one call (a copy's listpack is its entry's size, not Redis 7.0's 4 KiB
# preallocation: docs/memory.md); the script builds the name by this literal suffix, and no key
# of that name outlives the call.
COMPACT_SUFFIX = "compact"
WAKE_SUFFIX = "wake"
_WAKE = ":" + WAKE_SUFFIX


def slot_queue_prefix(slot: int) -> str:
    """What every queue key of the slot starts with: a queue's own keys are this, its qid, ':'
    and one of QUEUE_SUFFIXES (lua/trim_slot.lua builds them so, for the queues it reads from
    the slot index)."""
    return f"{slot_tag(slot)}:q:"


class QueueKeys:
    """One queue's key names. Only the common prefix is stored and each name is built on
    access: tens of thousands of idle long-polls each pin one (through the cache below), and
    eleven stored strings made that ~1 KiB a queue. The enqueue hot path encodes the names
    once per queue itself (storage/store.py)."""

    __slots__ = ("_base", "qid", "slot")

    def __init__(self, slot: int, qid: str) -> None:
        self.slot = slot
        self.qid = qid
        self._base = slot_queue_prefix(slot) + qid

    def __repr__(self) -> str:
        return f"QueueKeys(slot={self.slot}, qid={self.qid!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QueueKeys) and (self.slot, self.qid) == (other.slot, other.qid)

    def __hash__(self) -> int:
        return hash((self.slot, self.qid))

    @property
    def base(self) -> str:
        """The prefix of the queue's own names: "<base>:<suffix>", QUEUE_SUFFIXES and WAKE_SUFFIX."""
        return self._base

    @property
    def meta(self) -> str:
        """Hash: seq (last seq handed out), epoch, bytes (payload bytes held), created (ms; only
        in metas written before docs/memory.md's change: no longer written),
        r (the Redis run id that last wrote the queue: the lost-tail check, lua/_prelude.lua),
        tseen ("<seq>:<ms>": the enqueue of <seq> was at or before <ms>; trim.lua's idle check),
        w ("<ms>:<seq>:<attempt token>": the rate window while it holds one enqueue, in place of
        the `rate` key; lua/_prelude.lua inline_rate, docs/memory.md)."""
        return self._base + ":meta"

    @property
    def msgs(self) -> str:
        """Stream: id = "<seq>-0", fields p (payload), t (received ms), m (messageId), n (size)."""
        return self._base + ":msgs"

    @property
    def idem(self) -> str:
        """Hash: idempotency key -> "<seq>:<digest>"."""
        return self._base + ":idem"

    @property
    def idemx(self) -> str:
        """Sorted set: idempotency key -> expiry ms."""
        return self._base + ":idemx"

    @property
    def rate(self) -> str:
        """Sorted set: "<seq>:<attempt token>" -> enqueue time ms (sliding rate window: the
        limit-th newest decides, older entries are trimmed lazily; the token finds a resent
        attempt's outcome, lua/enqueue.lua). Only while the window holds two enqueues or more
        (a window of one is the meta's field 'w'); it expires one window after its newest."""
        return self._base + ":rate"

    @property
    def wake(self) -> str:
        """Pub/sub channel announcing new messages of this queue."""
        return self._base + _WAKE

    @property
    def state(self) -> str:
        return slot_state(self.slot)

    @property
    def index(self) -> str:
        return slot_index(self.slot)

    @property
    def stats(self) -> str:
        return slot_stats(self.slot)

    def all_keys(self) -> tuple[str, ...]:
        return tuple(self._base + ":" + suffix for suffix in QUEUE_SUFFIXES)


# Every queue's metadata hash as a SCAN MATCH pattern, and its (slot, qid) back from a name: the
# retention benchmark's floor walks the keyspace with them instead of the slot indexes
# (tools/relayfleet_testing/bench/scale/retention.py).
QUEUE_META_GLOB = PREFIX + ":{rf*}:q:*:meta"
_SLOT_HEAD = PREFIX + ":{rf"


def queue_of_meta_key(name: str) -> tuple[int, str] | None:
    """(slot, qid) of a queue's metadata key name; None for any other name."""
    if not (name.startswith(_SLOT_HEAD) and name.endswith(":meta")):
        return None
    slot_text, sep, rest = name[len(_SLOT_HEAD) : -len(":meta")].partition("}:q:")
    if not sep or not slot_text.isdigit() or not rest or ":" in rest:
        return None
    return int(slot_text), rest


# Hot queues are looked up on every request; the names never change, so cache them.
@functools.lru_cache(maxsize=8192)
def queue_id(recipient: bytes, channel: bytes) -> str:
    return f"{b64(recipient)}.{b64(channel)}"


@functools.lru_cache(maxsize=8192)
def queue_keys_for_id(slot: int, qid: str) -> QueueKeys:
    return QueueKeys(slot, qid)


def queue_keys(recipient: bytes, channel: bytes) -> QueueKeys:
    return queue_keys_for_id(slot_of(recipient, channel), queue_id(recipient, channel))


# The channel of every queue the DIDComm mediator keeps (forwards, Pickup over a connection,
# its status and live delivery): the mediator's own key space. It is longer than any channel
# the HTTP API accepts (relay/api/params.MAX_CHANNEL_BYTES, 64), so no signed or anonymous
# HTTP request can name one of these queues, and no keylist-update can name a queue of the
# HTTP API: a registered key reaches only what was forwarded to it (docs/design-decisions.md,
# "The mediator's own key space"). Queue ids stay "<recipient>.<channel>" like any other, so
# slot migration, retention, trim and the indexes treat these queues as they treat the rest.
MEDIATOR_CHANNEL = b"relayfleet didcomm mediator: queues of mediated keys, beyond the HTTP API"


def slot_didcomm(slot: int) -> str:
    """Hash: the DIDComm mediator's records in this slot (relay/didcomm/records.py): 'c:<key>'
    connection, 'r:<key>' keys the connection registered, 'k:<key>' the connection owning a
    registered key. A slot-level key, so migration moves it with the slot's queues."""
    return f"{slot_tag(slot)}:didcomm"


def slot_recipients(slot: int) -> str:
    """Hash: the per-recipient quota records of the recipients whose default channel lives in
    this slot (their "home"; docs/design-decisions.md, "Per-recipient quotas"). Fields, each
    prefixed "<b64 recipient>|": 'c' its registered non-default channels (b64url, space-separated),
    'n' / 'b' messages / payload bytes admitted to them and not yet refunded, 'g' admits so far,
    't' the last admit (ms), 'w' the rate ring ("<first bucket> <count> ..."). A slot-level key,
    so migration moves it with the slot; the enqueue script reads it for default-channel items."""
    return f"{slot_tag(slot)}:rcpt"


def recipient_field(recipient: bytes) -> str:
    """The prefix of a recipient's fields in slot_recipients ("<b64 recipient>|")."""
    return b64(recipient) + "|"


def slot_presence(slot: int) -> str:
    """Hash: the fleet-wide presence leases of this slot's queues (relay/presence.py,
    lua/presence.lua): 'l|<qid>' a live socket's lease "<expiry ms> <token>", 'p|<qid>' a
    waiting long-poll's "<expiry ms>". Present only while a lease is: every write sets the
    key's expiry to its latest lease's, so it leaves Redis by itself when the last holder
    stops refreshing. A slot-level key, so migration copies it with the slot."""
    return f"{slot_tag(slot)}:live"


def slot_didcomm_idle(slot: int) -> str:
    """Sorted set: when each DIDComm record of slot_didcomm(slot) expires if left idle (member
    'c:<key>' a connection, 'k:<key>' a registration; score = expiry ms). The dc_*.lua scripts
    read it (an expired record reads as absent) and sweep it on writes; migration moves it."""
    return f"{slot_tag(slot)}:didcomm-idle"
