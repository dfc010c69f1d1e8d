"""What minReplicas costs: enqueue throughput and latency with and without WAIT, one run.

``python -m relayfleet_testing.bench.wait_cost [--seconds S] [--rounds N] [--connections C] [--size B]``

Starts a primary and one replica (redis-server, diskless replication, AOF everysec as a
shard runs), one Sentinel watching them, and two relay processes on the same Sentinel
service: one with ``minReplicas=1`` (every write batch followed by ``WAIT 1``), one
without. Rounds alternate between the two (A B A B ...) so both see the same machine
load; each round is a closed loop of C connections each POSTing its next enqueue (B-byte
payload, a fresh queue per connection) as soon as the previous answer came. Prints one
line per round and a summary (median of the rounds per relay, and the ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
from relayfleet_testing.bench.loadgen import Conn, HttpError, build_request
from relayfleet_testing.bench.procs import BenchError, Procs, free_port, wait_port
from relayfleet_testing.bench.targets import BENCH_RELAY_ENV

from relay.fleet.sharding import SentinelTarget


def _b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _redis_bin(name: str) -> str:
    for candidate in (f"/usr/bin/{name}", shutil.which(name)):
        if candidate and os.path.exists(candidate):
            return candidate
    raise BenchError(f"{name} not found (apt-get install redis-server redis-sentinel)")


async def _round(port: int, connections: int, seconds: float, size: int) -> tuple[int, int, list[float]]:
    """(answered 2xx, errors, latencies in seconds) of one closed-loop round."""
    payload = os.urandom(size)
    conns = [await Conn.open("127.0.0.1", port) for _ in range(connections)]
    latencies: list[float] = []
    errors = [0]
    stop_at = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        path = f"/v1/queues/{_b64(os.urandom(32))}/messages"
        raw = build_request(
            "POST", path, "127.0.0.1", payload, (("Content-Type", "application/octet-stream"),)
        )
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                resp = await conns[i].request_raw(raw)
            except (HttpError, OSError):
                errors[0] += 1
                continue
            if 200 <= resp.status < 300:
                latencies.append(resp.done - t0)
            else:
                errors[0] += 1

    try:
        await asyncio.gather(*(worker(i) for i in range(connections)))
    finally:
        for c in conns:
            c.close()
    return len(latencies), errors[0], latencies


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="relay-wait-cost-"))
    redis_server, redis_sentinel = _redis_bin("redis-server"), _redis_bin("redis-sentinel")
    with Procs(workdir) as procs:
        primary, replica, sentinel = free_port(), free_port(), free_port()
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "yes", "--appendfsync", "everysec"]
        common += ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        for port, extra in ((primary, []), (replica, ["--replicaof", "127.0.0.1", str(primary)])):
            node_dir = workdir / f"redis-{port}"
            node_dir.mkdir()
            child = procs.start(
                f"redis-{port}", [redis_server, "--port", str(port), "--dir", str(node_dir), *common, *extra]
            )
            await wait_port(port, child)
        conf = workdir / "sentinel.conf"
        conf.write_text(
            f"port {sentinel}\nbind 127.0.0.1\ndir {workdir}\n"
            f"sentinel monitor bench 127.0.0.1 {primary} 1\n"
            "sentinel down-after-milliseconds bench 5000\n"
        )
        await wait_port(sentinel, procs.start("sentinel", [redis_sentinel, str(conf)]))
        await asyncio.sleep(1.0)  # the replica's first sync
        relays: dict[str, int] = {}
        for label, min_replicas in (("minReplicas=1", 1), ("no minReplicas", 0)):
            url = SentinelTarget((("127.0.0.1", sentinel),), "bench", min_replicas=min_replicas).url()
            port = free_port()
            argv = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--redis-url", url, "--auth", "none"]
            env = {"RELAY_LOG_LEVEL": "WARNING", "RELAY_RATE_LIMIT": str(1 << 30), **BENCH_RELAY_ENV}
            await wait_port(port, procs.start(f"relay-{min_replicas}", argv, env))
            relays[label] = port
        for port in relays.values():  # warm up: connections, scripts
            await _round(port, args.connections, 1.0, args.size)
        results: dict[str, list[tuple[float, float, float, int]]] = {k: [] for k in relays}
        for r in range(args.rounds):
            for label, port in relays.items():
                ok, errors, lat = await _round(port, args.connections, args.seconds, args.size)
                rate = ok / args.seconds
                row = (rate, _p(lat, 0.5) * 1000, _p(lat, 0.99) * 1000, errors)
                results[label].append(row)
                print(
                    f"round {r + 1} {label:15s} {rate:8.0f} enqueues/s  p50 {row[1]:6.2f} ms  "
                    f"p99 {row[2]:6.2f} ms  errors {errors}",
                    flush=True,
                )
        # proof the minReplicas relay waited: WAIT calls and time on the primary
        with redis.Redis(port=primary) as client:
            wait = client.info("commandstats").get("cmdstat_wait", {})
        print(
            f"\nprimary: WAIT called {wait.get('calls', 0)} times, "
            f"{float(wait.get('usec_per_call', 0.0)) / 1000:.2f} ms per call"
        )
        load = os.getloadavg()
        print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
        med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in results.items()}
        for label, (rate, p50, p99) in med.items():
            print(
                f"median of {args.rounds} rounds, {label:15s}: {rate:8.0f} enqueues/s, "
                f"p50 {p50:.2f} ms, p99 {p99:.2f} ms"
            )
        a, b = med["minReplicas=1"], med["no minReplicas"]
        if b[0] and b[1] and b[2]:
            print(
                f"minReplicas=1 / none: throughput x{a[0] / b[0]:.2f}, "
                f"p50 x{a[1] / b[1]:.2f}, p99 x{a[2] / b[2]:.2f}"
            )
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m relayfleet_testing.bench.wait_cost", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--seconds", type=float, default=8.0, help="per round (no env)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per relay, alternating (no env)")
    p.add_argument("--connections", type=int, default=32, help="closed-loop connections (no env)")
    p.add_argument("--size", type=int, default=256, help="payload bytes (no env)")
    try:
        return asyncio.run(run(p.parse_args(argv)))
    except BenchError as exc:
        print(f"wait_cost: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
