"""Wakeups: one supervised pub/sub connection per shard, shared by every waiter.

A waiter registers (and its channel is confirmed subscribed) *before* the queue
is read, so a message stored between the read and the wait still wakes it.
A wakeup is a hint, and may carry the messages that caused it: the enqueue script
publishes small messages with their seq and the queue's epoch, and an enqueue this
process sent hands its stored message to this process's waiters as Redis answers it
(`WakeupHub.carry`). A waiter answers from carried messages only when they are exactly
the ones that follow its last read (`Waiter.take`: same epoch, the next seq on, no gap);
anything else — a plain wakeup, a gap, another epoch — and it re-reads. When the
connection is down, waiters fall back to polling, and after a reconnect every waiter is
woken to re-read, because wakeups may have been missed meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from relay.fleet.sharding import is_sentinel_url
from relay.retrying import WAKEUP_CONNECT, retrying
from relay.storage import keys as K
from relay.storage import sentinel
from relay.storage.connection import RedisConnectError, RedisTarget
from relay.storage.message import Message
from relay.storage.pipeline import Conn, encode, open_connection

log = logging.getLogger("relay.wakeups")

_IDLE_UNSUBSCRIBE_S = 10.0  # keep hot channels subscribed between long-polls
_PING_EVERY_S = 5.0
_DEAD_AFTER_S = 15.0
_POLL_FALLBACK_S = 0.25


_MAP_MOVED = K.SHARD_MAP_MOVED.encode()
# wakeup-channel payloads that are notices (live takeovers and releases, published by
# lua/presence.lua under this literal prefix), not new messages
NOTICE_PREFIX = b"n:"
_MAX_NOTICES = 64
# carried messages (and their payload bytes) a waiter keeps between reads; past either it
# drops them and re-reads: a live socket whose client stopped acking pins no more than this
_MAX_CARRIED = 64
_MAX_CARRIED_BYTES = 256 * 1024


class Stored(Protocol):
    """What `WakeupHub.carry` takes of an enqueue request (relay/storage/store.py)."""

    @property
    def payload(self) -> bytes: ...

    @property
    def message_id(self) -> str: ...


class Waiter:
    # Lean on purpose: 10,000s of idle long-polls each hold one. A bare future with a timer
    # handle instead of an Event + wait_for (which wraps each wait in a Task), and the notice
    # queue only for the waiters that get notices (live connections).
    __slots__ = (
        "_carried",
        "_carried_bytes",
        "_chan",
        "_expect",
        "_flag",
        "_fut",
        "_hub",
        "_notices",
        "_plain",
        "_prepare",
        "taken",
        "woken_at_ms",
    )

    def __init__(self, hub: WakeupHub, chan: _Channel) -> None:
        self._hub = hub
        self._chan = chan
        self._flag = False  # woken since the last wait returned
        self._fut: asyncio.Future[None] | None = None
        self._notices: collections.deque[bytes] | None = None
        self.woken_at_ms: int | None = None  # enqueue time of the message that woke us
        # since the last `forget`: messages carried by wakeups, (epoch, message) in arrival
        # order; and whether a wakeup came that carried none (only a read tells what is new)
        self._carried: list[tuple[str, Message]] | None = None
        self._carried_bytes = 0
        self._plain = False
        # set by `expect`: what a carrying wakeup is taken for, and who answers from it
        self._expect: _Expectation | None = None
        self._prepare: Prepare | None = None
        self.taken: list[Message] | None = None  # what `expect`'s answerer was handed

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
        self._expect = None
        self._plain = True
        self._carried = None
        self._set()

    def carry(self, enqueued_ms: int | None, epoch: str, messages: list[Message]) -> bool:
        """A wakeup for `messages` (ascending seqs of one store), stored in the queue's `epoch`.
        True when its task has nothing to answer from it: `expect`'s answerer answered there
        and then, or nothing in it was new."""
        if enqueued_ms is not None and self.woken_at_ms is None:
            self.woken_at_ms = enqueued_ms
        if not self._plain:
            carried = self._carried
            if carried is None:
                carried = self._carried = []
                self._carried_bytes = 0
            for m in messages:  # usually one: a plain loop is the cheapest on a cold path
                self._carried_bytes += len(m.payload)
                carried.append((epoch, m))
            if len(carried) > _MAX_CARRIED or self._carried_bytes > _MAX_CARRIED_BYTES:
                self._plain = True
                self._carried = None
        expect = self._expect
        answered = False
        if expect is not None:
            got = self.take(*expect[1:])
            if got is None:
                self._expect = None
                self._plain = True  # the waiting task re-reads
            elif got:
                self._expect = None
                self.taken = got
                answered = expect[0](got)
            else:
                answered = True  # nothing new: still expecting
        self._set()
        return answered

    def expect(
        self,
        answer: Callable[[list[Message]], bool],
        epoch: str,
        last_seq: int,
        from_seq: int | None,
        limit: int,
        budget: int,
        prepare: Prepare | None = None,
    ) -> None:
        """Take carried messages (as `take` with these arguments would) the moment a wakeup
        carries them, and hand them to `answer` there and then, before the waiting task
        resumes: a long-poll's answer is written from the enqueue's reply itself. `answer`
        runs inside a Redis reply's processing, so it must not raise; it says whether it
        answered (wrote) them, else the task does (see `carry`). The waiting task finds
        them in `taken`; a wakeup that cannot be answered so (see `take`) makes it re-read.
        `prepare` (epoch, stored time, message) is told of an enqueue this process sent to the
        queue while Redis stores it, so the answer can be made ready but for its seq."""
        self._expect = (answer, epoch, last_seq, from_seq, limit, budget)
        self._prepare = prepare
        self.taken = None

    def prepare(self, stored_ms: int, stored: Stored) -> None:
        # the first enqueue sent after `expect` only: the next message stored in the queue is
        # what carries the answer; later ones of a burst would only be prepared for nothing
        expect, prepare = self._expect, self._prepare
        if expect is not None and prepare is not None:
            self._prepare = None
            prepare(expect[1], stored_ms, stored)

    def forget(self) -> None:
        """Drop what wakeups carried so far: called before a read, which sees all of it."""
        self._carried = None
        self._plain = False
        self._expect = None
        self.taken = None

    def take(
        self, epoch: str, last_seq: int, from_seq: int | None, limit: int, budget: int
    ) -> list[Message] | None:
        """What the wakeups since the last read say is new, when they say all of it: the
        carried messages that follow that read (its `epoch`, `last_seq`) seq by seq, to be
        answered as a read of `limit` / `budget` at `from_seq` would answer them; [] when
        nothing new was carried. None when only a read can tell (a plain wakeup, a gap, another
        epoch, more than fits one answer). Consumes what was carried."""
        carried, plain = self._carried, self._plain
        self._carried = None
        self._plain = False
        if plain:
            return None
        out: list[Message] = []
        if carried is None:
            return out
        expect = last_seq + 1
        size = 0
        for ep, m in carried:
            if ep != epoch:
                return None
            seq = m.seq
            if seq < expect:
                continue  # covered by the read, or already taken (carried twice)
            if seq != expect or len(out) == limit or (out and size + len(m.payload) > budget):
                return None
            if from_seq is not None and seq < from_seq:
                return None
            out.append(m)
            size += len(m.payload)
            expect += 1
        return out

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
                if self._hub.healthy:
                    return False
                self._plain = True  # polling mode: treat the tick as a hint, to be read
                return True
        self._flag = False
        return True

    def close(self) -> None:
        self._hub._unregister(self)


_Expectation = tuple[Callable[[list[Message]], bool], str, int, int | None, int, int]
Prepare = Callable[[str, int, Stored], None]  # the queue's epoch, the stored time, the message


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


FOLLOWS = b":+"  # a wakeup head whose carried messages come in the very next wakeup


def parse_wakeup(data: bytes) -> tuple[int | None, str, list[Message] | None]:
    """(first enqueue time, epoch, carried messages) of a wakeup lua/enqueue.lua published:
    "<newest seq>:<time>:<epoch>", then per carried message "\n<seq>:<time>:<len messageId>:
    <len payload>\n<messageId><payload>". Messages None when it carries none, or is not of
    that form (an older relay's "<seq>:<time>", a migration's "moved"): a plain wakeup; []
    for a head ending ":+", whose messages the next wakeup on the channel carries."""
    cut = data.find(b"\n")
    head = data if cut < 0 else data[:cut]
    parts = head.split(b":", 2)
    try:
        enq_ms: int | None = int(parts[1])
    except (ValueError, IndexError):
        return None, "", None
    if cut < 0:
        return enq_ms, "", [] if len(parts) == 3 and head.endswith(FOLLOWS) else None
    if len(parts) < 3:
        return enq_ms, "", None
    messages: list[Message] = []
    end = len(data)
    pos = cut
    try:
        while pos < end:
            line_end = data.index(b"\n", pos + 1)
            seq, ts, mid_len, size = map(int, data[pos + 1 : line_end].split(b":"))
            mid_at = line_end + 1
            payload_at = mid_at + mid_len
            pos = payload_at + size
            if mid_len < 0 or size < 0 or pos > end:
                return enq_ms, "", None
            mid = data[mid_at:payload_at].decode() if mid_len else None
            messages.append(Message(seq, data[payload_at:pos], ts, mid))
    except ValueError:  # a malformed one (UnicodeDecodeError is one): read instead
        return enq_ms, "", None
    if not messages:
        return enq_ms, "", None
    return enq_ms, parts[2].decode(errors="replace"), messages


class WakeupHub:
    def __init__(
        self, url: str, shard: str = "default", on_reconnect: Callable[[], None] | None = None
    ) -> None:
        self.url = url
        # a redis+sentinel:// URL names no node: its primary is looked up on every connect
        self.target = RedisTarget.from_url(url) if not is_sentinel_url(url) else None
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
        self._node: tuple[str, int] | None = None  # the primary subscribed on (Sentinel shards)
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

    def carry(self, channel: str, stored_ms: int, epoch: bytes, seq: int, stored: Stored) -> bool:
        """A message an enqueue of this process stored (`seq` in `epoch`, at `stored_ms`),
        handed to this process's waiters on its channel as Redis answers the enqueue (its
        PUBLISH still wakes the others). True when a waiter here still answers from its task
        (Waiter.carry): the sender's answer should follow theirs; False when none waits here
        or each answered there and then."""
        chan = self._channels.get(channel)
        if chan is None or not chan.waiters:
            return False
        messages = [Message(seq, stored.payload, stored_ms, stored.message_id or None)]
        text = epoch.decode(errors="replace")
        pending = False
        for w in chan.waiters:
            if not w.carry(stored_ms, text, messages):
                pending = True
        return pending

    def prepare(self, channel: str, stored_ms: int, stored: Stored) -> None:
        """An enqueue of this process was sent to the queue of `channel` (to be stored at
        `stored_ms`): its waiters that expect an answer may prepare it (Waiter.expect)."""
        chan = self._channels.get(channel)
        if chan is not None:
            for w in chan.waiters:
                w.prepare(stored_ms, stored)

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
        """A Sentinel announced a failover to (host, port): unless subscribed there already,
        resubscribe on it (the session ends, the supervisor reconnects and every waiter
        re-reads). Heard once per Sentinel, as relay/storage/pipeline.py's connections."""
        if self._node != (host, port):
            self._close_writer()

    async def _open(self, timeout: float) -> Conn:
        """A logged-in connection to the shard's primary (found through Sentinel for a
        redis+sentinel:// URL, then checked with ROLE: never subscribe on a node Sentinel
        has not made primary yet, or one being demoted, where the PUBLISHes do not happen)."""
        if self.target is not None:
            return Conn(*await open_connection(self.target, timeout))
        if self._unwatch is None:
            self._unwatch = sentinel.watch(self.url, self._primary_changed)
        try:
            target = RedisTarget.from_url(await sentinel.primary_url(self.url))
        except sentinel.NoPrimary as exc:
            raise RedisConnectError(str(exc)[:200]) from None
        conn = Conn(*await open_connection(target, timeout))
        self._node = (target.host, target.port)
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

    def _cannot_connect(self, exc: BaseException, _: float) -> None:
        # RedisConnectError's text names the step and the reason, never the credentials
        reason = str(exc) if isinstance(exc, RedisConnectError) else type(exc).__name__
        self.last_error = reason
        log.warning("wakeup subscriber for shard %s cannot connect: %s", self.shard, reason)

    async def _supervise(self) -> None:
        sessions = 0
        while True:
            # until connected (its backoff starts over after each session); cancelled by stop()
            connect = retrying(WAKEUP_CONNECT, (OSError, TimeoutError), on_retry=self._cannot_connect)
            conn: Conn = await connect(self._open, 3.0)
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
            if chan is None or not chan.waiters:
                return  # (kept subscribed a while after its last waiter left: nobody to tell)
            if msg[2].startswith(NOTICE_PREFIX):
                for w in chan.waiters:
                    w.notice(msg[2][len(NOTICE_PREFIX) :])
                return
            enq_ms, epoch, messages = parse_wakeup(msg[2])
            if messages is None:
                for w in chan.waiters:
                    w.wake(enq_ms)
            elif messages:
                for w in chan.waiters:
                    w.carry(enq_ms, epoch, messages)
            # else: the head of a wakeup that carries them, next on this connection
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
