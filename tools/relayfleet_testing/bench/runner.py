"""`relayfleet bench [--quick] [--baseline DIR]`: which scenarios run against which targets, in what order.

Servers are started here and stopped by pid in a ``finally`` (also on Ctrl-C /
SIGTERM); a target that fails to start or dies is recorded as skipped and the
run goes on with the others.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TypeVar

import uvloop
from relayfleet_testing.bench import report, scenarios, targets, wake
from relayfleet_testing.bench.procs import GROUP_NICE_ENV, BenchError, Procs, group_nice, raise_nofile_limit
from relayfleet_testing.bench.results import Results, Row, counts, size_label
from relayfleet_testing.bench.scenarios import Run
from relayfleet_testing.bench.targets import BASELINE, RedisServer, Target

from relay import cli

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[3]


def default_output(cwd: Path | None = None) -> Path:
    """Where results go without --output: docs/benchmarks.md when run from a checkout
    (it exists under the current directory), else ./benchmarks.md — never next to the
    installed module."""
    base = Path.cwd() if cwd is None else cwd
    in_checkout = base / "docs" / "benchmarks.md"
    return in_checkout if in_checkout.is_file() else base / "benchmarks.md"


@dataclass
class Plan:
    mode: str
    seconds: int
    warmup: int
    sizes: list[int]  # enqueue sizes of the relay and nchan (the head to head with nchan needs all three)
    connections: int
    sweep_connections: list[int]
    sweep_targets: list[str]
    ceiling_processes: list[int]
    relay_processes: list[int]
    nchan_mem: bool
    read_ack_batches: list[int]
    read_ack_total: int
    fanout_sizes: list[int]
    aof: bool = True
    # the head-to-head verdict: relay-1p and nchan-redis enqueue runs alternated this many times per size
    head_to_head_rounds: int = 3
    # enqueue sizes of the limit (redis-benchmark) and aiohttp-ceiling runs; None: every size
    side_sizes: list[int] | None = None
    # the wake head to head: relay-1p and nchan-redis alternated this many rounds, per mode
    # (long-poll, WebSocket) and count of idle waiters, each run this many measured wakes
    wake_rounds: int = 3
    wake_waiters: list[int] = field(default_factory=lambda: [1000, 10000])
    wake_probes: int = 1000
    phases: tuple[str, ...] = ("throughput", "head-to-head", "wake")
    # an older checkout's relay, run beside this one's as `baseline-1p` in every relay-1p step and
    # in the same alternating rounds (before / after in one run)
    baseline: Path | None = None
    notes: list[str] = field(default_factory=list)


def make_plan(quick: bool) -> Plan:
    if quick:
        return Plan(
            mode="quick",
            seconds=2,
            warmup=1,
            sizes=[256, 4096, 65536],
            side_sizes=[256],
            connections=64,
            sweep_connections=[],
            sweep_targets=[],
            ceiling_processes=[1],
            relay_processes=[1],
            nchan_mem=False,
            read_ack_batches=[100],
            read_ack_total=20000,
            fanout_sizes=[256],
            head_to_head_rounds=2,
            wake_rounds=2,
            wake_waiters=[1000],
            wake_probes=200,
        )
    return Plan(
        mode="full",
        seconds=3,
        warmup=1,
        sizes=[256, 4096, 65536],
        connections=64,
        sweep_connections=[16, 256],
        sweep_targets=["aiohttp-1p", "nchan-redis", "relay-1p"],
        ceiling_processes=[1, 2],
        relay_processes=[1, 2],
        nchan_mem=True,
        read_ack_batches=[10, 100, 1000],
        read_ack_total=50000,
        fanout_sizes=[256, 4096],
    )


class Bench:
    def __init__(self, plan: Plan, procs: Procs) -> None:
        self.plan = plan
        self.procs = procs
        self.results = Results()
        self.run = Run(procs, plan.seconds, plan.warmup)
        self.t0 = time.monotonic()
        self.redis: RedisServer | None = None  # the one redis-server every target shares

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.0f}s] {text}", file=sys.stderr, flush=True)

    async def attempt(self, scenario: str, target: str, step: Callable[[], Awaitable[T]]) -> T | None:
        """Run one step; a BenchError is recorded as a skip instead of ending the run."""
        try:
            return await step()
        except BenchError as exc:
            reason = str(exc).strip()
            self.log(f"SKIP {scenario} / {target}: {reason.splitlines()[0] if reason else 'failed'}")
            self.results.skip(scenario, target, reason.splitlines()[0] if reason else "failed")
            return None

    def stop(self, target: Target) -> None:
        for child in target.children:
            self.procs.stop(child)

    def record(self, row: Row) -> None:
        self.results.add(row)
        v = row.values
        params = ", ".join(
            size_label(int(val)) if key == "size" else f"{key}={val}" for key, val in row.params.items()
        )
        shown = " ".join(
            f"{k}={val:,.2f}"
            for k, val in v.items()
            if k in ("rate", "msg_rate", "p50_ms", "p99_ms", "server_cpu_us", "redis_cpu_us", "foreign_cores")
        )
        self.log(f"{row.scenario:<11} {row.target:<18} {params:<32} {shown}")

    # -- the run --------------------------------------------------------------------------

    async def main(self) -> None:
        plan = self.plan
        redis = self.redis = await targets.start_redis(self.procs, aof=plan.aof)
        self.log(f"redis-server on port {redis.port} (AOF {'everysec' if plan.aof else 'off'})")
        if "throughput" in plan.phases:
            await self.peers(redis)
            await self.limits(redis)
            for n in plan.ceiling_processes:
                await self.ceiling(n)
            for n in plan.relay_processes:
                await self.relay(redis, n)
            if plan.baseline is not None:
                await self.relay(redis, 1, plan.baseline)
        if "head-to-head" in plan.phases:
            await self.head_to_head(redis)
        if "wake" in plan.phases:
            await self.wake_head_to_head(redis)

    async def peers(self, redis: RedisServer) -> None:
        plan = self.plan

        async def calibration() -> None:
            mem, _ = await targets.start_nchan(self.procs, redis.url)
            try:
                static = Target("nginx-static", "nginx", mem.ports, mem.children, master_pid=mem.master_pid)
                for row in await scenarios.calibrate(self.run, static, "/bench/static", plan.connections):
                    self.record(row)
            finally:
                self.stop(mem)

        await self.attempt("calibration", "nginx", calibration)
        for size in plan.sizes:
            # a fresh nginx per size: nchan's shared memory holds every message of the previous run
            async def one_size(size: int = size) -> None:
                mem, red = await targets.start_nchan(self.procs, redis.url)
                try:
                    for t in ([mem] if plan.nchan_mem else []) + [red]:
                        await self.attempt("enqueue", t.name, partial(self.enqueue, t, size))
                        await redis.flushall()
                    if size == 256:
                        for c in plan.sweep_connections:
                            if red.name in plan.sweep_targets:
                                await self.attempt(
                                    "enqueue",
                                    red.name,
                                    partial(self.enqueue, red, 256, c),
                                )
                                await redis.flushall()
                finally:
                    self.stop(mem)

            await self.attempt("enqueue", "nchan", one_size)

    async def head_to_head(self, redis: RedisServer) -> None:
        """relay-1p and nchan-redis enqueue runs in alternation, each size, `head_to_head_rounds`
        times, who goes first switching every round: the head-to-head verdict takes each side's
        median, so a drift of this machine's speed (minutes apart, the phases above differ by
        up to 30 %) falls on both sides alike."""
        plan = self.plan
        if plan.head_to_head_rounds < 1:
            return

        async def rounds() -> None:
            relays = [await targets.start_relay(self.procs, redis.url, 1)]
            try:
                if plan.baseline is not None:
                    relays.append(await self.start_baseline(redis, plan.baseline))
                for n in range(plan.head_to_head_rounds):
                    for size in plan.sizes:
                        # a fresh nginx per run: nchan's shared memory holds every message
                        mem, red = await targets.start_nchan(self.procs, redis.url)
                        try:
                            for t in turn_order([red, *relays], n):
                                row = await scenarios.enqueue(self.run, t, size, plan.connections, redis)
                                row.scenario = "head_to_head"
                                row.params["round"] = n + 1
                                self.record(row)
                                await redis.flushall()
                        finally:
                            self.stop(mem)
            finally:
                for relay in relays:
                    self.stop(relay)

        await self.attempt("head_to_head", "relay-1p", rounds)

    async def wake_head_to_head(self, redis: RedisServer) -> None:
        """relay-1p and nchan-redis (and baseline-1p) wake runs in alternation (bench/wake.py),
        `wake_rounds` times, who goes first changing every round; each run on a freshly started
        server."""
        plan = self.plan
        names = ["nchan-redis", "relay-1p"] + ([f"{BASELINE}-1p"] if plan.baseline is not None else [])
        for n in range(plan.wake_rounds):
            for mode in wake.MODES:
                for waiters in plan.wake_waiters:
                    for name in turn_order(names, n):
                        step = partial(self.wake, name, mode, waiters, n + 1, redis)
                        await self.attempt("wake", name, step)

    async def wake(self, name: str, mode: str, waiters: int, round_: int, redis: RedisServer) -> None:
        if name == "relay-1p":
            t = await targets.start_relay(self.procs, redis.url, 1)
        elif name == f"{BASELINE}-1p" and self.plan.baseline is not None:
            t = await self.start_baseline(redis, self.plan.baseline)
        else:
            t = (await targets.start_nchan(self.procs, redis.url))[1]
        try:
            row = await wake.run(
                t, mode, waiters, self.plan.wake_probes, scenarios.recipient, scenarios.filler(256), redis
            )
        finally:
            self.stop(t)
            await redis.flushall()
        row.params["round"] = round_
        self.record(row)

    async def limits(self, redis: RedisServer) -> None:
        if not scenarios.have_redis_benchmark():
            self.results.skip("limit", "redis", "redis-benchmark is not installed")
            return
        for size in self.plan.side_sizes or self.plan.sizes:
            rows = await self.attempt(
                "limit",
                "redis",
                partial(
                    scenarios.redis_limit, self.run, redis, size, self.plan.connections, self.plan.seconds
                ),
            )
            for row in rows or []:
                self.record(row)

    async def ceiling(self, processes: int) -> None:
        plan = self.plan

        async def throughput() -> None:
            t = await targets.start_ceiling(self.procs, processes)
            try:
                if processes == 1:
                    for row in await scenarios.calibrate(self.run, t, "/empty", plan.connections):
                        self.record(row)
                for size in plan.side_sizes or plan.sizes:
                    await self.attempt("enqueue", t.name, partial(self.enqueue, t, size))
                if t.name in plan.sweep_targets:
                    for c in plan.sweep_connections:
                        await self.attempt("enqueue", t.name, partial(self.enqueue, t, 256, c))
            finally:
                self.stop(t)

        await self.attempt("start", f"aiohttp-{processes}p", throughput)

    async def start_baseline(self, redis: RedisServer, tree: Path) -> Target:
        return await targets.start_relay(self.procs, redis.url, 1, tree, BASELINE)

    async def relay(self, redis: RedisServer, processes: int, tree: Path | None = None) -> None:
        """The relay's throughput steps; ``tree``: the baseline checkout's relay instead of this
        one's (one process)."""
        plan = self.plan
        name = f"{BASELINE if tree else 'relay'}-{processes}p"

        async def throughput() -> None:
            if tree is not None:
                t = await self.start_baseline(redis, tree)
            else:
                t = await targets.start_relay(self.procs, redis.url, processes)
            try:
                for size in plan.sizes:
                    await self.attempt("enqueue", t.name, partial(self.enqueue, t, size))
                    await redis.flushall()
                if t.name in plan.sweep_targets:
                    for c in plan.sweep_connections:
                        await self.attempt("enqueue", t.name, partial(self.enqueue, t, 256, c))
                        await redis.flushall()
                for batch in plan.read_ack_batches:
                    await self.attempt("read_ack", t.name, partial(self.read_ack, t, redis, batch))
                for size in plan.fanout_sizes:
                    await self.attempt("fanout", t.name, partial(self.fanout, t, size))
                    await redis.flushall()
            finally:
                self.stop(t)

        await self.attempt("start", name, throughput)

    # -- steps ----------------------------------------------------------------------------

    async def enqueue(self, t: Target, size: int, connections: int = 0) -> None:
        row = await scenarios.enqueue(self.run, t, size, connections or self.plan.connections, self.redis)
        self.record(row)

    async def read_ack(self, t: Target, redis: RedisServer, batch: int) -> None:
        try:
            row = await scenarios.read_ack(
                t, redis.url, batch, self.plan.read_ack_total, self.plan.connections
            )
        finally:
            await redis.flushall()
        self.record(row)

    async def fanout(self, t: Target, size: int) -> None:
        self.record(await scenarios.fanout(self.run, t, size, 100, self.plan.connections))


def _parse(argv: list[str]) -> argparse.Namespace:
    # the relay CLI's parser: a usage error is one line, exit 2
    p = cli.command_parser("relayfleet bench", "Side-by-side benchmarks (see docs/benchmarks.md).")
    p.epilog = targets.ENV_HELP
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer scenarios and shorter runs, wake at 1,000 waiters only: about two minutes",
    )
    p.add_argument(
        "--wake-waiters",
        type=counts,
        metavar="N,N",
        help="idle waiters of the wake head to head, comma-separated (default 1000,10000; --quick: 1000)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="alternating rounds of the enqueue and wake head to heads (default 3; --quick: 2, "
        "with --baseline 3)",
    )
    p.add_argument(
        "--only",
        type=_phases,
        metavar="PHASE,PHASE",
        help=f"run only these phases, of {', '.join(PHASES)} (the report gets a section of its own)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        help="markdown file to update (default: ./docs/benchmarks.md when it exists, else ./benchmarks.md)",
    )
    p.add_argument(
        "--no-write", action="store_true", help="print the tables instead of updating the markdown file"
    )
    p.add_argument("--json", type=Path, help="also write raw results as JSON here")
    p.add_argument(
        "--no-aof", action="store_true", help="run Redis without AOF (default: appendfsync everysec)"
    )
    p.add_argument(
        "--scale",
        action="store_true",
        help="how cost grows with the work instead: store, retention, rebalance and operator phases "
        "(`relayfleet bench --scale --help`)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="also run the relay of the checkout in DIR (a folder holding relay/, e.g. made by "
        "`git worktree add DIR REV`) as baseline-1p, beside relay-1p in every step and round",
    )
    return p.parse_args(argv)


def turn_order(subjects: list[T], n: int) -> list[T]:
    """Round ``n``'s order: rotated by one each round, so every subject goes first in turn (with
    two subjects: who goes first switches every round)."""
    k = n % len(subjects)
    return subjects[k:] + subjects[:k]


PHASES = ("throughput", "head-to-head", "wake")


def _phases(text: str) -> tuple[str, ...]:
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in chosen if x not in PHASES]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"phases are {', '.join(PHASES)}; got {text!r}")
    return chosen


def _group_nice_note(procs: Procs) -> str:
    if not procs.group_nice:
        return "Scheduling: the processes the bench started competed with other sessions' work as equals."
    how = "could not be set here" if procs.group_nice_refused else "set"
    return (
        f"Scheduling: every process the bench started (servers, Redis, wrk) in a group at nice "
        f"{procs.group_nice} ({GROUP_NICE_ENV}; {how}), so others' niced work on this machine yields to it."
    )


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # same clean-up path as Ctrl-C


def main(argv: list[str]) -> int:
    if "--scale" in argv:  # its own phases and flags (bench/scale)
        from relayfleet_testing.bench import scale

        return scale.main([a for a in argv if a != "--scale"])
    try:
        args = _parse(argv)
    except SystemExit as exc:
        return 2 if exc.code not in (0, None) else 0
    plan = make_plan(args.quick)
    plan.aof = not args.no_aof
    if args.wake_waiters:
        plan.wake_waiters = args.wake_waiters
    if args.rounds is not None:
        plan.head_to_head_rounds = plan.wake_rounds = max(1, args.rounds)
    elif args.baseline is not None:
        # three subjects take turns going first: three rounds give each the first turn once
        plan.head_to_head_rounds = plan.wake_rounds = max(3, plan.head_to_head_rounds)
    if args.only:
        plan.phases = args.only
    if args.baseline is not None:
        try:
            plan.baseline = targets.relay_tree(args.baseline)
        except BenchError as exc:
            print(f"relayfleet bench: --baseline: {exc}", file=sys.stderr)
            return 2
        plan.notes.append(
            f"{BASELINE}-1p: the relay of {plan.baseline} ({report.tree_commit(plan.baseline)})."
        )
    nofile = raise_nofile_limit()
    if max(plan.wake_waiters) + 1000 > nofile:
        plan.notes.append(f"open-files limit {nofile}: wake waiters capped")
        plan.wake_waiters = [n for n in plan.wake_waiters if n + 1000 <= nofile]
    command = "relayfleet bench" + (" " + shlex.join(argv) if argv else "")
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = report.loadavg()
    facts = report.machine_facts(REPO)  # before the run: the commit measured, not one made meanwhile
    workdir = Path(tempfile.mkdtemp(prefix="relayfleet-bench-"))
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    bench: Bench | None = None
    try:
        with Procs(workdir, group_nice()) as procs:
            bench = Bench(plan, procs)
            uvloop.run(bench.main())
    except KeyboardInterrupt:
        print("relayfleet bench: interrupted; every started process was stopped", file=sys.stderr)
        return 1
    except BenchError as exc:
        print(f"relayfleet bench: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)
    assert bench is not None
    elapsed = time.monotonic() - bench.t0
    notes = [
        f"Load average before / after: {load_before} / {report.loadavg()} (the machine is shared; "
        "numbers move with its load).",
        "Everything runs on this machine: servers, Redis and the load generators share its cores.",
        f"Redis: one redis-server, AOF {'appendfsync everysec' if plan.aof else 'off'}, noeviction, "
        "flushed between runs.",
        _group_nice_note(bench.procs),
        *plan.notes,
    ]
    text = report.render(bench.results, plan.mode, command, facts, started, elapsed, plan.connections, notes)
    if args.json is not None:
        args.json.write_text(json.dumps(bench.results.to_json(), indent=1))
    if args.no_write:
        print(text)
    else:
        if args.output is None:
            args.output = default_output()
        if args.only:  # a section of its own: a partial run must not replace the last full one
            only = ", ".join(plan.phases)
            section = f"{plan.mode}-only-{'-'.join(plan.phases)}"
            report.write(args.output, section, text, f"## Latest {plan.mode} run of {only} only")
        else:
            report.write(args.output, plan.mode, text)
        print(f"relayfleet bench: results written to {args.output}", file=sys.stderr)
    failed = [s for s in bench.results.skips if s.scenario == "start"]
    return 1 if failed and not bench.results.rows else 0
