"""CPU time per enqueue: the figure that survives a shared machine.

Throughput on two shared cores moves with everyone else's load; the CPU a server
process spends per answered request moves much less. Each target gets its own
redis-server; rounds alternate between targets so load drifts hit them alike.
Per run: wrk warm-up, then utime + stime of the server (and its Redis) from
/proc before and after a measured wrk run, divided by the requests answered.

Run: python -m relayfleet_testing.bench.cpu [--tree LABEL=DIR ...] [--ceiling] [--rounds N]
A tree is a directory holding a ``relay`` package (e.g. ``git archive HEAD relay |
tar -x -C /tmp/base``); the relay is started from it with this interpreter.
``--cpu-profile DIR`` runs each server under tools/relayfleet_testing/bench/sampler.py (CPU-time
samples; py-spy's wall-clock samples overstate writes that wake another process)
and profiles one extra run per target, not counted in the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from relayfleet_testing.bench import profile, wrk
from relayfleet_testing.bench.procs import BenchError, Child, Procs, free_port
from relayfleet_testing.bench.scenarios import OCTET, recipient
from relayfleet_testing.bench.targets import REPO, RedisServer, Target, relay_python, start_redis, wait_http

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
SAMPLER = Path(__file__).with_name("sampler.py")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # fields 14 and 15 of stat(5)


@dataclass
class Subject:
    label: str
    target: Target
    redis: RedisServer
    runs: list[tuple[float, float, float]] = field(default_factory=list)  # µs/req, redis µs/req, req/s
    samples: Path | None = None  # collapsed stacks written by the sampler on exit

    @property
    def pid(self) -> int:
        return self.target.children[0].pid


async def _start(procs: Procs, label: str, tree: Path | None, sample_dir: Path | None) -> Subject:
    redis = await start_redis(procs, aof=True)
    port = free_port()
    samples = sample_dir / f"{label}.collapsed.txt" if sample_dir else None
    python = [relay_python()] + ([str(SAMPLER), str(samples)] if samples else [])
    if tree is None:  # the empty-handler ceiling
        argv = [*python, "-m", "relayfleet_testing.bench.ceiling", "--port", str(port)]
        child: Child = procs.start(label, argv, cwd=REPO)
        kind = "aiohttp"
    else:
        argv = [*python, "-m", "relay", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--redis-url", redis.url, "--auth", "none"]
        # `-m` puts the working directory first on sys.path: the tree's relay package is used
        child = procs.start(label, argv, cwd=tree)
        kind = "relay"
    await wait_http(port, "/readyz", child)
    return Subject(label, Target(label, kind, [port], [child]), redis, samples=samples)


def _script(s: Subject, size: int) -> str:
    # fresh recipients each run: no queue comes near the rate limit or its caps
    paths = [s.target.enqueue_path(recipient()) for _ in range(wrk.pool_size(size, 4096))]
    return wrk.lua_script("POST", paths, [], OCTET, filler_size=size)


async def _measure(procs: Procs, s: Subject, size: int, conns: int, seconds: int, warmup: int) -> None:
    script = _script(s, size)
    urls = s.target.urls()
    if warmup:
        await wrk.run(procs, urls, [script], conns, 1, warmup, "wrk-warmup")
    before, rbefore = cpu_seconds(s.pid), cpu_seconds(s.redis.child.pid)
    res = await wrk.run(procs, urls, [script], conns, 1, seconds, "wrk")
    cpu, rcpu = cpu_seconds(s.pid) - before, cpu_seconds(s.redis.child.pid) - rbefore
    s.target.check_alive()
    if res.errors or res.requests == 0:
        raise BenchError(f"{s.label}: {res.errors} errors in {res.requests} requests")
    s.runs.append((cpu / res.requests * 1e6, rcpu / res.requests * 1e6, res.rate))
    print(
        f"{s.label:>12}: {s.runs[-1][0]:6.1f} µs/req  (redis {s.runs[-1][1]:5.1f})  {res.rate:8,.0f} req/s"
        f"  load {os.getloadavg()[0]:.2f}",
        flush=True,
    )


def _subjects(args: argparse.Namespace) -> list[tuple[str, Path | None]]:
    subjects: list[tuple[str, Path | None]] = []
    for spec in args.tree or [f"this={REPO}"]:
        label, eq, path = spec.partition("=")
        tree = Path(path if eq else label).resolve()
        if not (tree / "relay" / "__init__.py").exists():
            raise BenchError(f"{tree} holds no relay package")
        subjects.append((label if eq else tree.name, tree))
    if args.ceiling:
        subjects.append(("aiohttp", None))
    for d in (args.profile, args.cpu_profile):
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
    return subjects


async def _cpu_profile(procs: Procs, s: Subject, args: argparse.Namespace) -> None:
    assert s.samples is not None
    script = _script(s, args.size)
    await wrk.run(procs, s.target.urls(), [script], args.connections, 1, args.warmup or 1, "wrk-warmup")
    os.kill(s.pid, signal.SIGUSR1)
    await wrk.run(procs, s.target.urls(), [script], args.connections, 1, args.seconds)
    os.kill(s.pid, signal.SIGUSR2)
    procs.stop(s.target.children[0])  # the sampler writes its file on exit
    total, text = profile.summarize(s.samples.read_text(), top=40)
    s.samples.with_suffix("").with_suffix(".top.txt").write_text(text)
    print(
        f"{s.label}: {total} CPU samples, top frames in {s.samples.with_suffix('').with_suffix('.top.txt')}"
    )


async def run(args: argparse.Namespace, subjects: list[tuple[str, Path | None]]) -> int:
    with tempfile.TemporaryDirectory(prefix="relay-cpu-") as tmp, Procs(Path(tmp)) as procs:
        sample_dir = Path(args.cpu_profile) if args.cpu_profile else None
        started = [await _start(procs, label, tree, sample_dir) for label, tree in subjects]
        await asyncio.sleep(args.settle)  # startup work (shard-health round) is not measured
        for _ in range(args.rounds):
            for s in started:
                await _measure(procs, s, args.size, args.connections, args.seconds, args.warmup)
        if args.profile:
            out = Path(args.profile)
            for s in started:
                async with profile.recording(procs, s.pid, out, s.label, args.seconds) as prof:
                    await wrk.run(
                        procs, s.target.urls(), [_script(s, args.size)], args.connections, 1, args.seconds
                    )
                print(f"{s.label}: {prof.samples} samples, top frames in {prof.text}")
        for s in started:
            if s.samples is not None:
                await _cpu_profile(procs, s, args)
    print(f"\n{args.size} B enqueue, wrk -t1 -c{args.connections}, {args.seconds} s runs")
    print("| server | CPU µs per enqueue (runs) | median | Redis µs per enqueue | req/s |")
    print("|---|---|---|---|---|")
    for s in started:
        us = ", ".join(f"{r[0]:.0f}" for r in s.runs)
        med = statistics.median(r[0] for r in s.runs)
        rmed = statistics.median(r[1] for r in s.runs)
        rate = statistics.median(r[2] for r in s.runs)
        print(f"| {s.label} | {us} | {med:.1f} | {rmed:.0f} | {rate:,.0f} |")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m relayfleet_testing.bench.cpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--tree", action="append", metavar="LABEL=DIR", help="a tree holding relay/ (repeatable)")
    p.add_argument("--ceiling", action="store_true", help="also the aiohttp empty-handler ceiling")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--settle", type=float, default=3.0, help="seconds between start and the first run")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--profile", metavar="DIR", help="then one py-spy run per target (not counted)")
    p.add_argument("--cpu-profile", metavar="DIR", help="then one CPU-time sampled run per target")
    args = p.parse_args(argv)
    try:
        return asyncio.run(run(args, _subjects(args)))
    except BenchError as exc:
        print(f"relayfleet_testing.bench.cpu: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
