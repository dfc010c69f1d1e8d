"""Retention sweep benchmark: Spark vs a single-threaded redis-py sweeper, same data.

    python -m relayfleet_testing.bench.spark_retention [--queues 100000] [--messages 1000000] [--shards 3]
        [--master local[2]] [--json PATH]

Starts its own redis-server shards on free ports, seeds them through the real
enqueue script (ShardStore, one process per shard), snapshots them (RDB), then
runs the identical sweep twice from the same snapshot: once task after task in
this thread (spark_jobs.retention.sweep_sequential), once as Spark tasks
(run_sweep). Both must remove exactly the same messages; the report gives the
wall times and their ratio. Every server is stopped by its pid at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from relayfleet_testing.localredis import free_port, redis_server_binary

from relay.fleet.sharding import ShardMap, even_split
from relay.retrying import READY_POLL, retrying_blocking
from relay.storage import keys as K
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore
from spark_jobs.retention import RetentionPolicy, run_sweep, sweep_sequential
from spark_jobs.shard_io import split_tasks

DAY_MS = 86_400_000
MAX_AGE_S = 7 * 86_400
MAX_MESSAGES = 12


@dataclass
class Server:
    """A redis-server with RDB snapshots only (no AOF), so a restart loads the snapshot."""

    dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.port = self.port or free_port()
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--dbfilename", "dump.rdb", "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--maxmemory-policy", "noeviction", "--logfile", str(self.dir / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

        def ping() -> None:
            with redis.Redis(port=self.port, socket_connect_timeout=0.5) as r:
                r.ping()

        not_up = (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError)
        try:
            retrying_blocking(READY_POLL, not_up, deadline=time.monotonic() + 120)(ping)
        except not_up:
            raise RuntimeError(
                f"redis-server on port {self.port} did not come up; see {self.dir}/redis.log"
            ) from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def _seed_shard(
    url: str, shard: str, shard_map: ShardMap, queues: int, messages: int, seed: int, now: int
) -> int:
    """Child process: `queues` queues on this shard holding `messages` messages in all."""
    rng = random.Random(seed)
    recipients: list[bytes] = []
    while len(recipients) < queues:
        r = rng.randbytes(32)
        if shard_map.shard_for(r) == shard:
            recipients.append(r)
    # message counts 1..2*avg-1 per queue, summing to `messages`
    counts = [1] * queues
    for _ in range(messages - queues):
        counts[rng.randrange(queues)] += 1
    jobs: list[tuple[bytes, bytes, int]] = []
    for r, n in zip(recipients, counts, strict=True):
        # each queue was active for a while within the last 10 days: some entirely
        # before the 7-day cutoff (emptied and deleted), some across it (trimmed)
        start = now - rng.randrange(10 * DAY_MS)
        end = start + rng.randrange(now - start + 1)
        step = max(1, (end - start) // n)
        for i in range(n):
            jobs.append((r, rng.randbytes(rng.randint(64, 256)), start + i * step))

    async def run() -> int:
        store = ShardStore(shard, url, QueueLimits(rate_count=10**9, max_messages=10**6), max_connections=4)
        await store.start()
        stored = 0
        try:
            for i in range(0, len(jobs), 4000):
                chunk = jobs[i : i + 4000]
                outs = await asyncio.gather(
                    *(store.enqueue(K.queue_keys(r, b""), EnqueueRequest(r, b"", p), t) for r, p, t in chunk)
                )
                stored += sum(1 for o in outs if o.kind == "stored")
        finally:
            await store.close()
        return stored

    return asyncio.run(run())


def _seed_worker(args: tuple[str, str, ShardMap, int, int, int, int]) -> int:
    return _seed_shard(*args)


def _snapshot(servers: dict[str, Server], snap: Path) -> None:
    for name, s in servers.items():
        with redis.Redis.from_url(s.url) as r:
            r.save()
        shutil.copy(s.dir / "dump.rdb", snap / f"{name}.rdb")


def _restore(servers: dict[str, Server], snap: Path) -> None:
    for name, s in servers.items():
        s.stop()
        shutil.copy(snap / f"{name}.rdb", s.dir / "dump.rdb")
        s.start()


def _totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    keys = ("queues_scanned", "messages_removed", "bytes_removed", "queues_deleted")
    return {k: sum(int(r[k]) for r in rows) for k in keys}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m relayfleet_testing.bench.spark_retention", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--queues", type=int, default=100_000)
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--task-slots", type=int, default=1024)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.messages < args.queues or args.queues < args.shards or args.shards < 1:
        print("bench: need messages >= queues >= shards >= 1", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="relayfleet-spark-bench-"))
    names = [chr(ord("a") + i) for i in range(args.shards)]
    servers = {n: Server(work / n) for n in names}
    try:
        for s in servers.values():
            s.dir.mkdir()
            s.start()
        shard_map = even_split("bench", {n: s.url for n, s in servers.items()})
        now = int(time.time() * 1000)
        t0 = time.monotonic()
        per_q = [args.queues // args.shards + (i < args.queues % args.shards) for i in range(args.shards)]
        per_m = [args.messages // args.shards + (i < args.messages % args.shards) for i in range(args.shards)]
        ctx = multiprocessing.get_context("spawn")
        jobs = [
            (servers[n].url, n, shard_map, per_q[i], per_m[i], 1000 + i, now) for i, n in enumerate(names)
        ]
        with ctx.Pool(args.shards) as pool:
            stored = sum(pool.map(_seed_worker, jobs))
        seed_s = time.monotonic() - t0
        print(f"bench: seeded {stored} messages in {args.queues} queues on {args.shards} shards "
              f"in {seed_s:.1f}s", file=sys.stderr)  # fmt: skip
        snap = work / "snap"
        snap.mkdir()
        _snapshot(servers, snap)

        tasks = split_tasks(shard_map, args.task_slots)
        policy = RetentionPolicy(max_age_s=MAX_AGE_S, max_messages=MAX_MESSAGES, idle_s=MAX_AGE_S)
        policies = {n: policy for n in names}
        at = now + 1000

        t0 = time.monotonic()
        seq_rows = sweep_sequential(tasks, policies, at)
        seq_s = time.monotonic() - t0
        print(f"bench: single-threaded sweep {seq_s:.2f}s {_totals(seq_rows)}", file=sys.stderr)

        _restore(servers, snap)
        from spark_jobs.session import get_session

        t0 = time.monotonic()
        spark = get_session("relayfleet-bench", args.master)
        startup_s = time.monotonic() - t0
        try:
            # one throwaway job, so JVM and Python-worker start-up are not counted as sweep time
            spark.sparkContext.parallelize(range(4), 2).count()
            t0 = time.monotonic()
            spark_rows = run_sweep(spark, tasks, policies, at)
            spark_s = time.monotonic() - t0
        finally:
            spark.stop()
        print(f"bench: Spark {args.master} sweep {spark_s:.2f}s (+{startup_s:.1f}s session start) "
              f"{_totals(spark_rows)}", file=sys.stderr)  # fmt: skip
        if _totals(seq_rows) != _totals(spark_rows):
            print("bench: the two sweeps disagree", file=sys.stderr)
            return 1
        result = {
            "shards": args.shards,
            "queues": args.queues,
            "messages": stored,
            "tasks": len(tasks),
            "cpus": os.cpu_count(),
            "seed_s": round(seed_s, 2),
            "sequential_s": round(seq_s, 2),
            "spark_master": args.master,
            "spark_s": round(spark_s, 2),
            "spark_startup_s": round(startup_s, 2),
            "speedup": round(seq_s / spark_s, 2),
            "speedup_with_startup": round(seq_s / (spark_s + startup_s), 2),
            **_totals(spark_rows),
        }
        print(json.dumps(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n", "utf-8")
        return 0
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
