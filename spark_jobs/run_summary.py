"""The run summary of a Spark job: always logged as one JSON line, and pushed to a
Prometheus Pushgateway when one is configured (--pushgateway or RELAYFLEET_PUSHGATEWAY).

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
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, pushadd_to_gateway

PUSHGATEWAY_ENV = "RELAYFLEET_PUSHGATEWAY"


@dataclass
class RunSummary:
    job: str
    pushgateway: str | None = None
    figures: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    active: bool = False  # set once the arguments parsed: --help and usage errors are no runs

    def finish(self, exit_code: int) -> None:
        """Log the summary; push it if configured. A push failure is logged, never raised:
        the job's own result must not change because monitoring is down."""
        if not self.active:
            return
        ok = exit_code == 0
        duration = time.monotonic() - self.started
        line = {"job": self.job, "ok": ok, "exitCode": exit_code, "durationSeconds": round(duration, 3)}
        line.update(self.figures)
        if exit_code != 2:  # bad arguments answer with exactly one line (the CLI contract)
            print(f"{self.job}: run summary {json.dumps(line, sort_keys=True)}", file=sys.stderr)
        gateway = self.pushgateway or os.environ.get(PUSHGATEWAY_ENV) or None
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
    p.add_argument(
        "--pushgateway",
        default=os.environ.get(PUSHGATEWAY_ENV),
        metavar="URL",
        help=f"push the run summary to this Prometheus Pushgateway (env {PUSHGATEWAY_ENV})",
    )


def run_job(
    job: str, body: Callable[[Sequence[str] | None, RunSummary], int], argv: Sequence[str] | None
) -> int:
    """Run a job's body and always finish its run summary with the exit code."""
    run = RunSummary(job)
    code = body(argv, run)
    run.finish(code)
    return code
