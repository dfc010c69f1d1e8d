"""Slot-level maintenance commands against one shard (synchronous redis-py).

The batch side of storage: the Spark jobs and `relayfleet plan` read per-slot
statistics, list a slot's queues and run the trim script through here. It is
synchronous on purpose: a Spark task is a plain Python function, and batch
throughput comes from pipelining many slots or queues per round trip, not from
an event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.exceptions import RedisError

from relay.storage import keys as K
from relay.storage import script_runner, scripts, sentinel
from relay.storage.script_runner import ScriptLoadFailed

__all__ = [
    "ROWS",
    "SWEEP_SLOTS",
    "TOTALS",
    "MaintenanceError",
    "ShardMaintenance",
    "SlotStats",
    "SlotTrim",
    "SweepMismatch",
    "TrimOutcome",
    "TrimPolicy",
    "sweep_args",
    "sweep_call",
    "sweep_refused",
    "sweep_stats",
    "sweep_totals",
]

# Slots per slot_sweep.lua call: one call stays well under a millisecond in Redis, and the
# relay's own work on its reply too, so neither Redis nor the relay's loop stalls while a
# shard's 16,384 slots are read (docs/benchmarks.md).
SWEEP_SLOTS = 64


class MaintenanceError(Exception):
    """A shard could not be read or written; the message names the shard, never a password."""


@dataclass(frozen=True, slots=True)
class SlotStats:
    slot: int
    state: str | None  # None = owned; 'migrating', 'importing' or 'moved <shard> <epoch>'
    msgs: int
    bytes: int
    rate: float  # enqueues per minute, from the last complete minute window
    queues: int

    @property
    def owned(self) -> bool:
        return self.state is None


@dataclass(frozen=True, slots=True)
class TrimPolicy:
    now_ms: int
    cutoff_ms: int = 0  # messages received before this are removed (0 = no age limit)
    max_messages: int = -1  # per-queue cap (-1 = none)
    idle_ms: int = -1  # empty queues idle this long are deleted (-1 = never)
    budget: int = 1000  # messages removed per script call, so one call never blocks Redis long


@dataclass(frozen=True, slots=True)
class SlotTrim:
    """What retention did to one slot's queues (ShardMaintenance.trim_slots)."""

    slot: int
    queues: int = 0  # queues trimmed (an index page read twice while Redis rehashes counts twice)
    removed: int = 0
    bytes: int = 0
    deleted: int = 0
    fenced: bool = False  # not owned here (migrating, importing, moved), or stopped being: skipped


@dataclass(frozen=True, slots=True)
class TrimOutcome:
    slot: int
    qid: str
    removed: int = 0
    bytes: int = 0
    deleted: bool = False
    fenced: bool = False  # the slot stopped being owned here (migration started): skipped


class SweepMismatch(MaintenanceError):
    """slot_sweep.lua and its caller are out of step: the script refused the arguments, or
    its reply is not the shape read here. A code defect, not a shard's state: never retried."""


# The script's modes (ARGV[1], lua/slot_sweep.lua's header): a row per slot holding anything,
# or the batch's totals.
ROWS, TOTALS = "rows", "totals"
# A row: position in the batch (from 1), state, queues, messages, bytes, enqueues per minute.
_ROW = 6
# Totals: messages, bytes, queues, enqueues per minute, migrating slots.
_TOTALS = 5
# What the script's refusal starts with (redis.error_reply), wherever the reply surfaces.
SWEEP_REFUSED = "slot_sweep: expected"


def sweep_args(slots: Sequence[int], mode: str, now_ms: int) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of the slot_sweep.lua call reading these slots' load at `now_ms` (at most
    SWEEP_SLOTS slots a call): a row per slot holding anything (ROWS, read by `sweep_stats`),
    or only the batch's totals (TOTALS, read by `sweep_totals`). The script interprets each
    slot's statistics (its rate window, moved and migrating slots): Python never does."""
    if mode not in (ROWS, TOTALS):
        raise SweepMismatch(f"slot_sweep has no mode {mode!r}")
    keys = [key for s in slots for key in (K.slot_state(s), K.slot_stats(s), K.slot_index(s))]
    return keys, [mode, str(now_ms)]


def sweep_call(slots: Sequence[int], now_ms: int) -> tuple[Any, ...]:
    """The EVALSHA of `sweep_args` for rows, for script_runner."""
    return script_runner.evalsha(scripts.SLOT_SWEEP, *sweep_args(slots, ROWS, now_ms))


def sweep_totals(reply: Any) -> tuple[int, int, int, float, int]:
    """Messages, bytes, queues, enqueues per minute and migrating slots of a TOTALS call, over
    its slots, moved ones left out."""
    if not isinstance(reply, list) or len(reply) != _TOTALS or not all(type(v) is int for v in reply):
        raise SweepMismatch(f"slot_sweep totals: expected {_TOTALS} integers, got {_shape(reply)}")
    messages, nbytes, queues, rate, migrating = reply
    return messages, nbytes, queues, float(rate), migrating


def sweep_stats(slots: Sequence[int], reply: Any) -> Iterator[SlotStats]:
    """The statistics of the slots a ROWS call reported, in order; a slot it left out holds
    nothing (zero load, owned, no queues)."""
    if not isinstance(reply, list):
        raise SweepMismatch(f"slot_sweep rows: expected a list of rows, got {_shape(reply)}")
    for row in reply:
        if (
            not isinstance(row, list)
            or len(row) != _ROW
            or not all(type(v) is int for v in (row[0], *row[2:]))
            or not 1 <= row[0] <= len(slots)
        ):
            raise SweepMismatch(f"slot_sweep rows: expected rows of {_ROW}, got {_shape(row)}")
        position, state, queues, msgs, nbytes, rate = row
        yield SlotStats(
            slot=slots[position - 1],
            state=state.decode("utf-8", "replace") if state is not None else None,
            msgs=msgs,
            bytes=nbytes,
            rate=float(rate),
            queues=queues,
        )


def sweep_refused(text: str) -> bool:
    """True when a Redis error reply is slot_sweep.lua refusing its arguments."""
    return SWEEP_REFUSED in text


def _shape(reply: Any) -> str:
    """What a reply was, for a SweepMismatch message: its type and length, never its values."""
    if isinstance(reply, list):
        return f"a list of {len(reply)}"
    return type(reply).__name__


def redacted(url: str) -> str:
    """host:port/db of a Redis URL, for messages (a URL may carry a password)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname}:{parts.port or 6379}{parts.path or ''}"


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class ShardMaintenance:
    """Maintenance session with one shard's Redis; one connection, pipelined."""

    def __init__(self, url: str, *, timeout: float = 30.0, batch: int = 512) -> None:
        self.url = url
        self._batch = batch
        try:
            # a single connection: the commands are sequential, pipelines carry the volume
            # (a Sentinel shard's primary is found through its Sentinels: Spark, retention)
            self.client: redis.Redis = sentinel.sync_client(
                url,
                decode_responses=False,
                socket_connect_timeout=5.0,
                socket_timeout=timeout,
                single_connection_client=True,
            )
        except (RedisError, OSError, ValueError) as exc:
            raise self._fail("connecting", exc) from None
        self._trim_loaded = False

    def __enter__(self) -> ShardMaintenance:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    def _fail(self, what: str, exc: Exception) -> MaintenanceError:
        return MaintenanceError(f"{what} on {redacted(self.url)} failed: {type(exc).__name__}: {exc}")

    def slot_states(self, slots: Sequence[int]) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        try:
            for chunk in _chunks(slots, 4096):
                pipe = self.client.pipeline(transaction=False)
                for s in chunk:
                    pipe.get(K.slot_state(s))
                values = pipe.execute()
                for s, v in zip(chunk, values, strict=True):
                    out[s] = v.decode() if v is not None else None
        except (RedisError, OSError) as exc:
            raise self._fail("reading slot states", exc) from None
        return out

    def slot_stats(self, slots: Sequence[int], now_ms: int) -> list[SlotStats]:
        """Statistics of every slot given, in order, as slot_sweep.lua reads them at `now_ms`;
        O(1) per slot, no payload read."""
        out: list[SlotStats] = []
        try:
            # a round trip carries several script calls (Redis serves others between two)
            for batch in _chunks(slots, self._batch):
                chunks = list(_chunks(batch, SWEEP_SLOTS))
                calls = [sweep_call(chunk, now_ms) for chunk in chunks]
                replies = script_runner.run(self.client, calls, (scripts.SLOT_SWEEP,), "all")
                for chunk, reply in zip(chunks, replies, strict=True):
                    if isinstance(reply, Exception):
                        if sweep_refused(str(reply)):
                            raise SweepMismatch(f"on {redacted(self.url)}: {reply}")
                        raise reply
                    found = {s.slot: s for s in sweep_stats(chunk, reply)}
                    out.extend(found.get(s) or SlotStats(s, None, 0, 0, 0.0, 0) for s in chunk)
        except ScriptLoadFailed as exc:
            raise self._fail("reading slot statistics", exc.cause) from None
        except (RedisError, OSError) as exc:
            raise self._fail("reading slot statistics", exc) from None
        return out

    def slot_queues(self, slot: int) -> list[str]:
        """Queue ids in the slot's index."""
        return self.queues_of([slot])[slot]

    def queues_of(self, slots: Sequence[int]) -> dict[int, list[str]]:
        """Queue ids of every slot given. SSCAN (never blocks Redis on a big slot),
        with the first page of many slots fetched in one pipeline."""
        out: dict[int, set[str]] = {s: set() for s in slots}
        cursors: dict[int, int] = dict.fromkeys(slots, 0)
        try:
            while cursors:
                todo = list(cursors.items())
                cursors = {}
                for chunk in _chunks(todo, self._batch):
                    pipe = self.client.pipeline(transaction=False)
                    for s, cursor in chunk:
                        pipe.sscan(K.slot_index(s), cursor=cursor, count=1000)
                    for (s, _), (cursor, members) in zip(chunk, pipe.execute(), strict=True):
                        out[s].update(m.decode() for m in members)
                        if int(cursor):
                            cursors[s] = int(cursor)
        except (RedisError, OSError) as exc:
            raise self._fail("listing queues", exc) from None
        return {s: sorted(q) for s, q in out.items()}

    def trim(self, items: Iterable[tuple[int, str]], policy: TrimPolicy) -> list[TrimOutcome]:
        """Run the trim script on every (slot, queue id) until each is done.

        Calls are pipelined across slots; a queue whose call ran out of budget
        is called again (the script is idempotent: a repeated call is safe).
        """
        totals: dict[tuple[int, str], TrimOutcome] = {(s, q): TrimOutcome(s, q) for s, q in items}
        pending = list(totals)
        try:
            if not self._trim_loaded:
                self.client.script_load(scripts.TRIM.source)
                self._trim_loaded = True
            while pending:
                again: list[tuple[int, str]] = []
                for chunk in _chunks(pending, self._batch):
                    for item, reply in zip(chunk, self._trim_batch(chunk, policy), strict=True):
                        prev = totals[item]
                        if reply[0] != b"ok":
                            totals[item] = replace(prev, fenced=True)
                            continue
                        totals[item] = replace(
                            prev,
                            removed=prev.removed + int(reply[1]),
                            bytes=prev.bytes + int(reply[2]),
                            deleted=bool(reply[3]),
                        )
                        if int(reply[4]):
                            again.append(item)
                pending = again
        except ScriptLoadFailed as exc:
            raise self._fail("trimming queues", exc.cause) from None
        except (RedisError, OSError) as exc:
            raise self._fail("trimming queues", exc) from None
        return list(totals.values())

    def trim_slots(self, slots: Sequence[int], policy: TrimPolicy, page: int = 256) -> list[SlotTrim]:
        """Retention for every queue of the given slots, in Redis: trim_slot.lua trims a page of
        a slot's index per call (each queue as trim.lua would), many slots' calls per round trip,
        until every slot's index is read through. A queue left with work (its budget spent) is
        finished by `trim`. No per-queue work here: a sweep waits on Redis, not on Python."""
        out = {s: SlotTrim(s) for s in slots}
        cursors = {s: "0" for s in slots}
        again: list[tuple[int, str]] = []
        fixed = [
            str(policy.now_ms), str(policy.cutoff_ms), str(policy.max_messages), str(policy.idle_ms),
            str(policy.budget),
        ]  # fmt: skip
        try:
            while cursors:
                todo = list(cursors.items())
                cursors = {}
                # a round trip of at most SWEEP_SLOTS calls: each call takes Redis about a
                # millisecond per hundred queues, and Redis serves others between two calls
                for chunk in _chunks(todo, SWEEP_SLOTS):
                    calls = [
                        script_runner.evalsha(
                            scripts.TRIM_SLOT,
                            (K.slot_state(s), K.slot_index(s), K.slot_stats(s)),
                            (*fixed, cursor, str(page), K.slot_queue_prefix(s), *K.QUEUE_SUFFIXES),
                        )
                        for s, cursor in chunk
                    ]
                    replies = script_runner.run(self.client, calls, (scripts.TRIM_SLOT,), "missing")
                    for (s, _), reply in zip(chunk, replies, strict=True):
                        if isinstance(reply, Exception):
                            raise reply
                        prev = out[s]
                        if reply[0] != b"ok":
                            out[s] = replace(prev, fenced=True)
                            continue
                        out[s] = replace(
                            prev,
                            queues=prev.queues + int(reply[2]),
                            removed=prev.removed + int(reply[3]),
                            bytes=prev.bytes + int(reply[4]),
                            deleted=prev.deleted + int(reply[5]),
                        )
                        again.extend((s, q.decode()) for q in reply[6])
                        if reply[1] != b"0":
                            cursors[s] = reply[1].decode()
        except ScriptLoadFailed as exc:
            raise self._fail("trimming slots", exc.cause) from None
        except (RedisError, OSError) as exc:
            raise self._fail("trimming slots", exc) from None
        for o in self.trim(again, policy):
            prev = out[o.slot]
            out[o.slot] = replace(
                prev,
                removed=prev.removed + o.removed,
                bytes=prev.bytes + o.bytes,
                deleted=prev.deleted + o.deleted,
                fenced=prev.fenced or o.fenced,
            )
        return list(out.values())

    def _trim_batch(self, items: Sequence[tuple[int, str]], policy: TrimPolicy) -> list[Any]:
        # Redis restarted or flushed its script cache: the runner loads it and redoes only
        # the calls it refused (a call that ran must not run twice: its counts would be lost)
        replies = script_runner.run(self.client, self._trim_calls(items, policy), (scripts.TRIM,), "missing")
        for r in replies:
            if isinstance(r, Exception):
                raise r
        return replies

    def _trim_calls(self, items: Sequence[tuple[int, str]], policy: TrimPolicy) -> list[tuple[Any, ...]]:
        calls = []
        for slot, qid in items:
            q = K.queue_keys_for_id(slot, qid)
            calls.append(
                script_runner.evalsha(
                    scripts.TRIM,
                    (q.state, q.meta, q.msgs, q.idem, q.idemx, q.rate, q.index, q.stats),
                    (
                        policy.now_ms,
                        policy.cutoff_ms,
                        policy.max_messages,
                        policy.idle_ms,
                        qid,
                        policy.budget,
                    ),
                )
            )
        return calls
