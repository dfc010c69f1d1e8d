"""RESP, Redis's wire protocol, for every connection this project writes by hand.

The hot path (relay/storage/pipeline.py, store.py) pre-encodes its commands with `bulk` /
`bulk_str` and parses replies in its own asyncio.Protocol; the other hand-written
connections (logins, Sentinels, wakeup subscribers, snapshots, the operator's INFO probe)
talk through `Conn`: one command at a time, or a subscription read as it arrives. Replies are
parsed by hiredis; a Redis error reply is returned as a `hiredis.ReplyError`, never raised.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hiredis

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
    """One command in RESP."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts.append(bulk(a))
    return b"".join(parts)


class Conn:
    """A stream pair spoken to in RESP. `call` is for one command at a time; a subscriber
    `send`s and hands what it reads to `received`."""

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


def parse_info(text: str | bytes) -> dict[str, str]:
    """INFO's `key:value` lines as a dict (section headers and blank lines skipped)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and ":" in line:
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip()
    return out
