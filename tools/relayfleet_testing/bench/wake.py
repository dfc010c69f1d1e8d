"""Wake latency with thousands of idle waiters: relay against nginx + nchan, same client code.

N waiters park on N distinct queues (nchan: channels) of one server process, as long-polls
or as live WebSockets. Once the server reports all N waiting and has gone quiet, probes
run one at a time: a 256-byte enqueue (nchan: a publish to ``/rpub/``) to one parked
waiter, the next only after the previous wake arrived (and a short gap, so the woken
waiter's follow-up is done). The figure is the time from sending the enqueue to the last
byte of the waiter's answer or frame, stamped where the bytes arrive (loadgen, wsclient).

CPU per wake: utime + stime of the server's processes (relay process; nginx master and
worker) and of its redis-server over the measured probes alone (not the set-up, not the
warm-up probes), gaps and idle waiters' upkeep included, ÷ the measured wakes
(targets.CpuMeter, as the enqueue's CPU per message).

Memory per idle waiter: the server's RSS once all N are parked, less its RSS before the first
opened (freshly started, after one enqueue and one look at its waiter count, so the enqueue
path's and the count's first allocations are not charged to the waiters), ÷ N.

Each waiter keeps its server's contract: a woken relay long-poll polls again from the
answer's ``nextSeq`` (docs/api.md), a nchan long-poll from the answer's Etag and
Last-Modified; a relay live socket acks each message. The probe goes to a waiter parked
since the set-up (round-robin over all N), never to one that has only just re-polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import orjson
from relayfleet_testing.bench.loadgen import Conn, HttpError, Response, build_request, gather_bounded
from relayfleet_testing.bench.procs import BenchError
from relayfleet_testing.bench.results import Row, percentile
from relayfleet_testing.bench.scenarios import OCTET, filler, recipient
from relayfleet_testing.bench.targets import CpuMeter, RedisServer, Target
from relayfleet_testing.bench.wsclient import WsConn

MODES = ("longpoll", "websocket")
WAIT_S = 60  # the relay's longest long-poll (docs/api.md); an expired one polls again
PROBE_TIMEOUT_S = 10.0


class _Waiter:
    """One parked waiter; ``expect`` returns a future that its next delivery resolves with
    the delivery's arrival time (perf_counter)."""

    def __init__(self, recipient: bytes) -> None:
        self.recipient = recipient
        self.unexpected = 0  # deliveries nobody expected, refusals, errors
        self._expect: asyncio.Future[float] | None = None
        self.task: asyncio.Task[None] | None = None

    def expect(self) -> asyncio.Future[float]:
        self._expect = asyncio.get_running_loop().create_future()
        return self._expect

    def woken(self, done: float) -> None:
        if self._expect is not None and not self._expect.done():
            self._expect.set_result(done)
        else:
            self.unexpected += 1

    async def run(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class PollWaiter(_Waiter):
    """A long-poll that polls again after each answer, from the position that answer gave."""

    def __init__(self, target: Target, conn: Conn, recipient: bytes) -> None:
        super().__init__(recipient)
        self.target = target
        self.conn = conn
        self._path = target.poll_path(recipient, WAIT_S)
        self._headers: tuple[tuple[str, str], ...] = ()

    def _advance(self, resp: Response) -> bool:
        """Move past a delivering answer; False when the answer delivered nothing."""
        if self.target.kind == "relay":
            doc = orjson.loads(resp.body)
            if not doc["messages"]:
                return False
            self._path = f"{self.target.poll_path(self.recipient, WAIT_S)}&fromSeq={doc['nextSeq']}"
            return True
        etag, modified = resp.header(b"etag"), resp.header(b"last-modified")
        if etag is None or modified is None:
            raise BenchError(f"{self.target.name}: a long-poll answer without Etag and Last-Modified")
        self._headers = (("If-None-Match", etag.decode()), ("If-Modified-Since", modified.decode()))
        return True

    async def run(self) -> None:
        with contextlib.suppress(HttpError, OSError):
            while True:
                resp = await self.conn.request("GET", self._path, b"", self._headers)
                if resp.status == 200 and self._advance(resp):
                    self.woken(resp.done)
                elif resp.status not in (200, 304, 408):  # 304 / 408 / empty 200: the wait expired
                    self.unexpected += 1
                    await asyncio.sleep(1.0)

    def close(self) -> None:
        self.conn.close(reset=True)  # RST: 10,000 closes must not leave 10,000 TIME_WAIT ports


class LiveWaiter(_Waiter):
    """A live WebSocket (relay: acks each message, as its contract asks; nchan has no ack)."""

    def __init__(self, target: Target, conn: WsConn, recipient: bytes) -> None:
        super().__init__(recipient)
        self.relay = target.kind == "relay"
        self.conn = conn

    async def run(self) -> None:
        with contextlib.suppress(HttpError, OSError):
            while True:
                msg = await self.conn.next_message()
                if not self.relay:
                    self.woken(msg.done)
                    continue
                doc = orjson.loads(msg.data)
                if doc.get("type") == "message":
                    self.woken(msg.done)
                    self.conn.send_text(orjson.dumps({"type": "ack", "upToSeq": doc["seq"]}))
                elif doc.get("type") != "empty":
                    self.unexpected += 1

    def close(self) -> None:
        self.conn.close(reset=True)


async def open_waiter(target: Target, mode: str, recipient: bytes) -> _Waiter:
    waiter: _Waiter
    if mode == "longpoll":
        waiter = PollWaiter(target, await Conn.open("127.0.0.1", target.port), recipient)
    else:
        conn = await WsConn.open("127.0.0.1", target.port, target.live_path(recipient))
        if target.kind == "relay":  # the backlog (none) then "empty": its waiter is registered
            first = orjson.loads((await asyncio.wait_for(conn.next_message(), PROBE_TIMEOUT_S)).data)
            if first.get("type") != "empty":
                conn.close(reset=True)
                raise BenchError(f"{target.name}: live sent {first.get('type')!r} before 'empty'")
        waiter = LiveWaiter(target, conn, recipient)
    waiter.task = asyncio.create_task(waiter.run())
    return waiter


# -- how many wait, and is the server done setting them up ----------------------------------


_RELAY_GAUGE = {"longpoll": "relayfleet_waiters", "websocket": "relayfleet_live_connections"}


async def waiting(target: Target, mode: str, conn: Conn) -> int:
    """How many waiters the server reports: the relay's gauge, nchan's stub status
    (subscribers, once no Redis command of nchan's is pending)."""
    if target.kind == "relay":
        text = (await conn.request("GET", "/metrics")).body.decode()
        m = re.search(rf"^{_RELAY_GAUGE[mode]} (\S+)$", text, re.M)
        return int(float(m.group(1))) if m else 0
    text = (await conn.request("GET", "/bench/nchan_status")).body.decode()
    subs = re.search(r"^subscribers: (\d+)", text, re.M)
    pending = re.search(r"^redis pending commands: (\d+)", text, re.M)
    if subs is None or pending is None:
        raise BenchError(f"{target.name}: /bench/nchan_status did not list subscribers")
    return int(subs.group(1)) if pending.group(1) == "0" else 0


# The quiet wait's own bound: from 20 s after its first socket opened, a relay with 10,000
# idle live sockets spends 16-24 % of a core on heartbeats and re-reads and is never that
# quiet; its waiters' first reads are done well within this once all are registered.
QUIET_MAX_S = 5.0


async def wait_registered(target: Target, mode: str, n: int, within: float = 300.0) -> None:
    """Until the server reports ``n`` waiters, then until its processes are quiet (their CPU
    grew by under 10 ms in 250 ms), at most QUIET_MAX_S: every waiter's registration and
    first read are done."""
    conn = await Conn.open("127.0.0.1", target.port)
    deadline = time.monotonic() + within
    try:
        while (seen := await waiting(target, mode, conn)) < n:
            target.check_alive()
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{target.name}: {seen} of {n} {mode} waiters registered after {within:.0f} s"
                )
            await asyncio.sleep(0.1)
    finally:
        conn.close()
    quiet_by = min(deadline, time.monotonic() + QUIET_MAX_S)
    before = target.cpu_seconds()
    while True:
        await asyncio.sleep(0.25)
        now = target.cpu_seconds()
        if now - before < 0.01 or time.monotonic() > quiet_by:
            return
        before = now


# -- the run --------------------------------------------------------------------------------


async def probe(target: Target, writer: Conn, waiter: _Waiter, body: bytes) -> float:
    """One enqueue to a parked waiter: ms from sending it to the waiter woken."""
    raw = build_request(
        "POST", target.enqueue_path(waiter.recipient), writer.host, body, tuple(OCTET.items())
    )
    woken = waiter.expect()
    sent = time.perf_counter()
    answer = await writer.request_raw(raw)
    if not 200 <= answer.status < 300:
        raise BenchError(f"{target.name}: enqueue answered {answer.status}: {answer.body[:200]!r}")
    try:
        done = await asyncio.wait_for(woken, PROBE_TIMEOUT_S)
    except TimeoutError:
        raise BenchError(
            f"{target.name}: a parked waiter was not woken within {PROBE_TIMEOUT_S:.0f} s"
        ) from None
    return (done - sent) * 1000


async def _wakes(
    target: Target, writer: Conn, waiters: list[_Waiter], body: bytes, gap_s: float
) -> list[float]:
    """One probe to each of ``waiters`` in turn, ``gap_s`` after each wake: their timings."""
    timings = []
    for waiter in waiters:
        timings.append(await probe(target, writer, waiter, body))
        await asyncio.sleep(gap_s)
    return timings


async def run(
    target: Target,
    mode: str,
    waiters: int,
    probes: int,
    redis: RedisServer,
    warmup: int = 20,
    gap_s: float = 0.002,
) -> Row:
    """Park ``waiters`` waiters on ``target``, then ``warmup`` + ``probes`` sequential wakes of
    256 B each; the CPU ``target`` and ``redis`` spend per measured wake."""
    body = filler(256)
    base_rss = await _warm_rss(target, recipient(), body)
    parked: list[_Waiter] = []

    async def one() -> _Waiter:
        w = await open_waiter(target, mode, recipient())
        parked.append(w)  # closed in the finally, also when another open fails
        return w

    writer: Conn | None = None
    try:
        try:
            await gather_bounded(waiters, one)
        except (OSError, HttpError, TimeoutError) as exc:
            raise BenchError(f"{target.name}: opening {waiters} {mode} waiters failed: {exc}") from None
        await wait_registered(target, mode, waiters)
        rss = target.rss_kib()
        writer = await Conn.open("127.0.0.1", target.port)
        order = [parked[i % len(parked)] for i in range(warmup + probes)]  # round-robin
        await _wakes(target, writer, order[:warmup], body, gap_s)
        meter = await CpuMeter.open(target, redis)
        timings = await _wakes(target, writer, order[warmup:], body, gap_s)
        cpu = await meter.close(len(timings))
        target.check_alive()
    finally:
        if writer is not None:
            writer.close()
        await _close(parked)
    sent_to_woken = sorted(timings)
    return Row(
        "wake",
        target.name,
        {"mode": mode, "waiters": waiters, "size": len(body)},
        {
            "p50_ms": percentile(sent_to_woken, 50),
            "p99_ms": percentile(sent_to_woken, 99),
            "max_ms": sent_to_woken[-1],
            "probes": float(len(sent_to_woken)),
            "unexpected": float(sum(w.unexpected for w in parked)),
            "rss_kib": float(rss),
            "rss_per_waiter_kib": (rss - base_rss) / waiters,
            **cpu.values(),  # server_cpu_us, redis_cpu_us, cpu_us: per measured wake
        },
    )


async def _warm_rss(target: Target, recipient: bytes, body: bytes) -> int:
    """The fresh server's RSS after one enqueue (to a queue nobody waits on) and one look at
    its waiter count: what the waiters' RSS is measured from."""
    conn = await Conn.open("127.0.0.1", target.port)
    try:
        raw = build_request("POST", target.enqueue_path(recipient), conn.host, body, tuple(OCTET.items()))
        answer = await conn.request_raw(raw)
        if not 200 <= answer.status < 300:
            raise BenchError(f"{target.name}: enqueue answered {answer.status}: {answer.body[:200]!r}")
        await waiting(target, "longpoll", conn)
    finally:
        conn.close()
    return target.rss_kib()


async def _close(parked: list[_Waiter]) -> None:
    tasks = [w.task for w in parked if w.task is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for w in parked:
        w.close()
