"""The HTTP fast path: clean `POST /v1/queues/{recipient}/messages` enqueues and
`GET /v1/queues/{recipient}/messages` reads (long-polls) served without aiohttp's request
machinery, everything else handed to aiohttp.

Every connection starts on `FastConnection`, a callback-based asyncio protocol: no Task
per enqueue, no Request/Response objects, no router per request. It parses a deliberately
narrow grammar (HTTP/1.1, the exact enqueue path with at most `?channel=<base64url>`, or the
read path with only the read's own query parameters, token-named ASCII headers, one
Content-Length within the payload cap (none or 0 for a read), no Transfer-Encoding,
Content-Encoding, Expect, Upgrade or Connection other than keep-alive, no duplicated
header). The request is validated by the same functions as the aiohttp handler
(relay/api/params, auth, queues, failures). An enqueue is sent with
QueueService.enqueue_into (the request's answer slot is the outcome sink, called as Redis's
reply is read) and answered from there; a read runs in a task, and a long-poll is answered
from the wakeup that carries its messages, inside the processing of the enqueue's reply
(Waiter.expect). Answers go out in request order under pipelining; the requests after a
read wait until it is answered, as on aiohttp's path. A read also starts only once every
enqueue before it on the connection is answered (stored): reads go over another Redis
connection than enqueues (the shard's bulk lane), so nothing else keeps a pipelined read
from overtaking them. The same holds behind an enqueue that takes its recipient's admit
round trip first (a non-default channel, QueueService.admits_first): a later request could
otherwise run before it. Pipelined default-channel enqueues stay in flight together (one
connection to their shard keeps their order).

Anything else — another route, a malformed or unusual request, a body that would
claim memory — is not its business: at that request's boundary (once the answers
owed before it are written) the connection, with every byte buffered, is handed to
aiohttp's hardened protocol (relay/http/serving.py GuardedRequestHandler), which answers
it exactly as it answers every request when this path is off (RELAY_HTTP_FASTPATH=0).

Until the handoff this protocol keeps the same bounds as that handler: the header
timeout (armed at connect and at a new request's first byte), the keep-alive idle
timeout, the body timeout (408), the connection cap (ConnectionGuard), the memory
guard (503 overloaded), and the same metrics. It logs nothing about a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections import deque
from email.utils import formatdate
from functools import partial
from typing import NamedTuple, cast

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from relay import metrics
from relay.api import bulk, params
from relay.api.context import Context
from relay.api.errors import ApiError, error_response, overloaded
from relay.api.failures import code_of, error_for
from relay.api.queues import enqueue_answer, next_seq, read_bytes
from relay.api.quota import Address, ClientQuota
from relay.http.memguard import CLAIM_FROM
from relay.http.serving import MAX_LINE, GuardedServer
from relay.metrics import RouteSeries
from relay.storage.store import EnqueueOutcome, EnqueueRequest, ReadResult, new_tuple
from relay.storage.wakeups import Stored

ROUTE = "/v1/queues/{recipient}/messages"  # the aiohttp route's canonical name (metrics label)

# The one request line served here. Anything else (percent-escapes, other query
# parameters, a fragment, another version) goes to aiohttp, which parses URLs fully.
_REQUEST_LINE_TEXT = (
    rb"POST /v1/queues/([A-Za-z0-9_-]{1,200})/messages(?:\?channel=([A-Za-z0-9_-]{0,200}))? HTTP/1\.1"
)
_REQUEST_LINE = re.compile(_REQUEST_LINE_TEXT)
# A read (long-poll) of the same path: its query only of the read's own parameters, each at
# most once, values of the characters those take (no escapes); anything else is aiohttp's.
_READ_LINE = re.compile(
    rb"GET (/v1/queues/([A-Za-z0-9_-]{1,200})/messages(?:\?([A-Za-z0-9_.&=-]{0,512}))?) HTTP/1\.1"
)
_READ_PARAMS = frozenset((b"channel", b"fromSeq", b"limit", b"wait"))
# A header line: a token name, optional whitespace, a value of visible ASCII, spaces and tabs.
_NAME_TEXT = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_VALUE_TEXT = rb"(?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?"
_HEADER = re.compile(rb"(%b):[ \t]*(%b)[ \t]*" % (_NAME_TEXT, _VALUE_TEXT))
# The header lines of a head of that grammar in one match (no class holds CR or LF, so
# each line is matched on its own), and its fields as (name, value) pairs.
_BLOCK = re.compile(rb"(?:\r\n%b:[ \t]*%b[ \t]*)*" % (_NAME_TEXT, _VALUE_TEXT))
_FIELDS = re.compile(rb"\r\n(%b):[ \t]*(%b)" % (_NAME_TEXT, _VALUE_TEXT))
_DIGITS = re.compile(rb"[0-9]{1,18}")
# A clean block holds each header at most once (header_fields): the client behind a trusted proxy.
_FORWARDED = re.compile(rb"\r\nx-forwarded-for:[ \t]*(%b)" % _VALUE_TEXT, re.IGNORECASE)
# Headers whose presence changes framing or the connection: aiohttp's business.
_FOREIGN = frozenset((b"transfer-encoding", b"content-encoding", b"expect", b"upgrade", b"http2-settings"))
MAX_HEAD = MAX_LINE  # aiohttp's line limit, for the whole head: a longer one is left to aiohttp
# Flow control (as aiohttp's protocol has it): a connection stops being read while it owes
# OWED_HIGH answers or its transport is above the write high-water mark, and is read again
# once it owes at most OWED_LOW and the transport is below its low-water mark.
OWED_HIGH = 64
OWED_LOW = 16
MAX_LINES = 64  # more header lines than any client sends: aiohttp's business
_PREFIX = b"POST /v1/queues/"
_READ_PREFIX = b"GET /v1/queues/"
# A client sends the same header lines request after request (only the recipient in the
# request line changes): their fields are kept by the exact bytes, in a bounded table.
_HEADER_BLOCKS_MAX = 512
_HEADER_BLOCK_BYTES = 1024
# The queues named by recent request lines, decoded: a long-poll's queue is named again by the
# enqueue that wakes it, and a sender's by its next enqueue (~8 µs of decoding on an idle
# relay, in the wake's path). Bounded like the header lines' table (~300 B an entry).
_QUEUES_MAX = 1024

_SERVER = SERVER_SOFTWARE.encode()
_REASONS = {201: b"Created", 200: b"OK"}


# What aiohttp writes for web.Response(status, body, content_type="application/json"),
# in its order: the status line and Content-Type, Content-Length, Date, Server.
_OK_HEADS = {
    status: b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: " % (status, reason)
    for status, reason in _REASONS.items()
}
_date_tail: list[object] = [-1, b""]  # [second, b"\r\nDate: ...\r\nServer: ...\r\n\r\n"]


def _head_bytes(status: int, length: int) -> bytes:
    """The head aiohttp writes for a JSON answer of `length` bytes (web.Response(status, body,
    content_type="application/json"), or a StreamResponse given that type and length); the
    Date and Server lines built once a second (Date is aiohttp's own per-second text)."""
    second = int(time.time())
    if second != _date_tail[0]:
        date = formatdate(usegmt=True).encode()
        _date_tail[:] = [second, b"\r\nDate: %s\r\nServer: %s\r\n\r\n" % (date, _SERVER)]
    return b"%s%d%s" % (_OK_HEADS[status], length, _date_tail[1])


def _ok_bytes(status: int, body: bytes) -> bytes:
    """What aiohttp writes for web.Response(status, body, content_type="application/json")."""
    return _head_bytes(status, len(body)) + body


def header_fields(block: bytes) -> tuple[bytes | None, bytes | None, int | None] | None:
    """Idempotency-Key, Authorization and Content-Length (None: absent) of clean header lines
    (`block`: the head after its request line), else None (aiohttp's business)."""
    if block.count(b"\r\n") >= MAX_LINES or _BLOCK.fullmatch(block) is None:
        return None
    pairs = _FIELDS.findall(block)
    fields = {name.lower(): value for name, value in pairs}
    if len(fields) != len(pairs) or not _FOREIGN.isdisjoint(fields):
        return None  # a header twice, or one that changes framing or the connection
    value = fields.get(b"content-length")
    if value is not None and _DIGITS.fullmatch(value) is None:
        return None
    connection = fields.get(b"connection")
    if connection is not None and connection.lower() != b"keep-alive":
        return None
    if b"host" not in fields:
        return None  # RFC 9112 section 3.2: aiohttp's path answers it 400
    return fields.get(b"idempotency-key"), fields.get(b"authorization"), None if value is None else int(value)


def read_query(query: bytes | None) -> _ReadQuery | None:
    """The read's parameters of a query the read line matched; None when it has any other
    parameter, one twice, or a pair without exactly one "=" (aiohttp's business)."""
    found: dict[bytes, bytes] = {}
    if query:
        for pair in query.split(b"&"):
            name, eq, value = pair.partition(b"=")
            if not eq or b"=" in value or name not in _READ_PARAMS or name in found:
                return None
            found[name] = value
    get = found.get
    return _ReadQuery(get(b"channel"), get(b"fromSeq"), get(b"limit"), get(b"wait"))


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


def response_bytes(response: web.Response, close: bool) -> bytes:
    """A built web.Response as aiohttp serialises it on an HTTP/1.1 connection."""
    body = response.body
    assert isinstance(body, bytes)
    lines = [b"HTTP/1.1 %d %s" % (response.status, response.reason.encode())]
    headers = response.headers
    for name, value in headers.items():
        lines.append(f"{name}: {value}".encode())
    if "Content-Length" not in headers:
        lines.append(b"Content-Length: %d" % len(body))
    if "Date" not in headers:
        lines.append(b"Date: " + formatdate(usegmt=True).encode())
    if "Server" not in headers:
        lines.append(b"Server: " + _SERVER)
    if close and "Connection" not in headers:
        lines.append(b"Connection: close")
    lines.append(b"")
    lines.append(body)
    return b"\r\n".join(lines)


class FastEndpoint:
    """What every fast connection of one app shares: the context, limits and metric series."""

    __slots__ = (
        "auth",
        "cap",
        "header_blocks",
        "memory",
        "queues",
        "quota",
        "read_series",
        "series",
        "service",
        "settings",
    )

    def __init__(self, ctx: Context) -> None:
        self.settings = ctx.settings
        self.service = ctx.service
        self.auth = ctx.auth
        self.memory = ctx.memory
        self.quota = ctx.quota
        self.cap = ctx.settings.max_payload
        self.series = RouteSeries(ROUTE, "POST")
        self.read_series = RouteSeries(ROUTE, "GET")
        self.header_blocks: dict[bytes, tuple[bytes | None, bytes | None, int | None]] = {}
        # (recipient, channel) as matched in a request line -> the queue they name (_queue_of)
        self.queues: dict[tuple[bytes, bytes | None], tuple[bytes, bytes]] = {}

    def accepts_body(self, length: int) -> bool:
        # a body that would claim memory (relay/http/memguard.py) is left to aiohttp's path
        return length <= self.cap and (length < CLAIM_FROM or self.memory.ceiling is None)


FAST_ENDPOINT = web.AppKey("relayfleet_fast_endpoint", FastEndpoint)


class _ReadQuery(NamedTuple):
    """A read's query parameters as sent (None: absent)."""

    channel: bytes | None
    from_seq: bytes | None
    limit: bytes | None
    wait: bytes | None


class _Head(NamedTuple):
    """A clean enqueue's or read's head: what the request line and header lines said."""

    recipient: bytes
    channel: bytes | None
    key: bytes | None
    authorization: bytes | None
    length: int
    read: _ReadQuery | None = None  # a read's parameters; None for an enqueue
    target: bytes = b""  # a read's path and query as sent (what its signature covers)


class _Pending(NamedTuple):
    """A request whose head was parsed and whose body is still arriving."""

    head: _Head
    start: float  # perf_counter at its head (the route's latency)


class _Prepared(NamedTuple):
    """The answer a long-poll gets if the message an enqueue of this process is storing is
    the one it is woken with (the same payload object, time, messageId and epoch)."""

    payload: bytes
    stored_ms: int
    message_id: str | None
    epoch: str
    template: tuple[bytes, bytes]  # relay/api/bulk.py answer_template


class _Answer:
    """One request's answer slot, in request order; where its enqueue's outcome goes
    (relay.service.OutcomeSink: called while Redis's reply is read, so it never raises),
    or its read's result."""

    __slots__ = ("close", "conn", "data", "prepared", "series", "size", "start", "task", "turn")

    def __init__(self, conn: FastConnection, start: float, series: RouteSeries) -> None:
        self.conn = conn
        self.start = start
        self.series = series
        self.data: bytes | None = None
        self.close = False
        self.size = 0  # body bytes counted by the memory guard while it is owed
        self.task: asyncio.Task[None] | None = None  # a read's, cancelled if the client leaves
        self.turn: asyncio.Future[None] | None = None  # a streamed read's: set once it is first
        self.prepared: _Prepared | None = None  # a long-poll's answer but for its seq

    def prepare(self, epoch: str, stored_ms: int, stored: Stored) -> None:
        """relay.storage.wakeups.Prepare: an enqueue to this long-poll's queue is on its way
        to Redis; make the answer it would get ready now, while Redis stores it."""
        try:
            mid = stored.message_id or None
            template = bulk.answer_template(stored.payload, stored_ms, mid, epoch)
            self.prepared = _Prepared(stored.payload, stored_ms, mid, epoch, template)
        except Exception as exc:  # runs in an enqueue's path: never let it fail that
            self.conn.broken(exc)

    def _woken_body(self, result: ReadResult) -> bytes | None:
        """The answer's body from the prepared template when `result` is just the prepared
        message (a payload of at most relay.service.CARRY_LOCAL_BYTES: never one to stream)."""
        p = self.prepared
        messages = result.messages
        if p is not None and len(messages) == 1:
            m = messages[0]
            if (
                m.payload is p.payload
                and m.received_ms == p.stored_ms
                and m.message_id == p.message_id
                and result.epoch == p.epoch
            ):
                return bulk.from_template(m.seq, p.template)
        return None

    def read_result(self, from_seq: int | None, result: ReadResult, body: bytes | None = None) -> bool:
        """Answer a read with `result` (as relay/api/queues.py read_response would, for one
        not worth streaming; `body`: its answer's body when already made); run from a wakeup
        as it arrives (Waiter.expect): never raises. True when its answer is made (written,
        or queued behind the answers owed before it)."""
        conn = self.conn
        try:
            if self.data is not None or conn.transport is None:
                return False
            if body is None:
                body = self._woken_body(result) or read_bytes(result, from_seq)
            self.data = _head_bytes(200, len(body)) + body
            self.prepared = None
            conn.flush()
            series = self.series  # counted once written: a woken long-poll's answer goes first
            series.count(200)
            series.observe(time.perf_counter() - self.start)
        except Exception as exc:
            conn.broken(exc)
            return False
        return True

    def early(self, from_seq: int | None, result: ReadResult) -> bool:
        """relay.service.EarlyAnswer: a long-poll answered from the wakeup that carried its
        messages, unless the answer is one to stream (its task does that). The wake's usual
        case, the message prepared while Redis stored it, skips the streaming test."""
        try:
            body = self._woken_body(result)
        except Exception as exc:  # runs in an enqueue's reply: never raises
            self.conn.broken(exc)
            return False
        if body is None and bulk.worth_streaming(result.messages):
            return False
        return self.read_result(from_seq, result, body)

    def done(self) -> bool:
        return self.data is not None

    def set_result(self, outcome: EnqueueOutcome, /) -> None:
        conn = self.conn
        try:
            try:
                status, body = enqueue_answer(outcome)
            except Exception as exc:  # refused by Redis (rate limit, caps, conflict): the JSON answer
                conn.refused(self, exc)
                return
            series = self.series
            series.count(status)
            series.observe(time.perf_counter() - self.start)
            self.data = _ok_bytes(status, body)
            conn.flush()
        except Exception as exc:
            conn.broken(exc)

    def set_exception(self, exception: BaseException, /) -> None:
        try:
            self.conn.refused(self, exception)
        except Exception as exc:
            self.conn.broken(exc)

    def cancel(self) -> bool:
        self.set_exception(asyncio.CancelledError())
        return True


class FastConnection(asyncio.Protocol):
    """One client connection while it sends clean enqueues (see the module docstring)."""

    __slots__ = (
        "_answers",
        "_armed_count",
        "_blocked_by",
        "_body_deadline",
        "_body_have",
        "_body_parts",
        "_body_timer",
        "_buf",
        "_client",
        "_closing",
        "_drained",
        "_guard",
        "_handing_off",
        "_header_timer",
        "_held",
        "_idle_since",
        "_keepalive_timer",
        "_loop",
        "_peer",
        "_pending",
        "_read_paused",
        "_requests",
        "_write_paused",
        "endpoint",
        "server",
        "transport",
    )

    def __init__(self, server: GuardedServer, endpoint: FastEndpoint) -> None:
        self.server = server
        self.endpoint = endpoint
        self._guard = server.guard
        self._loop = server.guard.loop
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._answers: deque[_Answer] = deque()
        self._requests = 0  # complete header blocks seen
        self._armed_count = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline = 0.0  # the loop time by which the pending request's body is due
        self._idle_since = 0.0
        self._pending: _Pending | None = None
        self._body_parts: list[bytes] = []
        self._body_have = 0
        self._handing_off = False
        self._closing = False
        self._read_paused = False  # by flow control (not by a hand-off or a 408)
        self._write_paused = False  # the transport is above its write high-water mark
        self._held = 0  # request bytes buffered here, as counted by the memory guard
        self._drained: asyncio.Future[None] | None = None  # a streamed answer waiting to write
        # the answer the next request waits for, as on aiohttp's path: a read in progress (no
        # enqueue after it runs first), an enqueue owed before a read (the read would overtake
        # it: another Redis connection), or one admitted first (see QueueService.admits_first)
        self._blocked_by: _Answer | None = None
        # the per-client quota's view of the peer: its address, and the client it is (None:
        # a trusted proxy, whose requests each name their client)
        self._peer: Address | None = None
        self._client: int | None = None

    # -- connection lifecycle ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio subclass
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # closed already
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        quota = self.endpoint.quota
        if quota is not None:
            self._peer, self._client = quota.peer_key(self.transport.get_extra_info("peername"))
        self._arm_headers()
        self._idle_since = self._loop.time()
        self._arm_keepalive()
        self._guard.opened(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        # answers still owed are counted when Redis replies (the messages are stored once);
        # reads still owed end now: a long-poll whose client left stops waiting at once
        self.transport = None
        for answer in self._answers:
            if answer.task is not None:
                answer.task.cancel()
        self._wake_writer()
        self._cancel_timers()
        self._guard.closed(self)
        self._buf = b""
        self._body_parts = []
        self._count_held()

    def eof_received(self) -> bool | None:
        return None  # as aiohttp's protocol: the transport closes

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._keepalive_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._keepalive_timer = self._body_timer = None

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._cancel_timers()

    # -- ConnectionGuard's view (same as GuardedRequestHandler's) ---------------------
    def waiting_for_headers(self) -> bool:
        # a connection flow control stopped reading waits for its client, not the reverse
        return (
            self.transport is not None
            and self._requests == self._armed_count
            and not self._handing_off
            and not self._read_paused
            and self._blocked_by is None
        )

    def idle(self) -> bool:
        return (
            self.transport is not None
            and not self._answers
            and not self._buf
            and self._pending is None
            and not self._handing_off
        )

    def shed(self) -> None:
        self._close()

    # -- flow control ---------------------------------------------------------------------
    def pause_writing(self) -> None:
        """The transport's write buffer passed its high-water mark (the client is not reading
        its answers): read no more requests until it drains."""
        self._write_paused = True
        metrics.HTTP_READ_PAUSES.labels("write_buffer").inc()
        if not self._handing_off:
            self._stop_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()
        if len(self._answers) <= OWED_LOW:
            self._resume_reading()

    def _wake_writer(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _backlogged(self) -> None:
        """Stop reading: the connection owes OWED_HIGH answers or its client is not reading
        them (the check, in _parse, is inline: per request it costs a len and a read)."""
        if not self._read_paused and not self._write_paused:
            metrics.HTTP_READ_PAUSES.labels("answers_owed").inc()
        self._stop_reading()

    def _stop_reading(self) -> None:
        if not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        """Read again (called once the answers owed are down to OWED_LOW): the requests
        already buffered are parsed first, on the next loop turn (not inside a flush)."""
        if not self._read_paused or self._write_paused or self._closing or self._handing_off:
            return
        self._read_paused = False
        if self.transport is not None:
            self.transport.resume_reading()
            if self._buf:
                self._loop.call_soon(self._parse_buffered)

    def _parse_buffered(self) -> None:
        self._parse()
        self._count_held()

    def _count_held(self) -> None:
        """Tell the memory guard how many request bytes this connection buffers (called once
        per read, not per request; a dispatched request's body is counted until answered)."""
        held = len(self._buf) + (self._body_have if self._pending is not None else 0)
        if held != self._held:
            self.endpoint.memory.held += held - self._held
            self._held = held

    # -- timers -------------------------------------------------------------------------
    def _arm_headers(self) -> None:
        self._armed_count = self._requests
        self._header_timer = self._guard.arm(self, self._headers_due)

    def _headers_due(self) -> None:
        self._header_timer = None
        self._guard.timed_out(self)
        if self.waiting_for_headers() and self._pending is None:
            metrics.HEADER_TIMEOUTS.inc()
            self._close()
        elif self._buf and self._pending is None and not self._handing_off and self.transport:
            self._arm_headers()  # a later request's head began before this timer was due

    def _arm_keepalive(self) -> None:
        timeout = self._guard.keepalive_timeout_s
        if timeout > 0 and self._keepalive_timer is None:
            self._keepalive_timer = self._loop.call_at(self._idle_since + timeout, self._keepalive_due)

    def _keepalive_due(self) -> None:
        self._keepalive_timer = None
        if not self.idle():
            return  # re-armed when it next goes idle
        due = self._idle_since + self._guard.keepalive_timeout_s
        if self._loop.time() < due:
            self._keepalive_timer = self._loop.call_at(due, self._keepalive_due)
        else:
            self._close()

    def _body_due(self) -> None:
        self._body_timer = None
        pending = self._pending
        if pending is None or self.transport is None:
            return
        if self._loop.time() < self._body_deadline:  # armed for an earlier body, or early
            self._body_timer = self._loop.call_at(self._body_deadline, self._body_due)
            return
        self._pending = None
        self._body_parts = []
        self._count_held()
        timeout_s = self.endpoint.settings.body_timeout_s
        exc = ApiError(
            408, "body_timeout", f"request body not received within {timeout_s:g} s", {"Connection": "close"}
        )
        answer = _Answer(self, pending.start, self.endpoint.series)
        self._answers.append(answer)
        self._stop_reading()
        self._closing = True
        self.refused(answer, exc)

    # -- reading ------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._handing_off:  # read before the pause took hold: aiohttp's too
            self._buf += data
            return
        pending = self._pending
        if pending is not None:
            self._body_parts.append(data)
            self._body_have += len(data)
            if self._body_have >= pending.head.length:
                self._body_complete()
            self._count_held()
            return
        self._buf = self._buf + data if self._buf else data
        if self._read_paused:  # read before the pause took hold: parsed once it ends
            self._count_held()
            return
        # bytes of a request head with no timer running arm the header timeout
        if self._header_timer is None:
            self._arm_headers()
        self._parse()
        self._count_held()

    def _parse(self) -> None:
        while self._buf and not self._handing_off and self.transport is not None and self._pending is None:
            if self._blocked_by is not None:
                if len(self._buf) > MAX_HEAD:
                    self._stop_reading()  # parsed (and read again) once the read is answered
                return
            if self._write_paused or len(self._answers) >= OWED_HIGH:
                self._backlogged()
                return
            buf = self._buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD or not self._may_become_enqueue(buf):
                    self._hand_off_soon()  # aiohttp refuses a bad line as soon as it sees it
                return
            head = self._request_head(buf[:end]) if end <= MAX_HEAD else None
            if head is None:
                self._hand_off_soon()
                return
            if head.read is not None and self._answers:
                # enqueues before it are still owed: it waits (unparsed, parsed again) until
                # they are answered, or its read could reach Redis before them
                self._blocked_by = self._answers[-1]
                continue
            self._requests += 1
            start = time.perf_counter()
            body_start = end + 4
            length = head.length
            if len(buf) - body_start >= length:
                self._buf = buf[body_start + length :]
                self._dispatch(head, buf[body_start : body_start + length], start)
                continue
            self._buf = b""
            self._pending = _Pending(head, start)
            rest = buf[body_start:]
            self._body_parts = [rest] if rest else []
            self._body_have = len(rest)
            # one timer per connection, left armed when a body completes and re-armed when
            # due for a later one (a timer per split body showed at 64 KiB)
            self._body_deadline = self._loop.time() + self.endpoint.settings.body_timeout_s
            if self._body_timer is None:
                self._body_timer = self._loop.call_at(self._body_deadline, self._body_due)
            return

    def _body_complete(self) -> None:
        pending = self._pending
        assert pending is not None
        self._pending = None
        length = pending.head.length
        joined = self._body_parts[0] if len(self._body_parts) == 1 else b"".join(self._body_parts)
        self._body_parts = []
        self._buf = joined[length:]
        self._dispatch(pending.head, joined[:length], pending.start)
        self._parse()

    @staticmethod
    def _may_become_enqueue(partial: bytes) -> bool:
        """Whether an incomplete head is still a clean enqueue or read so far (checked only
        for heads split across reads)."""
        prefix, line = (_READ_PREFIX, _READ_LINE) if partial[:1] == b"G" else (_PREFIX, _REQUEST_LINE)
        n = min(len(partial), len(prefix))
        if partial[:n] != prefix[:n]:
            return False
        if partial.count(b"\n") != partial.count(b"\r\n"):
            return False  # a bare LF: aiohttp answers it 400 at once (RFC 9112 section 2.2)
        lines = partial.split(b"\r\n")[:-1]  # the last one may be incomplete
        if not lines:
            return True
        if not partial.isascii() or line.fullmatch(lines[0]) is None:
            return False
        return all(_HEADER.fullmatch(line) is not None for line in lines[1:])

    def _request_head(self, head: bytes) -> _Head | None:
        """The fields of an enqueue or read head this path serves, else None (aiohttp's business)."""
        if not head.isascii():
            return None
        cut = head.find(b"\r\n")
        if cut < 0:
            cut = len(head)
        line = _REQUEST_LINE.fullmatch(head, 0, cut)
        if line is None:
            return self._read_head(head, cut)
        endpoint = self.endpoint
        block = head[cut:]
        fields = endpoint.header_blocks.get(block)
        if fields is None:
            fields = header_fields(block)
            if fields is None:
                return None
            # not kept: a block with an Idempotency-Key (every one is unique) or longer than
            # any client's usual lines (so the table holds at most 512 KiB)
            if fields[0] is None and len(block) <= _HEADER_BLOCK_BYTES:
                if len(endpoint.header_blocks) >= _HEADER_BLOCKS_MAX:
                    endpoint.header_blocks.clear()
                endpoint.header_blocks[block] = fields
        key, authorization, length = fields
        if length is None or not endpoint.accepts_body(length):
            return None
        if endpoint.quota is not None and not self._admitted(endpoint.quota, block, authorization, length):
            return None  # aiohttp's path answers the 429 without reading the body
        return new_tuple(_Head, (line[1], line[2], key, authorization, length, None, b""))

    def _admitted(self, quota: ClientQuota, block: bytes, authorization: bytes | None, length: int) -> bool:
        """The per-client quota, charged as the head arrives (relay/api/quota.py): False when
        the client is over it (nothing charged; aiohttp's path refuses it, same check)."""
        client = quota.token_key(authorization)
        if client is None:
            client = self._client
            if client is None:  # a trusted proxy: its X-Forwarded-For names the client
                found = _FORWARDED.search(block)
                client = quota.forwarded_key(self._peer, None if found is None else found[1].decode())
        return quota.take(client, 1, length) is None

    def _read_head(self, head: bytes, cut: int) -> _Head | None:
        """The fields of a read's head (no body, no Idempotency-Key), else None."""
        line = _READ_LINE.fullmatch(head, 0, cut)
        if line is None:
            return None
        query = read_query(line[3])
        fields = header_fields(head[cut:])  # not kept in the table: one long-poll a wait
        if query is None or fields is None:
            return None
        key, authorization, length = fields
        if key is not None or length:
            return None  # a body to a GET, or a header it has no use for: aiohttp's
        return _Head(line[2], query.channel, None, authorization, 0, query, line[1])

    # -- serving --------------------------------------------------------------------------
    def _dispatch(self, head: _Head, body: bytes, start: float) -> None:
        endpoint = self.endpoint
        if head.read is not None:
            answer = _Answer(self, start, endpoint.read_series)
            self._answers.append(answer)
            self._blocked_by = answer
            # a long-poll waits up to minutes: its header and keep-alive timers (armed at
            # connect) would fire meanwhile, and 10,000 connections opened together fired theirs
            # in one loop turn (a 10 ms stall); armed again by the next request's first byte or
            # once the connection is idle
            self._cancel_timers()
            self._guard.timed_out(self)
            answer.task = self._loop.create_task(self._serve_read(head, head.read, answer))
            return
        answer = _Answer(self, start, endpoint.series)
        answer.size = len(body)
        endpoint.memory.held += answer.size  # released when its answer leaves (flush)
        self._answers.append(answer)
        try:
            # the aiohttp handler's steps, in its order (relay/api/queues.py enqueue)
            recipient, channel = self._queue_of(head)
            if endpoint.service.admits_first(channel):
                # answered after an admit round trip: the next request waits for it (as on
                # aiohttp's path), or it could be stored or read before this one is stored
                self._blocked_by = answer
            key = head.key
            idempotency_key = "" if key is None else params.idempotency_value(key.decode())
            endpoint.auth.verify_enqueue_header(_text(head.authorization), ROUTE)
            payload = params.non_empty(body)
            endpoint.service.enqueue_into(
                answer, EnqueueRequest(recipient, channel, payload, idempotency_key)
            )
        except Exception as exc:
            if not answer.done():
                self.refused(answer, exc)

    def _queue_of(self, head: _Head) -> tuple[bytes, bytes]:
        """Both handlers' first steps: the memory guard's refusal, then the queue the head names
        (recipient, channel)."""
        endpoint = self.endpoint
        if endpoint.memory.over:
            raise overloaded()
        named = head.recipient, head.channel
        queue = endpoint.queues.get(named)
        if queue is None:  # decoded and checked once (only a valid one is kept)
            recipient = params.recipient_key_matched(head.recipient)  # matched by the request line
            channel = params.channel_value(head.channel.decode()) if head.channel else b""
            queue = recipient, channel
            if len(endpoint.queues) >= _QUEUES_MAX:
                endpoint.queues.clear()
            endpoint.queues[named] = queue
        return queue

    async def _serve_read(self, head: _Head, query: _ReadQuery, answer: _Answer) -> None:
        """A read, as the aiohttp handler serves it (relay/api/queues.py read, its steps in its
        order); a long-poll is answered from the wakeup that carries its messages."""
        endpoint = self.endpoint
        try:
            recipient, channel = self._queue_of(head)
            settings = endpoint.settings
            start = params.from_seq_value(_text(query.from_seq))
            lim = params.limit_value(_text(query.limit), settings)
            wait = params.wait_value(_text(query.wait), settings)
            auth = endpoint.auth
            if auth.enabled:
                authorization = _text(head.authorization)
                await auth.verify_header(authorization, "GET", head.target.decode(), recipient, b"")
            result = await endpoint.service.read(
                recipient, channel, start, lim, wait, partial(answer.early, start), answer.prepare
            )
            if answer.data is not None:
                return  # answered as the wakeup arrived
            if bulk.worth_streaming(result.messages):
                await self._stream(answer, result, start)
            else:
                answer.read_result(start, result)
        except Exception as exc:
            if answer.data is None and answer.turn is None:
                self.refused(answer, exc)
            else:  # failed mid-stream: the answer can no longer be completed
                self._closing = True
                self._close()

    async def _stream(self, answer: _Answer, result: ReadResult, from_seq: int | None) -> None:
        """A big read's answer, written slice by slice once it is the next one owed (the
        same bytes as relay/api/bulk.py stream_read, with the same back-pressure)."""
        answer.turn = self._loop.create_future()
        self.flush()
        await answer.turn
        length, slices = bulk.read_body(result.messages, next_seq(result, from_seq), result.epoch, None)
        transport = self.transport
        if transport is None:
            return
        transport.write(_head_bytes(200, length))
        for piece in slices:
            if self.transport is None:
                return
            self.transport.write(piece)
            while self._write_paused and self.transport is not None:
                waiter = self._drained = self._loop.create_future()
                await waiter
            await asyncio.sleep(0)  # other requests run between slices
        series = answer.series
        series.count(200)
        series.observe(time.perf_counter() - answer.start)
        answer.data = b""
        answer.turn = None
        self.flush()

    def refused(self, answer: _Answer, exc: BaseException) -> None:
        """Answer `exc` as the aiohttp path would (relay/app.py observed)."""
        response = (
            error_for(exc)
            if isinstance(exc, Exception)
            else error_response(500, "internal_error", "internal error")
        )
        status = response.status
        metrics.REJECTED.labels(code_of(response)).inc()
        series = answer.series
        series.count(status)
        series.observe(time.perf_counter() - answer.start)
        answer.close = answer.close or response.headers.get("Connection") == "close"
        answer.data = response_bytes(response, answer.close)
        self.flush()

    def broken(self, exc: Exception) -> None:
        """A bug while answering from Redis's reply: reported as the loop reports a failed
        callback, and the connection closed (its answers can no longer be in order)."""
        self._loop.call_exception_handler(
            {"message": "enqueue answer failed", "exception": exc, "protocol": self}
        )
        self._closing = True
        self._close()

    def flush(self) -> None:
        """Write the answers that are ready, in request order."""
        answers = self._answers
        transport = self.transport
        released = 0
        while answers and answers[0].data is not None:
            answer = answers.popleft()
            released += answer.size
            if transport is None:
                continue
            transport.write(answer.data)  # type: ignore[arg-type]
            if answer.close:
                self._closing = True
            if answer is self._blocked_by:
                self._blocked_by = None
                if self._buf and not self._read_paused:
                    self._loop.call_soon(self._parse_buffered)
        self.endpoint.memory.held -= released
        if answers and (turn := answers[0].turn) is not None and not turn.done():
            turn.set_result(None)  # a streamed answer writes itself from here on
        if self._read_paused and len(answers) <= OWED_LOW:
            self._resume_reading()
        if answers or transport is None:
            return
        if self._closing:
            self._close()
        elif self._handing_off:
            self._hand_off()
        elif not self._buf and self._pending is None:
            self._idle_since = self._loop.time()
            self._arm_keepalive()

    # -- handing the connection to aiohttp -----------------------------------------------
    def _hand_off_soon(self) -> None:
        self._stop_reading()
        self._handing_off = True
        if not self._answers:
            self._hand_off()

    def _hand_off(self) -> None:
        transport = self.transport
        assert transport is not None
        data, self._buf = self._buf, b""
        self._count_held()
        self._cancel_timers()
        self._guard.closed(self)
        self.transport = None
        handler = self.server.aiohttp_protocol()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data:
            handler.data_received(data)
        if not transport.is_closing():
            transport.resume_reading()

    # -- graceful shutdown --------------------------------------------------------------
    def drain(self) -> None:
        """Stop taking requests: close now if idle, else once the answers owed are written."""
        self._closing = True
        if self.transport is not None and not self._answers:
            self._close()
        else:
            self._stop_reading()

    def busy(self) -> bool:
        return self.transport is not None and bool(self._answers)
