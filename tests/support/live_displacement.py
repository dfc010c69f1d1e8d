"""Live displacement under load, recorded for the history checker (tests/relay/fleet and e2e/).

One queue; a producer stores `total` messages (Idempotency-Key, ~150/s) while live sockets are
opened one after another, each through the next relay URL in turn: every new socket displaces the
one before (close code 4409), `cycles` times. Each socket records its frames as deliveries on its
own connection (``conn``, in open order; ``t0`` its open, ``t1`` the frame's arrival), acks over
HTTP every eighth frame (the answer bounds the removal), and the last socket reads to the end.
The checker then says whether anything was lost and whether a displaced socket got a frame after
its successor's first (``displaced``); every request is signed with the queue's key.

`live_delivery` asks a relay for status.live_delivery; `until_live` times a flip; `scrape` reads
a relay's metric samples.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from relay.protocol import KeyPair, keypair, sign_headers
from tests.support.history import History, Verdict
from tests.support.waiting import until

ACK_EVERY = 8
CYCLE_S = 0.35  # between two opens


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class LiveQueue:
    keys: KeyPair = field(default_factory=keypair)
    name: str = "q"

    def path(self, tail: str) -> str:
        return f"/v1/queues/{b64(self.keys.public)}/{tail}"

    def signed(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        return sign_headers(self.keys.private, method, path, body)


def session() -> aiohttp.ClientSession:
    # a connection per request: a signed GET resent on a broken kept-alive connection is a replay
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True, limit=0),
        timeout=aiohttp.ClientTimeout(total=30, sock_connect=5),
    )


async def live_delivery(http: aiohttp.ClientSession, url: str, q: LiveQueue) -> bool:
    path = q.path("status")
    async with http.get(url + path, headers=q.signed("GET", path)) as resp:
        assert resp.status == 200, await resp.text()
        return bool((await resp.json())["live_delivery"])


async def until_live(
    http: aiohttp.ClientSession, url: str, q: LiveQueue, want: bool, limit_s: float
) -> float:
    """Seconds until status.live_delivery through `url` answers `want` (asked every 10 ms)."""
    t0 = time.monotonic()

    async def answered() -> bool:
        return await live_delivery(http, url, q) is want

    await until(f"live_delivery {want}", answered, limit_s, 0.01)
    return time.monotonic() - t0


async def scrape(http: aiohttp.ClientSession, url: str, sample: str) -> dict[tuple[str, ...], float]:
    """The relay's samples named `sample`, by their label values."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {
        tuple(s.labels.values()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample
    }


async def open_live(http: aiohttp.ClientSession, url: str, q: LiveQueue) -> aiohttp.ClientWebSocketResponse:
    """A live socket, once its "empty" marker came (its lease is taken by then)."""
    path = q.path("live")
    ws = await http.ws_connect("ws" + url.removeprefix("http") + path, headers=q.signed("GET", path))
    msg = await asyncio.wait_for(ws.receive(), 10)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    assert json.loads(msg.data)["type"] == "empty", msg
    return ws


class Consumer:
    """One live socket of the queue, numbered in open order."""

    def __init__(self, n: int, http: aiohttp.ClientSession, url: str, q: LiveQueue, h: History) -> None:
        self.n, self.http, self.url, self.q, self.h = n, http, url, q, h
        self.got: list[int] = []
        self.opened = 0.0
        self.closed_at: float | None = None
        self.code: int | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.task: asyncio.Task[None] | None = None

    async def open(self) -> float:
        """Open the socket; the time the upgrade completed."""
        path = self.q.path("live")
        self.opened = time.monotonic()
        self.ws = await self.http.ws_connect(
            "ws" + self.url.removeprefix("http") + path, headers=self.q.signed("GET", path)
        )
        upgraded = time.monotonic()
        self.task = asyncio.get_running_loop().create_task(self._read())
        return upgraded

    async def _read(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            doc = json.loads(msg.data)
            if doc["type"] != "message":
                continue
            t = time.monotonic()
            seq = int(doc["seq"])
            payload = doc["payload"]
            msg_id = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).decode()
            # a live stream reads on from its last frame (the first: from the oldest held); the
            # relay may have read a frame's message at any time since the socket opened
            after = self.got[-1] + 1 if self.got else None
            self.h.deliver(
                self.q.name, "read", self.opened, t, 200, [(seq, msg_id)], after, None, conn=self.n
            )
            self.got.append(seq)
            if len(self.got) % ACK_EVERY == 0:
                await self._ack(seq)
        self.closed_at = time.monotonic()
        self.code = self.ws.close_code

    async def _ack(self, upto: int) -> None:
        path = self.q.path("ack")
        body = json.dumps({"upToSeq": upto}).encode()
        for _ in range(20):  # a connection that broke before an answer: the ack is sent again
            headers = {"Content-Type": "application/json", **self.q.signed("POST", path, body)}
            t0 = time.monotonic()
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.post(self.url + path, data=body, headers=headers) as resp:
                    status = resp.status
                self.h.ack(self.q.name, t0, time.monotonic(), status, upto=upto)
                if status == 200:
                    return
            await asyncio.sleep(0.05)


async def _produce(
    http: aiohttp.ClientSession, urls: Sequence[str], q: LiveQueue, h: History, n: int
) -> None:
    for i in range(n):
        msg_id = f"m{i}"
        headers = {"Content-Type": "application/octet-stream", "Idempotency-Key": msg_id}
        for _ in range(100):
            t0 = time.monotonic()
            status, seq, ra = 0, None, False
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.post(
                    urls[i % len(urls)] + q.path("messages"), data=msg_id.encode(), headers=headers
                ) as r:
                    doc = await r.json(content_type=None)
                    status, seq, ra = r.status, doc.get("seq"), "Retry-After" in r.headers
            h.enqueue(q.name, msg_id, t0, time.monotonic(), status, seq, msg_id, ra)
            if status in (200, 201):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.006)


@dataclass
class Displacements:
    history: History
    to_4409: list[float]  # per cycle: the newer socket's upgrade -> the older one's 4409 close
    closes: list[int | None]  # the displaced sockets' close codes
    delivered: int

    def verdict(self) -> Verdict:
        return self.history.check(exactly_once=False)  # unacked messages go to the newer socket

    def figures(self) -> str:
        ms = sorted(t * 1000 for t in self.to_4409)
        p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
        return (
            f"{len(ms)} displacements, {self.delivered} frames; time to 4409 median "
            f"{statistics.median(ms):.1f} ms, p95 {p95:.1f} ms, max {ms[-1]:.1f} ms"
        )


async def displace_under_load(
    urls: Sequence[str] | Callable[[], Sequence[str]], cycles: int = 20, total: int = 1000
) -> Displacements:
    """Run the workload (the module docstring); each socket through the next of `urls`."""
    q = LiveQueue()
    h = History()

    def at(i: int) -> str:
        us = urls() if callable(urls) else urls
        return us[i % len(us)]

    async with session() as http:
        producer = asyncio.get_running_loop().create_task(_produce(http, [at(0), at(1)], q, h, total))
        consumers = [Consumer(0, http, at(0), q, h)]
        await consumers[0].open()
        to_4409: list[float] = []
        try:
            for i in range(1, cycles + 1):
                await asyncio.sleep(CYCLE_S)
                old = consumers[-1]
                new = Consumer(i, http, at(i), q, h)
                upgraded = await new.open()
                consumers.append(new)
                assert old.task is not None
                await asyncio.wait_for(asyncio.shield(old.task), 15)
                assert old.closed_at is not None
                to_4409.append(old.closed_at - upgraded)
            await asyncio.wait_for(producer, 180)
            stored = {e["seq"] for e in h.events if e["op"] == "enqueue" and e["status"] in (200, 201)}
            await until(
                "every stored message delivered", lambda: stored <= {s for c in consumers for s in c.got}, 90
            )
        finally:
            producer.cancel()
            for c in consumers:
                if c.ws is not None:
                    await c.ws.close()
                if c.task is not None:
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await c.task
    closes = [c.code for c in consumers[:-1]]
    return Displacements(h, to_4409, closes, sum(len(c.got) for c in consumers))
