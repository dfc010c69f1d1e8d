"""The HTTP fast path: `POST /v1/queues/{recipient}/messages` (enqueue) and
`GET /v1/queues/{recipient}/messages` (read, long-poll) served without aiohttp's request
machinery; every other request is handed to aiohttp.

Every connection starts on `FastConnection`, an asyncio protocol that the server aiohttp's
AppRunner starts its sites with hands out (relay/http/serving.py GuardedServer). Its heads
are parsed by llhttp (httptools, the parser aiohttp's own C parser and uvicorn use), so the
framing rules (bare LF, obs-fold, a bad Content-Length, a control character) are llhttp's.
A head is served here only when it is plainly one of the two requests: HTTP/1.1 with Host,
the path in base64url characters with at most the request's own query parameters, no
Transfer-Encoding, Content-Encoding, Expect, Upgrade or Connection other than keep-alive,
none of the headers read here twice, a Content-Length within the payload cap (none or 0 for
a read). Anything else, from a refused byte on, is not its business: at that request's
boundary (once the answers owed before it are written) the connection, with every byte
buffered from that request's first one, is handed to aiohttp's protocol
(GuardedRequestHandler), which answers it as it answers every request when this path is
off (RELAY_HTTP_FASTPATH=0).

The requests served here run the handlers' steps in the handlers' order with the same functions
(relay/api/params, auth, quota, queues, failures). A read is a coroutine, in a task, that
awaits QueueService.read and returns its answer, but for one case: a long-poll woken by an
enqueue of this process is answered as the wakeup arrives, inside the processing of the
enqueue's Redis reply (QueueService.read's early answer, Waiter.expect; the task then finds it
answered), not a loop turn later when its task resumes: measured, wake p50 0.74 x without it
(median of 4 alternating rounds, 300 idle long-polls, load average 23; docs/design-decisions.md
"One HTTP stack"). An enqueue is sent to Redis as its request is parsed, and answered from the
future QueueService.enqueue returns, by its done callback: measured, a task awaiting it cost
10-32 % more CPU per message in the relay process (loaded machine, alternating rounds), and an
answer made inside Redis's reply instead (a sink in the future's place) 0.93 x at 256 B but
1.13 x at 4 KiB, its Redis more too (medians of 5 alternating rounds, load 30): not kept
(docs/design-decisions.md "One HTTP stack"). Every answer is a
`Reply` (status, body, headers) built from the handlers' own results and serialised by
`reply_bytes` as aiohttp serialises a web.Response. Answers go out in request order under
pipelining; the requests after a read wait until it is answered, as on aiohttp's path. A read
also starts only once every enqueue before it on the connection is answered (stored): reads go
over another Redis connection than enqueues (the shard's bulk lane), so nothing else keeps a
pipelined read from overtaking them. The same holds behind an enqueue that takes its
recipient's admit round trip first (a non-default channel, QueueService.admits_first).
Pipelined default-channel enqueues stay in flight together (one connection to their shard keeps
their order).

This protocol keeps the same bounds as aiohttp's: the header timeout (armed at connect and at
a new request's first byte), the keep-alive idle timeout, the body timeout (408), the
connection cap (ConnectionGuard), the memory guard (503 overloaded; a body that would claim
memory goes to aiohttp's path), the per-client quota charged at the head, flow control
(OWED_HIGH answers owed or a full write buffer stop reading), and the same metrics. It logs
nothing about a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import Coroutine, Iterable
from email.utils import formatdate
from functools import partial
from http import HTTPStatus
from typing import Any, NamedTuple, cast

import httptools
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from relay import metrics
from relay.api import bulk, params
from relay.api.context import Context
from relay.api.errors import ApiError, overloaded
from relay.api.failures import code_of, error_for
from relay.api.queues import ENQUEUE_ROUTE, enqueue_answer, next_seq, read_bytes
from relay.api.quota import Address, ClientQuota
from relay.http.memguard import CLAIM_FROM
from relay.http.serving import MAX_LINE, GuardedServer
from relay.metrics import RouteSeries
from relay.storage.message import Message
from relay.storage.store import EnqueueOutcome, EnqueueRequest, ReadResult, new_tuple
from relay.storage.wakeups import Stored

MAX_HEAD = MAX_LINE  # aiohttp's line limit, for the whole head: a longer one is aiohttp's
MAX_LINES = 64  # more header lines than any client sends: aiohttp's business
# Flow control (as aiohttp's protocol has it): a connection stops being read while it owes
# OWED_HIGH answers or its transport is above the write high-water mark, and is read again
# once it owes at most OWED_LOW and the transport is below its low-water mark.
OWED_HIGH = 64
OWED_LOW = 16

_PREFIX = b"/v1/queues/"
_SUFFIX = b"/messages"
_MAX_SEGMENT = 200  # a recipient's or channel's base64url text longer than any valid one
_MAX_QUERY = 512
_BASE64URL = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
# a read's query: its parameters' names and values, no escapes (aiohttp decodes those)
_QUERY_BYTES = frozenset(_BASE64URL + b".&=")
_READ_PARAMS = frozenset((b"channel", b"fromSeq", b"limit", b"wait"))
_ENQUEUE_PARAMS = frozenset((b"channel",))
# the headers this path reads (each at most once), and those whose presence changes framing
# or the connection (aiohttp's business)
_READ_HEADERS = frozenset(
    (b"host", b"content-length", b"connection", b"authorization", b"idempotency-key", b"x-forwarded-for")
)
_FOREIGN = frozenset((b"transfer-encoding", b"content-encoding", b"expect", b"upgrade", b"http2-settings"))
_SERVER = SERVER_SOFTWARE


class Reply(NamedTuple):
    """An answer: what a handler's web.Response holds (headers besides Content-Length, Date and
    Server, which `reply_bytes` adds as aiohttp's StreamResponse does)."""

    status: int
    body: bytes
    headers: Iterable[tuple[str, str]] = (("Content-Type", "application/json"),)
    close: bool = False


def reply_of(response: web.Response) -> Reply:
    """A built web.Response (an error's: relay/api/failures.py error_for) as a Reply."""
    body = response.body
    assert isinstance(body, bytes)
    headers = response.headers
    return Reply(response.status, body, list(headers.items()), headers.get("Connection") == "close")


# [second, "Date: ...\r\nServer: ...\r\n", the same as bytes]: aiohttp's own per-second Date
# text, with the Server line
_date: list[Any] = [-1, "", b""]
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}
_OK_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "


def _date_now() -> None:
    second = int(time.time())
    if second != _date[0]:
        lines = f"Date: {formatdate(usegmt=True)}\r\nServer: {_SERVER}\r\n"
        _date[:] = [second, lines, lines.encode()]


def ok_json_bytes(body: bytes) -> bytes:
    """`reply_bytes(Reply(200, body))` in one format: a woken long-poll's answer (`_Woken`),
    whose body is made while Redis stores its message."""
    _date_now()
    return b"%b%d\r\n%b\r\n%b" % (_OK_JSON, len(body), _date[2], body)


def reply_bytes(reply: Reply) -> bytes:
    """`reply` on an HTTP/1.1 connection as aiohttp writes a web.Response: the status line, the
    response's headers in order, then Content-Length, Date, Server (Connection: close when it
    closes). The lines end in CRLF as they are made, then one join and one encode: 1.30 against
    1.80 us per 201 answer in paired rounds of one process (a list of the names seen and a join on
    CRLF before)."""
    _date_now()
    status = reply.status
    lines = [_STATUS_LINES.get(status) or f"HTTP/1.1 {status} \r\n"]
    length = close = True  # still to add
    for name, value in reply.headers:
        lines.append(f"{name}: {value}\r\n")
        if name == "Content-Length":
            length = False
        elif name == "Connection":
            close = False
    body = reply.body
    if length:
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append(_date[1])
    if reply.close and close:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode() + body


class FastEndpoint:
    """What every fast connection of one app shares: the context, limits and metric series."""

    __slots__ = ("auth", "cap", "memory", "quota", "read_series", "series", "service", "settings")

    def __init__(self, ctx: Context) -> None:
        self.settings = ctx.settings
        self.service = ctx.service
        self.auth = ctx.auth
        self.memory = ctx.memory
        self.quota = ctx.quota
        self.cap = ctx.settings.max_payload
        self.series = RouteSeries(ENQUEUE_ROUTE, "POST")
        self.read_series = RouteSeries(ENQUEUE_ROUTE, "GET")

    def accepts_body(self, length: int) -> bool:
        # a body that would claim memory (relay/http/memguard.py) is left to aiohttp's path
        return length <= self.cap and (length < CLAIM_FROM or self.memory.ceiling is None)


FAST_ENDPOINT = web.AppKey("relayfleet_fast_endpoint", FastEndpoint)


class Head(NamedTuple):
    """A served head: what its request line and header lines said."""

    read: bool  # GET (a read); else POST (an enqueue)
    recipient: bytes  # the path's segment, base64url text
    query: dict[bytes, bytes]  # its parameters as sent (an enqueue's: channel at most)
    target: bytes  # the path and query as sent (what a signed read's signature covers)
    fields: dict[bytes, bytes]  # the headers in _READ_HEADERS, lower-cased names
    length: int  # Content-Length (0: none)


def served_query(query: bytes, allowed: frozenset[bytes]) -> dict[bytes, bytes] | None:
    """The parameters of a query of `allowed` names, each at most once, as "name=value" pairs of
    plain characters; None for anything else (aiohttp's business)."""
    found: dict[bytes, bytes] = {}
    if not query:
        return found
    if len(query) > _MAX_QUERY or not _QUERY_BYTES.issuperset(query):
        return None
    for pair in query.split(b"&"):
        name, eq, value = pair.partition(b"=")
        if not eq or b"=" in value or name not in allowed or name in found:
            return None
        found[name] = value
    return found


def served_segment(path: bytes) -> bytes | None:
    """The recipient segment of `/v1/queues/{recipient}/messages` in base64url characters."""
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
        return None
    segment = path[len(_PREFIX) : -len(_SUFFIX)]
    # what is left once the base64url bytes are deleted: b"" when there is no other (one C pass;
    # frozenset.issuperset made an int per byte: 0.77-1.17 against 1.21-1.86 us per call)
    if not 0 < len(segment) <= _MAX_SEGMENT or segment.translate(None, _BASE64URL):
        return None
    return segment


class _Answer:
    """One request's answer slot, in request order."""

    __slots__ = ("close", "data", "read", "series", "size", "start", "task", "turn")

    def __init__(self, start: float, series: RouteSeries, read: bool = False) -> None:
        self.start = start
        self.series = series
        self.read = read  # a read's task ends when its client leaves (an enqueue's runs on)
        self.data: bytes | None = None
        self.close = False
        self.size = 0  # body bytes counted by the memory guard while it is owed
        self.task: asyncio.Task[None] | None = None  # its handler's
        self.turn: asyncio.Future[None] | None = None  # a streamed read's: set once it is first


class _Woken:
    """relay.service.EarlyAnswer of one long-poll: its answer written from the wakeup that
    carries its messages, as it arrives (inside the processing of the enqueue's Redis reply,
    when this process sent it), not once its task resumes a loop turn later. When this process
    sent the enqueue, the answer's body but for its two numbers is made while Redis stores the
    message (`prepare`, relay/api/bulk.py Prepared and lone_answer_parts), so the answer is one
    format once Redis has said the seq. Called by the waiter itself (Waiter.expect, with the
    epoch bound): the answer is made in this one frame, no layer between. Measured:
    docs/design-decisions.md "The wake at nchan parity"."""

    __slots__ = ("answer", "conn", "from_seq", "parts", "ready")

    def __init__(self, conn: FastConnection, answer: _Answer, from_seq: int | None) -> None:
        self.conn = conn
        self.answer = answer
        self.from_seq = from_seq
        self.ready: bulk.Prepared | None = None
        self.parts: tuple[bytes, bytes] = (b"", b"")

    def __call__(self, epoch: str, messages: list[Message], /) -> bool:
        """The long-poll answered from `messages` (stored in `epoch`); a big answer is left to
        the task, which streams it. The message `ready` was prepared for, alone: its answer is
        `parts` around its seq (the same bytes, tests/relay/http/test_fastpath.py). Never
        raises: a failure closes the connection."""
        ready, self.ready = self.ready, None
        answer = self.answer
        conn = self.conn
        try:
            if answer.data is not None or conn.transport is None:
                return False
            if ready is not None and len(messages) == 1 and ready.matches(messages[0], epoch):
                answer.data = ok_json_bytes(bulk.lone_answer(messages[0].seq, self.parts))
            elif bulk.worth_streaming(messages):
                return False
            else:
                result = ReadResult(messages, epoch, messages[-1].seq)
                answer.data = reply_bytes(Reply(200, read_bytes(result, self.from_seq)))
            conn.flush()  # counted after the write: on a wake's path the answer is what matters
            conn._count(answer, 200)
        except Exception:
            conn._broken()
            return False
        return True

    def prepare(self, epoch: str, stored_ms: int, stored: Stored, /) -> None:
        try:
            ready = bulk.prepare(epoch, stored_ms, stored.payload, stored.message_id)
            self.parts = bulk.lone_answer_parts(ready)
            self.ready = ready
        except Exception:  # (in the enqueue's path) the answer is then made from scratch
            self.ready = None


class FastConnection(asyncio.Protocol):
    """One client connection while it sends enqueues and reads (see the module docstring)."""

    __slots__ = (
        "_answers",
        "_armed_count",
        "_at",
        "_blocked_by",
        "_body_deadline",
        "_body_have",
        "_body_parts",
        "_body_timer",
        "_buf",
        "_client",
        "_closing",
        "_drained",
        "_fed",
        "_fields",
        "_foreign",
        "_guard",
        "_handing_off",
        "_head_done",
        "_header_timer",
        "_held",
        "_idle_since",
        "_keepalive_timer",
        "_lines",
        "_loop",
        "_parser",
        "_peer",
        "_pending",
        "_read_paused",
        "_requests",
        "_resuming",
        "_url",
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
        self._parser = httptools.HttpRequestParser(self)
        # bytes read and not yet served: from `_at` (the current request's first byte) on; a
        # served request moves `_at` past it instead of copying what follows it (b"" once all
        # is served)
        self._buf = b""
        self._at = 0
        self._fed = 0  # up to where the parser has read (the current head's bytes so far)
        self._url = b""
        self._fields: dict[bytes, bytes] = {}
        self._lines = 0
        self._foreign = False  # the current head is not one this path serves
        self._head_done = False
        self._answers: deque[_Answer] = deque()
        self._requests = 0  # complete heads seen
        self._armed_count = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline = 0.0  # the loop time by which the pending request's body is due
        self._idle_since = 0.0
        self._pending: tuple[Head, float] | None = None  # a served head whose body is arriving
        self._body_parts: list[bytes] = []
        self._body_have = 0
        self._handing_off = False
        self._closing = False
        self._read_paused = False  # by flow control (not by a hand-off or a 408)
        self._resuming = False  # reading resumes on the next loop turn
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

    # -- llhttp's callbacks (httptools): one head's request line and header lines ---------
    def on_url(self, url: bytes) -> None:
        self._url += url  # in pieces when the line arrives in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        self._lines += 1
        lower = name.lower()
        if lower in _READ_HEADERS:
            if lower in self._fields:
                self._foreign = True  # twice: which one counts is aiohttp's to say
            self._fields[lower] = value
        elif lower in _FOREIGN:
            self._foreign = True
        if not value.isascii() or self._lines > MAX_LINES:
            self._foreign = True

    def on_headers_complete(self) -> None:
        self._head_done = True

    def _next_head(self) -> None:
        self._url = b""
        self._fields = {}
        self._lines = 0
        self._foreign = self._head_done = False

    def _served_head(self) -> Head | None:
        """The head the parser just read, when this path serves it; else None."""
        parser = self._parser
        if self._foreign or parser.get_http_version() != "1.1" or parser.should_upgrade():
            return None
        fields = self._fields
        if b"host" not in fields:
            return None  # RFC 9112 section 3.2: aiohttp's path answers it 400
        connection = fields.get(b"connection")
        if connection is not None and connection.lower() != b"keep-alive":
            return None
        method = parser.get_method()
        read = method == b"GET"
        if not read and method != b"POST":
            return None
        url = self._url
        path, _, query = url.partition(b"?")
        segment = served_segment(path)
        found = served_query(query, _READ_PARAMS if read else _ENQUEUE_PARAMS)
        if segment is None or found is None or b"#" in url:
            return None
        raw_length = fields.get(b"content-length")
        length = 0 if raw_length is None else int(raw_length)  # digits: llhttp checked them
        endpoint = self.endpoint
        if read:
            if length or b"idempotency-key" in fields:
                return None  # a body to a GET, or a header it has no use for: aiohttp's
        elif raw_length is None or not endpoint.accepts_body(length):
            return None
        elif endpoint.quota is not None and not self._admitted(endpoint.quota, fields, length):
            return None  # aiohttp's path answers the 429 without reading the body
        return Head(read, segment, found, url, fields, length)

    def _admitted(self, quota: ClientQuota, fields: dict[bytes, bytes], length: int) -> bool:
        """The per-client quota, charged as the head arrives (relay/api/quota.py): False when
        the client is over it (nothing charged; aiohttp's path refuses it, same check)."""
        client = quota.token_key(fields.get(b"authorization"))
        if client is None:
            client = self._client
            if client is None:  # a trusted proxy: its X-Forwarded-For names the client
                forwarded = fields.get(b"x-forwarded-for")
                client = quota.forwarded_key(self._peer, None if forwarded is None else forwarded.decode())
        return quota.take(client, 1, length) is None

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
        # enqueues still owed complete as Redis replies (the messages are stored once) and
        # are counted then; reads still owed end now: a long-poll whose client left stops
        # waiting at once
        self.transport = None
        for answer in self._answers:
            if answer.read and answer.task is not None:
                answer.task.cancel()
        self._wake_writer()
        self._cancel_timers()
        self._guard.closed(self)
        self._buf = b""
        self._at = self._fed = 0
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
        """Read again (called once the answers owed are down to OWED_LOW), on the next loop turn
        (not inside a flush)."""
        if not self._read_paused or self._write_paused or self._closing or self._handing_off:
            return
        if not self._resuming:
            self._resuming = True
            self._loop.call_soon(self._resume_now)

    def _resume_now(self) -> None:
        self._resuming = False
        if not self._read_paused or self._write_paused or self._closing or self._handing_off:
            return
        self._read_paused = False
        # the requests already buffered are served first, and the socket is read again only
        # if they leave room (a client that never reads its answers is never read ahead of them)
        self._parse_buffered()
        if not self._read_paused and not self._handing_off and self.transport is not None:
            self.transport.resume_reading()

    def _parse_buffered(self) -> None:
        self._parse()
        self._count_held()

    def _count_held(self) -> None:
        """Tell the memory guard how many request bytes this connection buffers (called once
        per read, not per request; a dispatched request's body is counted until answered)."""
        held = len(self._buf) - self._at + (self._body_have if self._pending is not None else 0)
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
        answer = _Answer(pending[1], self.endpoint.series)
        self._answers.append(answer)
        self._stop_reading()
        self._closing = True
        self._answer(answer, self._refusal(exc))

    # -- reading ------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._handing_off:  # read before the pause took hold: aiohttp's too
            self._buf += data
            return
        pending = self._pending
        if pending is not None:
            self._body_parts.append(data)
            self._body_have += len(data)
            if self._body_have >= pending[0].length:
                self._body_complete()
            self._count_held()
            return
        if self._at:  # what was served goes now, once per read (not once per request)
            self._buf = self._buf[self._at :]
            self._fed -= self._at
            self._at = 0
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
        """Serve the requests buffered, in order, until one is incomplete, must wait, or is
        aiohttp's (then handed to it)."""
        while self._buf and not self._handing_off and self.transport is not None and self._pending is None:
            if self._blocked_by is not None:
                if len(self._buf) - self._at > MAX_HEAD:
                    self._stop_reading()  # parsed (and read again) once the read is answered
                return
            if self._write_paused or len(self._answers) >= OWED_HIGH:
                self._backlogged()
                return
            buf, at = self._buf, self._at
            # the parser reads the head alone (up to its blank line), so the body and the
            # requests after it stay in `buf`, and a head it refuses is handed over whole
            end = buf.find(b"\r\n\r\n", max(at, self._fed - 3))
            stop = len(buf) if end < 0 else end + 4
            if stop - at > MAX_HEAD:
                self._hand_off_soon()
                return
            if stop > self._fed:
                try:
                    self._parser.feed_data(buf[self._fed : stop])
                except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                    self._hand_off_soon()  # aiohttp refuses it as soon as it sees it
                    return
                self._fed = stop
            if self._foreign:
                self._hand_off_soon()  # a header already says it is aiohttp's
                return
            if not self._head_done:
                if end >= 0:  # the parser saw no end where the blank line is
                    self._hand_off_soon()
                return
            head = self._served_head()
            if head is None:
                self._hand_off_soon()
                return
            if head.read and self._answers:
                # enqueues before it are still owed: it waits (parsed, not yet served) until
                # they are answered, or its read could reach Redis before them
                self._blocked_by = self._answers[-1]
                return
            self._requests += 1
            start = time.perf_counter()
            length = head.length
            if len(buf) - stop >= length:
                self._at = stop + length
                if self._at == len(buf):
                    self._buf = b""
                    self._at = 0
                self._dispatch(head, buf[stop : stop + length], start)
                continue
            self._pending = (head, start)
            rest = buf[stop:]
            self._buf = b""
            self._at = 0
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
        head, start = pending
        joined = self._body_parts[0] if len(self._body_parts) == 1 else b"".join(self._body_parts)
        self._body_parts = []
        self._buf = joined[head.length :]  # (data received meanwhile went to the body parts)
        self._dispatch(head, joined[: head.length], start)
        self._parse()

    # -- serving --------------------------------------------------------------------------
    def _dispatch(self, head: Head, body: bytes, start: float) -> None:
        """Serve a complete request: its answer slot in order; a read's coroutine in a task, an
        enqueue sent to Redis now and answered as its outcome arrives."""
        endpoint = self.endpoint
        if head.read:
            self._next_message(body)
            answer = _Answer(start, endpoint.read_series, read=True)
            self._answers.append(answer)
            self._blocked_by = answer
            # a long-poll waits up to minutes: its header and keep-alive timers (armed at
            # connect) would fire meanwhile, and 10,000 connections opened together fired theirs
            # in one loop turn (a 10 ms stall); armed again by the next request's first byte or
            # once the connection is idle
            self._cancel_timers()
            self._guard.timed_out(self)
            answer.task = self._loop.create_task(self._answered(answer, self._read(head, answer)))
            return
        # sent before its answer slot and the parser's step past it are set up: on a wake's path
        # Redis's round trip is what every other step waits for (nothing here runs in between)
        refused: Exception | None = None
        try:
            sent = self._send(head, body)
        except Exception as exc:
            refused = exc
        self._next_message(body)
        answer = _Answer(start, endpoint.series)
        answer.size = len(body)
        endpoint.memory.held += answer.size  # released when its answer leaves (flush)
        self._answers.append(answer)
        if refused is not None:
            self._answer(answer, self._refusal(refused))
            return
        channel = head.query.get(b"channel")
        if channel and endpoint.service.admits_first(channel):
            # answered after an admit round trip: the next request waits for it (as on
            # aiohttp's path), or it could be stored or read before this one is stored
            self._blocked_by = answer
        # the outcome's future, not a task awaiting it: a task per enqueue cost 10-32 % of the
        # relay process's CPU per message (docs/design-decisions.md, "One HTTP stack")
        sent.add_done_callback(partial(self._enqueued, answer))

    def _next_message(self, body: bytes) -> None:
        """The parser past the request just served (its body fed: llhttp is at the next head)."""
        if body:
            self._parser.feed_data(body)
        self._fed = self._at
        self._next_head()

    def _enqueued(self, answer: _Answer, sent: asyncio.Future[EnqueueOutcome]) -> None:
        """An enqueue's answer from its outcome (relay/api/queues.py enqueue_answer)."""
        if sent.cancelled():
            return  # only at shutdown: nobody to answer
        try:
            status, body = enqueue_answer(sent.result())
            reply = Reply(status, body)
        except Exception as exc:
            reply = self._refusal(exc)
        self._answer(answer, reply)

    async def _answered(self, answer: _Answer, handler: Coroutine[Any, Any, Reply | None]) -> None:
        """Run a read and write what it returns (a streamed read writes itself)."""
        try:
            reply = await handler
        except Exception as exc:
            if answer.turn is not None:  # failed mid-stream: the answer cannot be completed
                self._closing = True
                self._close()
                return
            reply = self._refusal(exc)
        if reply is not None:
            self._answer(answer, reply)

    def _queue_of(self, head: Head) -> tuple[bytes, bytes]:
        """Both handlers' first steps: the memory guard's refusal, then the queue the head names
        (recipient, channel)."""
        if self.endpoint.memory.over:
            raise overloaded()
        recipient = params.recipient_key_matched(head.recipient)  # base64url characters only
        channel = head.query.get(b"channel")
        return recipient, params.channel_value(channel.decode()) if channel else b""

    def _send(self, head: Head, body: bytes) -> asyncio.Future[EnqueueOutcome]:
        """An enqueue, as the aiohttp handler serves it (relay/api/queues.py enqueue, its steps
        in its order; the per-client quota was charged at the head), sent to Redis now, the
        request built without a frame of its own: on a wake's path each call before the write
        runs from cold caches."""
        endpoint = self.endpoint
        recipient, channel = self._queue_of(head)
        fields = head.fields
        raw = fields.get(b"idempotency-key")
        idempotency_key = "" if raw is None else params.idempotency_value(raw.decode())
        raw = fields.get(b"authorization")
        endpoint.auth.verify_enqueue_header(None if raw is None else raw.decode(), ENQUEUE_ROUTE)
        payload = body or params.non_empty(body)  # (400 empty_payload)
        req = new_tuple(EnqueueRequest, (recipient, channel, payload, idempotency_key, "", False, 0))
        return endpoint.service.enqueue(req)

    async def _read(self, head: Head, answer: _Answer) -> Reply | None:
        """A read, as the aiohttp handler serves it (relay/api/queues.py read, its steps in its
        order); None when its answer was streamed."""
        endpoint = self.endpoint
        recipient, channel = self._queue_of(head)
        settings = endpoint.settings
        query = head.query
        start = params.from_seq_value(_text(query.get(b"fromSeq")))
        lim = params.limit_value(_text(query.get(b"limit")), settings)
        wait = params.wait_value(_text(query.get(b"wait")), settings)
        auth = endpoint.auth
        if auth.enabled:
            authorization = _text(head.fields.get(b"authorization"))
            await auth.verify_header(authorization, "GET", head.target.decode(), recipient, b"")
        result = await endpoint.service.read(
            recipient, channel, start, lim, wait, _Woken(self, answer, start)
        )
        if answer.data is not None:
            return None  # answered as the wakeup arrived
        if bulk.worth_streaming(result.messages):
            await self._stream(answer, result, start)
            return None
        return Reply(200, read_bytes(result, start))

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
        headers = (("Content-Type", "application/json"), ("Content-Length", str(length)))
        transport.write(reply_bytes(Reply(200, b"", headers)))
        for piece in slices:
            if self.transport is None:
                return
            self.transport.write(piece)
            while self._write_paused and self.transport is not None:
                waiter = self._drained = self._loop.create_future()
                await waiter
            await asyncio.sleep(0)  # other requests run between slices
        self._count(answer, 200)
        answer.data = b""
        answer.turn = None
        self.flush()

    def _broken(self) -> None:
        """An answer could not be made (a bug): the connection closes, as aiohttp's does on a
        handler's failure, the answers owed before it aside."""
        self._closing = True
        self._close()

    def _refusal(self, exc: BaseException) -> Reply:
        """`exc` answered as the aiohttp path answers it (relay/app.py observed)."""
        response = error_for(exc)
        metrics.REJECTED.labels(code_of(response)).inc()
        return reply_of(response)

    def _count(self, answer: _Answer, status: int) -> None:
        series = answer.series
        series.count(status)
        series.observe(time.perf_counter() - answer.start)

    def _answer(self, answer: _Answer, reply: Reply) -> None:
        """`reply` is `answer`'s: written once the answers before it are, and counted (after the
        write: on a wake's path the answer is the critical part)."""
        answer.close = answer.close or reply.close
        answer.data = reply_bytes(reply)
        self.flush()
        self._count(answer, reply.status)

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
        data = self._buf[self._at :]
        self._buf = b""
        self._at = 0
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


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()
