"""A real fleet for migration tests: redis-server shards, relay processes, a recording workload.

`FleetProcs` starts Debian redis-server processes, writes the shard-map file and starts
`python -m relay --shard-map FILE --port P --auth none` subprocesses (stopped by pid);
`spawn_relay`, `wait_ready` and `stop_relays` run such relay processes for other tests too,
on a map file, a ConfigMap or a single Redis URL; `didcomm_slots` says where the DIDComm
mediator's records are.
`Workload` drives producers (uniquely numbered payloads, Idempotency-Key retries),
read+ack consumers, drain consumers and long-polls through every relay, recording each
response into a `tests.support.history.History`, and finally reads every queue to its end.
`Migrator` moves the workload's slots back and forth between shards meanwhile.

The harness itself is tested in tests/relay/fleet/test_fleet_harness.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from relayfleet_testing.localredis import LocalRedis, free_port

from relay.fleet.migration import MigrationReport, file_publisher, migrate_slots, write_map_file
from relay.fleet.routing import load_file
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange, even_split, slot_of
from relay.storage import keys as K
from tests.support.history import History, Verdict

DEBIAN_REDIS = "/usr/bin/redis-server"
SHARD_NAMES = ("a", "b", "c", "d", "e")


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@dataclass
class RelayProc:
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class FleetProcs:
    """N redis-server shards + M relay processes sharing one shard-map file."""

    def __init__(self, workdir: Path, shards: int = 3, relays: int = 2, all_on_first: bool = False) -> None:
        self.workdir = workdir
        self.n_shards = shards
        self.n_relays = relays
        self.all_on_first = all_on_first
        self.servers: dict[str, LocalRedis] = {}
        self.relays: list[RelayProc] = []
        self.map_path = str(workdir / "shardmap.json")
        self.env: dict[str, str] = {}  # extra environment of every relay

    def start(self, env: dict[str, str] | None = None) -> FleetProcs:
        self.env = dict(env or {})
        try:
            for name in SHARD_NAMES[: self.n_shards]:
                self.servers[name] = LocalRedis(
                    binary=DEBIAN_REDIS, dir=str(self.workdir / f"redis-{name}")
                ).start()
            urls = {n: s.url for n, s in self.servers.items()}
            if self.all_on_first:
                first = next(iter(urls))
                shard_map = ShardMap("test", 1, urls, (SlotRange(0, SLOT_COUNT - 1, first),))
            else:
                shard_map = even_split("test", urls)
            write_map_file(self.map_path, shard_map)
            for _ in range(self.n_relays):
                self.relays.append(self.start_relay())
            for r in self.relays:
                wait_ready(r)
        except BaseException:
            self.stop()
            raise
        return self

    def start_relay(self, port: int = 0) -> RelayProc:
        """One more relay on the fleet's map file (on `port`, to restart one); not waited for."""
        return spawn_relay(["--shard-map", self.map_path], self.workdir, self.env, port)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.relays]

    def shard_map(self) -> ShardMap:
        return load_file(self.map_path)

    def stop(self) -> None:
        stop_relays(self.relays)
        for s in self.servers.values():
            s.stop()

    def relay_logs(self) -> str:
        return relay_logs(self.relays)


def spawn_relay(
    source: Sequence[str],
    workdir: Path,
    env: dict[str, str] | None = None,
    port: int = 0,
    signed: bool = False,
) -> RelayProc:
    """`python -m relay SOURCE --port P --auth none` (with `signed`, the default ed25519) as a
    subprocess, SOURCE being `--shard-map FILE`, `--shard-map-configmap NS/NAME` or
    `--redis-url URL`. It logs to workdir/relay-P.log, appended so a restart on the same port
    keeps the earlier lines. Not waited for: see wait_ready."""
    port = port or free_port()
    argv = [sys.executable, "-m", "relay", *source, "--port", str(port)]
    if not signed:
        argv += ["--auth", "none"]
    log_path = workdir / f"relay-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RELAY_FLEET": "test", "RELAY_LOG_LEVEL": "WARNING", **(env or {})},
        )
    return RelayProc(port, proc, log_path)


def stop_relays(relays: Sequence[RelayProc], sig: int = signal.SIGTERM) -> None:
    """Signal every relay still running at once, then wait for each (SIGKILL after 15 s)."""
    for r in relays:
        if r.proc.poll() is None:
            r.proc.send_signal(sig)
    for r in relays:
        try:
            r.proc.wait(15)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait(5)


def relay_logs(relays: Sequence[RelayProc]) -> str:
    """The end of each relay's log, for a failing assertion's message."""
    return "\n".join(
        f"--- {r.log_path.name}\n{r.log_path.read_text(errors='replace')[-4000:]}" for r in relays
    )


def wait_ready(relay: RelayProc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if relay.proc.poll() is not None:
            raise RuntimeError(
                f"relay exited with {relay.proc.returncode}: {relay.log_path.read_text()[-2000:]}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(relay.url + "/readyz", timeout=1) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"relay on {relay.port} not ready in {timeout}s")


@contextlib.contextmanager
def fleet_procs(tmp_path: Path, **kw: Any) -> Iterator[FleetProcs]:
    fleet = FleetProcs(tmp_path, **kw).start()
    try:
        yield fleet
    finally:
        fleet.stop()


def didcomm_slots(servers: Mapping[str, LocalRedis]) -> dict[int, str]:
    """Every slot holding DIDComm mediator records (K.slot_didcomm) -> the shard holding it."""
    placement: dict[int, str] = {}
    for name, server in servers.items():
        with redis.Redis.from_url(server.url) as client:
            for raw in client.scan_iter(match=K.PREFIX + ":{rf*}:didcomm", count=1000):
                key = raw.decode()
                placement[int(key[key.index("{rf") + 3 : key.index("}")])] = name
    return placement


def retries(fleet: FleetProcs) -> dict[str, float]:
    """The relays' internal retries by reason ('moved', 'migrating'), summed over relays."""
    out: dict[str, float] = {}
    for r in fleet.relays:
        with urllib.request.urlopen(r.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("relayfleet_internal_retries_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# -- the workload ---------------------------------------------------------------------


@dataclass
class QueueSpec:
    name: str
    recipient: bytes
    channel: bytes
    mode: str  # 'read' (one read+ack consumer) or 'drain' (two drainers)
    weight: float = 1.0  # share of the producers' traffic; small = mostly long-polls waiting

    @property
    def slot(self) -> int:
        return slot_of(self.recipient, self.channel)

    def path(self, tail: str) -> str:
        ch = f"?channel={b64(self.channel)}" if self.channel else ""
        return f"/v1/queues/{b64(self.recipient)}/{tail}{ch}"


def make_queues(n: int, seed: int, drain_share: float = 0.3, quiet_share: float = 0.2) -> list[QueueSpec]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        recipient = rnd.randbytes(32)
        channel = rnd.randbytes(rnd.choice((0, 8, 16)))
        mode = "drain" if rnd.random() < drain_share else "read"
        weight = 0.05 if rnd.random() < quiet_share else 1.0
        out.append(QueueSpec(f"q{i:02d}", recipient, channel, mode, weight))
    return out


def _q(base: str, extra: dict[str, Any]) -> str:
    sep = "&" if "?" in base else "?"
    return base + sep + "&".join(f"{k}={v}" for k, v in extra.items())


@dataclass
class Workload:
    urls: list[str]
    queues: list[QueueSpec]
    history: History = field(default_factory=History)
    producers: int = 6
    producer_pause_s: float = 0.01
    dup_share: float = 0.05  # share of stored messages re-sent with the same key (expect 200)
    seed: int = 1
    max_wait_s: float = 3.0
    stored: int = 0
    refused: int = 0  # calls answered with neither 200 nor 201, or not answered
    _progress: asyncio.Event = field(default_factory=asyncio.Event)
    _stop_producing: asyncio.Event = field(default_factory=asyncio.Event)
    _final: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        self.rnd = random.Random(self.seed)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    def url(self) -> str:
        return self.rnd.choice(self.urls)

    async def _call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[float, float, int, dict[str, Any], bool]:
        """(t0, t1, status, json body, has Retry-After); status 0 when no response came."""
        t0 = time.monotonic()
        try:
            async with self.session.request(method, self.url() + path, data=body, headers=headers) as resp:
                doc = await resp.json(content_type=None) if resp.content_length != 0 else {}
                answer = t0, time.monotonic(), resp.status, doc or {}, "Retry-After" in resp.headers
        except (aiohttp.ClientError, TimeoutError, ValueError):
            answer = t0, time.monotonic(), 0, {}, False
        if answer[2] not in (200, 201):
            self.refused += 1
            self._progress.set()
        return answer

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.max_wait_s + 30),
        )
        loop = asyncio.get_running_loop()
        for p in range(self.producers):
            self._tasks.append(loop.create_task(self._producer(p)))
        for q in self.queues:
            if q.mode == "read":
                self._tasks.append(loop.create_task(self._reader(q)))
            else:
                self._tasks.append(loop.create_task(self._drainer(q)))
                self._tasks.append(loop.create_task(self._drainer(q)))

    async def until(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        """Return once `done()` holds, checked after each answer: the traffic a phase of a test
        needs, seen rather than slept for (a fixed sleep is too short on a loaded machine and
        too long on a quiet one)."""
        async with asyncio.timeout(timeout):
            while not done():
                self._progress.clear()
                await self._progress.wait()

    async def until_stored(self, more: int, timeout: float = 60.0) -> None:
        """Return once `more` further messages are stored."""
        target = self.stored + more
        await self.until(lambda: self.stored >= target, timeout)

    async def until_refused(self, more: int, timeout: float = 60.0) -> None:
        """Return once `more` further calls were refused (a 503, no answer): the load met a fault."""
        target = self.refused + more
        await self.until(lambda: self.refused >= target, timeout)

    async def stop(self, limit_s: float = 60.0) -> None:
        """Stop producing, then let consumers read every queue to its end."""
        self._stop_producing.set()
        try:  # the session is closed even when producers time out: no socket outlives the test
            await asyncio.wait_for(asyncio.gather(*self._tasks[: self.producers]), limit_s)
            self._final.set()
            await asyncio.wait_for(asyncio.gather(*self._tasks[self.producers :]), limit_s)
        finally:
            await self.cancel()

    async def cancel(self) -> None:
        """End every producer and consumer at once and close the session: for a test that
        already failed (a shard left without a primary would hold `stop` on retries until its
        own timeout, and that error would hide the first)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Workload]:
        """The load runs for the block: started on entry; on leaving, stopped with every queue
        read to its end (`stop`), or, when the block raised, ended at once (`cancel`: the
        failure is the result, no drain)."""
        await self.start()
        try:
            yield self
        except BaseException:
            await self.cancel()
            raise
        await self.stop()

    def verdict(self, saved_in: Path, exactly_once: bool = True, allow_unanswered: bool = False) -> Verdict:
        """The history checker's verdict on this run, its history saved as
        `saved_in`/history.jsonl (the test's tmp_path: kept for reading a failure)."""
        verdict = self.history.check(exactly_once, allow_unanswered)
        self.history.save(str(saved_in / "history.jsonl"))
        return verdict

    # -- producers ----------------------------------------------------------------
    async def _producer(self, p: int) -> None:
        rnd = random.Random(self.seed * 1000 + p)
        weights = [q.weight for q in self.queues]
        n = 0
        while not self._stop_producing.is_set():
            n += 1
            q = rnd.choices(self.queues, weights)[0]
            msg_id = f"p{p}-{n}"
            payload = msg_id.encode() + b" " + rnd.randbytes(rnd.randint(0, 300))
            await self._send_until_stored(q, msg_id, payload)
            if rnd.random() < self.dup_share:
                await self._send_until_stored(q, msg_id, payload)  # a retry of a success: 200, same seq
            await asyncio.sleep(rnd.random() * 2 * self.producer_pause_s)

    async def _send_until_stored(self, q: QueueSpec, msg_id: str, payload: bytes) -> None:
        headers = {"Content-Type": "application/octet-stream", "Idempotency-Key": msg_id}
        for attempt in range(200):
            t0, t1, status, doc, ra = await self._call("POST", q.path("messages"), payload, headers)
            seq = doc.get("seq") if status in (200, 201) else None
            self.history.enqueue(q.name, msg_id, t0, t1, status, seq, msg_id, ra)
            if status in (200, 201):
                self.stored += status == 201
                self._progress.set()
                return
            await asyncio.sleep(min(0.5, 0.02 * (attempt + 1)))
        raise AssertionError(f"{msg_id} never stored")

    # -- consumers ------------------------------------------------------------------
    def _wait(self) -> float:
        return 0.0 if self._final.is_set() else round(self.rnd.uniform(0.5, self.max_wait_s), 2)

    async def _reader(self, q: QueueSpec) -> None:
        next_seq: int | None = None
        while True:
            final = self._final.is_set()
            extra: dict[str, Any] = {"limit": 50, "wait": self._wait()}
            if next_seq is not None:
                extra["fromSeq"] = next_seq
            t0, t1, status, doc, ra = await self._call("GET", _q(q.path("messages"), extra))
            items = delivered_items(doc) if status == 200 else []
            self.history.deliver(q.name, "read", t0, t1, status, items, next_seq, doc.get("epoch"), ra)
            if status != 200:
                await asyncio.sleep(0.05)
                continue
            if items:
                await self._ack(q, items[-1][0])
            next_seq = int(doc["nextSeq"]) if items or next_seq is not None else next_seq
            if final and not items:
                return

    async def _ack(self, q: QueueSpec, upto: int) -> None:
        body = f'{{"upToSeq": {upto}}}'.encode()
        for _ in range(200):
            t0, t1, status, _doc, ra = await self._call(
                "POST", q.path("ack"), body, {"Content-Type": "application/json"}
            )
            self.history.ack(q.name, t0, t1, status, upto=upto, retry_after=ra)
            if status == 200:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"ack on {q.name} never succeeded")

    async def _drainer(self, q: QueueSpec) -> None:
        while True:
            final = self._final.is_set()
            t0, t1, status, doc, ra = await self._call(
                "POST", _q(q.path("drain"), {"limit": 20, "wait": self._wait()}), b""
            )
            items = delivered_items(doc) if status == 200 else []
            self.history.deliver(q.name, "drain", t0, t1, status, items, None, doc.get("epoch"), ra)
            if status != 200:
                await asyncio.sleep(0.05)
                continue
            if final and not items:
                return


def delivered_items(doc: dict[str, Any]) -> list[tuple[int, str]]:
    out = []
    for m in doc.get("messages", []):
        payload = base64.urlsafe_b64decode(m["payload"] + "=" * (-len(m["payload"]) % 4))
        out.append((int(m["seq"]), payload.split(b" ", 1)[0].decode()))
    return out


# -- moving slots meanwhile ---------------------------------------------------------------


@dataclass
class Migrator:
    """Moves random subsets of the workload's slots to random shards until stopped."""

    fleet: FleetProcs
    slots: list[int]
    seed: int = 7
    pause_s: tuple[float, float] = (0.05, 0.4)
    reports: list[MigrationReport] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        rnd = random.Random(self.seed)
        shards = list(self.fleet.servers)
        publish = file_publisher(self.fleet.map_path)
        while not self._stop.is_set():
            shard_map = await asyncio.to_thread(self.fleet.shard_map)
            chosen = rnd.sample(self.slots, max(1, len(self.slots) // 3))
            if rnd.random() < 0.2:  # now and then a wide range around one queue: many empty slots too
                s = rnd.choice(self.slots)
                chosen += list(range(max(0, s - 100), min(SLOT_COUNT, s + 100)))
            target = rnd.choice(shards)
            self.reports.append(await migrate_slots(shard_map, chosen, target, publish))
            await asyncio.sleep(rnd.uniform(*self.pause_s))

    def stop(self) -> None:
        self._stop.set()

    @property
    def moved(self) -> int:
        return sum(r.slots_moved for r in self.reports)

    def pauses(self) -> list[float]:
        return [p for r in self.reports for p in r.pauses_s]


async def final_placement_problems(fleet: FleetProcs, slots: Sequence[int]) -> list[str]:
    """Every slot's keys live only on its owner; no shard holds a fence or stray keys for it."""
    import redis.asyncio as aioredis

    from relay.storage import keys as K

    shard_map = fleet.shard_map()
    problems = []
    for name, server in fleet.servers.items():
        client = aioredis.Redis.from_url(server.url)
        try:
            for s in slots:
                owner = shard_map.shard_for_slot(s)
                raw = await client.get(K.slot_state(s))
                state = raw.decode() if isinstance(raw, bytes) else raw
                n_keys = len([k async for k in client.scan_iter(match=K.slot_key_pattern(s), count=1000)])
                if name == owner:
                    if state is not None:
                        problems.append(f"slot {s}: owner {name} has state {state!r}")
                else:
                    if state is not None and not state.startswith("moved "):
                        problems.append(f"slot {s}: non-owner {name} has state {state!r}")
                    if n_keys - (state is not None) > 0:
                        problems.append(f"slot {s}: non-owner {name} still holds {n_keys} key(s)")
        finally:
            await client.aclose()
    return problems
