"""Wakeups: one supervised pub/sub connection per shard, shared by every waiter.

A waiter registers (and its channel is confirmed subscribed) *before* the queue
is read, so a message stored between the read and the wait still wakes it.
A wakeup is only a hint: the waiter always re-reads. When the connection is
down, waiters fall back to polling, and after a reconnect every waiter is woken
to re-read, because wakeups may have been missed meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from relay.fleet.sharding import is_sentinel_url
from relay.storage import keys as K
from relay.storage import sentinel
from relay.storage.connection import RedisConnectError, RedisTarget, open_connection
from relay.storage.resp import Conn, encode

log = logging.getLogger("relay.wakeups")

_IDLE_UNSUBSCRIBE_S = 10.0  # keep hot channels subscribed between long-polls
_PING_EVERY_S = 5.0
_DEAD_AFTER_S = 15.0
_POLL_FALLBACK_S = 0.25


_MAP_MOVED = K.SHARD_MAP_MOVED.encode()
NOTICE_PREFIX = b"n:"  # wakeup-channel payloads that are notices (live takeovers), not new messages
_MAX_NOTICES = 64


class Waiter:
    # Lean on purpose: 10,000s of idle long-polls each hold one. A bare future with a timer
    # handle instead of an Event + wait_for (which wraps each wait in a Task), and the notice
    # queue only for the waiters that get notices (live connections).
    __slots__ = ("_chan", "_flag", "_fut", "_hub", "_notices", "woken_at_ms")

    def __init__(self, hub: WakeupHub, chan: _Channel) -> None:
        self._hub = hub
        self._chan = chan
        self._flag = False  # woken since the last wait returned
        self._fut: asyncio.Future[None] | None = None
        self._notices: collections.deque[bytes] | None = None
        self.woken_at_ms: int | None = None  # enqueue time of the message that woke us

    @property
    def notices(self) -> collections.deque[bytes]:
        """Notice payloads (prefix stripped) in publish order; the newest are kept."""
        if self._notices is None:
            self._notices = collections.deque(maxlen=_MAX_NOTICES)
        return self._notices

    def _set(self) -> None:
        self._flag = True
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def notice(self, data: bytes) -> None:
        self.notices.append(data)
        self._set()

    def wake(self, enqueued_ms: int | None) -> None:
        if enqueued_ms is not None and self.woken_at_ms is None:
            self.woken_at_ms = enqueued_ms
        self._set()

    async def ready(self, timeout: float) -> bool:
        """Wait until the channel is subscribed (False: hub down, caller polls)."""
        fut = self._chan.confirm
        if self._chan.subscribed or fut is None:
            return self._chan.subscribed
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        return self._chan.subscribed

    async def wait(self, timeout: float) -> bool:
        """Sleep until woken or `timeout`; True when woken. Clears the wake flag."""
        if timeout <= 0:
            return False
        if not self._hub.healthy:
            timeout = min(timeout, _POLL_FALLBACK_S)
        if not self._flag:
            loop = asyncio.get_running_loop()
            fut = self._fut = loop.create_future()
            timer = loop.call_later(timeout, _expire, fut)
            try:
                await fut
            finally:
                timer.cancel()
                self._fut = None
            if not self._flag:
                return not self._hub.healthy  # polling mode: treat the tick as a hint
        self._flag = False
        return True

    def close(self) -> None:
        self._hub._unregister(self)


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass
class _Channel:
    name: str
    waiters: set[Waiter] = field(default_factory=set)
    subscribed: bool = False
    confirm: asyncio.Future[None] | None = None
    idle_since: float = 0.0


class WakeupHub:
    def __init__(
        self, url: str, shard: str = "default", on_reconnect: Callable[[], None] | None = None
    ) -> None:
        self.url = url
        # a redis+sentinel:// URL names no node: its primary is looked up on every connect
        self.target = RedisTarget.from_url(url) if not is_sentinel_url(url) else RedisTarget()
        self.shard = shard
        self._channels: dict[str, _Channel] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self.healthy = False
        # called each time the subscriber is connected again after losing its connection
        # (relayfleet_wakeup_reconnects_total, relay/fleet/routing.py)
        self._on_reconnect = on_reconnect
        self.last_error = ""  # why the subscriber is down (no URL, no secret)
        self._unwatch: Callable[[], None] | None = None
        # called when a migration announces that the map moved slots off this shard
        # (keys.SHARD_MAP_MOVED); the channel is subscribed only when someone listens
        self.on_map_moved: Callable[[], None] | None = None

    # -- lifecycle ---------------------------------------------------------
    async def start(self, wait_connected: float = 2.0) -> None:
        self._task = asyncio.get_running_loop().create_task(self._supervise())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), wait_connected)

    async def stop(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._close_writer()
        for chan in self._channels.values():
            for w in chan.waiters:
                w.wake(None)

    def wake_all(self) -> None:
        for chan in self._channels.values():
            for w in list(chan.waiters):
                w.wake(None)

    # -- waiters -----------------------------------------------------------
    @contextlib.contextmanager
    def waiting(self, channel: str) -> Iterator[Waiter]:
        w = self.register(channel)
        try:
            yield w
        finally:
            w.close()

    def register(self, channel: str) -> Waiter:
        chan = self._channels.get(channel)
        if chan is None:
            chan = self._channels[channel] = _Channel(channel)
        w = Waiter(self, chan)
        chan.waiters.add(w)
        if not chan.subscribed and chan.confirm is None:
            chan.confirm = asyncio.get_running_loop().create_future()
            self._send(encode("SUBSCRIBE", channel))
        return w

    def _unregister(self, w: Waiter) -> None:
        chan = w._chan
        chan.waiters.discard(w)
        if not chan.waiters:
            chan.idle_since = time.monotonic()

    # -- connection --------------------------------------------------------
    def _send(self, data: bytes) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _primary_changed(self, host: str, port: int) -> None:
        """Sentinel announced a failover: resubscribe on the new primary (the session ends,
        the supervisor reconnects and every waiter re-reads)."""
        self._close_writer()

    async def _open(self, timeout: float) -> Conn:
        """A logged-in connection to the shard's primary (found through Sentinel for a
        redis+sentinel:// URL, then checked with ROLE: never subscribe on a node Sentinel
        has not made primary yet, or one being demoted, where the PUBLISHes do not happen)."""
        if not is_sentinel_url(self.url):
            return Conn(*await open_connection(self.target, timeout))
        if self._unwatch is None:
            self._unwatch = sentinel.watch(self.url, self._primary_changed)
        try:
            target = RedisTarget.from_url(await sentinel.primary_url(self.url))
        except sentinel.NoPrimary as exc:
            raise RedisConnectError(str(exc)[:200]) from None
        conn = Conn(*await open_connection(target, timeout))
        try:
            async with asyncio.timeout(timeout):
                role = await conn.call("ROLE")
        except BaseException:
            conn.close()
            raise
        if not sentinel.role_is_primary(role):
            conn.close()
            raise RedisConnectError("the node Sentinel named is not a primary")
        return conn

    async def _supervise(self) -> None:
        backoff = 0.05
        sessions = 0
        while True:
            try:
                conn = await self._open(3.0)
            except (OSError, TimeoutError) as exc:
                # RedisConnectError's text names the step and the reason, never the credentials
                reason = str(exc) if isinstance(exc, RedisConnectError) else type(exc).__name__
                self.last_error = reason
                log.warning("wakeup subscriber for shard %s cannot connect: %s", self.shard, reason)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            self.last_error = ""
            sessions += 1
            if sessions > 1 and self._on_reconnect is not None:
                self._on_reconnect()
            self._writer = conn.writer
            try:
                await self._session(conn)
            except (OSError, ConnectionError, TimeoutError) as exc:
                self.last_error = f"connection lost: {type(exc).__name__}"
                log.warning("wakeup subscriber for shard %s lost: %s", self.shard, type(exc).__name__)
            finally:
                self.healthy = False
                self._connected.clear()
                self._close_writer()
                for chan in self._channels.values():
                    chan.subscribed = False
                self.wake_all()  # waiters poll until we are back

    async def _session(self, conn: Conn) -> None:
        # resubscribe everything still wanted, then let every waiter re-read
        for chan in list(self._channels.values()):
            if chan.waiters or chan.confirm is not None:
                if chan.confirm is None or chan.confirm.done():
                    chan.confirm = asyncio.get_running_loop().create_future()
                self._send(encode("SUBSCRIBE", chan.name))
            else:
                del self._channels[chan.name]
        if self.on_map_moved is not None:
            self._send(encode("SUBSCRIBE", K.SHARD_MAP_MOVED))
        self._send(encode("PING"))
        last_data = time.monotonic()
        last_ping = last_data
        first = True
        while True:
            try:
                data = await conn.read(_PING_EVERY_S)
            except TimeoutError:
                data = None
            now = time.monotonic()
            if data == b"":
                raise ConnectionError("closed by server")
            if data:
                last_data = now
                for msg in conn.received(data):
                    self._dispatch(msg)
                    if first:
                        first = False
                        self.healthy = True
                        self._connected.set()
                        self.wake_all()
            elif now - last_data > _DEAD_AFTER_S:
                raise TimeoutError("no reply to PING")
            if now - last_ping >= _PING_EVERY_S:
                last_ping = now
                self._send(encode("PING"))
                self._sweep(now)

    def _dispatch(self, msg: object) -> None:
        if not isinstance(msg, list) or not msg:
            return
        kind = msg[0]
        if kind == b"message" and len(msg) == 3:
            if msg[1] == _MAP_MOVED and self.on_map_moved is not None:
                self.on_map_moved()
                return
            chan = self._channels.get(msg[1].decode())
            if chan is None:
                return
            if msg[2].startswith(NOTICE_PREFIX):
                for w in chan.waiters:
                    w.notice(msg[2][len(NOTICE_PREFIX) :])
                return
            enq_ms: int | None = None
            with contextlib.suppress(ValueError, IndexError):
                enq_ms = int(msg[2].split(b":", 1)[1])
            for w in chan.waiters:
                w.wake(enq_ms)
        elif kind == b"subscribe":
            chan = self._channels.get(msg[1].decode())
            if chan is not None:
                chan.subscribed = True
                if chan.confirm is not None and not chan.confirm.done():
                    chan.confirm.set_result(None)
                chan.confirm = None

    def _sweep(self, now: float) -> None:
        stale = [
            c
            for c in self._channels.values()
            if not c.waiters and c.subscribed and now - c.idle_since > _IDLE_UNSUBSCRIBE_S
        ]
        for chan in stale:
            # Removed at once: a later SUBSCRIBE of the same name is answered after
            # this UNSUBSCRIBE, so its confirmation cannot be confused with it.
            del self._channels[chan.name]
            self._send(encode("UNSUBSCRIBE", chan.name))
