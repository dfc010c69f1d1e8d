"""A recording client workload for the e2e tests: producers and authenticated readers.

Producers send uniquely numbered payloads with an Idempotency-Key (retried until stored);
each queue has one reader that long-polls, signs its reads and acks with the recipient's
Ed25519 key, and at the end reads its queue to the end. Every response goes into a
`tests.support.history.History`, which the test checks.

`live` queues are read over the live WebSocket instead (backlog, "empty", then each new message;
acked over the socket). Their deliveries are recorded, their socket acks are not (unconfirmed: one
lost with a closing socket is not a removal), and a closed socket is reopened from the next seq;
every close and its code is kept in `closes`. At the end they are read to the end like the others.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from relay.protocol import keypair, sign_headers
from tests.support.history import History

NOT_SENT = -1
CONNECT_TIMEOUT_S = 5.0  # a TCP connect on the node's bridge takes milliseconds
SIGNER = "X-E2E-Signer"  # which queue's key signs this GET (removed before it is sent)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class Queue:
    name: str
    public: bytes
    private: bytes

    def path(self, tail: str) -> str:
        return f"/v1/queues/{b64(self.public)}/{tail}"


@dataclass
class Workload:
    """Runs on its own thread and event loop, so tests can step the cluster meanwhile."""

    base_url: Callable[[], str]  # called per request: a Service may have several endpoints
    queues: int = 8
    producers: int = 3
    pause_s: float = 0.05
    seed: int = 11
    history: History = field(default_factory=History)
    stored: int = 0
    connect_failures: int = 0
    live: int = 0  # how many of the queues are read over the live WebSocket
    # which queues to use (by public key, e.g. those a given shard owns); None: any
    accept: Callable[[bytes], bool] | None = None
    closes: list[tuple[float, int | None]] = field(default_factory=list)  # (when, close code)
    _stop: threading.Event = field(default_factory=threading.Event)
    _final: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def __post_init__(self) -> None:
        # (an `accept` must take `queues` of them: each key pair lands on a shard at random)
        self.qs: list[Queue] = []
        while len(self.qs) < self.queues:
            public, private = keypair()
            if self.accept is None or self.accept(public):
                self.qs.append(Queue(f"q{len(self.qs)}", public, private))
        self._keys = {q.name: q.private for q in self.qs}

    def start(self) -> Workload:
        self._thread = threading.Thread(target=self._main, name="e2e-workload", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 90.0) -> None:
        """Stop producing, let readers read every queue to its end, join."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"workload did not finish within {timeout:.0f}s")
        if self._error is not None:
            raise AssertionError(f"workload failed: {self._error!r}")

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported by stop()
            self._error = exc

    async def _run(self) -> None:
        # A connect that does not complete sent nothing: give up on it soon and try again (a SYN
        # DNAT'ed to the address of a Pod already gone, while kube-proxy still lists it, is never
        # answered; waiting out the whole request's time for it made the request look lost).
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=CONNECT_TIMEOUT_S)
        # A connection per request: a POST sent on a kept-alive connection the relay closed
        # meanwhile would get no answer, though the relay never read it.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, middlewares=(self._sign,)
        ) as session:
            producers = [asyncio.create_task(self._producer(session, p)) for p in range(self.producers)]
            readers = [
                asyncio.create_task(self._live(session, q) if n < self.live else self._reader(session, q))
                for n, q in enumerate(self.qs)
            ]
            await asyncio.to_thread(self._stop.wait)
            await asyncio.gather(*producers)
            self._final.set()
            await asyncio.gather(*readers)

    async def _sign(
        self, req: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        """Signs a GET each time it is sent: aiohttp sends an idempotent request once more when
        its connection breaks, and one signature sent twice is a replay the relay refuses (401)."""
        name = req.headers.pop(SIGNER, None)
        if name is not None:
            req.headers.update(sign_headers(self._keys[name], req.method, req.url.raw_path_qs))
        return await handler(req)

    async def _call(
        self, session: aiohttp.ClientSession, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[float, float, int, dict[str, Any], bool]:
        t0 = time.monotonic()
        try:
            base = self.base_url()
        except LookupError:  # no ready endpoint at this moment: nothing sent
            self.connect_failures += 1
            return t0, time.monotonic(), NOT_SENT, {}, False
        try:
            async with session.request(method, base + path, data=body, headers=headers) as resp:
                doc = await resp.json(content_type=None) if resp.content_length != 0 else {}
                return t0, time.monotonic(), resp.status, doc or {}, "Retry-After" in resp.headers
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
            # Never connected, so nothing was sent: not part of the history (a stale endpoint).
            self.connect_failures += 1
            return t0, time.monotonic(), NOT_SENT, {}, False
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError):
            return t0, time.monotonic(), 0, {}, False

    async def _producer(self, session: aiohttp.ClientSession, p: int) -> None:
        rnd = random.Random(self.seed * 100 + p)
        n = 0
        while not self._stop.is_set():
            n += 1
            q = rnd.choice(self.qs)
            msg_id = f"p{p}-{n}"
            payload = msg_id.encode() + b" " + rnd.randbytes(rnd.randint(1, 200))
            headers = {"Content-Type": "application/octet-stream", "Idempotency-Key": msg_id}
            for attempt in range(400):
                t0, t1, status, doc, ra = await self._call(
                    session, "POST", q.path("messages"), payload, headers
                )
                if status == NOT_SENT:
                    await asyncio.sleep(0.1)
                    continue
                seq = doc.get("seq") if status in (200, 201) else None
                self.history.enqueue(q.name, msg_id, t0, t1, status, seq, msg_id, ra)
                if status in (200, 201):
                    self.stored += status == 201
                    break
                await asyncio.sleep(min(0.5, 0.05 * (attempt + 1)))
            else:
                raise AssertionError(f"{msg_id} was never stored")
            await asyncio.sleep(rnd.random() * 2 * self.pause_s)

    async def _live(self, session: aiohttp.ClientSession, q: Queue) -> None:
        next_seq: int | None = None
        while not self._final.is_set():
            path = q.path("live") + (f"?fromSeq={next_seq}" if next_seq is not None else "")
            try:
                base = self.base_url()
                ws = await session.ws_connect(
                    "ws" + base.removeprefix("http") + path,
                    headers={SIGNER: q.name},
                    heartbeat=10.0,  # a partitioned relay sends no close: notice it
                )
            except (LookupError, aiohttp.ClientError, OSError, TimeoutError):
                self.connect_failures += 1
                await asyncio.sleep(0.2)
                continue
            async with ws:
                while not self._final.is_set():
                    try:
                        msg = await ws.receive(timeout=1.0)
                    except TimeoutError:
                        continue
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break
                    frame = json.loads(msg.data)
                    if frame.get("type") != "message":
                        continue
                    now = time.monotonic()
                    item = _item(frame)
                    self.history.deliver(q.name, "read", now, now, 200, [item], item[0], None)
                    next_seq = item[0] + 1
                    await ws.send_str(json.dumps({"type": "ack", "upToSeq": item[0]}))
            if not self._final.is_set():
                self.closes.append((time.monotonic(), ws.close_code))
        await self._reader(session, q, next_seq)

    async def _reader(self, session: aiohttp.ClientSession, q: Queue, next_seq: int | None = None) -> None:
        while True:
            final = self._final.is_set()
            query = f"?limit=50&wait={0 if final else 2}" + (
                f"&fromSeq={next_seq}" if next_seq is not None else ""
            )
            path = q.path("messages") + query
            headers = {SIGNER: q.name}
            t0, t1, status, doc, ra = await self._call(session, "GET", path, b"", headers)
            if status == NOT_SENT:
                await asyncio.sleep(0.1)
                continue
            items = _items(doc) if status == 200 else []
            self.history.deliver(q.name, "read", t0, t1, status, items, next_seq, doc.get("epoch"), ra)
            if status != 200:
                await asyncio.sleep(0.1)
                continue
            if items:
                await self._ack(session, q, items[-1][0])
                next_seq = int(doc["nextSeq"])
            elif final:
                return

    async def _ack(self, session: aiohttp.ClientSession, q: Queue, upto: int) -> None:
        body = f'{{"upToSeq": {upto}}}'.encode()
        path = q.path("ack")
        for _ in range(400):
            headers = {"Content-Type": "application/json", **sign_headers(q.private, "POST", path, body)}
            t0, t1, status, _doc, ra = await self._call(session, "POST", path, body, headers)
            if status == NOT_SENT:
                await asyncio.sleep(0.1)
                continue
            self.history.ack(q.name, t0, t1, status, upto=upto, retry_after=ra)
            if status == 200:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"ack on {q.name} never succeeded")


def _item(m: dict[str, Any]) -> tuple[int, str]:
    payload = base64.urlsafe_b64decode(m["payload"] + "=" * (-len(m["payload"]) % 4))
    return int(m["seq"]), payload.split(b" ", 1)[0].decode()


def _items(doc: dict[str, Any]) -> list[tuple[int, str]]:
    return [_item(m) for m in doc.get("messages", [])]


def window_figures(history: History, start: float, end: float) -> dict[str, Any]:
    """What clients saw of requests begun in [start, end] (monotonic seconds): how many, how
    many failed and how (status), enqueue latency p50/p99/max in ms."""
    events = [e for e in history.events if start <= e["t0"] <= end]
    failed: dict[str, int] = {}
    for e in events:
        if e["status"] not in (200, 201):
            key = f"{e['op']} {e['status'] or 'no answer'}"
            failed[key] = failed.get(key, 0) + 1
    lat = sorted((e["t1"] - e["t0"]) * 1000 for e in events if e["op"] == "enqueue")

    def pct(p: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))], 1) if lat else None

    return {
        "seconds": round(end - start, 1),
        "requests": len(events),
        "failed": failed,
        "enqueue_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": round(lat[-1], 1) if lat else None},
    }
