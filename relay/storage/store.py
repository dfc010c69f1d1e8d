"""One shard's queues: every data command relayfleet sends to Redis goes through here."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis.asyncio as aioredis

from relay.bounded import Bounded
from relay.fleet.sharding import is_sentinel_url, min_replicas_of
from relay.storage import keys as K
from relay.storage import scripts
from relay.storage import sentinel as S
from relay.storage.limits import QueueLimits
from relay.storage.maintenance import TOTALS, SweepMismatch, sweep_args, sweep_refused, sweep_totals
from relay.storage.message import Message
from relay.storage.pipeline import (
    ReplicationTimeout,
    ReplySink,
    ScriptBatcher,
    StoreFailover,
    StoreOutcomeUnknown,
    StoreRejected,
    StoreUnavailable,
    Wire,
    bulk,
    bulk_str,
    encode,
    is_auth_failure,
)

_PING = encode("PING")
_INFO_MEMORY = encode("INFO", "memory")

__all__ = [
    "EnqueueOutcome",
    "EnqueueRequest",
    "Message",
    "QueueLimits",
    "ReadResult",
    "ReplicationTimeout",
    "ShardStore",
    "SlotMigrating",
    "SlotMoved",
    "StatusResult",
    "StoreFailover",
    "StoreOutcomeUnknown",
    "StoreRejected",
    "StoreUnavailable",
    "enqueue_outcome",
    "new_tuple",
]


class SlotMoved(Exception):
    def __init__(self, shard: str, epoch: int) -> None:
        super().__init__(f"slot moved to {shard} (map epoch {epoch})")
        self.shard = shard
        self.epoch = epoch


class SlotMigrating(Exception):
    """The slot is fenced for a migration; retry shortly."""


class EnqueueRequest(NamedTuple):
    """One message a sender asks the relay to store (docs/api.md), the same object from the
    handler through QueueService to its enqueue.lua item, and kept for a retry or resend.
    A NamedTuple, immutable like a frozen dataclass at little more than a tuple's cost: one
    is built per enqueue, and a frozen dataclass's constructor measured ~0.5 µs more."""

    recipient: bytes
    channel: bytes
    payload: bytes
    idempotency_key: str = ""
    message_id: str = ""
    any_payload_is_duplicate: bool = False  # a repeated key is a duplicate whatever its payload
    now_ms: int = 0  # the time to store it with (a caller that answers with it); 0: when sent

    def digest(self) -> str:
        """What enqueue.lua compares when the idempotency key repeats ("*": any payload)."""
        if self.any_payload_is_duplicate:
            return "*"
        return hashlib.sha256(self.payload).hexdigest() if self.idempotency_key else ""


# Builds a NamedTuple on a hot path without its own __new__, a Python frame (~2 µs of the
# wake's cold path): new_tuple(Cls, (field, ...)), every field given, in order.
new_tuple = tuple.__new__


class EnqueueOutcome(NamedTuple):  # a tuple: built on every enqueue, cheaper than a frozen dataclass
    kind: str  # stored | duplicate | conflict | rate_limited | full
    seq: int = 0
    retry_after_ms: int = 0
    subscribers: int = 0
    reason: str = ""
    epoch: bytes = b""  # of a stored message (b"" for a resend that found its lost attempt)


@dataclass(slots=True)  # not frozen, as Message (relay/storage/message.py): built per read
class ReadResult:
    messages: list[Message]
    epoch: str
    last_seq: int
    more: bool = False


@dataclass(frozen=True, slots=True)
class StatusResult:
    count: int
    bytes: int
    epoch: str
    last_seq: int
    oldest_ms: int | None
    newest_ms: int | None
    above: int = 0  # messages with a seq above the one `status` was given (else `count`)


_ENQUEUE_KEYS = 9  # per item (lua/enqueue.lua)
_ENQUEUE_HEAD = bulk_str("EVALSHA") + bulk_str(scripts.ENQUEUE.sha)
_ENQUEUE_FIXED_ARGS = 9
_ENQUEUE_ITEM_ARGS = 9
# a call of one item, up to its keys
_LONE_HEAD = b"*%d\r\n%b%b" % (
    3 + _ENQUEUE_KEYS + _ENQUEUE_ITEM_ARGS + _ENQUEUE_FIXED_ARGS,
    _ENQUEUE_HEAD,
    bulk(_ENQUEUE_KEYS),
)
# One enqueue.lua call carries at most this many enqueues and (past its first) payload
# bytes: Redis runs a call without a break, so a call stays short for the other clients.
_CALL_ITEMS = 64
_CALL_BYTES = 1 << 20
# queues whose encoded enqueue parts are kept (~500 B each; the oldest goes when full)
_ENQUEUE_PARTS_MAX = 65536
# The enqueue item's keys as RESP bulk strings (lua/enqueue.lua's order: the slot's state,
# the queue's own five from its base (keys.QueueKeys.base), the slot's index, statistics and
# recipient records),
# then its qid and wake channel: one format each, from the slot's number and the queue's base.
# The first enqueue of a queue (in every wake of a fresh queue) runs from cold caches: eight
# names built and encoded one by one cost ~40 µs there, the slot's three through a per-slot
# cache ~8 more when it missed.
_SLOT_SUFFIXES = [
    name(0).removeprefix(K.slot_tag(0)).encode()
    for name in (K.slot_state, K.slot_index, K.slot_stats, K.slot_recipients)
]
# each slot name's length past the slot's digits
_SLOT_KEY_EXTRA = tuple(len(K.slot_tag(0)) - 1 + len(suffix) for suffix in _SLOT_SUFFIXES)
_QUEUE_KEY_EXTRA = tuple(1 + len(s) for s in K.QUEUE_SUFFIXES)  # each name's length past the base
_SLOT_KEY = [b"$%%d\r\n%b%b\r\n" % (K.SLOT_TAG.encode(), suffix) for suffix in _SLOT_SUFFIXES]
_ITEM_KEYS = b"".join(
    [_SLOT_KEY[0], *[b"$%%d\r\n%%b:%b\r\n" % s.encode() for s in K.QUEUE_SUFFIXES], *_SLOT_KEY[1:]]
)
_QID_WAKE = b"$%%d\r\n%%b\r\n$%%d\r\n%%b:%b\r\n" % K.WAKE_SUFFIX.encode()
_WAKE_EXTRA = 1 + len(K.WAKE_SUFFIX)
_EMPTY_BULK = b"$0\r\n\r\n"
_NO_KEY = _EMPTY_BULK * 2  # no idempotency key, so no digest
# A payload this large is written as it came, not copied into its item, the call and the
# batch (three copies of each 64 KiB payload showed in the relay's CPU per message).
_SPLIT_PAYLOAD = 16 * 1024
_RESEND = b"$1\r\n1\r\n"

_EPOCH_PREFIX = os.urandom(5).hex()
_EPOCH_PREFIX_BYTES = _EPOCH_PREFIX.encode()
_epoch_counter = itertools.count()


def _epoch_bulk() -> bytes:
    """A RESP bulk string (16 hex digits) no other call anywhere returns: random per process,
    then a counter (urandom per call was measurable); re-seeded in forked children (see
    below). Each enqueue attempt's token, kept as the epoch when a queue's meta was lost."""
    n = next(_epoch_counter)
    if n > 0xFFFFFF:  # same 16 hex digits as before; never reuse a value
        _reseed_epochs()  # (before the prefix is read: it draws a new one)
        n = next(_epoch_counter)
    return b"$16\r\n%b%06x\r\n" % (_EPOCH_PREFIX_BYTES, n)


def _reseed_epochs() -> None:
    global _EPOCH_PREFIX, _EPOCH_PREFIX_BYTES, _epoch_counter
    _EPOCH_PREFIX = os.urandom(5).hex()
    _EPOCH_PREFIX_BYTES = _EPOCH_PREFIX.encode()
    _epoch_counter = itertools.count()


os.register_at_fork(after_in_child=_reseed_epochs)


def _sink_of(sink: ReplySink | None, make: Callable[[bytes], ReplySink] | None, token: bytes) -> ReplySink:
    if make is not None:
        return make(token)
    assert sink is not None
    return sink


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check(reply: Any) -> list[Any]:
    """Raise for fence replies; return the reply list otherwise."""
    tag = reply[0]
    if tag == b"moved":
        raise SlotMoved(_s(reply[1]), int(reply[2]))
    if tag == b"migrating":
        raise SlotMigrating()
    return list(reply)


def _messages(entries: list[Any]) -> list[Message]:
    out = []
    for entry_id, fields in entries:
        # enqueue.lua writes the fields as p, t, m, n in this order; fall back otherwise
        if len(fields) >= 6 and fields[0] == b"p" and fields[2] == b"t" and fields[4] == b"m":
            payload, received, mid = fields[1], fields[3], fields[5]
        else:
            f = dict(zip(fields[::2], fields[1::2], strict=True))
            payload, received, mid = f[b"p"], f[b"t"], f.get(b"m", b"")
        out.append(
            Message(
                seq=int(entry_id[: entry_id.index(b"-")]),
                payload=payload,
                received_ms=int(received),
                message_id=mid.decode() if mid else None,
            )
        )
    return out


def enqueue_outcome(raw: Any) -> EnqueueOutcome:
    """What enqueue.lua answered; SlotMoved / SlotMigrating for a fenced slot."""
    if raw[0] == b"ok":  # nearly every reply: Lua's numbers arrive as RESP integers
        return new_tuple(EnqueueOutcome, ("stored", raw[1], 0, raw[2], "", raw[3] if len(raw) > 3 else b""))
    reply = _check(raw)
    tag = reply[0]
    if tag == b"dup":
        return EnqueueOutcome("duplicate", seq=int(reply[1]))
    if tag == b"conflict":
        return EnqueueOutcome("conflict", seq=int(reply[1]))
    if tag == b"rate":
        return EnqueueOutcome("rate_limited", retry_after_ms=int(reply[1]))
    if tag == b"rrate":  # the recipient's rate across its channels
        return EnqueueOutcome("rate_limited", retry_after_ms=int(reply[1]), reason="recipient")
    return EnqueueOutcome("full", reason=_s(reply[1]))


class _EnqueueCall:
    """Every enqueue sent to this shard in one loop tick (or while the pipeline is full),
    as one enqueue.lua call: Redis's per-call cost (EVALSHA, the script's set-up, reading
    the boot mark, each slot's fence and statistics) is paid once for all of them. It is
    the call's ReplySink and hands each item its own reply; a failure goes to every item."""

    __slots__ = ("args", "fixed", "keys", "nbytes", "sealed", "sinks", "split")

    def __init__(self, fixed: bytes) -> None:
        self.fixed = fixed
        self.keys: list[bytes] = []
        self.args: list[bytes] = []
        self.sinks: list[ReplySink] = []
        self.nbytes = 0
        self.sealed = False
        self.split = False  # holds a payload kept as its own part (_SPLIT_PAYLOAD)

    def takes(self, size: int) -> bool:
        n = len(self.sinks)
        return not self.sealed and n < _CALL_ITEMS and (n == 0 or self.nbytes + size <= _CALL_BYTES)

    def add(self, keys: bytes, args: bytes, size: int, sink: ReplySink) -> None:
        self.keys.append(keys)
        self.args.append(args)
        self.sinks.append(sink)
        self.nbytes += size

    def add_split(self, keys: bytes, args: tuple[bytes, bytes, bytes], size: int, sink: ReplySink) -> None:
        """`add` for an item whose arguments are three parts, the payload in the middle."""
        self.keys.append(keys)
        self.args += args
        self.sinks.append(sink)
        self.nbytes += size
        self.split = True

    def seal(self) -> Wire:
        self.sealed = True
        n = len(self.sinks)
        parts = [
            b"*%d\r\n%b%b"
            % (
                3 + n * (_ENQUEUE_KEYS + _ENQUEUE_ITEM_ARGS) + _ENQUEUE_FIXED_ARGS,
                _ENQUEUE_HEAD,
                bulk(n * _ENQUEUE_KEYS),
            ),
            *self.keys,
            self.fixed,
            *self.args,
        ]
        return parts if self.split else b"".join(parts)

    def done(self) -> bool:
        return False  # each item's sink says for itself

    def set_result(self, result: Any, /) -> None:
        self.sealed = True
        for sink, reply in zip(self.sinks, result, strict=True):
            if not sink.done():
                sink.set_result(reply)

    def set_exception(self, exception: BaseException, /) -> None:
        self.sealed = True  # failed before it was sent: nothing may join it any more
        for sink in self.sinks:
            if not sink.done():
                sink.set_exception(exception)


class _LoneCall:
    """An enqueue.lua call of one item, already written (ShardStore.enqueue_to on an idle
    connection): hands the item its reply. Lighter than an _EnqueueCall, whose item lists
    it would not use, on the wake's path (built while Redis runs the call; read as it replies)."""

    __slots__ = ("sink",)

    def __init__(self, sink: ReplySink) -> None:
        self.sink = sink

    def done(self) -> bool:
        return False  # the item's sink says for itself

    def set_result(self, result: Any, /) -> None:
        (reply,) = result
        if not self.sink.done():
            self.sink.set_result(reply)

    def set_exception(self, exception: BaseException, /) -> None:
        if not self.sink.done():
            self.sink.set_exception(exception)


class SlotLeases(NamedTuple):
    """One slot's presence leases to renew (ShardStore.presence_renew)."""

    slot: int
    live: Sequence[tuple[str, str]]  # (qid, token)
    polls: Sequence[str]  # qids


class ShardStore:
    """Queue operations against one Redis shard, coalesced into pipelines."""

    def __init__(self, name: str, url: str, limits: QueueLimits, max_connections: int = 16) -> None:
        self.name = name
        self.url = url
        self.limits = limits
        # a Sentinel-managed shard: a lost or refused connection is a failover to ride out
        self.follows_failover = is_sentinel_url(url)
        self.client: aioredis.Redis = S.async_client(
            url,
            decode_responses=False,
            max_connections=max_connections,
            socket_connect_timeout=2.0,
            socket_timeout=5.0,
            health_check_interval=0,
        )
        # hot: enqueue, ack, status, nonce, publish (small replies, short deadline);
        # bulk: read and drain, whose replies reach max_response_bytes (docs/api.md).
        # The hot lane keeps two batches in flight: one running in Redis, the next one
        # queued behind it while this loop gathers the one after. A third let pipelined
        # batches reach Redis together and be answered together (uneven calls, a stalled
        # relay): 13-15k against 15-17k enqueues/s at 64 connections (docs/benchmarks.md).
        self._batcher = ScriptBatcher(
            self.client,
            url,
            max_inflight=2,
            reply_timeout=limits.write_timeout_s,
            min_replicas=min_replicas_of(url),
            wait_timeout_ms=limits.wait_timeout_ms,
        )
        self._bulk = ScriptBatcher(
            self.client,
            url,
            reply_timeout=limits.read_timeout_s,
            reply_bytes=limits.max_response_bytes,
            min_replicas=min_replicas_of(url),
            wait_timeout_ms=limits.wait_timeout_ms,
            fence_in_failover=False,
        )
        self.last_error = ""  # why the last ping failed, for /readyz (never the URL)
        # called when Redis refuses this store's login (wrong or missing password)
        self.on_auth_failure: Callable[[], None] | None = None
        self._batcher.on_connect_failure = self._bulk.on_connect_failure = self._connect_failed
        # per hot queue, the encoded parts of its enqueue command that never change (enqueue
        # only: an entry per idle long-poll would cost ~1 KiB each); bounded, the oldest goes
        self._enqueue_parts: Bounded[str, tuple[bytes, bytes]] = Bounded(_ENQUEUE_PARTS_MAX)
        self._call: _EnqueueCall | None = None  # the enqueue call still taking items
        self.in_reserve = False  # within the shard's reserve (set_reserve)
        self._enqueue_fixed = self._fixed_args()

    def _fixed_args(self) -> bytes:
        """enqueue.lua's fixed arguments, encoded once (again when the reserve flips)."""
        limits = self.limits
        return b"".join(
            [
                bulk(a)
                for a in (
                    limits.rate_count,
                    limits.rate_window_ms,
                    limits.max_messages,
                    limits.max_bytes,
                    limits.retention_ms,
                    limits.recipient_max_messages,
                    limits.recipient_max_bytes,
                    limits.recipient_rate_count,
                    limits.shard_reserve_queue_bytes if self.in_reserve else 0,
                )
            ]
        )

    def set_reserve(self, on: bool) -> None:
        """The shard is (not) within its reserve (relay/shard_health.py's memory reads): from the
        next enqueue call on, a message taking its queue past shard_reserve_queue_bytes is refused.
        An argument of the same call, not a round trip."""
        on = on and self.limits.shard_reserve_queue_bytes > 0
        if on != self.in_reserve:
            self.in_reserve = on
            self._enqueue_fixed = self._fixed_args()

    def _connect_failed(self, reason: str) -> None:
        if self.on_auth_failure is not None and is_auth_failure(reason):
            self.on_auth_failure()

    async def start(self) -> None:
        """Connect the hot lane now, not at the first request (its handshake loads the scripts).
        Through the store's own connection: redis-py's, on uvloop, leaves a future behind when a
        connect is cut short while DNS does not answer."""
        if not await self.ping():
            raise StoreUnavailable(self.last_error or "unavailable")

    async def close(self) -> None:
        await self._batcher.close()
        await self._bulk.close()
        await self.client.aclose()

    async def ping(self) -> bool:
        """PING over the hot path's own connection (so a TLS or login problem of that
        connection shows); on failure `last_error` says why, without URL or secret."""
        try:
            reply = await asyncio.wait_for(self._batcher.submit(_PING), 2.0)
        except StoreUnavailable as exc:
            self.last_error = str(exc) or "unavailable"
            return False
        except StoreRejected:
            self.last_error = "rejected"
            return False
        except TimeoutError:
            self.last_error = "no answer within 2s"
            return False
        self.last_error = ""
        return bool(reply == b"PONG")

    async def enqueue(
        self, q: K.QueueKeys, req: EnqueueRequest, now_ms: int, token: bytes = b"", resend: bool = False
    ) -> EnqueueOutcome:
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.enqueue_to(reply, q, req, now_ms, token, resend)
        return enqueue_outcome(await reply)

    def enqueue_to(
        self,
        sink: ReplySink | None,
        q: K.QueueKeys,
        req: EnqueueRequest,
        now_ms: int,
        token: bytes = b"",
        resend: bool = False,
        make_sink: Callable[[bytes], ReplySink] | None = None,
    ) -> bytes:
        """Add the enqueue to this tick's enqueue call; Redis's raw reply for it goes to `sink`,
        `enqueue_outcome` reads it. No coroutine: the hot path awaits nothing here. Instead of
        `sink`, `make_sink(token)` may build it: called once, after a lone enqueue is written
        (so building it is not in the wake's path), before this returns.

        Returns the attempt's token (RESP-encoded). When the reply is lost
        (StoreOutcomeUnknown), enqueue again with the same `now_ms`, that token and
        `resend`: Redis then answers the first attempt's seq if it stored the message.
        """
        parts = self._enqueue_parts.get(q.qid)
        if parts is None:
            parts = self._encode_enqueue_parts(q)
        payload, idem_key, message_id = req.payload, req.idempotency_key, req.message_id
        if idem_key or req.any_payload_is_duplicate:  # the idempotency key and payload digest
            keyed = (bulk_str(idem_key) if idem_key else _EMPTY_BULK) + bulk_str(req.digest())
        else:
            keyed = _NO_KEY
        now = b"%d" % now_ms
        token = token or _epoch_bulk()
        size = len(payload)
        call = self._call
        first = call is None or not call.takes(size)
        mid = bulk_str(message_id) if message_id else _EMPTY_BULK
        flag = _RESEND if resend else _EMPTY_BULK
        # the item: its keys; payload, now, idempotency key, digest, messageId, qid and wake
        # (cached), token, resend flag (lua/enqueue.lua)
        if first and size < _SPLIT_PAYLOAD:
            # alone on an idle connection: a call of one, in one format, written before anything
            # else is done (formatted before the check: a busy connection wastes one format per
            # tick's call)
            lone = b"%b%b%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b%b%b%b%b" % (
                _LONE_HEAD,
                parts[0],
                self._enqueue_fixed,
                size,
                payload,
                len(now),
                now,
                keyed,
                mid,
                parts[1],
                token,
                flag,
            )
            if self._batcher.write_now(lone):
                self._batcher.written(lone, _LoneCall(_sink_of(sink, make_sink, token)))
                return token
        rest = b"\r\n$%d\r\n%b\r\n%b%b%b%b%b" % (len(now), now, keyed, mid, parts[1], token, flag)
        if first:
            call = self._call = _EnqueueCall(self._enqueue_fixed)
        assert call is not None
        sink = _sink_of(sink, make_sink, token)
        if size < _SPLIT_PAYLOAD:
            call.add(parts[0], b"$%d\r\n%b%b" % (size, payload, rest), size, sink)
        else:
            call.add_split(parts[0], (b"$%d\r\n" % size, payload, rest), size, sink)
        if first:
            # submitted holding its first item: on an idle connection it is written at once
            self._batcher.submit_to(call, call, durable=True, at_once=True)
        return token

    def _encode_enqueue_parts(self, q: K.QueueKeys) -> tuple[bytes, bytes]:
        """The queue's fixed parts of an enqueue item: its keys (state, the queue's own five,
        index, stats, recipient records: lua/enqueue.lua's order); its qid and wake channel."""
        slot = q.slot
        d = len(str(slot))
        base = q.base.encode()
        n = len(base)
        m, s, i, x, r = _QUEUE_KEY_EXTRA
        st, ix, sx, rx = _SLOT_KEY_EXTRA
        qid = q.qid
        parts = (
            _ITEM_KEYS
            % (
                d + st,
                slot,
                n + m,
                base,
                n + s,
                base,
                n + i,
                base,
                n + x,
                base,
                n + r,
                base,
                d + ix,
                slot,
                d + sx,
                slot,
                d + rx,
                slot,
            ),
            _QID_WAKE % (len(qid), qid.encode(), n + _WAKE_EXTRA, base),
        )
        self._enqueue_parts.put(q.qid, parts)
        return parts

    async def read(self, q: K.QueueKeys, from_seq: int | None, limit: int) -> ReadResult:
        """At most `limit` messages and max_response_bytes of payload (at least one message)."""
        reply = _check(
            await self._bulk.call(
                scripts.READ,
                (q.state, q.meta, q.msgs, q.stats),
                ("" if from_seq is None else from_seq, limit, self.limits.max_response_bytes, q.qid),
            )
        )
        return ReadResult(_messages(reply[3]), _s(reply[1]), int(reply[2]))

    async def drain(self, q: K.QueueKeys, limit: int) -> ReadResult:
        """As `read` from the oldest, deleting exactly the messages returned."""
        reply = _check(
            await self._bulk.call(
                scripts.DRAIN,
                (q.state, q.meta, q.msgs, q.stats),
                (limit, self.limits.max_response_bytes, q.qid),
                durable=True,
            )
        )
        return ReadResult(_messages(reply[3]), _s(reply[1]), int(reply[2]), more=bool(reply[4]))

    async def ack_upto(self, q: K.QueueKeys, up_to_seq: int) -> int:
        return (await self.ack_sized(q, up_to_seq, None))[0]

    async def ack_seqs(self, q: K.QueueKeys, seqs: list[int]) -> int:
        return (await self.ack_sized(q, None, seqs))[0]

    async def ack_sized(
        self, q: K.QueueKeys, up_to_seq: int | None, seqs: list[int] | None
    ) -> tuple[int, int]:
        """Ack up to a seq, or the given seqs: (messages removed, their payload bytes)."""
        args: tuple[str | int, ...] = (
            ("upto", up_to_seq) if up_to_seq is not None else ("seqs", *(seqs or ()))
        )
        if len(args) < 2:
            return 0, 0
        reply = _check(
            await self._batcher.call(scripts.ACK, (q.state, q.meta, q.msgs, q.stats), args, durable=True)
        )
        return int(reply[1]), int(reply[2])

    # -- per-recipient quotas (the recipient's home: the slot of its default channel) ----------
    def _home(self, recipient: bytes) -> tuple[str, ...]:
        q = K.queue_keys(recipient, b"")
        return (q.state, K.slot_recipients(q.slot), q.meta, q.msgs, q.rate)

    async def recipient_admit(
        self, recipient: bytes, channel: bytes, size: int, now_ms: int
    ) -> EnqueueOutcome:
        """Admit one message to a non-default channel on its recipient's home shard (this store):
        the channel cap, the recipient's held caps and rate; counted as held until refunded.
        Kind "stored" (admitted), "rate_limited" or "full" (reason: channels, recipient ...)."""
        lim = self.limits
        reply = _check(
            await self._batcher.call(
                scripts.RCPT_ADMIT,
                self._home(recipient),
                (
                    K.recipient_field(recipient),
                    K.b64(channel),
                    size,
                    now_ms,
                    lim.recipient_max_channels,
                    lim.recipient_max_messages,
                    lim.recipient_max_bytes,
                    lim.recipient_rate_count,
                    lim.rate_window_ms,
                ),
                durable=True,
            )
        )
        if reply[0] == b"ok":
            return EnqueueOutcome("stored")
        return enqueue_outcome(reply)

    async def recipient_refund(
        self, recipient: bytes, messages: int, size: int, now_ms: int, admitted_ms: int = 0
    ) -> None:
        """Give back what a non-default channel no longer holds (or was admitted but not stored:
        then `admitted_ms` is the admit's time, and its rate entry goes too)."""
        home = self._home(recipient)
        _check(
            await self._batcher.call(
                scripts.RCPT_REFUND,
                home[:2],
                (
                    K.recipient_field(recipient),
                    messages,
                    size,
                    admitted_ms,
                    now_ms,
                    self.limits.rate_window_ms,
                ),
                durable=True,
            )
        )

    async def recipient_channels(self, recipient: bytes) -> tuple[list[bytes], int, int]:
        """The recipient's registered non-default channels, its admit count and last admit (ms)."""
        reply = _check(
            await self._batcher.call(
                scripts.RCPT_SETTLE, self._home(recipient)[:2], (K.recipient_field(recipient), "peek")
            )
        )
        text = _s(reply[1])
        return [K.b64decode(c) for c in text.split()], int(reply[2]), int(reply[3])

    async def recipient_settle(
        self,
        recipient: bytes,
        seen_admits: int,
        now_ms: int,
        quiet_ms: int,
        held: Sequence[tuple[bytes, int, int]],
    ) -> bool:
        """Replace the recipient's held counters with what its channels' queues hold (`held`:
        channel, messages, bytes, read after `recipient_channels` answered `seen_admits`), and
        unregister the empty channels, unless an admit came since or within `quiet_ms` (one may
        still be on its way). True when applied."""
        args: list[str | int] = [
            K.recipient_field(recipient),
            "set",
            seen_admits,
            now_ms,
            quiet_ms,
            self.limits.rate_window_ms,
        ]
        for channel, messages, size in held:
            args += [K.b64(channel), messages, size]
        reply = _check(
            await self._batcher.call(
                scripts.RCPT_SETTLE, self._home(recipient)[:2], tuple(args), durable=True
            )
        )
        return bool(reply[0] == b"ok")

    async def status(self, q: K.QueueKeys, above_seq: int | None = None) -> StatusResult:
        """`above_seq`: also count the messages past that seq (`above`; a Pickup lease's cursor)."""
        args = (q.qid,) if above_seq is None else (q.qid, above_seq)
        r = _check(await self._batcher.call(scripts.STATUS, (q.state, q.meta, q.msgs, q.stats), args))
        return StatusResult(
            count=int(r[1]),
            bytes=int(r[2]),
            epoch=_s(r[3]),
            last_seq=int(r[4]),
            oldest_ms=int(r[5]) if r[5] else None,
            newest_ms=int(r[6]) if r[6] else None,
            above=int(r[7]),
        )

    async def memory(self) -> tuple[int, int]:
        """(used_memory, maxmemory) of the shard, over the store's own hot lane (redis-py's
        INFO, on uvloop, leaves a future behind when its connect is cut short by DNS). Not the
        bulk lane: an INFO batched behind a slot sweep's script calls there made those calls
        time out (test_slot_sweep's loop test failed 2 of 6 runs; 0 of 8 on the hot lane,
        where one small INFO a second costs nothing measurable)."""
        reply = await asyncio.wait_for(self._batcher.submit(_INFO_MEMORY), 3.0)
        fields = dict(
            line.split(b":", 1)
            for line in bytes(reply).splitlines()
            if b":" in line and not line.startswith(b"#")
        )
        return int(fields.get(b"used_memory", b"0")), int(fields.get(b"maxmemory", b"0"))

    # -- fleet-wide presence leases (lua/presence.lua, relay/presence.py) -------------------
    async def _presence(self, slot: int, args: tuple[str | int, ...]) -> list[Any]:
        return _check(
            await self._batcher.call(scripts.PRESENCE, (K.slot_state(slot), K.slot_presence(slot)), args)
        )

    async def presence_take(self, q: K.QueueKeys, token: str, now_ms: int, ttl_ms: int) -> tuple[int, str]:
        """The queue's live lease becomes `token`'s (its takeover notice published with it):
        (ms the previous holder's lease had left, 0 for none; that holder's token)."""
        r = await self._presence(q.slot, ("take", now_ms, ttl_ms, q.qid, token, q.wake))
        return int(r[1]), _s(r[2])

    async def presence_drop(self, q: K.QueueKeys, token: str, now_ms: int) -> bool:
        """End `token`'s live lease (deleted if still its) and publish its release notice."""
        r = await self._presence(q.slot, ("drop", now_ms, q.qid, token, q.wake))
        return bool(int(r[1]))

    async def presence_renew(
        self, slots: Sequence[SlotLeases], now_ms: int, ttl_ms: int, sweep: bool = False
    ) -> list[list[str] | None]:
        """Extend leases of these slots in one script call: per slot, live (qid, token) pairs and
        waiting polls' qids. Per slot in order: the qids of live leases another token holds now
        (nothing written for them), or None when the slot is fenced here (nothing written)."""
        keys: list[str] = []
        args: list[str | int] = ["renew", now_ms, ttl_ms, "1" if sweep else "0"]
        for slot, live, polls in slots:
            keys += (K.slot_state(slot), K.slot_presence(slot))
            args += (len(live), len(polls))
            for pair in live:
                args += pair
            args += polls
        replies = await self._batcher.call(scripts.PRESENCE, tuple(keys), tuple(args))
        return [[_s(x) for x in r[1:]] if r[0] == b"ok" else None for r in replies]

    async def presence_get(self, q: K.QueueKeys, now_ms: int) -> tuple[bool, bool]:
        """(a live socket holds a lease, a live socket or a waiting poll does)."""
        r = await self._presence(q.slot, ("get", now_ms, q.qid))
        return bool(int(r[1])), bool(int(r[2]))

    async def use_nonce(self, slot: int, member: str, now_ms: int, lifetime_ms: int) -> bool:
        """True when the nonce was unused (and is now recorded)."""
        r = _check(
            await self._batcher.call(
                scripts.NONCE, (K.slot_state(slot), K.slot_nonces(slot)), (member, now_ms, lifetime_ms)
            )
        )
        return bool(r[1])

    async def sweep_totals(self, slots: Sequence[int], now_ms: int) -> tuple[int, int, int, float, int]:
        """slot_sweep.lua's totals of these slots (maintenance.sweep_totals), over the bulk
        lane: its own connection, packed as the hot path packs, so the hot lane's batches
        never carry it. SweepMismatch when the script and this caller are out of step."""
        keys, args = sweep_args(slots, TOTALS, now_ms)
        try:
            reply = await self._bulk.call(scripts.SLOT_SWEEP, tuple(keys), tuple(args))
        except StoreUnavailable as exc:
            if sweep_refused(str(exc)):
                raise SweepMismatch(str(exc)) from None
            raise
        return sweep_totals(reply)

    # -- the DIDComm mediator's records (one hash per slot; relay/didcomm/records.py) ----------
    async def _records(self, script: scripts.Script, slot: int, args: tuple[str | int, ...]) -> list[Any]:
        keys = (K.slot_state(slot), K.slot_didcomm(slot), K.slot_didcomm_idle(slot))
        return _check(await self._batcher.call(script, keys, args))

    async def record_get(
        self, slot: int, fields: tuple[str, ...], now_ms: int, idle_ms: int
    ) -> list[bytes | None]:
        """The fields; one whose record's idle expiry passed reads as None."""
        return (await self._records(scripts.DC_GET, slot, (now_ms, idle_ms, *fields)))[1:]

    async def record_set(
        self,
        slot: int,
        pairs: tuple[tuple[str, str], ...],
        deletes: tuple[str, ...],
        now_ms: int,
        idle_ms: int,
    ) -> int:
        """Write and delete fields; the number of expired records swept on the way."""
        args: tuple[str | int, ...] = (now_ms, idle_ms, len(pairs), *(x for p in pairs for x in p), *deletes)
        return int((await self._records(scripts.DC_SET, slot, args))[1])

    async def record_claim(
        self, slot: int, field: str, owner: str, add: bool, now_ms: int, idle_ms: int, proven: bool = False
    ) -> tuple[bool, str]:
        """(done, the previous owner a take displaced or '')."""
        args = (field, owner, "add" if add else "remove", now_ms, idle_ms, "1" if proven else "0")
        reply = await self._records(scripts.DC_CLAIM, slot, args)
        previous = reply[2]
        return bool(reply[1]), previous.decode() if isinstance(previous, bytes) else str(previous)

    async def record_list(self, slot: int, field: str, add: bool, cap: int, members: tuple[str, ...]) -> bool:
        """False when adding would pass `cap` (nothing added)."""
        reply = await self._records(scripts.DC_LIST, slot, (field, "add" if add else "remove", cap, *members))
        return bool(reply[0] == b"ok")

    async def record_swap(
        self, slot: int, field: str, expected: str, new: str, now_ms: int, idle_ms: int
    ) -> bool:
        """dc_swap.lua: write `new` only if `field` holds `expected` ('' = absent or expired)."""
        reply = await self._records(scripts.DC_SWAP, slot, (now_ms, idle_ms, field, expected, new))
        return bool(reply[1])

    async def record_stamp(self, slot: int, field: str, now_ms: int, interval_ms: int) -> bool:
        """dc_stamp.lua: True when `field`'s last stamp is `interval_ms` old or more (now stamped)."""
        reply = await self._records(scripts.DC_STAMP, slot, (now_ms, interval_ms, field))
        return bool(reply[1])

    async def record_expire(self, slots: Sequence[int], now_ms: int, budget: int) -> tuple[int, int, int]:
        """dc_expire.lua over these slots, on the bulk lane (the hot lane's batches never carry
        it): (records removed, position from 1 of the slot to call again from or 0 when all
        are done, fenced slots skipped). At most `budget` records removed."""
        keys = tuple(k for s in slots for k in (K.slot_state(s), K.slot_didcomm(s), K.slot_didcomm_idle(s)))
        reply = await self._bulk.call(scripts.DC_EXPIRE, keys, (now_ms, budget))
        return int(reply[1]), int(reply[2]), int(reply[3])

    async def take_lease(self, key: str, holder: str, ms: int) -> bool:
        """SET key holder NX PX ms over the bulk lane: True when this call took the lease."""
        return await self._bulk.submit(encode("SET", key, holder, "NX", "PX", ms)) is not None
