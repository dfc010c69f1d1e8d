"""CPU time per enqueue, server + Redis: the figure that survives a shared machine.

Throughput on two shared cores moves with everyone else's load; the CPU a server and
its Redis spend per stored message moves much less. Each subject gets its own
redis-server; rounds alternate between subjects (and sizes) so load drifts hit them
alike. Per run: a wrk warm-up, then utime + stime of the server's processes and of its
redis-server over the measured wrk run (relayfleet_testing.bench.cputime), divided by the 2xx
answers; Redis is flushed (and its AOF rewritten) after every run, outside the window.

Run: python -m relayfleet_testing.bench.cpu [--tree LABEL=DIR ...] [--nchan] [--layers [L,...]]
     [--ceiling] [--size 256,4096,65536] [--rounds N]
A tree is a directory holding a ``relay`` package (e.g. ``git archive HEAD relay |
tar -x -C /tmp/base``); the relay is started from it with this interpreter.
``--nchan`` adds the peer: nginx + nchan with Redis storage (master + worker + Redis),
restarted before each of its runs so its shared memory starts empty.
``--layers`` adds the HTTP stack at several depths with a fixed 201 and no Redis
(tools/relayfleet_testing/bench/layers.py: protocol, lowlevel, app, relay-http): what each layer costs.
``--cpu-profile DIR`` runs each Python server under tools/relayfleet_testing/bench/sampler.py (CPU-time
samples; py-spy's wall-clock samples overstate writes that wake another process)
and profiles one extra run per target, not counted in the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from relayfleet_testing.bench import profile, scenarios, wrk
from relayfleet_testing.bench.layers import LAYERS
from relayfleet_testing.bench.procs import BenchError, Child, Procs, free_port, group_nice
from relayfleet_testing.bench.results import counts, size_label
from relayfleet_testing.bench.scenarios import OCTET, recipient
from relayfleet_testing.bench.targets import (
    ENV_HELP,
    REPO,
    RedisServer,
    Target,
    relay_python,
    start_nchan,
    start_redis,
    wait_http,
)

SAMPLER = Path(__file__).with_name("sampler.py")
NCHAN = "nchan-redis"


@dataclass(frozen=True)
class Measured:
    server_us: float
    redis_us: float  # NaN for subjects without Redis
    rate: float

    @property
    def total_us(self) -> float:
        return self.server_us + (0.0 if math.isnan(self.redis_us) else self.redis_us)


@dataclass
class Subject:
    label: str
    target: Target
    redis: RedisServer | None
    runs: dict[int, list[Measured]] = field(default_factory=dict)  # by message size
    samples: Path | None = None  # collapsed stacks written by the sampler on exit
    # nchan: a fresh nginx before each run (its shared memory keeps every message)
    restart: Callable[[], Awaitable[Target]] | None = None

    @property
    def pid(self) -> int:
        return self.target.children[0].pid

    @property
    def python(self) -> bool:
        return self.restart is None


@dataclass(frozen=True)
class Spec:
    label: str
    kind: str  # relay | ceiling | layer | nchan
    tree: Path | None = None
    layer: str = ""


async def _start_python(procs: Procs, spec: Spec, sample_dir: Path | None) -> Subject:
    redis = await start_redis(procs, aof=True) if spec.kind == "relay" else None
    port = free_port()
    samples = sample_dir / f"{spec.label}.collapsed.txt" if sample_dir else None
    python = [relay_python()] + ([str(SAMPLER), str(samples)] if samples else [])
    cwd = REPO
    if spec.kind == "ceiling":
        argv = [*python, "-m", "relayfleet_testing.bench.ceiling", "--port", str(port)]
        kind = "aiohttp"
    elif spec.kind == "layer":
        argv = [*python, "-m", "relayfleet_testing.bench.layers", "--layer", spec.layer, "--port", str(port)]
        kind = "aiohttp"
    else:
        assert redis is not None
        assert spec.tree is not None
        argv = [*python, "-m", "relay", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--redis-url", redis.url, "--auth", "none"]
        # `-m` puts the working directory first on sys.path: the tree's relay package is used
        cwd = spec.tree
        kind = "relay"
    child: Child = procs.start(spec.label, argv, cwd=cwd)
    await wait_http(port, "/readyz", child)
    return Subject(spec.label, Target(spec.label, kind, [port], [child]), redis, samples=samples)


async def _start_nchan(procs: Procs) -> Subject:
    redis = await start_redis(procs, aof=True)
    current: list[Target] = []

    async def restart() -> Target:
        for old in current:
            for child in old.children:
                procs.stop(child)
        current[:] = [(await start_nchan(procs, redis.url))[1]]
        return current[0]

    target = await restart()
    return Subject(NCHAN, target, redis, restart=restart)


async def _measure(
    procs: Procs, s: Subject, size: int, conns: int, seconds: int, warmup: int, commandstats: bool = False
) -> None:
    if s.restart is not None:
        s.target = await s.restart()
    if commandstats and s.redis is not None:
        await s.redis.command_stats()  # reset: the run's own commands only
    row = await scenarios.enqueue(scenarios.Run(procs, seconds, warmup), s.target, size, conns, s.redis)
    if commandstats and s.redis is not None:
        print(_command_table(await s.redis.command_stats()), flush=True)
    if s.redis is not None:
        await s.redis.flushall()  # outside the window: every run starts from an empty Redis
    v = row.values
    if v["errors"] or v["rate"] <= 0:
        raise BenchError(f"{s.label}: {v['errors']:.0f} errors ({row.note or 'no request completed'})")
    m = Measured(v["server_cpu_us"], v["redis_cpu_us"], v["rate"])
    s.runs.setdefault(size, []).append(m)
    redis = "     -" if math.isnan(m.redis_us) else f"{m.redis_us:6.1f}"
    print(
        f"{s.label:>14} {size_label(size):>6}: {m.total_us:7.1f} µs/msg  (server {m.server_us:6.1f}, "
        f"redis {redis})  {m.rate:8,.0f} msg/s  load {os.getloadavg()[0]:.2f}",
        flush=True,
    )


def _specs(args: argparse.Namespace) -> list[Spec]:
    specs: list[Spec] = []
    for spec in args.tree or [f"this={REPO}"]:
        label, eq, path = spec.partition("=")
        tree = Path(path if eq else label).resolve()
        if not (tree / "relay" / "__init__.py").exists():
            raise BenchError(f"{tree} holds no relay package")
        specs.append(Spec(label if eq else tree.name, "relay", tree))
    if args.nchan:
        specs.append(Spec(NCHAN, "nchan"))
    if args.ceiling:
        specs.append(Spec("aiohttp", "ceiling"))
    if args.layers:
        names = LAYERS if args.layers == "all" else tuple(args.layers.split(","))
        for name in names:
            if name not in LAYERS:
                raise BenchError(f"--layers: unknown layer {name!r} (known: {', '.join(LAYERS)})")
            specs.append(Spec(f"layer:{name}", "layer", layer=name))
    for d in (args.profile, args.cpu_profile):
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
    return specs


async def _cpu_profile(procs: Procs, s: Subject, args: argparse.Namespace, size: int) -> None:
    assert s.samples is not None
    script = _script(s, size)
    await wrk.run(procs, s.target.urls(), [script], args.connections, 1, args.warmup or 1, "wrk-warmup")
    os.kill(s.pid, signal.SIGUSR1)
    await wrk.run(procs, s.target.urls(), [script], args.connections, 1, args.seconds)
    os.kill(s.pid, signal.SIGUSR2)
    procs.stop(s.target.children[0])  # the sampler writes its file on exit
    total, text = profile.summarize(s.samples.read_text(), top=40)
    top = s.samples.with_suffix("").with_suffix(".top.txt")
    top.write_text(text)
    print(f"{s.label}: {total} CPU samples, top frames in {top}")


def _command_table(stats: dict[str, tuple[int, float]]) -> str:
    """Redis's time per command, per stored message (one XADD each; with warm-up), biggest first."""
    stored = stats.get("xadd", (0, 0.0))[0]
    if not stored:
        total = sum(c for c, _ in stats.values()) or 1
        return "  commands: " + ", ".join(f"{n} {c / total:.0%}" for n, (c, _) in sorted(stats.items()))
    rows = sorted(stats.items(), key=lambda kv: -kv[1][1])
    return "\n".join(
        f"  {name:>18}: {calls / stored:6.2f} calls/msg  {usec / stored:6.2f} µs/msg"
        for name, (calls, usec) in rows
    )


def _script(s: Subject, size: int) -> str:
    paths = [s.target.enqueue_path(recipient()) for _ in range(wrk.pool_size(size, 4096))]
    return wrk.lua_script("POST", paths, [], OCTET, filler_size=size)


def summary(subjects: list[Subject], sizes: list[int], connections: int, seconds: int) -> str:
    """The markdown table of medians; ``÷ nchan`` compares total CPU per message with the peer's."""
    peer = next((s for s in subjects if s.label == NCHAN), None)
    lines = [
        f"enqueue, wrk -t1 -c{connections}, {seconds} s runs; µs of CPU per stored message (median of runs)",
        "| server | size | total µs/msg (runs) | server µs/msg | Redis µs/msg | total µs/msg | ÷ nchan "
        "| msg/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        nchan_total = statistics.median(m.total_us for m in peer.runs[size]) if peer else math.nan
        for s in subjects:
            runs = s.runs.get(size, [])
            if not runs:
                continue
            total = statistics.median(m.total_us for m in runs)
            server = statistics.median(m.server_us for m in runs)
            redis_runs = [m.redis_us for m in runs if not math.isnan(m.redis_us)]
            redis = f"{statistics.median(redis_runs):.1f}" if redis_runs else "-"
            ratio = "-" if math.isnan(nchan_total) or not nchan_total else f"{total / nchan_total:.2f}"
            rate = statistics.median(m.rate for m in runs)
            each = ", ".join(f"{m.total_us:.0f}" for m in runs)
            lines.append(
                f"| {s.label} | {size_label(size)} | {each} | {server:.1f} | {redis} | {total:.1f} "
                f"| {ratio} | {rate:,.0f} |"
            )
    return "\n".join(lines)


async def run(args: argparse.Namespace, specs: list[Spec]) -> int:
    sizes: list[int] = args.size
    with tempfile.TemporaryDirectory(prefix="relay-cpu-") as tmp, Procs(Path(tmp), group_nice()) as procs:
        sample_dir = Path(args.cpu_profile) if args.cpu_profile else None
        started = [
            await (_start_nchan(procs) if spec.kind == "nchan" else _start_python(procs, spec, sample_dir))
            for spec in specs
        ]
        await asyncio.sleep(args.settle)  # startup work (shard-health round) is not measured
        for _ in range(args.rounds):
            for size in sizes:
                for s in started:
                    await _measure(
                        procs, s, size, args.connections, args.seconds, args.warmup, args.commandstats
                    )
        if args.profile:
            out = Path(args.profile)
            for s in started:
                if not s.python:
                    continue
                async with profile.recording(procs, s.pid, out, s.label, args.seconds) as prof:
                    await wrk.run(
                        procs, s.target.urls(), [_script(s, sizes[0])], args.connections, 1, args.seconds
                    )
                print(f"{s.label}: {prof.samples} samples, top frames in {prof.text}")
        for s in started:
            if s.samples is not None:
                await _cpu_profile(procs, s, args, sizes[0])
    print()
    print(summary(started, sizes, args.connections, args.seconds))
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m relayfleet_testing.bench.cpu",
        description=__doc__.split("\n")[0],
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tree", action="append", metavar="LABEL=DIR", help="a tree holding relay/ (repeatable)")
    p.add_argument("--nchan", action="store_true", help="also nginx + nchan with Redis storage (the peer)")
    p.add_argument("--ceiling", action="store_true", help="also the aiohttp empty-handler ceiling")
    p.add_argument(
        "--layers",
        nargs="?",
        const="all",
        metavar="L,...",
        help=f"also the HTTP stack at several depths, fixed 201, no Redis (default all: {','.join(LAYERS)})",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--settle", type=float, default=3.0, help="seconds between start and the first run")
    p.add_argument(
        "--size", type=counts, default=[256], help="message bytes, comma-separated (256,4096,65536)"
    )
    p.add_argument("--connections", type=int, default=64)
    p.add_argument(
        "--commandstats", action="store_true", help="print Redis's own µs per command per stored message"
    )
    p.add_argument("--profile", metavar="DIR", help="then one py-spy run per Python server (not counted)")
    p.add_argument("--cpu-profile", metavar="DIR", help="then one CPU-time sampled run per Python server")
    args = p.parse_args(argv)
    try:
        return asyncio.run(run(args, _specs(args)))
    except BenchError as exc:
        print(f"relayfleet_testing.bench.cpu: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
