"""Migration under load, measured: per-slot write pause and throughput (docs/migration.md).

Two redis-server shards, two relay processes. Shard a holds a slot range full of
queues; writers enqueue through the relays to queues inside the range (which moves)
and outside it (which does not) while the range migrates to shard b. Reported:

- throughput: payload MB moved / wall time of the whole migration (fence to cleanup)
- write pause per slot, migrator side: fence set -> new map published (p50/p99/max)
- write latency seen by clients during the migration, moving slots vs the rest

As a test it runs small and checks the invariants (every write 201, every message
moved). As a command it prints the figures:

    .venv/bin/python -m tests.relay.fleet.test_migration_bench --queues 2000 --messages 10 --size 8192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from relay.fleet.migration import file_publisher, migrate_slots
from relay.fleet.sharding import slot_of
from relay.storage import keys as K
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore
from tests.support.fleet_harness import b64, fleet_procs

LO, HI = 0, 1023  # the moving range (1/16 of the slots)


@dataclass
class BenchConfig:
    queues: int = 300
    messages: int = 10
    size: int = 4096
    writers: int = 16
    max_batch_slots: int = 1024  # the library's defaults
    max_batch_bytes: int = 8 << 20
    warmup_s: float = 2.0


@dataclass
class Writes:
    moving: list[tuple[float, float]] = field(default_factory=list)  # (start, latency)
    other: list[tuple[float, float]] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


def _recipients(n: int, inside: bool, seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    out: list[bytes] = []
    while len(out) < n:
        r = rnd.randbytes(32)
        if (LO <= slot_of(r) <= HI) == inside:
            out.append(r)
    return out


async def _preload(url: str, recipients: list[bytes], cfg: BenchConfig) -> int:
    """Fill shard a directly through the enqueue script (much faster than HTTP)."""
    # set-up, not what is measured: 2,000 enqueues of 4 KiB go out at once, so a loaded box
    # must not fail them on the relay's 2 s per-request write deadline
    limits = QueueLimits(rate_count=1 << 30, write_timeout_s=60.0)
    store = ShardStore("a", url, limits, max_connections=4)
    await store.start()
    total = 0
    try:
        rnd = random.Random(5)
        now = int(time.time() * 1000)
        for i in range(0, len(recipients), 200):
            calls = []
            for r in recipients[i : i + 200]:
                q = K.queue_keys(r, b"")
                for _ in range(cfg.messages):
                    calls.append(store.enqueue(q, EnqueueRequest(r, b"", rnd.randbytes(cfg.size)), now))
                    total += cfg.size
            await asyncio.gather(*calls)
    finally:
        await store.close()
    return total


async def _writer(
    http: aiohttp.ClientSession,
    urls: list[str],
    moving: list[bytes],
    other: list[bytes],
    out: Writes,
    stop: asyncio.Event,
) -> None:
    rnd = random.Random()
    while not stop.is_set():
        inside = rnd.random() < 0.5
        r = rnd.choice(moving if inside else other)
        t0 = time.monotonic()
        async with http.post(f"{rnd.choice(urls)}/v1/queues/{b64(r)}/messages", data=b"w" * 100) as resp:
            await resp.read()
            status = resp.status
        lat = time.monotonic() - t0
        out.statuses[status] = out.statuses.get(status, 0) + 1
        (out.moving if inside else out.other).append((t0, lat))


async def run_bench(workdir: Path, cfg: BenchConfig) -> dict[str, Any]:
    with fleet_procs(workdir, shards=2, relays=2, all_on_first=True) as fleet:
        moving = _recipients(cfg.queues, True, seed=1)
        other = _recipients(64, False, seed=2)
        payload = await _preload(fleet.servers["a"].url, moving, cfg)
        writes = Writes()
        stop = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            loop = asyncio.get_running_loop()
            tasks = [
                loop.create_task(_writer(http, fleet.urls, moving, other, writes, stop))
                for _ in range(cfg.writers)
            ]
            try:
                await asyncio.sleep(cfg.warmup_s)
                t_start = time.monotonic()
                report = await migrate_slots(
                    fleet.shard_map(),
                    range(LO, HI + 1),
                    "b",
                    file_publisher(fleet.map_path),
                    max_batch_slots=cfg.max_batch_slots,
                    max_batch_bytes=cfg.max_batch_bytes,
                )
                t_end = time.monotonic()
                await asyncio.sleep(1.0)
            finally:
                stop.set()
                await asyncio.gather(*tasks)
        # every preloaded message arrived, with its seq
        store = ShardStore("b", fleet.servers["b"].url, QueueLimits())
        await store.start()
        try:
            counts = [(await store.status(K.queue_keys(r, b""))).count for r in moving[:50]]
        finally:
            await store.close()
        during = [(t, lat) for t, lat in writes.moving if t_start <= t <= t_end]
        during_other = [(t, lat) for t, lat in writes.other if t_start <= t <= t_end]
        before = [lat for t, lat in writes.moving + writes.other if t < t_start]
        return {
            "config": cfg.__dict__,
            "payload_mb": round(payload / 1e6, 1),
            "copied_mb": round(report.bytes / 1e6, 1),
            "keys": report.keys,
            "slots": report.slots_moved,
            "batches": report.batches,
            "migration_s": round(t_end - t_start, 2),
            "throughput_mb_s": round(report.mb_per_s, 1),
            "pause_ms": {
                "p50": round(report.pause(0.5) * 1000, 1),
                "p99": round(report.pause(0.99) * 1000, 1),
                "max": round(max(report.pauses_s) * 1000, 1),
            },
            "client_write_ms": {
                "before_p99": round(_quantile(before, 0.99) * 1000, 1),
                "moving_p50": round(_quantile([lat for _, lat in during], 0.5) * 1000, 1),
                "moving_p99": round(_quantile([lat for _, lat in during], 0.99) * 1000, 1),
                "moving_max": round(max((lat for _, lat in during), default=0.0) * 1000, 1),
                "other_p99": round(_quantile([lat for _, lat in during_other], 0.99) * 1000, 1),
                "writes_during": len(during) + len(during_other),
            },
            "statuses": writes.statuses,
            "sample_counts_ok": all(c >= cfg.messages for c in counts),
        }


async def test_migration_bench_small(tmp_path: Path) -> None:
    result = await run_bench(tmp_path, BenchConfig())
    print(json.dumps(result, indent=2))
    assert result["slots"] == HI - LO + 1
    assert set(result["statuses"]) == {201}, result["statuses"]  # the pause stays inside the deadline
    assert result["sample_counts_ok"]
    assert result["copied_mb"] >= result["payload_mb"]
    assert result["throughput_mb_s"] > 1.0
    assert result["pause_ms"]["max"] < 5000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.relay.fleet.test_migration_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--queues", type=int, default=2000)
    p.add_argument("--messages", type=int, default=10)
    p.add_argument("--size", type=int, default=8192, help="payload bytes per message")
    p.add_argument("--writers", type=int, default=16)
    p.add_argument("--batch-slots", type=int, default=1024)
    p.add_argument("--batch-mb", type=float, default=8.0)
    args = p.parse_args(argv)
    cfg = BenchConfig(
        queues=args.queues,
        messages=args.messages,
        size=args.size,
        writers=args.writers,
        max_batch_slots=args.batch_slots,
        max_batch_bytes=int(args.batch_mb * (1 << 20)),
    )
    with tempfile.TemporaryDirectory(prefix="relayfleet-migbench-") as d:
        result = asyncio.run(run_bench(Path(d), cfg))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
