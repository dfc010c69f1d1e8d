"""Faults of the shard's Redis itself: restarts under load, a lost AOF tail, maxmemory.

- SIGKILL + restart with ``appendfsync always``: zero loss, epochs unchanged.
- ``appendfsync everysec``: a killed *process* loses nothing (its writes are in the page
  cache); what everysec risks is a machine crash losing the writes since the last fsync
  (≤ 1 s, ≤ 2 s when fsync stalls). We simulate that by cutting the AOF back to its size
  one second before the kill, measure what is lost, and check whether it is reported
  through the queue ``epoch`` (the contract: history lost ⇒ epoch changes).
- ``maxmemory`` with noeviction: enqueues get 507, every stored message stays readable.
"""

from __future__ import annotations

import asyncio
import base64
import glob
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from relayfleet_testing.localredis import LocalRedis

from tests.support.faults import call, report, start_relay, stop_relay
from tests.support.fleet_harness import (
    DEBIAN_REDIS,
    QueueSpec,
    RelayProc,
    Workload,
    _q,
    delivered_items,
    make_queues,
)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def _kill_and_restart(redis: LocalRedis, before_start: Callable[[float], None] | None = None) -> float:
    """SIGKILL redis-server, start it again on its port and dir; seconds it was away.
    ``before_start(t_kill)`` runs while it is down."""
    t0 = time.monotonic()
    redis.stop(signal.SIGKILL)
    if before_start is not None:
        before_start(t0)
    redis.start()
    return time.monotonic() - t0


def _aof_file(redis: LocalRedis) -> str:
    files = glob.glob(os.path.join(redis.dir, "appendonlydir", "*.incr.aof"))
    assert files, os.listdir(redis.dir)
    return max(files, key=os.path.getmtime)


class _AofSampler:
    """Samples the AOF's size every 20 ms: what the disk would hold if fsync ran then."""

    def __init__(self, redis: LocalRedis) -> None:
        self.redis = redis
        self.samples: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            path = _aof_file(self.redis)
            self.samples.append((time.monotonic(), path, os.path.getsize(path)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def at(self, t: float) -> tuple[str, int]:
        best = [s for s in self.samples if s[0] <= t]
        assert best, "no AOF sample before the cut point"
        return best[-1][1], best[-1][2]


async def _with_relays(tmp_path: Path, redis: LocalRedis, n: int = 2) -> list[RelayProc]:
    return [await asyncio.to_thread(start_relay, tmp_path, redis.url) for _ in range(n)]


@pytest.mark.parametrize("appendfsync", ["always", "everysec"])
async def test_redis_process_sigkilled_loses_nothing(tmp_path: Path, appendfsync: str) -> None:
    """A killed redis-server process (not the machine) loses nothing with either policy:
    everysec has already write()n each command to the AOF before it answers. With
    everysec the restart still changes every written queue's epoch (see check_boot)."""
    await _redis_kills(tmp_path, appendfsync, 2)


@pytest.mark.soak
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("appendfsync", ["always", "everysec"])
async def test_redis_process_sigkilled_soak(tmp_path: Path, appendfsync: str, soak_seconds: float) -> None:
    await _redis_kills(tmp_path, appendfsync, max(2, int(soak_seconds / 2.5)))


async def _redis_kills(tmp_path: Path, appendfsync: str, kills: int) -> None:
    redis = LocalRedis(binary=DEBIAN_REDIS, appendfsync=appendfsync, dir=str(tmp_path / "redis")).start()
    relays = await _with_relays(tmp_path, redis)
    try:
        work = Workload(
            [r.url for r in relays], make_queues(8, seed=31, drain_share=0.0), producers=4, max_wait_s=2.0
        )
        away: list[float] = []
        async with work.running():
            for _ in range(kills):
                await work.until_stored(50)  # traffic before each kill (and after the last restart)
                away.append(await asyncio.to_thread(_kill_and_restart, redis))
            await work.until_stored(40)
        verdict = work.verdict(tmp_path)
        report(
            f"redis-sigkill-{appendfsync}",
            verdict,
            kills=kills,
            redis_away_s_max=round(max(away), 2),
            retryable_503=verdict.counts.get("retryable_503", 0),
            epoch_changes_expected=verdict.by_kind().get("epoch", 0),
        )
        if appendfsync == "always":
            assert verdict.ok, verdict.render()  # includes: no epoch change on any queue
        else:
            # everysec cannot tell a clean restart from a lost tail: epochs change, and
            # that must be the only thing the history shows (nothing lost, no dup, order kept)
            assert set(verdict.by_kind()) <= {"epoch"}, verdict.render()
        assert verdict.counts["retryable_503"] > 0
    finally:
        for r in relays:
            stop_relay(r)
        redis.stop()


async def _read_all(http: aiohttp.ClientSession, url: str, q: QueueSpec) -> tuple[list[tuple[int, str]], str]:
    """Every held message of a queue as (seq, id), and the queue's epoch."""
    out: list[tuple[int, str]] = []
    extra: dict[str, object] = {"limit": 1000}
    while True:
        for _ in range(100):  # right after a restart the relay may still be reconnecting
            status, doc, _h, _t = await call(http, "GET", url + _q(q.path("messages"), extra))
            if status != 503:
                break
            await asyncio.sleep(0.1)
        assert status == 200, doc
        out += delivered_items(doc)
        if not doc["messages"]:
            return out, str(doc["epoch"])
        extra["fromSeq"] = doc["nextSeq"]


async def test_everysec_lost_tail_is_measured_and_must_change_epoch(tmp_path: Path) -> None:
    redis = LocalRedis(binary=DEBIAN_REDIS, appendfsync="everysec", dir=str(tmp_path / "redis")).start()
    relay = (await _with_relays(tmp_path, redis, 1))[0]
    sampler = _AofSampler(redis)
    queues = make_queues(6, seed=41, drain_share=0.0)
    acked: dict[str, tuple[str, int, float]] = {}  # id -> (queue, seq, end of its 201)
    stop = asyncio.Event()

    async def produce(http: aiohttp.ClientSession, p: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            q, msg_id = queues[(p + n) % len(queues)], f"p{p}-{n}"
            status, doc, _h, _t = await call(
                http,
                "POST",
                relay.url + q.path("messages"),
                msg_id.encode() + b" x",
                **{"Idempotency-Key": msg_id},
            )
            if status == 201:
                acked[msg_id] = (q.name, int(doc["seq"]), time.monotonic())
            await asyncio.sleep(0.005)

    try:
        async with aiohttp.ClientSession() as http:
            before = {q.name: (await _read_all(http, relay.url, q))[1] for q in queues}
            sampler.start()
            producers = [asyncio.ensure_future(produce(http, p)) for p in range(4)]
            await asyncio.sleep(3.0)
            killed_at: list[float] = []

            def lose_tail(t_kill: float) -> None:
                # a power cut right after an fsync one second ago: the rest never reached disk
                killed_at.append(t_kill)
                path, size = sampler.at(t_kill - 1.0)
                sampler.stop()
                with open(path, "r+b") as f:
                    f.truncate(size)

            stop.set()
            await asyncio.gather(*producers)
            await asyncio.to_thread(_kill_and_restart, redis, lose_tail)
            t_kill = killed_at[0]
            held: dict[str, set[str]] = {}
            after: dict[str, str] = {}
            for q in queues:
                items, after[q.name] = await _read_all(http, relay.url, q)
                held[q.name] = {i for _s, i in items}
            lost = {i: a for i, a in acked.items() if i not in held[a[0]]}
            # one new message per queue: does it reuse a seq already acknowledged for another?
            reused = 0
            by_seq = {(a[0], a[1]) for i, a in acked.items()}
            epoch_now: dict[str, str] = {}
            for q in queues:
                status, doc, _h, _t = await call(http, "POST", relay.url + q.path("messages"), b"new x")
                assert status == 201, doc
                reused += (q.name, int(doc["seq"])) in by_seq
                epoch_now[q.name] = (await _read_all(http, relay.url, q))[1]
        damaged = {a[0] for a in lost.values()}
        flagged = {q for q in damaged if epoch_now[q] != before[q]}
        window = t_kill - min((a[2] for a in lost.values()), default=t_kill)
        report(
            "redis-everysec-lost-tail",
            None,
            acknowledged=len(acked),
            lost_acknowledged=len(lost),
            loss_window_s=round(window, 2),
            queues_damaged=len(damaged),
            queues_epoch_changed=len(flagged),
            seqs_reused_after_restart=reused,
        )
        assert lost, "the simulated lost tail should have held acknowledged messages"
        assert window <= 1.1, f"lost messages acknowledged up to {window:.2f}s before the crash"
        # The contract: a queue whose history was lost shows a new epoch (already on the
        # first read after the restart), and no seq is handed out twice.
        assert damaged == flagged, f"{len(damaged - flagged)} queue(s) lost history silently"
        assert all(after[q] != before[q] for q in damaged), "the first read after the restart"
        assert reused == 0, f"{reused} acknowledged seq(s) handed out again"
    finally:
        sampler.stop()
        stop_relay(relay)
        redis.stop()


async def test_maxmemory_answers_507_and_keeps_what_was_stored(tmp_path: Path) -> None:
    redis = LocalRedis(binary=DEBIAN_REDIS, maxmemory="12mb", dir=str(tmp_path / "redis")).start()
    # Redis' own maxmemory answer, not the relay's shard reserve (its once-a-second INFO can see the
    # shard nearly full first when the suite runs slower, and answers storage_reserve: tested apart)
    no_reserve = {"RELAY_SHARD_RESERVE_FRACTION": "0"}
    relays = [await asyncio.to_thread(start_relay, tmp_path, redis.url, no_reserve)]
    url = relays[0].url
    queues = make_queues(4, seed=51, drain_share=0.0)
    stored: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    statuses: dict[int, int] = defaultdict(int)
    try:
        async with aiohttp.ClientSession() as http:
            n = 0
            full = 0
            while full < 20 and n < 2000:
                q = queues[n % len(queues)]
                body = f"m{n} ".encode() + os.urandom(48 * 1024)
                status, doc, _h, _t = await call(
                    http, "POST", url + q.path("messages"), body, **{"Idempotency-Key": f"k{n}"}
                )
                statuses[status] += 1
                if status == 201:
                    stored[q.name].append((int(doc["seq"]), body))
                else:
                    assert status == 507, (status, doc)
                    assert doc["code"] == "storage_full", doc
                    full += 1
                n += 1
            assert full == 20, f"never reached maxmemory: {dict(statuses)}"
            # everything answered 201 is still there, in order, byte for byte
            for q in queues:
                got: list[tuple[int, bytes]] = []
                next_seq = None
                while True:
                    extra = {"limit": 50} if next_seq is None else {"limit": 50, "fromSeq": next_seq}
                    status, doc, _h, _t = await call(http, "GET", url + _q(q.path("messages"), extra))
                    assert status == 200, doc
                    if not doc["messages"]:
                        break
                    got += [
                        (
                            int(m["seq"]),
                            base64.urlsafe_b64decode(m["payload"] + "=" * (-len(m["payload"]) % 4)),
                        )
                        for m in doc["messages"]
                    ]
                    next_seq = doc["nextSeq"]
                assert got == stored[q.name], q.name
            # reads and acks still work at maxmemory, and acking frees room for writes again
            for q in queues:
                if stored[q.name]:
                    status, doc, _h, _t = await call(
                        http, "POST", url + q.path("ack"), f'{{"upToSeq": {stored[q.name][-1][0]}}}'.encode()
                    )
                    assert status == 200, doc
            status, doc, _h, _t = await call(http, "POST", url + queues[0].path("messages"), b"after")
            assert status == 201, doc
        report(
            "redis-maxmemory",
            None,
            stored=sum(len(v) for v in stored.values()),
            rejected_507=statuses[507],
            other=sum(c for s, c in statuses.items() if s not in (201, 507)),
            lost=0,
        )
    finally:
        for r in relays:
            stop_relay(r)
        redis.stop()


async def test_lost_meta_hash_gives_the_next_write_a_new_epoch(tmp_path: Path) -> None:
    """A queue whose keys are all gone (a replaced or emptied Redis) answers with a new
    epoch; the new history may start again at seq 1 because the epoch tells clients."""
    from relay.storage import keys as K

    redis_server = LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / "redis")).start()
    relay = (await _with_relays(tmp_path, redis_server, 1))[0]
    q = make_queues(1, seed=71)[0]
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(3):
                status, doc, _h, _t = await call(http, "POST", relay.url + q.path("messages"), b"m%d" % i)
                assert status == 201, doc
            _items, first = await _read_all(http, relay.url, q)
            await client.delete(*K.queue_keys(q.recipient, q.channel).all_keys())
            status, doc, _h, _t = await call(http, "POST", relay.url + q.path("messages"), b"again")
            assert status == 201, doc
            items, second = await _read_all(http, relay.url, q)
        assert second != first
        assert [i for _s, i in items] == ["again"]
        report("redis-meta-lost", None, epoch_changed=second != first, seq_after=items[0][0])
    finally:
        await client.aclose()
        stop_relay(relay)
        redis_server.stop()
