"""A minimal HTTP/1.1 keep-alive client on raw asyncio protocols (uvloop), for latency work.

Why not aiohttp's client: each response's completion time is stamped inside
``data_received`` — the moment its last byte arrives — so event-loop scheduling
of the awaiting coroutine does not inflate latencies, and one connection costs a
few hundred bytes, so 10,000 idle long-polls fit in the generator.

One request in flight per connection (no pipelining); responses must carry
Content-Length or chunked encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar, cast

T = TypeVar("T")


class HttpError(Exception):
    """The peer broke HTTP/1.1 framing or closed the connection mid-response."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    done: float  # time.perf_counter() when the last byte arrived
    headers: tuple[bytes, ...] = ()  # the raw header lines ("Name: value"), status line excluded

    def header(self, name: bytes) -> bytes | None:
        """The first header called ``name`` (lower case), value stripped; None without one."""
        for line in self.headers:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name:
                return value.strip()
        return None


def build_request(
    method: str, path: str, host: str, body: bytes = b"", headers: tuple[tuple[str, str], ...] = ()
) -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    if body or method in ("POST", "PUT"):
        head.append(f"Content-Length: {len(body)}")
    head.extend(f"{k}: {v}" for k, v in headers)
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _Proto(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._waiter: asyncio.Future[Response] | None = None
        self._status = 0
        self._body_start = -1
        self._length = -1  # -1: not known yet; -2: chunked
        self._headers: tuple[bytes, ...] = ()
        self._closed_exc: Exception | None = None
        self._will_close = False  # the server said "Connection: close" (e.g. nginx keepalive_requests)

    @property
    def reusable(self) -> bool:
        return self._closed_exc is None and not self._will_close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed_exc = HttpError(f"connection closed: {exc}" if exc else "connection closed")
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self._closed_exc)

    def start(self, raw: bytes) -> asyncio.Future[Response]:
        if self._closed_exc is not None:
            raise self._closed_exc
        if self._waiter is not None and not self._waiter.done():
            raise HttpError("a request is already in flight on this connection")
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._status, self._body_start, self._length = 0, -1, -1
        self.transport.write(raw)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            self._parse()
        except (ValueError, IndexError) as exc:
            self._fail(HttpError(f"bad response: {exc}"))

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def _parse(self) -> None:
        buf = self._buf
        if self._body_start < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(buf[:end]).split(b"\r\n")
            self._status = int(lines[0].split(b" ", 2)[1])
            self._headers = tuple(lines[1:])
            self._length = 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    self._length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    self._length = -2
                elif name == b"connection" and b"close" in value.lower():
                    self._will_close = True
            self._body_start = end + 4
        if self._length >= 0:
            stop = self._body_start + self._length
            if len(buf) < stop:
                return
            body = bytes(buf[self._body_start : stop])
            del buf[:stop]
        else:
            parsed = _dechunk(buf, self._body_start)
            if parsed is None:
                return
            body, stop = parsed
            del buf[:stop]
        self._body_start = -1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(Response(self._status, body, time.perf_counter(), self._headers))


def _dechunk(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a complete chunked body starting at ``start``; None while incomplete."""
    out = bytearray()
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n", pos)  # no trailers expected: just the final CRLF
            return (bytes(out), end + 2) if end >= 0 else None
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos : pos + size]
        pos += size + 2


class Conn:
    """One keep-alive connection, reopened when the server closes it between requests; a
    response is stamped on its last byte (Response.done)."""

    def __init__(self, proto: _Proto, host: str, port: int) -> None:
        self._proto = proto
        self.host = f"{host}:{port}"
        self._addr = (host, port)

    @staticmethod
    async def _connect(host: str, port: int) -> _Proto:
        _, proto = await asyncio.get_running_loop().create_connection(_Proto, host, port)
        sock = proto.transport.get_extra_info("socket") if proto.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return proto

    @classmethod
    async def open(cls, host: str, port: int) -> Conn:
        return cls(await cls._connect(host, port), host, port)

    async def request_raw(self, raw: bytes) -> Response:
        if not self._proto.reusable:
            self.close()
            self._proto = await self._connect(*self._addr)
        return await self._proto.start(raw)

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: tuple[tuple[str, str], ...] = ()
    ) -> Response:
        return await self.request_raw(build_request(method, path, self.host, body, headers))

    def close(self, reset: bool = False) -> None:
        close_transport(self._proto.transport, reset)


def close_transport(transport: asyncio.Transport | None, reset: bool) -> None:
    """Close; ``reset`` sends RST instead of FIN so thousands of closes leave no TIME_WAIT."""
    if transport is None:
        return
    if reset:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.close()


async def gather_bounded(n: int, make: Callable[[], Awaitable[T]], concurrency: int = 100) -> list[T]:
    """``make()`` n times, at most ``concurrency`` at once; the results in order. A failure is
    raised once every call has ended, so none is still running (opening) after it."""
    sem = asyncio.Semaphore(concurrency)

    async def one() -> T:
        async with sem:
            return await make()

    results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if not isinstance(r, BaseException)]


@dataclass(frozen=True, slots=True)
class LoopResult:
    requests: int  # answered 2xx
    errors: int  # not 2xx, broken connections, and what ``inspect`` found in 2xx answers
    seconds: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


async def closed_loop(
    port: int,
    make_request: Callable[[int], bytes],
    connections: int,
    seconds: float,
    inspect: Callable[[Response], int] = lambda _: 0,
) -> LoopResult:
    """Each connection sends its next request as soon as the previous answer arrives;
    ``inspect`` counts the errors a 2xx answer reports inside (a fan-out's per-recipient ones)."""
    conns = [await Conn.open("127.0.0.1", port) for _ in range(connections)]
    done = [0] * connections
    errors = [0] * connections
    stop_at = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        n = i
        while time.perf_counter() < stop_at:
            try:
                resp = await conns[i].request_raw(make_request(n))
            except (HttpError, OSError):
                errors[i] += 1  # the next request reconnects
                continue
            n += connections
            if 200 <= resp.status < 300:
                done[i] += 1
                errors[i] += inspect(resp)
            else:
                errors[i] += 1

    started = time.perf_counter()
    try:
        await asyncio.gather(*(worker(i) for i in range(connections)))
    finally:
        for c in conns:
            c.close()
    return LoopResult(sum(done), sum(errors), time.perf_counter() - started)
