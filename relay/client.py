"""Asyncio client library for the relayfleet HTTP API (used by apps, the demo and the tests).

Requests that need the recipient's key are signed automatically when the client
holds it; enqueue stays anonymous.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import orjson

from relay.protocol import b64decode, b64encode, sign_headers


class RelayError(Exception):
    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
        super().__init__(f"{status} {body.get('code')}: {body.get('error')}")
        self.status = status
        self.body = body
        self.code = str(body.get("code", ""))
        self.headers = headers


@dataclass(frozen=True)
class Received:
    seq: int
    payload: bytes
    received_at: str
    message_id: str | None


@dataclass(frozen=True)
class Batch:
    messages: list[Received]
    next_seq: int
    epoch: str
    more: bool = False


def _batch(doc: dict[str, Any]) -> Batch:
    msgs = [
        Received(m["seq"], b64decode(m["payload"]), m["receivedAt"], m["messageId"]) for m in doc["messages"]
    ]
    return Batch(msgs, doc["nextSeq"], doc["epoch"], bool(doc.get("more", False)))


class RelayClient:
    def __init__(
        self,
        base_url: str,
        private_key: bytes | None = None,
        public_key: bytes | None = None,
        session: aiohttp.ClientSession | None = None,
        bearer_token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.private_key = private_key
        self.public_key = public_key
        self.bearer_token = bearer_token
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> RelayClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    @staticmethod
    def _path(recipient: bytes, tail: str, query: dict[str, Any]) -> str:
        q = {k: v for k, v in query.items() if v is not None}
        path = f"/v1/queues/{quote(b64encode(recipient))}/{tail}"
        return f"{path}?{urlencode(q)}" if q else path

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        sign: bool = False,
        ok: tuple[int, ...] = (200, 201),
    ) -> tuple[int, dict[str, Any]]:
        h = dict(headers or {})
        if sign and self.private_key is not None:
            h.update(sign_headers(self.private_key, method, path, body))
        async with self.session.request(method, self.base_url + path, data=body or None, headers=h) as resp:
            raw = await resp.read()
            doc = orjson.loads(raw) if raw else {}
            if resp.status not in ok:
                raise RelayError(resp.status, doc, dict(resp.headers))
            return resp.status, doc

    async def enqueue(
        self, recipient: bytes, payload: bytes, channel: bytes = b"", idempotency_key: str | None = None
    ) -> tuple[int, bool]:
        """Store a message; returns (seq, duplicate)."""
        headers = {"Content-Type": "application/octet-stream"}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        if self.bearer_token:
            headers["Authorization"] = f"Bearer {self.bearer_token}"
        path = self._path(recipient, "messages", {"channel": b64encode(channel) if channel else None})
        _, doc = await self.request("POST", path, payload, headers)
        return int(doc["seq"]), bool(doc["duplicate"])

    async def read(
        self,
        recipient: bytes | None = None,
        channel: bytes = b"",
        from_seq: int | None = None,
        limit: int | None = None,
        wait: float | None = None,
    ) -> Batch:
        r = recipient or self._me()
        q = {
            "channel": b64encode(channel) if channel else None,
            "fromSeq": from_seq,
            "limit": limit,
            "wait": wait,
        }
        _, doc = await self.request("GET", self._path(r, "messages", q), sign=True)
        return _batch(doc)

    async def drain(
        self,
        recipient: bytes | None = None,
        channel: bytes = b"",
        limit: int | None = None,
        wait: float | None = None,
    ) -> Batch:
        r = recipient or self._me()
        q = {"channel": b64encode(channel) if channel else None, "limit": limit, "wait": wait}
        _, doc = await self.request("POST", self._path(r, "drain", q), sign=True)
        return _batch(doc)

    async def ack(
        self,
        recipient: bytes | None = None,
        channel: bytes = b"",
        up_to_seq: int | None = None,
        seqs: list[int] | None = None,
    ) -> int:
        r = recipient or self._me()
        body = orjson.dumps({"upToSeq": up_to_seq} if up_to_seq is not None else {"seqs": seqs or []})
        path = self._path(r, "ack", {"channel": b64encode(channel) if channel else None})
        _, doc = await self.request("POST", path, body, {"Content-Type": "application/json"}, sign=True)
        return int(doc["removed"])

    async def status(self, recipient: bytes | None = None, channel: bytes = b"") -> dict[str, Any]:
        r = recipient or self._me()
        path = self._path(r, "status", {"channel": b64encode(channel) if channel else None})
        _, doc = await self.request("GET", path, sign=True)
        return doc

    # -- live delivery, Pickup 2.0, inbox, fan-out ----------------------------
    async def live(
        self, recipient: bytes | None = None, channel: bytes = b"", from_seq: int | None = None
    ) -> LiveConnection:
        """Open the queue's live WebSocket (signed); close it with `await conn.close()` or `async with`."""
        r = recipient or self._me()
        q = {"channel": b64encode(channel) if channel else None, "fromSeq": from_seq}
        path = self._path(r, "live", q)
        headers = sign_headers(self.private_key, "GET", path) if self.private_key is not None else {}
        url = "ws" + self.base_url.removeprefix("http") + path
        try:
            ws = await self.session.ws_connect(url, headers=headers, heartbeat=20.0, compress=0)
        except aiohttp.WSServerHandshakeError as exc:
            raise RelayError(exc.status, {"code": "handshake_failed", "error": exc.message}, {}) from None
        return LiveConnection(ws)

    async def pickup(self, message: dict[str, Any], channel: bytes = b"") -> dict[str, Any]:
        """Send one Pickup 2.0 message over HTTP (signed with this client's key); returns the reply."""
        path = "/v1/didcomm/pickup" + (f"?{urlencode({'channel': b64encode(channel)})}" if channel else "")
        body = orjson.dumps(message)
        _, doc = await self.request("POST", path, body, {"Content-Type": "application/json"}, sign=True)
        return doc

    async def inbox_append(self, inbox_id: str, message_id: str, ciphertext: bytes) -> tuple[int, str, bool]:
        """Append to a tunnl3d inbox; returns (seq, storedAt, duplicate)."""
        body = orjson.dumps({"messageId": message_id, "ciphertext": b64encode(ciphertext)})
        headers = {"X-Inbox-ID": inbox_id, "Content-Type": "application/json"}
        status, doc = await self.request("POST", "/v1/inbox/append", body, headers)
        return int(doc["seq"]), str(doc["storedAt"]), status == 200

    async def inbox_read(
        self, inbox_id: str, from_seq: int | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """Read a tunnl3d inbox (never deletes): {"messages": [...], "nextSeq": N}."""
        q = {k: v for k, v in {"fromSeq": from_seq, "limit": limit}.items() if v is not None}
        path = "/v1/inbox/messages" + (f"?{urlencode(q)}" if q else "")
        _, doc = await self.request("GET", path, headers={"X-Inbox-ID": inbox_id})
        return doc

    async def fanout(
        self, recipients: list[bytes], payload: bytes, channel: bytes = b"", message_id: str | None = None
    ) -> list[dict[str, Any]]:
        """Queue one payload for every recipient independently; one result per recipient, in order."""
        doc: dict[str, Any] = {"recipients": [b64encode(r) for r in recipients]}
        doc["payload"] = b64encode(payload)
        if channel:
            doc["channel"] = b64encode(channel)
        if message_id is not None:
            doc["messageId"] = message_id
        headers = {"Content-Type": "application/json"}
        if self.bearer_token:
            headers["Authorization"] = f"Bearer {self.bearer_token}"
        _, out = await self.request("POST", "/v1/messages", orjson.dumps(doc), headers)
        return list(out["results"])

    def _me(self) -> bytes:
        if self.public_key is None:
            raise ValueError("this client has no key of its own; pass recipient=")
        return self.public_key


def received(frame: dict[str, Any]) -> Received:
    """A live "message" frame as a Received."""
    return Received(frame["seq"], b64decode(frame["payload"]), frame["receivedAt"], frame["messageId"])


class LiveClosed(Exception):
    """The live connection ended; `code` is the WebSocket close code (4409: displaced)."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"live connection closed (code {code})")
        self.code = code


class LiveConnection:
    """A queue's live WebSocket: JSON frames in, acks and Pickup messages out."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws

    async def __aenter__(self) -> LiveConnection:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code

    async def receive(self) -> dict[str, Any]:
        """The next frame; LiveClosed when the connection ends (bound it with asyncio.timeout)."""
        msg = await self.ws.receive()
        if msg.type == aiohttp.WSMsgType.TEXT:
            doc: dict[str, Any] = orjson.loads(msg.data)
            return doc
        # the code the relay sent, even when the TCP close raced the close handshake
        raise LiveClosed(msg.data if msg.type == aiohttp.WSMsgType.CLOSE else self.ws.close_code)

    async def messages(self) -> list[Received]:
        """Frames up to and including the next "empty" marker, as messages."""
        out: list[Received] = []
        while (doc := await self.receive())["type"] != "empty":
            if doc["type"] == "message":
                out.append(received(doc))
        return out

    async def ack(self, up_to_seq: int) -> None:
        await self.send({"type": "ack", "upToSeq": up_to_seq})

    async def send(self, doc: dict[str, Any]) -> None:
        await self.ws.send_str(orjson.dumps(doc).decode())

    async def close(self) -> None:
        await self.ws.close()


async def wait_ready(base_url: str, timeout: float = 20.0) -> None:
    """Poll /readyz until the relay answers 200."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(base_url.rstrip("/") + "/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"relay at {base_url} not ready after {timeout}s")
            await asyncio.sleep(0.05)
