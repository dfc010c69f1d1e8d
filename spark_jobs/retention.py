"""Retention sweep: trim old and surplus messages on every shard, in parallel.

    python -m spark_jobs.retention --shard-map FILE [--max-age SECONDS]
        [--max-messages N] [--idle SECONDS | --keep-empty] [--report PATH]

The driver cuts the shard map into tasks of (shard, slot range); each Spark
task opens its own Redis connection and runs the slot trim script on each of
its slots, many slots per round trip: a call reads a page of the slot's queue
index and trims each queue atomically (relay/storage/lua/trim_slot.lua, each
queue as trim.lua trims it), and a slot that is not plainly owned (migrating,
importing, moved) is skipped. The work is in Redis, so a task waits on Redis,
not on Python; the sweep is idempotent and safe next to live traffic and
migrations. The driver turns
the task rows into a per-shard report (a DataFrame), writes it as JSON lines
(or Parquet when PATH ends in .parquet) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.storage.maintenance import ShardMaintenance, TrimPolicy
from spark_jobs.run_summary import JobInput, RunSummary, add_job_args, run_job
from spark_jobs.settings import add_source_args, environment_help
from spark_jobs.shard_io import (
    ArgParser,
    JobError,
    SlotTask,
    UsageError,
    fleet_shard_specs,
    load_shard_map,
    now_ms,
    parse_duration_s,
    split_ns_name,
    split_tasks,
    with_credentials,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

DEFAULT_MAX_AGE_S = 7 * 86400  # RelayShard retention.maxAge default
DEFAULT_MAX_MESSAGES = 10000  # RelayShard retention.maxMessages default

# what each task counts; the report sums them per shard
COUNT_COLUMNS = (
    "slots_scanned",
    "slots_skipped",
    "queues_scanned",
    "messages_removed",
    "bytes_removed",
    "queues_deleted",
)
REPORT_COLUMNS = ("shard", "tasks", *COUNT_COLUMNS, "duration_s")


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    max_age_s: int | None = DEFAULT_MAX_AGE_S  # None: no age limit
    max_messages: int | None = DEFAULT_MAX_MESSAGES  # None: no count limit
    idle_s: int | None = None  # empty queues idle this long are deleted; None: never

    def trim_policy(self, at_ms: int) -> TrimPolicy:
        return TrimPolicy(
            now_ms=at_ms,
            cutoff_ms=at_ms - self.max_age_s * 1000 if self.max_age_s is not None else 0,
            max_messages=self.max_messages if self.max_messages is not None else -1,
            idle_ms=self.idle_s * 1000 if self.idle_s is not None else -1,
        )


def sweep_task(task: SlotTask, policy: RetentionPolicy, at_ms: int) -> dict[str, Any]:
    """One Spark task: retention over one shard's slot range. Plain Python, no Spark. The
    trimming runs in Redis a page of a slot's queues per call (ShardMaintenance.trim_slots):
    the task waits on Redis, it does no work per queue."""
    started = time.monotonic()
    with ShardMaintenance(task.url) as m:
        slots = m.trim_slots(list(task.slots), policy.trim_policy(at_ms))
    scanned = [s for s in slots if not s.fenced]  # a fenced slot is not owned here, or stopped being
    return {
        "shard": task.shard,
        "start": task.start,
        "end": task.end,
        "slots_scanned": len(scanned),
        "slots_skipped": len(slots) - len(scanned),
        "queues_scanned": sum(s.queues for s in slots),
        "messages_removed": sum(s.removed for s in slots),
        "bytes_removed": sum(s.bytes for s in slots),
        "queues_deleted": sum(s.deleted for s in slots),
        "duration_s": time.monotonic() - started,
    }


def run_sweep(
    spark: SparkSession,
    tasks: Sequence[SlotTask],
    policies: Mapping[str, RetentionPolicy],
    at_ms: int,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Run every task as a Spark task (one partition each); the task rows."""
    from spark_jobs.session import Progress, collect

    sc = spark.sparkContext
    done = sc.accumulator(0)
    removed = sc.accumulator(0)
    work = [(t, policies[t.shard]) for t in tasks]

    def run(item: tuple[SlotTask, RetentionPolicy]) -> dict[str, Any]:
        row = sweep_task(item[0], item[1], at_ms)
        done.add(1)
        removed.add(row["messages_removed"])
        return row

    def sample() -> str:
        return f"{done.value}/{len(work)} tasks, {removed.value} messages removed"

    rdd = sc.parallelize(work, max(1, len(work))).map(run)
    return collect(rdd, Progress("retention", sample) if progress else None)


def report_frame(spark: SparkSession, rows: Iterable[Mapping[str, Any]]) -> DataFrame:
    """Task rows as a DataFrame with a fixed schema."""
    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    from spark_jobs.session import rows_frame

    schema = StructType(
        [
            StructField("shard", StringType(), False),
            StructField("start", LongType(), False),
            StructField("end", LongType(), False),
            *(StructField(c, LongType(), False) for c in COUNT_COLUMNS),
            StructField("duration_s", DoubleType(), False),
        ]
    )
    return rows_frame(spark, schema, rows)


def per_shard(tasks: DataFrame) -> DataFrame:
    """Per-shard totals of the task rows (duration: summed task time)."""
    from pyspark.sql import functions as F

    return (
        tasks.groupBy("shard")
        .agg(
            F.count(F.lit(1)).alias("tasks"),
            *(F.sum(c).alias(c) for c in COUNT_COLUMNS),
            F.round(F.sum("duration_s"), 3).alias("duration_s"),
        )
        .select(*REPORT_COLUMNS)
        .orderBy("shard")
    )


def write_report(report: DataFrame, path: str) -> None:
    """Parquet (a Spark output directory) for *.parquet, otherwise one JSON object per line."""
    if path.endswith(".parquet"):
        report.coalesce(1).write.mode("overwrite").parquet(path)
        return
    lines = [json.dumps(r.asDict(), sort_keys=False) for r in report.collect()]
    try:
        Path(path).write_text("".join(line + "\n" for line in lines), "utf-8")
    except OSError as exc:
        raise JobError(f"cannot write report {path}: {exc.strerror or exc}") from None


def summary(rows: Sequence[Mapping[str, Any]], wall_s: float) -> str:
    total = {c: sum(int(r[c]) for r in rows) for c in REPORT_COLUMNS[1:-1]}
    return (
        f"retention: {len(rows)} shards, {total['queues_scanned']} queues scanned, "
        f"{total['messages_removed']} messages and {total['bytes_removed']} bytes removed, "
        f"{total['queues_deleted']} idle queues deleted, {total['slots_skipped']} slots skipped "
        f"(not owned), {wall_s:.1f}s"
    )


def policies_for(
    shards: Iterable[str],
    cli: RetentionPolicy,
    overrides: set[str],
    specs: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, RetentionPolicy]:
    """Each shard's policy: its RelayShard spec.retention where known, command-line
    options overriding it; the idle period defaults to the shard's max age."""
    out: dict[str, RetentionPolicy] = {}
    for shard in shards:
        policy = cli
        retention = (specs or {}).get(shard, {}).get("retention") or {}
        if "max_age" not in overrides and "maxAge" in retention:
            policy = replace(policy, max_age_s=parse_duration_s(str(retention["maxAge"])))
        if "max_messages" not in overrides and "maxMessages" in retention:
            policy = replace(policy, max_messages=int(retention["maxMessages"]))
        if "idle" not in overrides:
            policy = replace(policy, idle_s=policy.max_age_s)
        out[shard] = policy
    return out


def _parser() -> ArgParser:
    p = ArgParser(
        prog="python -m spark_jobs.retention",
        description=__doc__.split("\n\n")[0],
        epilog=environment_help(),
    )
    add_source_args(p)
    p.add_argument("--max-age", type=int, metavar="SECONDS", help=f"default {DEFAULT_MAX_AGE_S}")
    p.add_argument("--max-messages", type=int, metavar="N", help=f"per queue, default {DEFAULT_MAX_MESSAGES}")
    idle = p.add_mutually_exclusive_group()
    idle.add_argument("--idle", type=int, metavar="SECONDS", help="delete empty queues idle this long")
    idle.add_argument("--keep-empty", action="store_true", help="never delete empty queues")
    p.add_argument("--report", metavar="PATH", help="JSON lines, or Parquet when PATH ends in .parquet")
    add_job_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_job("retention", argv, _parser(), _prepare)


def _prepare(args: argparse.Namespace) -> JobInput:
    """Check the options, read the shard map and each shard's policy."""
    for flag, value in (("--max-age", args.max_age), ("--max-messages", args.max_messages)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1")
    if args.idle is not None and args.idle < 0:
        raise UsageError("--idle must be >= 0")
    shard_map = with_credentials(
        load_shard_map(args.shard_map, args.shard_map_configmap), args.credentials_dir
    )
    tasks = split_tasks(shard_map, args.task_slots)
    specs = None
    if args.shard_map_configmap:
        namespace, _ = split_ns_name(args.shard_map_configmap, "--shard-map-configmap")
        specs = fleet_shard_specs(namespace, shard_map.fleet)
    cli = RetentionPolicy(
        max_age_s=args.max_age if args.max_age is not None else DEFAULT_MAX_AGE_S,
        max_messages=args.max_messages if args.max_messages is not None else DEFAULT_MAX_MESSAGES,
        idle_s=None if args.keep_empty else args.idle,
    )
    overrides = {
        name
        for name, given in (
            ("max_age", args.max_age is not None),
            ("max_messages", args.max_messages is not None),
            ("idle", args.idle is not None or args.keep_empty),
        )
        if given
    }
    policies = policies_for(shard_map.shards, cli, overrides, specs)
    return JobInput(shard_map, tasks, partial(_sweep, args, tasks, policies))


def _sweep(
    args: argparse.Namespace,
    tasks: Sequence[SlotTask],
    policies: Mapping[str, RetentionPolicy],
    spark: SparkSession,
    run: RunSummary,
) -> None:
    """The Spark part: sweep, per-shard report, summary."""
    rows = run_sweep(spark, tasks, policies, now_ms(), progress=not args.quiet)
    report = per_shard(report_frame(spark, rows))
    shard_rows = [r.asDict() for r in report.collect()]
    if args.report:
        write_report(report, args.report)
    for r in shard_rows:
        print(json.dumps(r))
    print(summary(shard_rows, time.monotonic() - run.started), file=sys.stderr)
    run.figures.update({c: float(sum(int(r[c]) for r in shard_rows)) for c in REPORT_COLUMNS[1:-1]})


if __name__ == "__main__":
    sys.exit(main())
