"""`relayfleet bench [--quick] [--baseline DIR]`: which scenarios run against which targets, in what order.

Servers are started here and stopped by pid in a ``finally`` (also on Ctrl-C / SIGTERM); a
target that fails to start or dies is recorded as skipped and the run goes on with the others.
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
from relayfleet_testing.bench.results import Results, Row, Skip, counts, size_label
from relayfleet_testing.bench.scenarios import Run
from relayfleet_testing.bench.targets import BASELINE, RedisServer, Target

from relay import cli

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[3]
PHASES = ("throughput", "head-to-head", "wake")


@dataclass
class Plan:
    mode: str  # quick | full
    seconds: int  # each measured run
    rounds: int  # alternating rounds of the enqueue and wake head to heads
    wake_waiters: list[int]  # idle waiters of the wake head to head, one run per count
    wake_probes: int  # measured wakes per run
    warmup: int = 1
    sizes: list[int] = field(default_factory=lambda: [256, 4096, 65536])  # the enqueue head to head's
    connections: int = 64
    read_ack_total: int = 20000  # messages, read in batches of 100
    phases: tuple[str, ...] = PHASES
    wake_modes: tuple[str, ...] = wake.MODES
    # an older checkout's relay, run beside this one's as `baseline-1p` in every relay step and in
    # the same alternating rounds (before / after in one run)
    baseline: Path | None = None
    notes: list[str] = field(default_factory=list)


def make_plan(quick: bool) -> Plan:
    if quick:
        return Plan("quick", seconds=2, rounds=2, wake_waiters=[1000], wake_probes=200)
    return Plan("full", seconds=3, rounds=3, wake_waiters=[1000, 10000], wake_probes=1000)


def turn_order(subjects: list[T], n: int) -> list[T]:
    """Round ``n``'s order: rotated by one each round, so every subject goes first in turn (with
    two subjects: who goes first switches every round)."""
    k = n % len(subjects)
    return subjects[k:] + subjects[:k]


class Bench:
    def __init__(self, plan: Plan, procs: Procs) -> None:
        self.plan = plan
        self.procs = procs
        self.results = Results()
        self.run = Run(procs, plan.seconds, plan.warmup)
        self.t0 = time.monotonic()

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.0f}s] {text}", file=sys.stderr, flush=True)

    async def attempt(self, scenario: str, target: str, step: Callable[[], Awaitable[T]]) -> T | None:
        """Run one step; a BenchError is recorded as a skip instead of ending the run."""
        try:
            return await step()
        except BenchError as exc:
            reason = (str(exc).strip() or "failed").splitlines()[0]
            self.log(f"SKIP {scenario} / {target}: {reason}")
            self.results.skips.append(Skip(scenario, target, reason))
            return None

    def stop(self, target: Target) -> None:
        for child in target.children:
            self.procs.stop(child)

    def record(self, row: Row) -> None:
        self.results.rows.append(row)
        params = ", ".join(
            size_label(int(val)) if key == "size" else f"{key}={val}" for key, val in row.params.items()
        )
        shown = " ".join(
            f"{k}={val:,.2f}"
            for k, val in row.values.items()
            if k
            in ("rate", "wrk_rate", "own_rate", "msg_rate", "p50_ms", "p99_ms", "cpu_us", "foreign_cores")
        )
        self.log(f"{row.scenario:<12} {row.target:<12} {params:<32} {shown}")

    def start_relay(self, redis: RedisServer, baseline: bool = False) -> Awaitable[Target]:
        if baseline and self.plan.baseline is not None:
            return targets.start_relay(self.procs, redis.url, self.plan.baseline, BASELINE)
        return targets.start_relay(self.procs, redis.url)

    async def main(self) -> None:
        plan = self.plan
        redis = await targets.start_redis(self.procs)
        self.log(f"redis-server on port {redis.port}")
        if "throughput" in plan.phases:
            await self.attempt("calibration", "nginx", partial(self.calibration, redis))
            for baseline in (False, True) if plan.baseline is not None else (False,):
                await self.attempt(
                    "start", f"{BASELINE if baseline else 'relay'}-1p", partial(self.relay, redis, baseline)
                )
        if "head-to-head" in plan.phases:
            await self.attempt("head_to_head", "relay-1p", partial(self.head_to_head, redis))
        if "wake" in plan.phases:
            await self.wake_head_to_head(redis)

    async def calibration(self, redis: RedisServer) -> None:
        nginx = await targets.start_nchan(self.procs, redis.url)
        try:
            self.record(await scenarios.calibrate(self.run, nginx, "/bench/static", self.plan.connections))
        finally:
            self.stop(nginx)

    async def relay(self, redis: RedisServer, baseline: bool) -> None:
        """The relay's own figures (nchan has no batch read, ack or fan-out): read + ack at batch
        100, fan-out of 256 B to 100 recipients."""
        plan = self.plan
        t = await self.start_relay(redis, baseline)
        try:
            read_ack = partial(scenarios.read_ack, t, redis.url, 100, plan.read_ack_total, plan.connections)
            for name, step in (
                ("read_ack", read_ack),
                ("fanout", partial(scenarios.fanout, self.run, t, 256, 100, plan.connections)),
            ):
                row = await self.attempt(name, t.name, step)
                await redis.flushall()
                if row is not None:
                    self.record(row)
        finally:
            self.stop(t)

    async def head_to_head(self, redis: RedisServer) -> None:
        """relay-1p (and baseline-1p) and nchan-redis enqueue runs in alternation, each size,
        `rounds` times, who goes first changing every round: the verdict takes each side's
        median, so a drift of this machine's speed (minutes apart, runs differ by up to 30 %)
        falls on every side alike."""
        plan = self.plan
        relays = [await self.start_relay(redis)]
        try:
            if plan.baseline is not None:
                relays.append(await self.start_relay(redis, baseline=True))
            for n in range(plan.rounds):
                for size in plan.sizes:
                    # a fresh nginx per run: nchan's shared memory holds every message
                    nchan = await targets.start_nchan(self.procs, redis.url)
                    try:
                        for t in turn_order([nchan, *relays], n):
                            row = await scenarios.enqueue(self.run, t, size, plan.connections, redis)
                            row.params["round"] = n + 1
                            self.record(row)
                            await redis.flushall()
                    finally:
                        self.stop(nchan)
        finally:
            for relay in relays:
                self.stop(relay)

    async def wake_head_to_head(self, redis: RedisServer) -> None:
        """relay-1p and nchan-redis (and baseline-1p) wake runs in alternation (bench/wake.py),
        `rounds` times, who goes first changing every round; each run on a freshly started server."""
        plan = self.plan
        names = ["nchan-redis", "relay-1p"] + ([f"{BASELINE}-1p"] if plan.baseline is not None else [])
        for n in range(plan.rounds):
            for mode in plan.wake_modes:
                for waiters in plan.wake_waiters:
                    for name in turn_order(names, n):
                        await self.attempt(
                            "wake", name, partial(self.wake, name, mode, waiters, n + 1, redis)
                        )

    async def wake(self, name: str, mode: str, waiters: int, round_: int, redis: RedisServer) -> None:
        if name == "nchan-redis":
            t = await targets.start_nchan(self.procs, redis.url)
        else:
            t = await self.start_relay(redis, baseline=name.startswith(BASELINE))
        try:
            row = await wake.run(t, mode, waiters, self.plan.wake_probes, redis)
        finally:
            self.stop(t)
            await redis.flushall()
        row.params["round"] = round_
        self.record(row)


def _parse(argv: list[str]) -> argparse.Namespace:
    # the relay CLI's parser: a usage error is one line, exit 2
    p = cli.command_parser("relayfleet bench", "Side-by-side benchmarks (see docs/benchmarks.md).")
    p.epilog = targets.ENV_HELP
    p.add_argument(
        "--quick",
        action="store_true",
        help="shorter runs, 2 rounds, wake at 1,000 waiters only: about 70 s",
    )
    p.add_argument(
        "--wake-waiters",
        type=counts,
        metavar="N,N",
        help="idle waiters of the wake head to head, comma-separated (default 1000,10000; --quick: 1000)",
    )
    p.add_argument(
        "--wake-modes",
        type=_choices(wake.MODES, "wake modes"),
        metavar="MODE,MODE",
        help=f"waiters of the wake head to head, of {', '.join(wake.MODES)} (default: both)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="alternating rounds of the enqueue and wake head to heads "
        "(default 3; --quick: 2, with --baseline 3)",
    )
    p.add_argument(
        "--only",
        type=_choices(PHASES, "phases"),
        metavar="PHASE,PHASE",
        help=f"run only these phases, of {', '.join(PHASES)} (the report gets a section of its own)",
    )
    report.output_arguments(p)
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


def _choices(allowed: tuple[str, ...], what: str) -> Callable[[str], tuple[str, ...]]:
    """A command-line list of some of `allowed`, comma-separated."""

    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(x.strip() for x in text.split(",") if x.strip())
        if not chosen or any(x not in allowed for x in chosen):
            raise argparse.ArgumentTypeError(f"{what} are {', '.join(allowed)}; got {text!r}")
        return chosen

    return parse


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
    plan.wake_waiters = args.wake_waiters or plan.wake_waiters
    plan.phases = args.only or plan.phases
    plan.wake_modes = args.wake_modes or plan.wake_modes
    if args.rounds is not None:
        plan.rounds = max(1, args.rounds)
    elif args.baseline is not None:
        plan.rounds = max(3, plan.rounds)  # three subjects take turns going first: each once
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
    notes = [
        f"Load average before / after: {load_before} / {report.loadavg()} (the machine is shared; "
        "numbers move with its load).",
        "Everything runs on this machine: servers, Redis and the load generators share its cores.",
        "Redis: one redis-server, AOF appendfsync everysec, noeviction, flushed between runs.",
        _group_nice_note(bench.procs),
        *plan.notes,
    ]
    elapsed = time.monotonic() - bench.t0
    text = report.render(bench.results, plan.mode, command, facts, started, elapsed, notes)
    if args.json is not None:
        args.json.write_text(json.dumps(bench.results.to_json(), indent=1))
    if args.no_write:
        print(text)
        return 0 if bench.results.rows else 1
    output = args.output or report.default_output()
    if args.only:  # a section of its own: a partial run must not replace the last full one
        section = f"{plan.mode}-only-{'-'.join(plan.phases)}"
        report.write(output, section, text, f"## Latest {plan.mode} run of {', '.join(plan.phases)} only")
    else:
        report.write(output, plan.mode, text)
    print(f"relayfleet bench: results written to {output}", file=sys.stderr)
    return 0 if bench.results.rows else 1
