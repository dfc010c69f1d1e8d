"""The relay's one hand-written Redis client: the hot path's pipelined RESP connection.

Every other connection goes through redis-py (asyncio, hiredis parsing). This module stays
hand-written because of a measurement (tools/relayfleet_testing/resp_bench.py, one run on a
2-core machine at load average 15-17 from other work: ratios, not absolute figures; see
docs/design-decisions.md, "One Redis stack"): 20,000 EVALSHA calls shaped like an enqueue
(3 keys, a 256 B payload, 6 small arguments; a 3-element reply), 256 concurrent callers at
a time over one connection, cost 18.4 us of client CPU per call through `ScriptBatcher`,
41.5 us through redis-py's asyncio pipeline on one connection (x2.3) and 171 us through
concurrent ``evalsha`` calls on a 4-connection pool (x9.3); reading 20,000 PUBLISHed 200 B
wakeups cost the hand-written subscriber (`Conn`) 0.9 us per message and redis-py's
``PubSub.get_message`` 25.9 us (x28).

What is here: RESP encoding (commands pre-encoded as bytes, parts cached by callers), the
raw connection (TCP or unix socket, TLS from redis-py's own context for the URL, AUTH,
SELECT, PING), `Conn` (a stream read as it arrives: the wakeup subscriber, the snapshot's
replication stream) and `ScriptBatcher`, which coalesces concurrent script calls into
pipelines: one awaited round trip per request caps a process near 9k req/s; sending every
call that arrived while the previous pipeline was in flight as one batch lifts that
ceiling (docs/architecture.md). URLs are parsed by redis-py (relay/storage/connection.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar, cast

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from relay.fleet.sharding import is_sentinel_url
from relay.storage import sentinel
from relay.storage.boot import mark_boot
from relay.storage.connection import RedisConnectError, RedisTarget, ssl_reason
from relay.storage.scripts import ALL, Script

# -- RESP -------------------------------------------------------------------------------

Arg = bytes | str | int


def bulk_str(value: str) -> bytes:
    raw = value.encode()
    return b"$%d\r\n%b\r\n" % (len(raw), raw)


def bulk(a: Arg) -> bytes:
    if isinstance(a, bytes):
        return b"$%d\r\n%b\r\n" % (len(a), a)
    if isinstance(a, str):
        return bulk_str(a)
    raw = b"%d" % a
    return b"$%d\r\n%b\r\n" % (len(raw), raw)


def encode(*args: Arg) -> bytes:
    """One command in RESP, packed by hiredis (in C: a presence renewal's 11 arguments 3.4
    against 10.3 us, a load sweep's 75 arguments 17 against 87 us, on the loaded machine);
    hiredis takes no bool (an int to Python), which is written as its digit as before."""
    try:
        packed: bytes = hiredis.pack_command(cast(Any, args))  # (its stub types a 1-tuple)
        return packed
    except TypeError:
        return b"".join([b"*%d\r\n" % len(args), *[bulk(a) for a in args]])


class Conn:
    """A stream pair spoken to in RESP, read as it arrives: `send` a command, hand what
    `read` returns to `received`. Replies are parsed by hiredis; a Redis error reply is
    returned as a `hiredis.ReplyError`, never raised."""

    __slots__ = ("_rd", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._rd = hiredis.Reader()

    def send(self, *args: Arg) -> None:
        self.writer.write(encode(*args))

    def received(self, data: bytes) -> list[Any]:
        """The replies `data` completes (a reply cut across reads is kept until its end arrives)."""
        self._rd.feed(data)
        out: list[Any] = []
        while (reply := self._rd.gets()) is not False:
            out.append(reply)
        return out

    async def read(self, idle: float | None = None) -> bytes:
        """The next bytes the server sends (b"" once it has closed the connection); TimeoutError
        when it sends nothing for `idle` seconds. asyncio.timeout, not wait_for: Python 3.11's
        wait_for returns the data when a cancellation lands just as the read completes, and
        a cancelled task that goes on reading keeps its connection open."""
        if idle is None:
            return await self.reader.read(65536)
        async with asyncio.timeout(idle):
            return await self.reader.read(65536)

    async def reply(self, idle: float | None = None) -> Any:
        """The next reply; ConnectionError when the server closes the connection, TimeoutError
        when it sends nothing for `idle` seconds."""
        while (reply := self._rd.gets()) is False:
            data = await self.read(idle)
            if not data:
                raise ConnectionError("the server closed the connection")
            self._rd.feed(data)
        return reply

    async def call(self, *args: Arg, idle: float | None = None) -> Any:
        """One command and its reply (only while nothing else is in flight on the connection)."""
        self.send(*args)
        return await self.reply(idle)

    def close(self) -> None:
        self.writer.close()


# -- connecting -------------------------------------------------------------------------


def login_commands(target: RedisTarget) -> list[tuple[str, bytes]]:
    """The commands a new connection sends before its first real one, with a safe label each.
    The PING proves the connection works end to end: with TLS 1.3 a server that refuses our
    client certificate says so only after the client's handshake has finished."""
    steps: list[tuple[str, bytes]] = []
    if target.password is not None:
        who = (target.username,) if target.username else ()
        steps.append(("AUTH", encode("AUTH", *who, target.password)))
    if target.db:
        steps.append(("SELECT", encode("SELECT", target.db)))
    steps.append(("PING", encode("PING")))
    return steps


async def open_connection(
    target: RedisTarget, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A logged-in stream pair to `target`; RedisConnectError, or TimeoutError past `timeout`."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**16, loop=loop)
    transport, proto = await open_protocol(
        target, lambda: asyncio.StreamReaderProtocol(reader, loop=loop), timeout
    )
    return reader, asyncio.StreamWriter(transport, proto, reader, loop)


P = TypeVar("P", bound=asyncio.BaseProtocol)


async def _connect_tcp(
    loop: asyncio.AbstractEventLoop, target: RedisTarget
) -> tuple[asyncio.Transport, _Login]:
    """create_connection to each address of `target.host` in turn, resolved here first. The
    loop is never handed a name: uvloop's create_connection resolves it in a future that a
    cancelled connect (our timeout, while DNS hangs) leaves behind, and its gaierror is then
    logged as "Future exception was never retrieved". loop.getaddrinfo cancels cleanly."""
    ctx = target.ssl_context()
    infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    failure: OSError = OSError(f"{target.host} has no address")
    for family, _, proto, _, sockaddr in infos:
        try:
            return await loop.create_connection(
                _Login,
                str(sockaddr[0]),
                target.port,
                family=family,
                proto=proto,
                ssl=ctx,
                server_hostname=target.host if ctx is not None else None,
            )
        except ssl.SSLError:
            raise
        except OSError as exc:
            failure = exc
    raise failure


async def open_protocol(
    target: RedisTarget, factory: Callable[[], P], timeout: float
) -> tuple[asyncio.Transport, P]:
    """Connect (TLS if the URL says so), log in, then hand the transport to a protocol made by
    `factory`; RedisConnectError, or TimeoutError past `timeout`. The transport is never left
    open on failure."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        try:
            if target.unix_path is not None:
                transport, login = await loop.create_unix_connection(_Login, target.unix_path)
            else:
                transport, login = await _connect_tcp(loop, target)
        except ssl.SSLError as exc:
            reason = ssl_reason(exc)
            raise RedisConnectError(f"TLS handshake with {target.address} failed: {reason}") from None
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise RedisConnectError(f"cannot connect to {target.address}: {reason}") from None
        try:
            await login.run(target, transport)
        except BaseException:
            transport.abort()
            raise
    proto = factory()
    transport.set_protocol(proto)
    proto.connection_made(transport)
    return transport, proto


class _Login(asyncio.Protocol):
    """Sends the login commands and checks their replies, before the real protocol takes over."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._replies: asyncio.Queue[object] = asyncio.Queue()

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                self._replies.put_nowait(reply)
        except hiredis.ProtocolError:
            self._replies.put_nowait(RedisConnectError("the server does not speak RESP"))

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, ssl.SSLError):
            reason = f"TLS {ssl_reason(exc)}"
        else:
            reason = "the connection was closed" if exc is None else type(exc).__name__
        self._replies.put_nowait(RedisConnectError(reason))

    async def run(self, target: RedisTarget, transport: asyncio.BaseTransport) -> None:
        steps = login_commands(target)
        cast(asyncio.Transport, transport).write(b"".join(cmd for _, cmd in steps))
        for label, _ in steps:
            reply = await self._replies.get()
            if isinstance(reply, RedisConnectError):
                hint = ""
                if target.tls and not target.options.get("ssl_certfile"):
                    # a server demanding a client certificate often just resets (TLS 1.3)
                    hint = "; if the server requires a client certificate, set ssl_certfile and ssl_keyfile"
                raise RedisConnectError(f"{label} on {target.address}: {reply}{hint}")
            if isinstance(reply, hiredis.ReplyError):
                # Redis's own error text (WRONGPASS, NOAUTH, ERR DB index...) holds no secret
                raise RedisConnectError(f"{label} on {target.address} refused: {str(reply)[:120]}")
        if not self._replies.empty():
            raise RedisConnectError(f"{target.address} sent replies nobody asked for")


# -- the pipeline -----------------------------------------------------------------------


class StoreUnavailable(Exception):
    """The shard's Redis did not answer; the caller answers 503 + Retry-After."""


class StoreOutcomeUnknown(StoreUnavailable):
    """The command was sent but its reply never came (timeout, connection lost): Redis
    may have run it. A write must find out what happened before it answers (see
    QueueService.enqueue); nothing here resends it."""


class StoreFailover(StoreUnavailable):
    """The command was refused or never sent because the node is not (or no longer) a
    writable primary (READONLY, LOADING, MASTERDOWN, no connection): nothing happened, so
    any operation may be retried once the primary is found again."""


class ReplicationTimeout(StoreUnavailable):
    """The write is applied on the primary but WAIT saw fewer replicas than the shard's
    minReplicas within its timeout: answered 503, the write may exist (retry with the
    same Idempotency-Key is safe)."""


class StoreRejected(Exception):
    """Redis refused the write (e.g. OOM under noeviction); the caller answers 507."""


class ReplySink(Protocol):
    """Where one command's reply goes: an asyncio.Future, or an object that acts on the
    reply at once (saves a future and a loop turn per command on hot paths)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


# One command's RESP: its bytes, or parts written as they are (a large payload is not copied
# into one buffer again: the transport writes the parts with one writev).
Wire = bytes | list[bytes]
_Item = tuple[Wire, ReplySink]  # one encoded command, where its reply goes


class Deferred(Protocol):
    """A command still open to more work (one script call carrying several requests,
    relay/storage/store.py): its bytes are settled, once, when its batch is sent."""

    def seal(self) -> Wire: ...


_Queued = tuple["bytes | Deferred", ReplySink]


def encode_evalsha(script: Script, keys: tuple[str, ...], args: tuple[Arg, ...]) -> bytes:
    """EVALSHA of `script` as RESP (`encode`)."""
    return encode("EVALSHA", script.sha, len(keys), *keys, *args)


# Replies of a node that cannot take writes now: a demoted primary (READONLY), one still
# loading its data, a replica whose primary is gone. Nothing ran; the primary is elsewhere.
_FAILOVER_ERRORS = ("READONLY", "LOADING", "MASTERDOWN", "NOREPLICAS")


# Login refused, or a command refused for want of one: the credentials in use are wrong or
# missing (a password that changed, or a credentials file not mounted yet).
_AUTH_ERRORS = ("NOAUTH", "WRONGPASS", "AuthenticationError", "invalid password")


def is_auth_failure(reason: str) -> bool:
    return any(marker in reason for marker in _AUTH_ERRORS)


def _classify(reply: hiredis.ReplyError) -> Exception:
    text = str(reply)
    if "OOM" in text or "maxmemory" in text:
        return StoreRejected("out of memory")
    if text.startswith(_FAILOVER_ERRORS):
        return StoreFailover(text.split(" ", 1)[0][:40])
    return StoreUnavailable(text.split("\n", 1)[0][:200])


class _Hold:
    """A write's reply sink while its batch's WAIT is outstanding (minReplicas >= 1): the
    reply is kept until WAIT confirms enough replicas hold it, errors pass at once."""

    __slots__ = ("replied", "reply", "sink")

    def __init__(self, sink: ReplySink) -> None:
        self.sink = sink
        self.reply: Any = None
        self.replied = False

    def done(self) -> bool:
        return self.replied or self.sink.done()

    def set_result(self, result: Any, /) -> None:
        self.reply = result
        self.replied = True

    def set_exception(self, exception: BaseException, /) -> None:
        if not self.sink.done():
            self.sink.set_exception(exception)


class _WaitReply:
    """WAIT's reply sink: releases (or fails) the writes of its batch that have replied."""

    __slots__ = ("fenced", "holds", "needed")

    def __init__(self, holds: list[_Hold], needed: int, fenced: Callable[[], bool]) -> None:
        self.holds = holds
        self.needed = needed
        self.fenced = fenced

    def done(self) -> bool:
        return False

    def set_result(self, result: Any, /) -> None:
        if self.fenced():
            # A Sentinel holds this primary down: a replica may be promoted while the one
            # that confirmed these writes still follows us, then follow the new primary and
            # drop them. Unconfirmed, not refused: retried with their tokens (or 503).
            self._fail(StoreUnavailable("a Sentinel holds the primary down; write not confirmed"))
        elif isinstance(result, int) and result >= self.needed:
            for h in self.holds:
                if h.replied and not h.sink.done():
                    h.sink.set_result(h.reply)
        else:
            self._fail(ReplicationTimeout(f"{result} of {self.needed} replica(s) confirmed the write"))

    def set_exception(self, exception: BaseException, /) -> None:
        # the write ran but its replication is unknown: never report it as a refusal
        reason = str(exception) or type(exception).__name__
        self._fail(StoreUnavailable(reason) if isinstance(exception, StoreFailover) else exception)

    def _fail(self, exc: BaseException) -> None:
        for h in self.holds:
            if h.replied and not h.sink.done():
                h.sink.set_exception(exc)


def _never() -> bool:
    return False


def _with_wait(
    items: list[_Item], needed: int, timeout_ms: int, fenced: Callable[[], bool] = _never
) -> list[_Item]:
    """`items` followed by one WAIT covering every held write among them (Redis runs one
    connection's commands in order, so WAIT counts the replicas that hold all of them)."""
    holds = [sink for _, sink in items if isinstance(sink, _Hold)]
    if not holds:
        return items
    return [*items, (encode("WAIT", needed, timeout_ms), _WaitReply(holds, needed, fenced))]


class _Batch:
    __slots__ = ("deadline", "items", "may_reload", "paced", "pos", "retry")

    def __init__(self, items: list[_Item], may_reload: bool, paced: bool = False) -> None:
        self.items = items
        self.pos = 0
        self.may_reload = may_reload
        # holds a command sent with at_once (an enqueue call): its answer says the connection
        # is busy with them (ScriptBatcher.submit_to)
        self.paced = paced
        self.retry: list[_Item] = []
        self.deadline = 0.0  # loop time by which its replies must have come (_Resp.send)


class _Resp(asyncio.Protocol):
    """One Redis connection: batches written in order, replies matched in order."""

    def __init__(self, owner: ScriptBatcher) -> None:
        self.owner = owner
        self.reader = hiredis.Reader()
        self.waiting: deque[_Batch] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.demoted = False
        self.node: tuple[str, int] | None = None  # (host, port) it is connected to (Sentinel shards)
        # One reply timer per connection, not per batch (arming and cancelling one per batch
        # showed on the wake path): armed for the earliest deadline of the batches waiting,
        # left armed when they are answered; when due it aborts if a waiting batch is overdue,
        # else re-arms for the earliest one still waiting, if any.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError:
                self.abort("protocol error")
                return
            if reply is False:
                return
            if not waiting:  # a reply nobody asked for: the stream is out of step
                self.abort("unexpected reply")
                return
            batch = waiting[0]
            item = batch.items[batch.pos]
            batch.pos += 1
            sink = item[1]
            if not sink.done():
                if isinstance(reply, hiredis.ReplyError):
                    if batch.may_reload and str(reply).startswith("NOSCRIPT"):
                        batch.retry.append(item)
                    else:
                        exc = _classify(reply)
                        sink.set_exception(exc)
                        if isinstance(exc, StoreFailover):
                            self.demoted = True
                else:
                    sink.set_result(reply)
            if batch.pos == len(batch.items):
                waiting.popleft()
                self.owner._batch_done(batch)
            if self.demoted:
                # This node no longer takes writes: drop the connection so the next one
                # finds the primary again (Sentinel), and answer the rest as not run.
                self.abort("not a writable primary", failover=True)
                return

    def send(self, batch: _Batch, timeout: float | None = None) -> None:
        """Write `batch`; without a reply in `timeout` (default: the batcher's for its size)
        the connection is aborted and the batch's commands get StoreOutcomeUnknown."""
        assert self.transport is not None
        parts: list[bytes] = []
        split = False
        for command, _ in batch.items:
            if isinstance(command, bytes):
                parts.append(command)
            else:
                parts += command
                split = True
        # written first, its bookkeeping after: no reply can be read before this returns
        if split:
            self.transport.writelines(parts)
            size = sum([len(p) for p in parts])
        else:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            self.transport.write(data)
            size = len(data)
        self.track(batch, size, timeout)

    def track(self, batch: _Batch, size: int, timeout: float | None = None) -> None:
        """Expect the replies of `batch` (`size` bytes), just written, within `timeout`."""
        if timeout is None:
            timeout = self.owner.reply_timeout(size, len(batch.items))
        self.waiting.append(batch)
        loop = asyncio.get_running_loop()
        batch.deadline = deadline = loop.time() + timeout
        if self._timer is None or deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(deadline, self._due)
            self._timer_at = deadline

    def _due(self) -> None:
        self._timer = None
        if self.lost or not self.waiting:
            return
        loop = asyncio.get_running_loop()
        first = min([batch.deadline for batch in self.waiting])
        if first <= loop.time():
            self.abort("timeout")
        else:
            self._timer = loop.call_at(first, self._due)
            self._timer_at = first

    def abort(self, reason: str, failover: bool = False) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._fail_all(reason, failover)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(type(exc).__name__ if exc is not None else "connection closed")

    def _fail_all(self, reason: str, failover: bool = False) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self.waiting = self.waiting, deque()
        for batch in waiting:
            if failover:  # refused (and what followed was refused too): nothing ran
                _fail(batch.items[batch.pos :] + batch.retry, StoreFailover(reason))
            else:
                # written, no reply: Redis may have run them; NOSCRIPT retries did not run
                _fail(batch.items[batch.pos :], StoreOutcomeUnknown(reason))
                _fail(batch.retry, StoreUnavailable(reason))
            batch.retry = []
            self.owner._batch_done(batch)


# A connection with no at_once command (an enqueue call) answered for this long is idle:
# submit_to(at_once=True) and write_now send at once.
IDLE_SEND_S = 0.001

# Reply deadlines grow with the bytes a batch moves at this rate (a floor well under
# loopback and LAN speed): a 5 MiB enqueue or an 8 MiB read gets its transfer time on top
# of the base, a batch of small writes only the base.
_MIN_BYTES_PER_S = 32 * 1024 * 1024


class ScriptBatcher:
    """One Redis connection of a shard and the pipeline feeding it.

    A shard has two (relay/storage/store.py): a hot one for writes and small replies
    and a bulk one for reads and drains, so a huge reply never sits in front of a small
    write (docs/api.md, "Hostile traffic"). Each batch's reply deadline is `reply_timeout`
    plus the transfer time of what it sends and of `reply_bytes` per command.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        url: str,
        max_inflight: int = 3,
        max_batch: int = 512,
        connect_timeout: float = 2.0,
        reply_timeout: float = 5.0,
        reply_bytes: int = 0,
        min_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        fence_in_failover: bool = True,
    ) -> None:
        self._client = client  # writes the boot mark of a new connection (boot.py); the rest is raw
        # >= 1: every durable write is answered only once WAIT confirms that many replicas
        self.min_replicas = min_replicas
        self._wait_timeout_ms = wait_timeout_ms
        # minReplicas writes confirmed while a Sentinel holds the primary down are failed as
        # unconfirmed (and resent). Not for drains (the bulk lane): a drain that ran is never
        # resent, so failing it would lose what it removed; answered, it is at worst
        # delivered again if the failover rolls its removal back.
        self._fence_in_failover = fence_in_failover
        self._url = url  # a redis+sentinel:// URL is resolved on every connect
        if not is_sentinel_url(url):
            RedisTarget.from_url(url)  # a bad URL fails here, not at the first request
        self._max_inflight = max_inflight
        self._max_batch = max_batch
        self._connect_timeout = connect_timeout
        self._reply_timeout = reply_timeout
        self._reply_bytes = reply_bytes
        self._pending: deque[_Queued] = deque()
        self._inflight = 0
        self._scheduled = False
        self._last_done = 0.0  # loop time the last batch with an at_once command was answered
        self._paced_pending = False  # an at_once command is pending (see submit_to)
        self._paced_inflight = 0  # batches in flight holding one
        self._conn: _Resp | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._unwatch: Callable[[], None] | None = None  # Sentinel failover notices
        # told why a new connection failed (the shard's owner re-reads credentials on AUTH)
        self.on_connect_failure: Callable[[str], None] | None = None

    def reply_timeout(self, sent_bytes: int, commands: int) -> float:
        """Seconds a batch of `commands` sending `sent_bytes` may wait for its replies."""
        # a batch that ends in WAIT may spend its whole timeout there before replying
        wait_s = self._wait_timeout_ms / 1000 if self.min_replicas else 0.0
        return self._reply_timeout + wait_s + (sent_bytes + commands * self._reply_bytes) / _MIN_BYTES_PER_S

    def call(
        self, script: Script, keys: tuple[str, ...], args: tuple[Arg, ...], durable: bool = False
    ) -> asyncio.Future[Any]:
        return self.submit(encode_evalsha(script, keys, args), durable)

    def submit(self, command: bytes, durable: bool = False) -> asyncio.Future[Any]:
        """Send one RESP-encoded command with the next pipeline; the future gets its reply."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.submit_to(command, fut, durable)
        return fut

    def submit_to(
        self, command: bytes | Deferred, sink: ReplySink, durable: bool = False, at_once: bool = False
    ) -> None:
        """As `submit`, the reply (or StoreUnavailable / StoreRejected) handed to `sink`.
        A `Deferred` command is sealed only when its batch is sent (until then, in this loop
        tick or while the pipeline is full, it may take more work). A `durable` command (a
        write the client is told about) waits for WAIT when the shard has minReplicas;
        ReplicationTimeout when too few replicas confirm it.

        `at_once`: when no batch holding an at_once command is in flight or was answered
        for IDLE_SEND_S, send it now, not at the next loop turn: a lone request on a quiet
        connection (the enqueue a long-poll waits for) saves a loop turn, while requests that
        arrive busily still gather into batches (one script call each, relay/storage/store.py).
        Other commands in flight or just answered (a presence lease, INFO) do not make the
        connection busy: counted, a bench wake's enqueue waited a loop turn behind the
        follow-up's lease in about a fifth of the wakes (docs/design-decisions.md)."""
        if durable and self.min_replicas:
            sink = _Hold(sink)
        self._pending.append((command, sink))
        if at_once:
            self._paced_pending = True
        if (
            at_once
            and self._paced_inflight == 0
            and self._inflight < self._max_inflight
            and not self._scheduled  # (else this tick's others are pending: it joins them)
            and asyncio.get_running_loop().time() - self._last_done >= IDLE_SEND_S
        ):
            self._flush()
        else:
            self._kick()

    def write_now(self, command: bytes) -> bool:
        """Write `command` now if the connection is idle: up, nothing pending, no at_once command
        in flight or answered for IDLE_SEND_S, no replica to confirm it; False (nothing done)
        otherwise. Once written, the caller hands its reply sink to `written` before it yields to
        the loop (no reply is read sooner). The write comes before any bookkeeping: on an idle relay each
        statement runs from cold caches, and before the write it is in the wake's critical path."""
        conn = self._conn
        if (
            conn is None
            or conn.lost
            or self._paced_inflight
            or self._inflight >= self._max_inflight
            or self._scheduled
            or self._pending
            or self.min_replicas
            or asyncio.get_running_loop().time() - self._last_done < IDLE_SEND_S
        ):
            return False
        assert conn.transport is not None
        conn.transport.write(command)
        return True

    def written(self, command: bytes, sink: ReplySink) -> None:
        """`command`, which `write_now` just wrote, gets its reply in `sink`."""
        conn = self._conn
        assert conn is not None
        self._inflight += 1
        self._paced_inflight += 1
        conn.track(_Batch([(command, sink)], may_reload=True, paced=True), len(command))

    async def close(self) -> None:
        self._closed = True
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._connecting is not None:
            self._connecting.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort("store closed")
        pending, self._pending = list(self._pending), deque()
        _fail(pending, StoreUnavailable("store closed"))
        for task in list(self._tasks):
            task.cancel()

    def _kick(self) -> None:
        if not self._scheduled and self._inflight < self._max_inflight:
            self._scheduled = True
            # call_soon lets every request parsed in this loop iteration join the batch
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if not self._pending:
            return
        conn = self._conn
        if conn is None or conn.lost:
            self._conn = None
            if self._connecting is None:
                self._connecting = self._spawn(self._connect())
            return
        paced, self._paced_pending = self._paced_pending, False
        while self._pending and self._inflight < self._max_inflight:
            n = min(len(self._pending), self._max_batch)
            items = [_sealed(self._pending.popleft()) for _ in range(n)]
            if self.min_replicas:
                items = _with_wait(items, self.min_replicas, self._wait_timeout_ms, self._fenced)
            self._inflight += 1
            self._paced_inflight += paced
            conn.send(_Batch(items, may_reload=True, paced=paced))
        if self._pending:  # (left for a later flush: it still holds them)
            self._paced_pending = self._paced_pending or paced

    def _batch_done(self, batch: _Batch) -> None:
        self._inflight -= 1
        if batch.paced:
            self._paced_inflight -= 1
            self._last_done = asyncio.get_running_loop().time()
        if batch.retry:
            self._reload_and_resend(batch.retry)
        if self._pending:
            self._kick()

    def _reload_and_resend(self, items: list[_Item]) -> None:
        # Redis lost its script cache (restart, SCRIPT FLUSH): load once, resend once.
        # Redis runs one connection's commands in order, so the loads land first.
        conn = self._conn
        if conn is None or conn.lost:
            _fail(items, StoreUnavailable("connection lost"))
            return
        if self.min_replicas:  # their first WAIT released nothing: they had not replied yet
            items = _with_wait(items, self.min_replicas, self._wait_timeout_ms, self._fenced)
        self._inflight += 1
        conn.send(_Batch([*_script_loads(), *items], may_reload=False))

    async def _connect(self) -> None:
        try:
            conn = await asyncio.wait_for(self._open(), self._connect_timeout)
        except Exception as exc:  # whatever went wrong, the waiting callers get an answer
            pending, self._pending = list(self._pending), deque()
            reason = str(exc) if isinstance(exc, StoreUnavailable) else type(exc).__name__
            _fail(pending, StoreFailover(reason))  # none of them was sent
            if self.on_connect_failure is not None:
                self.on_connect_failure(reason)
            return
        finally:
            self._connecting = None
        if self._closed:
            conn.abort("store closed")
            return
        self._conn = conn
        self._kick()

    def _fenced(self) -> bool:
        return self._fence_in_failover and sentinel.suspected(self._url)

    def _primary_changed(self, host: str, port: int) -> None:
        """A Sentinel announced a failover to (host, port): leave any other node now, not at
        its next error (what was in flight on it may have run: answered as unknown, not as
        refused). Heard once per Sentinel: a connection made since the first notice to a node
        a lagging Sentinel still named moves at the next one; one on the new primary stays."""
        conn = self._conn
        if conn is not None and not conn.lost and conn.node != (host, port):
            self._conn = None
            conn.abort("primary changed")

    async def _open(self) -> _Resp:
        if self._unwatch is None and is_sentinel_url(self._url):
            self._unwatch = sentinel.watch(self._url, self._primary_changed)
        try:
            url = await sentinel.primary_url(self._url)
        except sentinel.NoPrimary as exc:
            raise StoreFailover(str(exc)[:200]) from None
        try:
            target = RedisTarget.from_url(url)  # parsed once per URL (cached)
            _, conn = await open_protocol(target, lambda: _Resp(self), self._connect_timeout)
        except RedisConnectError as exc:
            raise StoreUnavailable(str(exc)) from None
        conn.node = (target.host, target.port)
        # a new connection often means a restarted Redis: record the run (lost-tail
        # detection, relay/storage/boot.py) before any script can run, then load them
        with _handshake(conn):
            await mark_boot(self._client, waited=self.min_replicas > 0)
        # ROLE before the first script: a demoted primary (or a replica a lagging Sentinel
        # still names) must never get a write
        loop = asyncio.get_running_loop()
        hello = [encode("ROLE")]
        handshake = [(cmd, _watched(loop.create_future())) for cmd in hello] + _script_loads()
        conn.send(_Batch([*handshake], may_reload=False), self._connect_timeout)
        self._inflight += 1  # _batch_done balances it
        with _handshake(conn):
            replies = await asyncio.gather(*[fut for _, fut in handshake])
            if not sentinel.role_is_primary(replies[len(hello) - 1]):
                # a Sentinel that has not seen the failover yet, or a node being demoted
                raise StoreFailover("the node Sentinel named is not a primary")
        return conn

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _sealed(queued: _Queued) -> _Item:
    command, sink = queued
    return (command, sink) if isinstance(command, bytes) else (command.seal(), sink)


def _script_loads() -> list[tuple[bytes, asyncio.Future[Any]]]:
    """SCRIPT LOAD of every script, each with a future nobody awaits (errors surface later)."""
    loop = asyncio.get_running_loop()
    items: list[tuple[bytes, asyncio.Future[Any]]] = []
    for script in ALL:
        items.append((encode("SCRIPT", "LOAD", script.source), _watched(loop.create_future())))
    return items


def _watched(fut: asyncio.Future[Any]) -> asyncio.Future[Any]:
    fut.add_done_callback(_consume)
    return fut


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved, so asyncio does not log it


@contextlib.contextmanager
def _handshake(conn: _Resp) -> Iterator[None]:
    """A failed handshake step aborts the new connection (never left open) and becomes
    StoreUnavailable; a connect timeout (cancellation) aborts it and propagates."""
    try:
        yield
    except (StoreUnavailable, StoreRejected) as exc:
        conn.abort("handshake failed")
        raise StoreUnavailable(f"handshake failed: {exc}") from None
    except (RedisError, OSError) as exc:
        conn.abort("handshake failed")
        raise StoreUnavailable(f"handshake failed: {type(exc).__name__}") from None
    except BaseException:
        conn.abort("handshake timed out")
        raise


def _fail(items: list[_Item] | list[_Queued], exc: Exception) -> None:
    for _, sink in items:
        if not sink.done():
            sink.set_exception(exc)
