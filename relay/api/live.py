"""Live delivery over WebSocket: the backlog from fromSeq, an "empty" marker, then new messages.

One connection per queue, fleet-wide: the handler authenticates the upgrade request
(the same signature as any GET), takes the queue over from an older connection of this
process, and then reads client frames (acks and Pickup 2.0 messages) while a sender task
streams. The sender subscribes to the queue's wakeups, then takes the queue's live lease
(relay/presence.py), which publishes its takeover notice: an older connection on any relay
closes with 4409 and, once it writes nothing more, publishes its release. The newer one's
first delivery waits for that release (at most until the older lease would lapse), so no
frame reaches a displaced socket after the newer socket's first. The sender registers its
waiter before reading, keeps at most ``live_queue_max`` frames unacknowledged, reads
Redis in small batches (at most READ_BATCH messages and the response byte budget),
and re-resolves the queue's route on every wake so it follows a slot migration. Once
caught up, a wakeup that carries the messages following the last read is sent from
them without reading them back (relay/storage/wakeups.py Waiter.take); anything else
is read. Nothing is deleted without an ack.

A slow consumer costs bounded memory: frames are written with back-pressure (each
send waits for the socket to drain), the batch being sent is released message by
message, and a client whose socket accepts nothing for RELAY_LIVE_SEND_TIMEOUT_S is
dropped (connection aborted). Cleanup of the registry and the gauge runs however
the connection ends.

The wake path is kept short: a message frame is shaped as bytes directly, and a frame
the transport's buffer shows cannot block (nothing buffered, the frame under the
high-water mark) is written without arming a send deadline. Each socket's heartbeat
interval is spread (HEARTBEAT_S, jittered) and, with the server's timeout_ceil_threshold
above it (relay/http/serving.py), not rounded to whole seconds: 10,000 idle sockets
never ping in one loop turn.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import random
import struct
from functools import partial
from typing import Any

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from relay import boundedjson, metrics
from relay.api import bulk, params, pickup
from relay.api.context import CTX, Context, ctx
from relay.api.errors import ApiError, error_response
from relay.api.queues import parse_ack
from relay.didcomm.messages import PREFIXES
from relay.service import Unavailable
from relay.storage.message import Message
from relay.storage.store import ReadResult
from relay.storage.wakeups import Stored, Waiter

log = logging.getLogger("relay.live")

routes = web.RouteTableDef()

CLOSE_DISPLACED = 4409
DISPLACED_CLOSE_S = 2.0  # a displaced client's close handshake, at most; then it is aborted
READ_BATCH = 16  # messages per Redis read: bounds memory per connection (payloads reach 5 MiB)
HEARTBEAT_S = 20.0  # WebSocket ping interval (jittered ±10 % per socket); no pong within half of it closes
REREAD_S = 30.0  # a wakeup is a hint: re-read about this often even without one (jittered)
PRUNE_S = 5.0  # with the window full, look this often for unacked messages removed elsewhere
NOTICE_CHECK_S = 0.5  # while not reading (window full, paused), look for takeover notices this often
MAX_FRAME = 1 << 20  # client frames are acks and Pickup messages
_FRAME_HEAD = 10  # the longest header of a server frame (RFC 6455 section 5.2: no mask)
_WOKEN_FRAMES = metrics.LIVE_FRAMES.labels("wakeup")
_TASK_FRAMES = metrics.LIVE_FRAMES.labels("task")


def message_frame(m: Message) -> bytes:
    """Exactly what orjson writes for {"type": "message", "seq", "payload", "receivedAt",
    "messageId"}: the read answer's message object (relay/api/bulk.py) with the type in front."""
    return b'{"type":"message",' + bulk.message_bytes(m)[1:]


def frame_with_seq(seq: int, after_seq: bytes) -> bytes:
    """`message_frame` of the message at `seq` from its `bulk.after_seq`."""
    return b'{"type":"message","seq":%d%b' % (seq, after_seq)


def text_frame(data: bytes) -> bytes:
    """A server's final, unmasked text frame carrying `data` (RFC 6455 section 5.2), written
    whole as aiohttp's writer writes one: the frames sent from a wakeup go to the transport."""
    n = len(data)
    if n < 126:
        return b"%c%c%b" % (0x81, n, data)
    if n < 65536:
        return struct.pack("!BBH", 0x81, 126, n) + data
    return struct.pack("!BBQ", 0x81, 127, n) + data


def heartbeat_s() -> float:
    """This socket's ping interval: spread so sockets opened together do not ping together."""
    return HEARTBEAT_S * random.uniform(0.9, 1.1)


class SlowConsumer(Exception):
    """The client's socket accepted nothing for live_send_timeout_s; the connection is aborted."""


class LiveSession:
    """One live connection: the queue, the stream position and the unacked window."""

    def __init__(
        self,
        c: Context,
        ws: web.WebSocketResponse,
        recipient: bytes,
        channel: bytes,
        transport: asyncio.Transport | None = None,
    ) -> None:
        self.c = c
        self.ws = ws
        self.transport = transport  # aborted to drop a consumer that stopped reading
        self.recipient = recipient
        self.channel = channel
        self.window = max(1, c.settings.live_queue_max)
        self.inflight: collections.deque[int] = collections.deque()  # sent, not yet acked, ascending
        self.room = asyncio.Event()  # set while fewer than `window` frames are unacked
        self.room.set()
        self.streaming = asyncio.Event()  # cleared by Pickup live-delivery-change false
        self.streaming.set()
        # done once a newer connection took the queue over (a future, not an Event: _receive
        # waits on it as it is, with no task and coroutine per socket to wait on an Event)
        self.displaced: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.token = os.urandom(16).hex()  # the live lease's; a foreign takeover after ours displaces us
        self._takeover = b"t" + self.token.encode()  # our takeover notice (lua/presence.lua)
        self._awaited: bytes | None = None  # the release notice of the holder we displaced
        self.seen_own = False
        self.released = False
        self._parked = False  # the stream task waits in `_send_carried`, nothing else
        self._woken_next: int | None = None  # the seq after frames `_send_woken` wrote
        self._prepared: bulk.Prepared | None = None

    def release(self) -> None:
        """This connection writes no more frames: its live lease goes, and its release notice
        lets a newer connection, on any relay, deliver (once)."""
        if not self.released:
            self.released = True
            self.c.presence.drop(self.recipient, self.channel, self.token)

    def displace(self, via: str = "here") -> None:
        if not self.displaced.done():
            metrics.LIVE_DISPLACED.labels(via).inc()
            self.displaced.set_result(None)

    # -- pickup.LiveControl ------------------------------------------------
    @property
    def live_delivery(self) -> bool:
        return self.streaming.is_set()

    def set_live_delivery(self, on: bool) -> None:
        if on:
            self.streaming.set()
        else:
            self.streaming.clear()

    def acked(self, seqs: list[int]) -> None:
        gone = set(seqs)
        self.inflight = collections.deque(s for s in self.inflight if s not in gone)
        self._update_room()

    # -- window ------------------------------------------------------------
    def acked_upto(self, n: int) -> None:
        while self.inflight and self.inflight[0] <= n:
            self.inflight.popleft()
        self._update_room()

    def _update_room(self) -> None:
        if len(self.inflight) < self.window:
            self.room.set()
        else:
            self.room.clear()

    async def send(self, doc: dict[str, Any]) -> None:
        await self.send_text(orjson.dumps(doc))

    async def send_text(self, data: bytes) -> None:
        # uncompressed frames are written whole without yielding, so the sender
        # task and replies to client frames never interleave inside a frame; the
        # writer then waits for the socket to drain (back-pressure)
        if self._cannot_block(len(data)):
            await self.ws.send_frame(data, WSMsgType.TEXT)
            return
        try:
            async with asyncio.timeout(self.c.settings.live_send_timeout_s):
                await self.ws.send_frame(data, WSMsgType.TEXT)
        except TimeoutError:
            self.drop()
            raise SlowConsumer() from None

    def _cannot_block(self, size: int) -> bool:
        """Whether writing a frame of `size` bytes leaves the transport under its high-water
        mark with writing not paused (buffer at most the low-water mark: a paused transport
        resumes only below it): then the writer has no drain to wait for and the send needs
        no deadline (one timer less per frame)."""
        transport = self.transport
        if transport is None:
            return False
        buffered = transport.get_write_buffer_size()
        low, high = transport.get_write_buffer_limits()
        return buffered <= low and buffered + size + _FRAME_HEAD <= high

    def drop(self) -> None:
        """Abort the connection: its unsent frames are freed, the client reconnects."""
        if self.transport is not None and not self.transport.is_closing():
            metrics.LIVE_DROPPED.inc()
            log.warning("live consumer dropped: socket blocked for %ss", self.c.settings.live_send_timeout_s)
            self.transport.abort()

    # -- sender ------------------------------------------------------------
    async def stream(self, from_seq: int | None) -> None:
        """Send the backlog, then "empty", then new messages, until cancelled."""
        service = self.c.service
        next_seq = from_seq
        epoch: str | None = None
        sent_empty = False
        announced = False
        while True:
            route = service.fleet.route(self.recipient, self.channel)
            with route.hub.waiting(route.keys.wake) as waiter:
                await waiter.ready(1.0)  # subscribed before the first read: no lost wakeup
                if not announced:
                    # after subscribing, so our own notice comes back to us: notices after
                    # it are from newer connections (Redis delivers in publish order)
                    left_s, prev = await self.c.presence.take(
                        self.recipient, self.channel, self.token, partial(self.displace, "lease")
                    )
                    announced = True
                    if left_s > 0:
                        await self._await_release(waiter, prev, left_s)
                while True:
                    await self._idle_until(self.streaming, waiter)
                    await self._wait_for_room(waiter)
                    want = min(READ_BATCH, self.window - len(self.inflight))
                    waiter.forget()  # this read sees whatever woke us so far
                    result = await service.read(self.recipient, self.channel, next_seq, want, 0)
                    if epoch is not None and result.epoch != epoch:
                        # the queue's history was reset: its seqs start again
                        next_seq = None
                        self.inflight.clear()
                        self._update_room()
                        epoch = result.epoch
                        continue
                    epoch = result.epoch
                    got = len(result.messages)
                    newest = result.messages[-1].seq if got else 0
                    next_seq = await self._send_batch(result, next_seq)
                    if got == want or (got and newest < result.last_seq):
                        continue  # more backlog may be waiting (limit or byte budget reached)
                    if not sent_empty:
                        await self.send({"type": "empty"})
                        sent_empty = True
                    next_seq = await self._send_carried(waiter, result.epoch, result.last_seq, next_seq)
                    self._check_notices(waiter)
                    if self.displaced.done():
                        return  # _receive closes with 4409
                    if service.closing:
                        await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"relay shutting down")
                        return
                    if service.fleet.route(self.recipient, self.channel).hub is not route.hub:
                        break  # the queue moved to another shard: wait there

    async def _send_carried(self, waiter: Waiter, epoch: str, last_seq: int, next_seq: int) -> int:
        """Caught up after a read of `epoch` up to `last_seq`: wait, sending what wakeups
        carry while it is exactly what follows; return (the next seq) when the queue must be
        read: woken otherwise, after REREAD_S, window full, paused, noticed, shutting down.
        Parked in the wait, the frames of the first wakeup that carries what follows are
        written from the wakeup itself (`_send_woken`), before this task resumes."""
        budget = self.c.settings.limits.max_response_bytes
        while True:
            want = min(READ_BATCH, self.window - len(self.inflight))
            if want > 0:
                answer = partial(self._send_woken, waiter, epoch)
                waiter.expect(answer, epoch, last_seq, next_seq, want, budget, self._prepare)
            self._parked = True
            try:
                # jittered: thousands of sockets opened together must not all re-read at one moment
                woken = await waiter.wait(REREAD_S * random.uniform(0.75, 1.25))
            finally:
                self._parked = False
            if self._woken_next is not None:  # written from the wakeup: go on after them
                next_seq = self._woken_next
                last_seq = next_seq - 1
                self._woken_next = None
                unsent = None
            else:
                unsent = waiter.taken  # handed over, not written (`_send_woken` declined)
            waiter.taken = None
            if not woken or not self._may_send(waiter):
                break  # (`unsent` too is read again, from next_seq)
            if unsent:
                next_seq = await self._send_delivered(ReadResult(unsent, epoch, unsent[-1].seq), next_seq)
                last_seq = next_seq - 1
                if not self._may_send(waiter):
                    break
            want = min(READ_BATCH, self.window - len(self.inflight))
            got = waiter.take(epoch, last_seq, next_seq, want, budget)
            if got is None:
                break
            if got:
                next_seq = await self._send_delivered(ReadResult(got, epoch, got[-1].seq), next_seq)
                last_seq = next_seq - 1
        return next_seq

    def _prepare(self, epoch: str, stored_ms: int, stored: Stored) -> None:
        """relay.storage.wakeups.Prepare: an enqueue to this queue is on its way to Redis;
        make its frame ready now, while Redis stores it. Runs in the enqueue's path: never raises."""
        try:
            self._prepared = bulk.prepare(epoch, stored_ms, stored.payload, stored.message_id)
        except Exception as exc:
            self._prepared = None
            log.error("live frame not prepared: %s", type(exc).__name__, exc_info=exc)

    def _frame(self, m: Message, epoch: str) -> bytes:
        p, self._prepared = self._prepared, None
        if p is not None and p.matches(m, epoch):
            return frame_with_seq(m.seq, p.after_seq)
        return message_frame(m)

    def _may_send(self, waiter: Waiter) -> bool:
        """Whether carried messages may be sent now: streaming, room in the window, no notice
        to look at first, not shutting down."""
        return (
            self.streaming.is_set()
            and self.room.is_set()
            and not waiter.notices
            and not self.c.service.closing
        )

    async def _send_delivered(self, batch: ReadResult, next_seq: int) -> int:
        self.c.service.count_delivered(batch)
        return await self._send_batch(batch, next_seq)

    def _send_woken(self, waiter: Waiter, epoch: str, messages: list[Message]) -> bool:
        """Write the frames of `messages` (exactly the next seqs, within the window: Waiter.expect)
        from the wakeup that carried them, as the stream task would, when nothing can come
        between: the task parked in `_send_carried`'s wait, the socket open and not displaced,
        a wait for nothing (`_may_send`, no notice) and the transport's buffer room for all of
        them (`_cannot_block`). Otherwise the task sends them, or reads them again. Runs inside
        the processing of a Redis reply: never raises. True when it wrote them."""
        transport = self.transport
        try:
            if (
                not self._parked
                or transport is None
                or transport.is_closing()
                or self.ws.closed
                or self.displaced.done()
                or not self._may_send(waiter)
            ):
                return False
            data = b"".join([text_frame(self._frame(m, epoch)) for m in messages])
            if not self._cannot_block(len(data)):
                return False
            transport.write(data)
            self.inflight.extend([m.seq for m in messages])
            self._update_room()
            self._woken_next = messages[-1].seq + 1
            _WOKEN_FRAMES.inc(len(messages))
            self.c.service.count_delivered(ReadResult(messages, epoch, messages[-1].seq))
        except Exception as exc:  # a frame half written cannot be taken back: end the connection
            log.error("live frame from a wakeup failed: %s", type(exc).__name__, exc_info=exc)
            if transport is not None:
                transport.abort()
            return False
        return True

    async def _send_batch(self, result: ReadResult, next_seq: int | None) -> int:
        if not result.messages:
            return next_seq if next_seq is not None else result.last_seq + 1
        last = result.messages[-1].seq
        pending = result.messages[::-1]
        result.messages.clear()  # each payload is freed once its frame is written
        while pending:
            m = pending.pop()
            await self.send_text(message_frame(m))
            self.inflight.append(m.seq)
            _TASK_FRAMES.inc()
            del m
        self._update_room()
        return last + 1

    async def _wait_for_room(self, waiter: Waiter) -> None:
        """Backpressure: with the window full, read nothing more until acks arrive."""
        while not self.room.is_set():
            await self._idle_until(self.room, waiter, PRUNE_S)
            if not self.room.is_set():
                await self._prune()

    async def _idle_until(self, event: asyncio.Event, waiter: Waiter, limit_s: float = math.inf) -> None:
        """Wait for `event` (at most `limit_s`) while still noticing newer connections elsewhere."""
        loop = asyncio.get_running_loop()
        end = loop.time() + limit_s
        while not event.is_set() and (left := end - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(NOTICE_CHECK_S, left))
            self._check_notices(waiter)

    async def _await_release(self, waiter: Waiter, prev: str, left_s: float) -> None:
        """Before the first delivery: wait until the connection this one displaced released
        the queue (it writes nothing more), or until its lease would have lapsed (its relay
        is gone). Notices are read as they come; messages wait for the first read."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + left_s
        self._awaited = b"r" + prev.encode()
        while True:
            self._check_notices(waiter)
            left = end - loop.time()
            if self._awaited is None or left <= 0 or self.displaced.done():
                break
            await waiter.wait(left)
        self._awaited = None
        metrics.LIVE_TAKEOVER_SECONDS.observe(loop.time() - start)

    def _check_notices(self, waiter: Waiter) -> None:
        """A foreign takeover after our own: a newer connection, elsewhere in the fleet. A
        release: an older connection stopped writing (`_await_release`)."""
        while waiter.notices:
            notice = waiter.notices.popleft()
            if notice[:1] == b"r":
                if notice == self._awaited:
                    self._awaited = None
            elif notice == self._takeover:
                self.seen_own = True
            elif self.seen_own:
                self.displace("notice")

    async def _prune(self) -> None:
        """Forget unacked frames whose messages were removed another way (HTTP ack, drain, retention)."""
        if not self.inflight:
            return
        first = await self.c.service.read(self.recipient, self.channel, self.inflight[0], 1, 0)
        oldest_held = first.messages[0].seq if first.messages else None
        while self.inflight and (oldest_held is None or self.inflight[0] < oldest_held):
            self.inflight.popleft()
        self._update_room()

    # -- client frames -----------------------------------------------------
    async def on_text(self, data: str) -> None:
        try:
            doc = boundedjson.loads(data, None, "the frame")  # the socket capped its size
        except boundedjson.JsonLimitError as exc:
            text = "frame must be a JSON object" if exc.code == "bad_json" else exc.text
            await self.send_error(exc.code, text)
            return
        if isinstance(doc, dict) and "@type" in doc:
            await self.on_pickup(doc)
        elif isinstance(doc, dict) and doc.get("type") == "ack":
            await self.on_ack(doc)
        else:
            await self.send_error("bad_frame", 'expected {"type": "ack", ...} or a Pickup 2.0 message')

    async def on_ack(self, doc: dict[str, Any]) -> None:
        try:
            up_to, seqs = parse_ack(doc)
        except ApiError as exc:
            await self.send_error(exc.code, exc.text)
            return
        await self.c.service.ack(self.recipient, self.channel, up_to, seqs)
        if up_to is not None:
            self.acked_upto(up_to)
        else:
            self.acked(seqs or [])

    async def on_pickup(self, doc: dict[str, Any]) -> None:
        prefix = PREFIXES[0]
        offending = doc.get("@id") if isinstance(doc.get("@id"), str) else None
        try:
            msg = pickup.parse_message(doc)
            prefix = msg.prefix
            key = msg.recipient_key
            if key is not None and pickup.recipient_from_key(key) != self.recipient:
                raise pickup.PickupError("recipient_key is not the key this connection proved")
            reply = await pickup.answer(self.c, msg, self.recipient, self.channel, self)
        except pickup.PickupError as exc:
            reply = pickup.problem_report(prefix, offending, exc.text)
        await self.send(reply)

    async def send_error(self, code: str, text: str) -> None:
        await self.send({"type": "error", "code": code, "error": text})


@routes.get("/v1/queues/{recipient}/live")
async def live(request: web.Request) -> web.StreamResponse:
    c = ctx(request)
    recipient = params.recipient_key(request.match_info["recipient"])
    channel = params.channel_of(request)
    from_seq = params.from_seq(request)
    ws = web.WebSocketResponse(heartbeat=heartbeat_s(), max_msg_size=MAX_FRAME, compress=False)
    if not ws.can_prepare(request).ok:
        return error_response(
            426, "websocket_required", "this endpoint speaks WebSocket only", {"Upgrade": "websocket"}
        )
    await c.auth.verify(request, recipient)
    if c.service.closing:
        raise Unavailable("relay shutting down")
    await ws.prepare(request)
    key = (recipient, channel)
    session = LiveSession(c, ws, recipient, channel, request.transport)
    c.live.take_over(key, session)  # an older connection of this process closes itself with 4409
    metrics.LIVE_CONNECTIONS.inc()
    sender = asyncio.get_running_loop().create_task(session.stream(from_seq))
    try:
        await _receive(session, sender)
    finally:
        # first the bookkeeping, with no await before it: it must run however the
        # connection ended (the sender's error, the client gone, this handler cancelled)
        sender.cancel()
        c.live.release(key, session)
        metrics.LIVE_CONNECTIONS.dec()
        # then collect the sender's end (its errors were answered in _receive, or the
        # client is gone) and close, neither of which may raise out of the handler
        await asyncio.gather(sender, return_exceptions=True)
        if not ws.closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(c.settings.live_send_timeout_s):
                    await ws.close()
            if not ws.closed:
                session.drop()
        session.release()  # it writes nothing more: its lease goes
    return ws


async def _receive(session: LiveSession, sender: asyncio.Task[None]) -> None:
    """Handle client frames until the connection or the sender ends."""
    ws = session.ws
    loop = asyncio.get_running_loop()
    reader = asyncio.ensure_future(ws.receive())
    displaced = session.displaced
    try:
        while True:
            # asyncio.wait(FIRST_COMPLETED) without its two coroutines and set per wait: a
            # socket waits so as long as it is open, and at 10,000 sockets every object one
            # holds lengthens the garbage collector's full passes
            watched = (reader, sender, displaced)
            woke = loop.create_future()
            wake = partial(_set_done, woke)
            for f in watched:
                f.add_done_callback(wake)
            try:
                await woke
            finally:
                for f in watched:
                    f.remove_done_callback(wake)
            if displaced.done():
                # closed from its own task with no receive pending, so the close
                # handshake completes and the client sees 4409 cleanly; bounded, as the
                # newer connection's first delivery waits for it (a dead client is aborted)
                reader.cancel()
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sender
                closing = asyncio.ensure_future(
                    ws.close(code=CLOSE_DISPLACED, message=b"displaced by a newer live connection")
                )
                # close() writes its frame before it first waits: after one loop turn the close
                # frame follows every frame this socket got, and the newer one may deliver
                await asyncio.sleep(0)
                session.release()
                try:
                    async with asyncio.timeout(DISPLACED_CLOSE_S):
                        await closing
                except TimeoutError:
                    session.drop()
                return
            if sender.done():
                await _sender_ended(session, sender)
                return
            msg = reader.result()
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return
            if msg.type == WSMsgType.TEXT:
                try:
                    await session.on_text(msg.data)
                except Unavailable:
                    await session.send_error("unavailable", "temporarily unavailable; send the frame again")
            elif msg.type == WSMsgType.BINARY:
                await session.send_error("bad_frame", "frames must be text (JSON)")
            reader = asyncio.ensure_future(ws.receive())
    except (ConnectionError, SlowConsumer):
        return  # the peer went away while we answered, or stopped reading
    except Exception as exc:  # never a traceback into the HTTP middleware after the upgrade
        log.error("live connection failed: %s", type(exc).__name__, exc_info=exc)
        await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")
    finally:
        displaced.cancel()
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


def _set_done(fut: asyncio.Future[None], _: object) -> None:
    """A done callback: `fut` done once one of the futures it watches is."""
    if not fut.done():
        fut.set_result(None)


async def _sender_ended(session: LiveSession, sender: asyncio.Task[None]) -> None:
    exc = None if sender.cancelled() else sender.exception()
    if exc is None or isinstance(exc, (ConnectionError, SlowConsumer)):
        return  # shut down, the peer went away mid-send, or it was dropped
    if isinstance(exc, Unavailable):
        code, text = WSCloseCode.TRY_AGAIN_LATER, b"shard unavailable; reconnect"
    else:
        log.error("live sender failed: %s", type(exc).__name__, exc_info=exc)
        code, text = WSCloseCode.INTERNAL_ERROR, b"internal error"
    await session.ws.close(code=code, message=text)


async def _close_all(app: web.Application) -> None:
    for conn in list(app[CTX].live.by_queue.values()):
        await conn.ws.close(code=WSCloseCode.GOING_AWAY, message=b"relay shutting down")


def setup(app: web.Application) -> None:
    app.on_shutdown.append(_close_all)
