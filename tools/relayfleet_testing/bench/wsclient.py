"""A minimal WebSocket client (RFC 6455) on raw asyncio protocols, for wake latency at scale.

Why not aiohttp's client: as in relayfleet_testing.bench.loadgen, a message's arrival is
stamped inside ``data_received`` (event-loop scheduling of the awaiting coroutine does
not inflate the figure), and an idle connection costs a few hundred bytes, so 10,000 live
sockets fit in one generator process. Text and binary messages only; pings are answered
at once (the relay closes a socket that misses its heartbeat's pong).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import cast

from relayfleet_testing.bench.loadgen import HttpError, close_transport

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3
_CONT, _TEXT, _BINARY, _CLOSE, _PING, _PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
MAX_MESSAGE = 1 << 24  # a bench client: a bigger message is a broken peer


@dataclass(frozen=True, slots=True)
class Message:
    data: bytes
    done: float  # time.perf_counter() when its last byte arrived


def frame(opcode: int, payload: bytes) -> bytes:
    """One final, masked client frame (clients must mask, RFC 6455 section 5.3)."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    mask = os.urandom(4)
    key = (mask * (n // 4 + 1))[:n]
    masked = int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")  # XOR the whole payload at once
    return head + mask + masked.to_bytes(n, "big")


def parse_frame(buf: bytearray) -> tuple[bool, int, bytes, int] | None:
    """(fin, opcode, payload, bytes used) of the first complete server frame; None while incomplete."""
    if len(buf) < 2:
        return None
    b0, b1 = buf[0], buf[1]
    n = b1 & 0x7F
    pos = 2
    if n == 126:
        if len(buf) < 4:
            return None
        n = struct.unpack_from("!H", buf, 2)[0]
        pos = 4
    elif n == 127:
        if len(buf) < 10:
            return None
        n = struct.unpack_from("!Q", buf, 2)[0]
        pos = 10
    if b1 & 0x80:
        raise HttpError("the server masked a frame")
    if n > MAX_MESSAGE:
        raise HttpError(f"a {n}-byte frame")
    if len(buf) < pos + n:
        return None
    return bool(b0 & 0x80), b0 & 0x0F, bytes(buf[pos : pos + n]), pos + n


class _WsProto(asyncio.Protocol):
    def __init__(self, key: bytes) -> None:
        self.transport: asyncio.Transport | None = None
        self._accept = base64.b64encode(hashlib.sha1(key + _GUID).digest())
        self._buf = bytearray()
        self._upgraded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._messages: collections.deque[Message] = collections.deque()
        self._next: asyncio.Future[Message] | None = None
        self._partial = bytearray()
        self.closed: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(HttpError(f"connection closed: {exc}" if exc else "connection closed"))

    def _fail(self, exc: Exception) -> None:
        if self.closed is None:
            self.closed = exc
        for fut in (self._upgraded, self._next):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            if not self._upgraded.done():
                self._handshake()
            if self._upgraded.done():
                self._frames()
        except (HttpError, ValueError, IndexError, struct.error) as exc:
            self._fail(exc if isinstance(exc, HttpError) else HttpError(f"bad frame: {exc}"))

    def _handshake(self) -> None:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = bytes(self._buf[:end]).split(b"\r\n")
        del self._buf[: end + 4]
        status = int(lines[0].split(b" ", 2)[1])
        if status != 101:
            raise HttpError(f"WebSocket handshake answered {status}")
        fields = (line.partition(b":") for line in lines[1:])
        accept = [v.strip() for k, _, v in fields if k.strip().lower() == b"sec-websocket-accept"]
        if accept != [self._accept]:
            raise HttpError("WebSocket handshake: wrong Sec-WebSocket-Accept")
        self._upgraded.set_result(None)

    def _frames(self) -> None:
        while (parsed := parse_frame(self._buf)) is not None:
            fin, opcode, payload, used = parsed
            del self._buf[:used]
            if opcode == _PING:
                self.send(_PONG, payload)
            elif opcode == _CLOSE:
                code = struct.unpack_from("!H", payload)[0] if len(payload) >= 2 else 1005
                self._fail(HttpError(f"the server closed the WebSocket ({code})"))
                return
            elif opcode in (_TEXT, _BINARY, _CONT):
                self._partial += payload
                if fin:
                    self._deliver(Message(bytes(self._partial), time.perf_counter()))
                    self._partial.clear()

    def _deliver(self, msg: Message) -> None:
        waiter = self._next
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)
        else:
            self._messages.append(msg)

    def upgraded(self) -> asyncio.Future[None]:
        return self._upgraded

    def send(self, opcode: int, payload: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(opcode, payload))

    def next_message(self) -> asyncio.Future[Message]:
        if self._next is not None and not self._next.done():
            return self._next
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        if self._messages:
            fut.set_result(self._messages.popleft())
        elif self.closed is not None:
            fut.set_exception(self.closed)
        else:
            self._next = fut
        return fut


class WsConn:
    """One client WebSocket; ``next_message`` is a future stamped on the message's last byte."""

    def __init__(self, proto: _WsProto) -> None:
        self._proto = proto

    @classmethod
    async def open(cls, host: str, port: int, path: str, timeout: float = 10.0) -> WsConn:
        key = base64.b64encode(os.urandom(16))
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(lambda: _WsProto(key), host, port)
        assert proto.transport is not None
        sock = proto.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key.decode()}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        proto.transport.write(request.encode("latin-1"))
        conn = cls(proto)
        try:
            await asyncio.wait_for(asyncio.shield(proto.upgraded()), timeout)
        except BaseException:
            conn.close(reset=True)
            raise
        return conn

    def next_message(self) -> asyncio.Future[Message]:
        return self._proto.next_message()

    def send_text(self, text: bytes) -> None:
        self._proto.send(_TEXT, text)

    def close(self, reset: bool = False) -> None:
        """Close without a close frame; ``reset`` as in loadgen.close_transport."""
        close_transport(self._proto.transport, reset)
