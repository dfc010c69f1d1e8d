"""Read and drain answers too big to build in one go: streamed JSON, base64 in slices.

A read may carry up to the 8 MiB payload budget (docs/api.md). Encoding that as one
base64 string and one JSON document blocks the event loop for tens of milliseconds
per answer, and three readers in a loop then delay every other client of the process
(measured in tests/hostile/test_storage_attacks.py). Here the body is written in
slices of SLICE payload bytes, yielding to the loop between them and waiting for the
socket (back-pressure), so a small request waits at most one slice and the process
holds one slice of base64 per answer instead of the whole document. The bytes are
exactly what orjson writes for the same dict (queues.read_json), so clients cannot
tell which way an answer was made. Small answers are built at once (`answer_bytes`), from
the same parts.
"""

from __future__ import annotations

import asyncio
import binascii
from collections.abc import Iterator
from typing import NamedTuple

import orjson
from aiohttp import web

from relay.api import params
from relay.storage.store import Message

STREAM_OVER = 256 * 1024  # payload bytes from which an answer is streamed
SLICE = 3 * 64 * 1024  # payload bytes encoded per step; a multiple of 3: no '=' inside
_URLSAFE = bytes.maketrans(b"+/", b"-_")


def _b64_len(n: int) -> int:
    """Length of unpadded base64 of n bytes."""
    return (4 * n + 2) // 3


def _tail(received_ms: int, message_id: str | None) -> bytes:
    """What follows the payload text of one message object."""
    # receivedAt is digits and punctuation: no JSON escaping to do (orjson writes it as is)
    return b'","receivedAt":"%b","messageId":%b}' % (
        params.rfc3339_ms(received_ms).encode(),
        b"null" if message_id is None else orjson.dumps(message_id),
    )


def _message_parts(m: Message) -> tuple[bytes, bytes]:
    """What comes before and after the payload text of one message object."""
    return b'{"seq":%d,"payload":"' % m.seq, _tail(m.received_ms, m.message_id)


def _b64(payload: bytes | memoryview) -> bytes:
    """Unpadded base64url of `payload` (params.b64encode's text, as bytes)."""
    return binascii.b2a_base64(payload, newline=False).translate(_URLSAFE).rstrip(b"=")


def _end(next_seq: int, epoch: str, more: bool | None) -> bytes:
    return b'],"nextSeq":%d%b' % (next_seq, _after_next_seq(epoch, more))


def _after_next_seq(epoch: str, more: bool | None) -> bytes:
    more_text = b"" if more is None else b',"more":' + (b"true" if more else b"false")
    return b',"epoch":%b%b}' % (orjson.dumps(epoch), more_text)


def message_bytes(m: Message) -> bytes:
    """One message object of a read answer: {"seq", "payload", "receivedAt", "messageId"}."""
    head, tail = _message_parts(m)
    return head + _b64(m.payload) + tail


def after_seq(payload: bytes, received_ms: int, message_id: str | None) -> bytes:
    """What follows the seq in one message object (`message_bytes`): all of it but the seq,
    which Redis assigns, so it can be made while Redis stores the message."""
    return b',"payload":"%b%b' % (_b64(payload), _tail(received_ms, message_id))


class Prepared(NamedTuple):
    """The message object, but for its seq (`after_seq`), of a message an enqueue of this process
    is storing, made while Redis stores it (relay.storage.wakeups.Waiter.expect's prepare), and
    what it was made from: used only for the very message the wakeup carries (`matches`)."""

    payload: bytes
    stored_ms: int
    message_id: str | None
    epoch: str
    after_seq: bytes

    def matches(self, m: Message, epoch: str) -> bool:
        """Whether `m`, stored in `epoch`, is the message this was made from (the same payload
        object, time, messageId and epoch)."""
        return (
            m.payload is self.payload
            and m.received_ms == self.stored_ms
            and m.message_id == self.message_id
            and epoch == self.epoch
        )


def prepare(epoch: str, stored_ms: int, payload: bytes, message_id: str) -> Prepared:
    """`Prepared` of a message being stored (`message_id` "" when it has none)."""
    mid = message_id or None
    return Prepared(payload, stored_ms, mid, epoch, after_seq(payload, stored_ms, mid))


def lone_answer_parts(ready: Prepared) -> tuple[bytes, bytes]:
    """The answer of a read that gets `ready`'s message alone, but for its two numbers (the
    message's seq, and nextSeq one past it): the text between them and the text after
    nextSeq. Made while Redis stores the message, so a woken long-poll's answer is one format
    (`lone_answer`) once Redis has said the seq."""
    return ready.after_seq + b'],"nextSeq":', _after_next_seq(ready.epoch, None)


def lone_answer(seq: int, parts: tuple[bytes, bytes]) -> bytes:
    """`answer_bytes([m], m.seq + 1, epoch, ready=ready)` for the message `ready` was made from,
    stored as `seq`, with `parts` = lone_answer_parts(ready)."""
    return b'{"messages":[{"seq":%d%b%d%b' % (seq, parts[0], seq + 1, parts[1])


def answer_bytes(
    messages: list[Message],
    next_seq: int,
    epoch: str,
    more: bool | None = None,
    ready: Prepared | None = None,
) -> bytes:
    """A read or drain answer built at once (one not worth streaming): the same bytes as
    read_body's pieces joined. `ready`: the one message's text made beforehand, if it matches."""
    if ready is not None and len(messages) == 1 and ready.matches(messages[0], epoch):
        body = b'{"seq":%d%b' % (messages[0].seq, ready.after_seq)
    else:
        body = b",".join([message_bytes(m) for m in messages])
    return b'{"messages":[%b%b' % (body, _end(next_seq, epoch, more))


def worth_streaming(messages: list[Message]) -> bool:
    size = 0
    for m in messages:  # a plain loop: no generator frame on the wake path
        size += len(m.payload)
    return size >= STREAM_OVER


def read_body(
    messages: list[Message], next_seq: int, epoch: str, more: bool | None
) -> tuple[int, Iterator[bytes]]:
    """The length of {"messages": [...], "nextSeq": N, "epoch": E[, "more": B]} and its
    pieces, each payload encoded SLICE bytes at a time as the pieces are taken."""
    parts = [_message_parts(m) for m in messages]
    end = _end(next_seq, epoch, more)
    length = len(b'{"messages":[') + len(end) + max(0, len(messages) - 1)
    for m, (head, tail) in zip(messages, parts, strict=True):
        length += len(head) + _b64_len(len(m.payload)) + len(tail)

    def pieces() -> Iterator[bytes]:
        # one piece per payload slice (the JSON around it joined on): the writer yields
        # to the loop once per piece, as often as a slice's encoding takes
        pending = b'{"messages":['
        for i, (m, (head, tail)) in enumerate(zip(messages, parts, strict=True)):
            pending += (b"," if i else b"") + head
            payload = memoryview(m.payload)
            for at in range(0, len(payload), SLICE):
                text = binascii.b2a_base64(payload[at : at + SLICE], newline=False).translate(_URLSAFE)
                yield pending + (text.rstrip(b"=") if at + SLICE >= len(payload) else text)
                pending = b""
            pending += tail
        yield pending + end

    return length, pieces()


async def stream_read(
    request: web.Request, messages: list[Message], next_seq: int, epoch: str, more: bool | None
) -> web.StreamResponse:
    """Write {"messages": [...], "nextSeq": N, "epoch": E[, "more": B]} slice by slice."""
    length, pieces = read_body(messages, next_seq, epoch, more)
    resp = web.StreamResponse(status=200)
    resp.content_type = "application/json"
    resp.content_length = length
    await resp.prepare(request)
    try:
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0)  # other requests run between slices
        await resp.write_eof()
    except ConnectionError:
        pass  # the reader left; nothing more to say to it
    return resp
