"""`relayfleet bench --scale`: how each part's cost grows with its work.

Phases, each run alone with `--phase` (default: all, in this order), each reporting its figures
against a floor or anchor measured in the same run and the exponent of its cost over two or
three sizes (docs/benchmarks.md, "Scale"):

- store: queues on one shard (held recipients per GiB against the payload's raw Redis bytes),
  the bytes a drained idle queue leaves behind;
- retention: the Spark retention job against one Lua/SCAN pass without Spark, Redis CPU;
- rebalance: planning 16,384 slots over N shards under Zipf load against LPT and the lower bound;
- operator: N RelayShards on a real kube-apiserver with kwok nodes: time to Ready, API
  requests per minute at rest, operator RSS; the same around a slot migration.

Sizes default to the issue's (1,000,000 queues; 10,000,000 messages; 64 shards; 100
RelayShards); every one is a flag, so a quick run or a test picks small ones.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from relayfleet_testing.bench import report as bench_report
from relayfleet_testing.bench.scale.report import PhaseReport, render

from relay import cli
from relay.progress import ProgressReporter

PHASES = ("store", "retention", "rebalance", "operator")
REPO = Path(__file__).resolve().parents[4]


# Each phase's sizes: (flag, type, default, what it sizes), every one >= 1 but --shards >= 2.
SIZES: dict[str, list[tuple[str, type, float, str]]] = {
    "store": [("queues", int, 1_000_000, "queues on the shard"), ("payload", int, 256, "bytes per message")],
    "retention": [
        ("retention-messages", int, 10_000_000, "messages"),
        ("retention-queues", int, 1_000_000, "queues holding them"),
        ("retention-payload", int, 256, "bytes per message"),
        ("executors", int, 2, "Spark executor cores, local[N]"),
    ],
    "rebalance": [("shards", int, 64, "shards"), ("skew", float, 0.6, "Zipf exponent of slot loads")],
    "operator": [
        ("relayshards", int, 100, "RelayShards on the kwok cluster"),
        ("rest-seconds", float, 60.0, "the window API requests are counted in at rest"),
        ("migration-timeout", float, 600.0, "seconds a migration may take before it is reported unfinished"),
    ],
}


def _parser() -> argparse.ArgumentParser:
    p = cli.command_parser(
        "relayfleet bench --scale", "How each part's cost grows (see docs/benchmarks.md, Scale)."
    )
    p.add_argument(
        "--phase", choices=PHASES, action="append", help="run this phase (repeatable; default: all)"
    )
    groups = {phase: p.add_argument_group(phase) for phase in PHASES}
    for phase, sizes in SIZES.items():
        for flag, kind, default, what in sizes:
            groups[phase].add_argument(
                f"--{flag}", type=kind, default=default, help=f"{phase}: {what} (default {default:,})"
            )
    groups["retention"].add_argument(
        "--retention-snapshot",
        type=Path,
        metavar="FILE",
        help="retention: keep the seeded shard in this RDB file and, when it matches, start from it",
    )
    groups["operator"].add_argument(
        "--kubeconfig", type=Path, help="operator: an existing (kwok) cluster instead of starting one"
    )
    groups["operator"].add_argument(
        "--operator-env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="operator: a setting for the operator process (repeatable; default: production settings)",
    )
    p.add_argument("--seed", type=int, default=41, help="random seed of every generated load")
    bench_report.output_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def run_phase(name: str, args: argparse.Namespace, say: Callable[[str], None]) -> PhaseReport:
    # each phase imported when run: the retention phase alone needs pyspark, the operator kubernetes
    if name == "store":
        from relayfleet_testing.bench.scale import store

        return store.run(args.queues, args.payload, args.seed, say)
    if name == "retention":
        from relayfleet_testing.bench.scale import retention

        return retention.run(
            args.retention_messages,
            args.retention_queues,
            args.executors,
            args.seed,
            say,
            payload=args.retention_payload,
            keep=args.retention_snapshot,
        )
    if name == "rebalance":
        from relayfleet_testing.bench.scale import rebalance

        return rebalance.run(args.shards, args.skew, args.seed, say)
    from relayfleet_testing.bench.scale import operator

    env = dict(args.operator_env)
    n, rest, timeout = args.relayshards, args.rest_seconds, args.migration_timeout
    return operator.run(n, rest, args.kubeconfig, env, say, timeout)


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code not in (0, None) else 0
    for flag, kind, _, _ in (size for sizes in SIZES.values() for size in sizes):
        if kind is int and getattr(args, flag.replace("-", "_")) < 1:
            print(f"relayfleet bench --scale: --{flag} must be >= 1", file=sys.stderr)
            return 2
    if args.shards < 2 or args.retention_messages < args.retention_queues:
        print("relayfleet bench --scale: need --shards >= 2 and --retention-messages >= --retention-queues",
              file=sys.stderr)  # fmt: skip
        return 2
    progress = ProgressReporter("relayfleet bench --scale", quiet=args.quiet)
    t0 = time.monotonic()

    def say(text: str) -> None:
        progress.say(f"[{time.monotonic() - t0:5.0f}s] {text}")

    command = "relayfleet bench " + shlex.join(["--scale", *argv])
    commit = bench_report.tree_commit(REPO)  # before the run: the commit measured
    cpu = bench_report.cpu_model()
    output = args.output
    if output is None and not args.no_write:
        output = bench_report.default_output()
    reports: list[PhaseReport] = []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for name in args.phase or PHASES:
            load = bench_report.loadavg()
            started = time.monotonic()
            rep = run_phase(name, args, say)
            rep.seconds = time.monotonic() - started
            rep.notes.append(
                f"Load average before / after: {load} / {bench_report.loadavg()} (a shared machine)."
            )
            reports.append(rep)
            say(f"{name}: done in {rep.seconds:.0f} s")
            # each phase's results kept as it ends: a long run stopped later loses only its last phase
            when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
            part = f"`{command}`, {when}, relay at {commit}, {cpu}\n\n{render(rep)}"
            if args.json is not None:
                args.json.write_text(json.dumps([r.to_json() for r in reports], indent=1))
            if output is None:
                print(part)
            else:
                bench_report.write(output, f"scale-{rep.phase}", part, f"### Latest scale run: {rep.phase}")
                say(f"{name}: results written to {output}")
    except KeyboardInterrupt:
        print("relayfleet bench --scale: interrupted; every started process was stopped", file=sys.stderr)
        return 1
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        # a phase that could not finish (a server that did not start, a wait that ran out): one
        # line, every started process already stopped by the phase's own clean-up
        print(f"relayfleet bench --scale: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # the phases' clean-up (servers stopped by pid) runs as on Ctrl-C
