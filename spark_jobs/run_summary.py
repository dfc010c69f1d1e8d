"""A Spark job's run: the driver flow both jobs share (`run_job`) and its run summary.

`run_job` parses the flags, lets the job read and check its inputs, starts Spark,
runs the job's Spark part and turns every outcome into the CLI contract (docs/spark.md):
exit status 0 ok, 2 bad input, 1 failure, each error one line on stderr.

The run summary is always logged as one JSON line, and pushed to a Prometheus
Pushgateway when one is configured (--pushgateway or RELAYFLEET_PUSHGATEWAY).

Batch jobs end before any scrape could reach them, hence the push. Metrics pushed
(grouping key job=relayfleet_<job>, so each job keeps its own series):
  relayfleet_spark_job_last_run_timestamp_seconds      every run
  relayfleet_spark_job_last_success_timestamp_seconds  successful runs only (push-add keeps the last one)
  relayfleet_spark_job_success                         1 ok / 0 failed
  relayfleet_spark_job_duration_seconds                wall time of the run
  relayfleet_spark_job_<figure>                        the job's totals (messages_removed, slots_moved, ...)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, pushadd_to_gateway

from relay.envconfig import add_flag
from relay.fleet.sharding import ShardMap
from relay.storage.maintenance import MaintenanceError
from spark_jobs.session import get_session, owns_session
from spark_jobs.settings import PUSHGATEWAY
from spark_jobs.shard_io import JobError, SlotTask, UsageError, failure_line, parse_job_args

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@dataclass
class RunSummary:
    job: str
    pushgateway: str | None = None
    figures: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    active: bool = False  # set once the arguments parsed: --help and usage errors are no runs
    # Bad input answers with exactly one line (the CLI contract): the summary is pushed, not logged.
    quiet: bool = False

    def finish(self, exit_code: int) -> None:
        """Log the summary; push it if configured. A push failure is logged, never raised:
        the job's own result must not change because monitoring is down."""
        if not self.active:
            return
        ok = exit_code == 0
        duration = time.monotonic() - self.started
        line = {"job": self.job, "ok": ok, "exitCode": exit_code, "durationSeconds": round(duration, 3)}
        line.update(self.figures)
        if not self.quiet:
            print(f"{self.job}: run summary {json.dumps(line, sort_keys=True)}", file=sys.stderr)
        gateway = self.pushgateway or PUSHGATEWAY.read()
        if not gateway:
            return
        try:
            pushadd_to_gateway(
                gateway, job=f"relayfleet_{self.job}", registry=self.registry(ok, duration), timeout=10
            )
        except Exception as exc:  # URLError, HTTPError, bad URL: one line, no traceback
            print(f"{self.job}: cannot push the run summary to {gateway}: {exc}", file=sys.stderr)

    def registry(self, ok: bool, duration: float) -> CollectorRegistry:
        reg = CollectorRegistry()
        now = time.time()

        def gauge(name: str, doc: str, value: float) -> None:
            g = Gauge(name, doc, ["spark_job"], registry=reg)
            g.labels(self.job).set(value)

        gauge("relayfleet_spark_job_last_run_timestamp_seconds", "Unix time the job last finished", now)
        if ok:
            gauge(
                "relayfleet_spark_job_last_success_timestamp_seconds",
                "Unix time of the last successful run",
                now,
            )
        gauge("relayfleet_spark_job_success", "1 when the last run succeeded", 1.0 if ok else 0.0)
        gauge("relayfleet_spark_job_duration_seconds", "Wall time of the last run", duration)
        for name, value in self.figures.items():
            gauge(f"relayfleet_spark_job_{name}", f"{name} in the last successful run", value)
        return reg


def add_job_args(p: argparse.ArgumentParser) -> None:
    """The flags every Spark job takes: task size, master, progress, Pushgateway."""
    p.add_argument("--task-slots", type=int, default=1024, metavar="N", help="slots per Spark task")
    p.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_flag(p, PUSHGATEWAY)


@dataclass(frozen=True, slots=True)
class JobInput:
    """What a job read and checked before Spark starts, and its Spark part."""

    shard_map: ShardMap
    tasks: Sequence[SlotTask]
    work: Callable[[SparkSession, RunSummary], None]  # raises on failure; figures go to the summary


def run_job(
    job: str,
    argv: Sequence[str] | None,
    parser: argparse.ArgumentParser,
    prepare: Callable[[argparse.Namespace], JobInput],
    bad_input: tuple[type[Exception], ...] = (),
) -> int:
    """Run a job and always finish its run summary with the exit code.

    `prepare` raises UsageError (exit 2) or JobError (exit 1) before any Spark
    starts; `bad_input` are the job's further exceptions that mean exit 2, before
    or during the Spark part."""
    run = RunSummary(job)
    code = _drive(job, argv, parser, prepare, bad_input, run)
    run.finish(code)
    return code


def _drive(
    job: str,
    argv: Sequence[str] | None,
    parser: argparse.ArgumentParser,
    prepare: Callable[[argparse.Namespace], JobInput],
    bad_input: tuple[type[Exception], ...],
    run: RunSummary,
) -> int:
    usage: tuple[type[Exception], ...] = (UsageError, *bad_input)
    reading: tuple[type[Exception], ...] = (*usage, JobError)
    working: tuple[type[Exception], ...] = (*bad_input, JobError, MaintenanceError)
    try:
        args = parse_job_args(parser, argv)
        run.pushgateway, run.active = args.pushgateway, True
        job_input = prepare(args)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except reading as exc:
        return _error_line(job, exc, usage, run)

    try:
        stop_after = owns_session()
        spark = get_session(f"relayfleet-{job}", args.master)
    except Exception as exc:  # the JVM could not start: say why in one line
        print(f"{job}: cannot start Spark: {exc}", file=sys.stderr)
        return 1
    try:
        shard_map, tasks = job_input.shard_map, job_input.tasks
        print(
            f"{job}: fleet {shard_map.fleet} (map epoch {shard_map.epoch}), "
            f"{len(shard_map.shards)} shards, {len(tasks)} tasks",
            file=sys.stderr,
        )
        job_input.work(spark, run)
        return 0
    except working as exc:
        return _error_line(job, exc, bad_input, run)
    except Exception as exc:
        # a task failure reaches the driver as a Py4J/Spark error holding the task's traceback
        print(f"{job}: failed: {failure_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if stop_after:
            spark.stop()


def _error_line(job: str, exc: Exception, usage: tuple[type[Exception], ...], run: RunSummary) -> int:
    """The error's one line on stderr; its exit status: 2 for bad input, else 1."""
    print(f"{job}: {exc}", file=sys.stderr)
    run.quiet = isinstance(exc, usage)
    return 2 if run.quiet else 1
