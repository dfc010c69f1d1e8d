"""Asyncio client library for the relayfleet HTTP API (used by apps, the demo and the tests).

Requests that need the recipient's key are signed automatically when the client
holds it; enqueue stays anonymous.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote, urlencode, urlsplit

import aiohttp
import orjson

from relay.protocol import KeyPair, b64decode, b64encode, key_bytes, public_key_of, sign_headers
from relay.retrying import READY_POLL, RELAY_ASKED, retrying

T = TypeVar("T")


class RelayClientError(Exception):
    """Anything this client raises for a request that did not succeed."""


class RelayUnreachable(RelayClientError, ConnectionError):
    """No answer from the relay: refused connection, DNS, TLS or a dropped connection."""

    def __init__(self, base_url: str, reason: str) -> None:
        super().__init__(f"relay at {base_url} unreachable: {reason}")
        self.reason = reason


class RelayError(RelayClientError):
    """The relay answered and refused: `status` (4xx/5xx) and the contract's `code` (docs/api.md)."""

    def __init__(self, status: int, body: dict[str, Any], headers: Mapping[str, str]) -> None:
        super().__init__(f"{status} {body.get('code')}: {body.get('error')}")
        self.status = status
        self.body = body
        self.code = str(body.get("code", ""))
        self.headers = dict(headers)


class RateLimited(RelayError):
    """429 or 503: not done, try again after `retry_after` seconds (Retry-After / retryAfterMs)."""

    def __init__(self, status: int, body: dict[str, Any], headers: Mapping[str, str]) -> None:
        super().__init__(status, body, headers)
        self.retry_after = _retry_after(body, headers)


RETRYABLE = (429, 503)


def _retry_after(body: dict[str, Any], headers: Mapping[str, str]) -> float:
    """Seconds to wait: the body's retryAfterMs (finer), else Retry-After, else 1."""
    ms = body.get("retryAfterMs")
    if isinstance(ms, int | float) and not isinstance(ms, bool) and ms >= 0:
        return ms / 1000
    try:
        return max(0.0, float(headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


def _error(status: int, body: dict[str, Any], headers: Mapping[str, str]) -> RelayError:
    return (RateLimited if status in RETRYABLE else RelayError)(status, body, headers)


def check_base_url(url: str) -> str:
    """A relay's base URL without its trailing slash; ValueError saying what is wrong (no
    scheme, no host, or the API's /v1 given: the client adds that itself)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r} (e.g. http://127.0.0.1:8080)")
    try:
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise ValueError(f"bad port in {url!r}") from None
    base = url.rstrip("/")
    if parts.query or parts.fragment or base.endswith("/v1"):
        raise ValueError(f"give the relay's base URL, without /v1 or a query: {url!r}")
    return base


Key = bytes | str  # raw 32 bytes, or the base64url text `relayfleet keygen` prints


class _ClosedOnExit:
    """`async with` returns the object itself and closes it on the way out."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


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


class RelayClient(_ClosedOnExit):
    """A relay's HTTP API. `private_key` (raw, base64url text as `relayfleet keygen` prints it,
    or a `keypair()`) signs this client's own queue requests; its public key, the queue's name,
    is derived. `retries` (default 0: off) retries a request answered 429/503 after the wait
    the relay asked for (at most `max_retry_wait` seconds each)."""

    def __init__(
        self,
        base_url: str,
        private_key: Key | KeyPair | None = None,
        *,
        public_key: Key | None = None,
        session: aiohttp.ClientSession | None = None,
        bearer_token: str | None = None,
        retries: int = 0,
        max_retry_wait: float = 30.0,
    ) -> None:
        self.base_url = check_base_url(base_url)
        if isinstance(private_key, KeyPair):
            private_key = private_key.private
        self.private_key = None if private_key is None else key_bytes(private_key, "private_key")
        self.public_key = None if self.private_key is None else public_key_of(self.private_key)
        if public_key is not None and key_bytes(public_key, "public_key") != self.public_key:
            raise ValueError("public_key is not the public half of private_key (it is derived: omit it)")
        self.bearer_token = bearer_token
        self.retries = retries
        self.max_retry_wait = max_retry_wait
        self._session = session
        self._own_session = session is None

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
    def _path(recipient: Key, tail: str, query: dict[str, Any]) -> str:
        q = {k: v for k, v in query.items() if v is not None}
        path = f"/v1/queues/{quote(b64encode(key_bytes(recipient, 'recipient')))}/{tail}"
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
        async def once() -> tuple[int, dict[str, Any]]:
            h = dict(headers or {})
            if sign and self.private_key is not None:  # signed anew: a fresh nonce each attempt
                h.update(sign_headers(self.private_key, method, path, body))
            url = self.base_url + path
            async with self.session.request(method, url, data=body or None, headers=h) as resp:
                raw = await resp.read()
                try:
                    doc = orjson.loads(raw) if raw else {}
                except orjson.JSONDecodeError:  # not the relay's JSON (a proxy's page)
                    doc = {"code": "not_json", "error": f"HTTP {resp.status} without a JSON body"}
                if resp.status not in ok:
                    raise _error(resp.status, doc, resp.headers)
                return resp.status, doc

        return await self._retrying(once)

    async def _retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run `attempt`; on 429/503 sleep what the relay asked and try again, `retries` times.
        A connection failure is RelayUnreachable (not retried: the request may have been done)."""

        def asked(exc: BaseException) -> bool:
            return isinstance(exc, RateLimited) and exc.retry_after <= self.max_retry_wait

        def as_asked(exc: BaseException, _: int) -> float:
            assert isinstance(exc, RateLimited)
            return exc.retry_after

        try:
            return await retrying(RELAY_ASKED, asked, attempts=self.retries + 1, wait=as_asked)(attempt)
        except aiohttp.ClientConnectionError as exc:
            raise RelayUnreachable(self.base_url, str(exc) or type(exc).__name__) from exc

    async def enqueue(
        self, recipient: Key, payload: bytes, channel: bytes = b"", idempotency_key: str | None = None
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
        recipient: Key | None = None,
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
        recipient: Key | None = None,
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
        recipient: Key | None = None,
        channel: bytes = b"",
        up_to_seq: int | None = None,
        seqs: list[int] | None = None,
    ) -> int:
        r = recipient or self._me()
        body = orjson.dumps({"upToSeq": up_to_seq} if up_to_seq is not None else {"seqs": seqs or []})
        path = self._path(r, "ack", {"channel": b64encode(channel) if channel else None})
        _, doc = await self.request("POST", path, body, {"Content-Type": "application/json"}, sign=True)
        return int(doc["removed"])

    async def status(self, recipient: Key | None = None, channel: bytes = b"") -> dict[str, Any]:
        r = recipient or self._me()
        path = self._path(r, "status", {"channel": b64encode(channel) if channel else None})
        _, doc = await self.request("GET", path, sign=True)
        return doc

    async def channels(self, recipient: Key | None = None) -> dict[str, Any]:
        """The recipient's channels and what each holds (signed): {"channels": [{"channel",
        "message_count", "total_bytes", "mediated"}, ...], "message_count", "total_bytes"}; the
        default channel ("") first. An entry with "mediated" true is the DIDComm mediator's queue
        of the key: counted in the totals and the recipient's quotas, not readable here."""
        r = recipient or self._me()
        _, doc = await self.request("GET", self._path(r, "channels", {}), sign=True)
        return doc

    # -- live delivery, Pickup 2.0, inbox, fan-out ----------------------------
    def live(
        self, recipient: Key | None = None, channel: bytes = b"", from_seq: int | None = None
    ) -> LiveOpening:
        """The queue's live WebSocket (signed): `async with client.live() as conn:` (or
        `conn = await client.live()`, then `await conn.close()`)."""
        r = recipient or self._me()
        q = {"channel": b64encode(channel) if channel else None, "fromSeq": from_seq}
        return LiveOpening(self._open_live(self._path(r, "live", q)))

    async def _open_live(self, path: str) -> LiveConnection:
        async def once() -> LiveConnection:
            headers = sign_headers(self.private_key, "GET", path) if self.private_key is not None else {}
            url = "ws" + self.base_url.removeprefix("http") + path
            try:
                ws = await self.session.ws_connect(url, headers=headers, heartbeat=20.0, compress=0)
            except aiohttp.WSServerHandshakeError as exc:
                doc = {"code": "handshake_failed", "error": exc.message}
                raise _error(exc.status, doc, exc.headers or {}) from None
            return LiveConnection(ws)

        return await self._retrying(once)

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
        doc: dict[str, Any] = {"recipients": [b64encode(key_bytes(r, "recipient")) for r in recipients]}
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
            raise ValueError("this client has no key of its own: pass private_key= (or recipient=)")
        return self.public_key


def received(frame: dict[str, Any]) -> Received:
    """A live "message" frame as a Received."""
    return Received(frame["seq"], b64decode(frame["payload"]), frame["receivedAt"], frame["messageId"])


class LiveClosed(Exception):
    """The live connection ended; `code` is the WebSocket close code (4409: displaced)."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"live connection closed (code {code})")
        self.code = code


class LiveConnection(_ClosedOnExit):
    """A queue's live WebSocket: JSON frames in, acks and Pickup messages out."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code

    async def frame(self) -> dict[str, Any]:
        """The next frame as sent (docs/api.md); LiveClosed when the connection ends (bound it
        with asyncio.timeout)."""
        msg = await self.ws.receive()
        if msg.type == aiohttp.WSMsgType.TEXT:
            doc: dict[str, Any] = orjson.loads(msg.data)
            return doc
        # the code the relay sent, even when the TCP close raced the close handshake
        raise LiveClosed(msg.data if msg.type == aiohttp.WSMsgType.CLOSE else self.ws.close_code)

    async def receive(self) -> Received:
        """The next message, payload decoded (other frames skipped); LiveClosed when the
        connection ends."""
        while (doc := await self.frame())["type"] != "message":
            pass
        return received(doc)

    async def messages(self) -> list[Received]:
        """The messages up to the next "empty" marker (the backlog), payloads decoded."""
        out: list[Received] = []
        while (doc := await self.frame())["type"] != "empty":
            if doc["type"] == "message":
                out.append(received(doc))
        return out

    async def ack(self, up_to_seq: int) -> None:
        await self.send({"type": "ack", "upToSeq": up_to_seq})

    async def send(self, doc: dict[str, Any]) -> None:
        await self.ws.send_str(orjson.dumps(doc).decode())

    async def close(self) -> None:
        await self.ws.close()


class LiveOpening:
    """What `RelayClient.live()` returns: use it in `async with`, or await it for the connection."""

    def __init__(self, opening: Awaitable[LiveConnection]) -> None:
        self._opening = opening
        self._conn: LiveConnection | None = None

    def __await__(self) -> Generator[Any, None, LiveConnection]:
        return self._opening.__await__()

    async def __aenter__(self) -> LiveConnection:
        self._conn = await self._opening
        return self._conn

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._conn is not None:
            await self._conn.close()


async def wait_ready(base_url: str, timeout: float = 20.0) -> None:
    """Poll /readyz until the relay answers 200."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as s:

        async def ready() -> None:
            async with s.get(base_url.rstrip("/") + "/readyz") as r:
                if r.status != 200:
                    raise _NotReady

        try:
            await retrying(READY_POLL, (aiohttp.ClientError, _NotReady), deadline=deadline)(ready)
        except (aiohttp.ClientError, _NotReady):
            raise TimeoutError(f"relay at {base_url} not ready after {timeout}s") from None


class _NotReady(Exception):
    """/readyz answered, not 200 yet."""
