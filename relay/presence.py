"""Fleet-wide presence: whether a queue has a live socket, or a waiting long-poll, on any relay.

Each relay writes a lease for what it holds into the slot's presence hash on the queue's own
shard (keys.slot_presence, lua/presence.lua), so any relay answers with one read there, and a
migration copies the leases with the slot:

- a live socket takes the queue's live lease before its first read (its token; the takeover
  notice goes out on the queue's wakeup channel in the same script, so every older socket of
  the queue, on any relay, learns it in Redis's order) and drops it when it closes: the
  answer turns false at once. The drop publishes a release notice, which the newer socket
  waits for before its first delivery (relay/api/live.py), bounded by the older lease's expiry.
- a long-poll that parks writes a poll lease (at most once a renewal period per queue), left
  to expire: a client that polls in a loop counts as online between its polls.
- every RELAY_PRESENCE_TTL_S / 3 the relay renews what it still holds, one script call per
  shard for up to 128 leases. A renewal that finds the live lease taken by another token closes
  the local socket with 4409 (the takeover notice may have been missed while the wakeup
  subscription was down).
  A killed relay renews nothing: its leases lapse within RELAY_PRESENCE_TTL_S.

The key holds fields only for queues with a lease, and expires with its newest lease, so an
idle queue costs nothing here (docs/design-decisions.md, "Fleet-wide presence").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from relay import metrics
from relay.fleet.routing import Route
from relay.service import QueueService, Unavailable
from relay.storage.store import (
    ShardStore,
    SlotLeases,
    SlotMigrating,
    SlotMoved,
    StoreRejected,
    StoreUnavailable,
)

__all__ = ["Presence"]

log = logging.getLogger("relay.presence")

_SWEEP_EVERY = 4  # renewal rounds between sweeps of expired fields (a killed relay's leases)
# leases renewed by one script call at most: Redis spends 10-13 us a lease (measured, loaded
# machine: docs/design-decisions.md "Fleet-wide presence"), so an enqueue behind such a call
# waits ~2 ms at most
_RENEW_LEASES = 128
_FAILED = (Unavailable, StoreUnavailable, StoreRejected, SlotMoved, SlotMigrating, OSError, TimeoutError)
_LIVE = metrics.PRESENCE_LEASES.labels("live")
_POLL = metrics.PRESENCE_LEASES.labels("poll")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _nothing() -> None:
    """The `lost` of a lease whose socket nothing displaces."""


@dataclass(slots=True)
class _Held:
    token: str
    lost: Callable[[], None]  # a renewal found the lease taken: the socket closes with 4409


QueueId = tuple[bytes, bytes]


class Presence:
    """This relay's presence leases, and the fleet's answer for any queue."""

    def __init__(self, service: QueueService, ttl_s: float) -> None:
        self.service = service
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.renew_s = ttl_s / 3
        self._live: dict[QueueId, _Held] = {}
        self._polls: dict[QueueId, int] = {}  # queue -> long-polls parked on it here
        self._poll_written: dict[QueueId, float] = {}  # queue -> when its poll lease was last written
        self._tasks: set[asyncio.Task[None]] = set()
        self._rounds = 0
        service.on_wait = self.poll

    # -- what push and the status answers ask ----------------------------------------------
    def held_here(self, recipient: bytes, channel: bytes) -> bool:
        """This relay holds a live socket or a waiting long-poll for the queue (no I/O)."""
        key = (recipient, channel)
        return key in self._live or key in self._polls

    async def live(self, recipient: bytes, channel: bytes) -> bool:
        """A live socket is open for the queue on some relay (status.live_delivery)."""
        if (recipient, channel) in self._live:
            return True
        live, _ = await self._get(recipient, channel)
        metrics.PRESENCE_CHECKS.labels("live" if live else "offline").inc()
        return live

    async def online(self, recipient: bytes, channel: bytes) -> bool:
        """A live socket or a waiting long-poll, on some relay (the push decision). True when
        the shard cannot tell: no notification is sent on a guess."""
        if self.held_here(recipient, channel):
            return True
        try:
            live, online = await self._get(recipient, channel)
        except _FAILED:
            metrics.PRESENCE_CHECKS.labels("unknown").inc()
            return True
        metrics.PRESENCE_CHECKS.labels("live" if live else "online" if online else "offline").inc()
        return online

    async def _get(self, recipient: bytes, channel: bytes) -> tuple[bool, bool]:
        now = _now_ms()
        return await self.service.call(recipient, channel, lambda r: r.store.presence_get(r.keys, now))

    # -- live sockets ---------------------------------------------------------------------------
    async def take(
        self, recipient: bytes, channel: bytes, token: str, lost: Callable[[], None]
    ) -> tuple[float, str]:
        """Take the queue's live lease for `token` (its takeover notice goes out with it).
        Returns (seconds the previous holder's lease had left, 0 for none; its token)."""
        self._register((recipient, channel), _Held(token, lost))
        now = _now_ms()
        try:
            left_ms, prev = await self.service.call(
                recipient, channel, lambda r: r.store.presence_take(r.keys, token, now, self.ttl_ms)
            )
        except BaseException:
            metrics.PRESENCE_WRITES.labels("take", "failed").inc()
            raise
        metrics.PRESENCE_WRITES.labels("take", "ok").inc()
        return left_ms / 1000, prev

    def hold(self, recipient: bytes, channel: bytes, token: str) -> None:
        """A live lease with no takeover to wait for (a DIDComm socket in live mode): taken in
        a task of its own, renewed as any other; a failed take is written by the next renewal."""
        self._register((recipient, channel), _Held(token, _nothing))
        self._spawn(self._hold(recipient, channel, token))

    async def _hold(self, recipient: bytes, channel: bytes, token: str) -> None:
        with contextlib.suppress(*_FAILED):
            await self.take(recipient, channel, token, _nothing)

    def _register(self, key: QueueId, held: _Held) -> None:
        if key not in self._live:
            _LIVE.inc()
        self._live[key] = held

    def drop(self, recipient: bytes, channel: bytes, token: str) -> None:
        """The socket holding `token` stopped writing: delete its lease (if still its) and
        publish its release, in a task of its own (a closing handler may be cancelled)."""
        key = (recipient, channel)
        held = self._live.get(key)
        if held is not None and held.token == token:
            del self._live[key]
            _LIVE.dec()
        self._spawn(self._drop(recipient, channel, token))

    async def _drop(self, recipient: bytes, channel: bytes, token: str) -> None:
        now = _now_ms()
        try:
            await self.service.call(recipient, channel, lambda r: r.store.presence_drop(r.keys, token, now))
        except _FAILED as exc:  # the lease lapses by itself; the newer socket waits for that
            metrics.PRESENCE_WRITES.labels("drop", "failed").inc()
            log.warning("presence lease not dropped: %s", type(exc).__name__)
            return
        metrics.PRESENCE_WRITES.labels("drop", "ok").inc()

    # -- long-polls (QueueService.on_wait) ------------------------------------------------------
    def poll(self, recipient: bytes, channel: bytes, delta: int) -> None:
        """A long-poll parks on the queue (+1) or leaves (-1). Never raises, never waits."""
        key = (recipient, channel)
        n = self._polls.get(key, 0) + delta
        if n > 0:
            if key not in self._polls:
                _POLL.inc()
            self._polls[key] = n
        elif key in self._polls:
            del self._polls[key]
            _POLL.dec()
        if delta > 0:
            mono = time.monotonic()
            written = self._poll_written.get(key)
            if written is None or mono - written >= self.renew_s:
                self._poll_written[key] = mono
                self._spawn(self._write_poll(recipient, channel))

    async def _write_poll(self, recipient: bytes, channel: bytes) -> None:
        route = self.service.fleet.route(recipient, channel)
        leases = SlotLeases(route.keys.slot, (), (route.keys.qid,))
        try:
            (written,) = await route.store.presence_renew([leases], _now_ms(), self.ttl_ms)
        except _FAILED:
            written = None
        if written is None:
            metrics.PRESENCE_WRITES.labels("renew", "failed").inc()
            self._poll_written.pop((recipient, channel), None)  # the next park tries again
            return
        metrics.PRESENCE_WRITES.labels("renew", "ok").inc()

    # -- renewal ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Renew every lease this relay holds, each third of the TTL, until cancelled."""
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                await self.renew()
            except Exception as exc:  # never let the loop die: leases would lapse fleet-wide
                log.error("presence renewal failed: %s", type(exc).__name__, exc_info=exc)

    async def renew(self) -> None:
        """One renewal round: one script call per shard for the slots this relay holds leases
        in there, up to _RENEW_LEASES leases a call (a call per slot cost a script call per
        waiter: docs/design-decisions.md "Fleet-wide presence")."""
        self._rounds += 1
        sweep = self._rounds % _SWEEP_EVERY == 0
        mono = time.monotonic()
        groups: dict[tuple[int, int], _Group] = {}

        def group(route: Route) -> _Group:
            k = (id(route.store), route.keys.slot)
            g = groups.get(k)
            if g is None:
                g = groups[k] = _Group(route.store, route.keys.slot)
            return g

        for key, held in self._live.items():
            route = self.service.fleet.route(*key)
            g = group(route)
            g.live.append((route.keys.qid, held.token))
            g.owners[route.keys.qid] = (key, held)
        for key in self._polls:
            route = self.service.fleet.route(*key)
            group(route).polls.append(route.keys.qid)
            self._poll_written[key] = mono
        for key, written in list(self._poll_written.items()):
            if mono - written > self.renew_s * 3 and key not in self._polls:
                del self._poll_written[key]
        per_store: dict[int, list[_Group]] = {}
        for g in groups.values():
            per_store.setdefault(id(g.store), []).append(g)
        calls = [call for gs in per_store.values() for call in _calls(gs)]
        if calls:
            await asyncio.gather(*(self._renew_call(call, sweep) for call in calls))

    async def _renew_call(self, call: list[_Group], sweep: bool) -> None:
        """Renew the leases of `call`'s slots (one shard's) in one script call."""
        store = call[0].store
        try:
            replies = await store.presence_renew(
                [SlotLeases(g.slot, g.live, g.polls) for g in call], _now_ms(), self.ttl_ms, sweep
            )
        except _FAILED:
            # the shard is down (the leases lapse, as a killed relay's would)
            metrics.PRESENCE_WRITES.labels("renew", "failed").inc(len(call))
            return
        for g, lost in zip(call, replies, strict=True):
            if lost is None:
                # fenced (a migration: its copy carries the leases; the next round writes on the
                # new owner)
                metrics.PRESENCE_WRITES.labels("renew", "failed").inc()
                continue
            metrics.PRESENCE_WRITES.labels("renew", "ok").inc()
            for qid in lost:
                owner = g.owners.get(qid)
                if owner is None:
                    continue
                key, held = owner
                if self._live.get(key) is held:
                    # counted by the socket (relay/api/live.py displace), once: one a notice
                    # displaced already is still held until its lease is dropped
                    held.lost()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Let the drops in flight finish (a relay shutting down releases its sockets' leases)."""
        if self._tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 2.0)


@dataclass(slots=True)
class _Group:
    """The leases of one slot on one shard: renewed in one script call."""

    store: ShardStore
    slot: int
    live: list[tuple[str, str]] = field(default_factory=list)  # (qid, token)
    polls: list[str] = field(default_factory=list)  # qids
    owners: dict[str, tuple[QueueId, _Held]] = field(default_factory=dict)


def _calls(groups: list[_Group]) -> Iterator[list[_Group]]:
    """One shard's slots in calls of at most _RENEW_LEASES leases (a slot's leases in one call)."""
    call: list[_Group] = []
    n = 0
    for g in groups:
        size = len(g.live) + len(g.polls)
        if call and n + size > _RENEW_LEASES:
            yield call
            call, n = [], 0
        call.append(g)
        n += size
    if call:
        yield call
