"""The SparkSession the jobs run in, and the driver-side Spark plumbing both jobs
use: collecting their tasks' rows (with progress output) and turning rows into a
DataFrame.

Under spark-submit (the CronJob pod: `--master k8s://...`, client mode) the
master and executor settings come from spark-submit; run as a plain
`python -m spark_jobs.…` the job starts its own local Spark (`local[*]`).
The job code is the same either way.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

T = TypeVar("T")

_ROOT = str(Path(__file__).resolve().parent.parent)


def under_spark_submit() -> bool:
    # spark-submit starts the Python driver with a gateway to its JVM already running
    return "PYSPARK_GATEWAY_PORT" in os.environ


def local_conf(master: str = "local[*]") -> dict[str, str]:
    """Settings for a local session: no UI, loopback only, few shuffle partitions."""
    return {
        "spark.master": master,
        "spark.ui.enabled": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.sql.shuffle.partitions": "4",
        "spark.python.worker.reuse": "true",
        "spark.ui.showConsoleProgress": "false",  # the jobs print their own progress
        # each task holds one Redis connection; a failed task is retried on another worker
        "spark.task.maxFailures": "2",
    }


def prepare_local_python() -> None:
    """Local Python workers are forked by the JVM: make them run this interpreter
    and find this source tree even when the project is not installed."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if _ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [_ROOT, *paths] if p)


def get_session(app_name: str, master: str | None = None) -> SparkSession:
    """The session for a job run: spark-submit's, or a local one (or the one
    already active in this process, e.g. a test's)."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName(app_name)
    if master is None and not under_spark_submit():
        master = "local[*]"
    if master is not None and master.startswith("local"):
        prepare_local_python()
        for key, value in local_conf(master).items():
            builder = builder.config(key, value)
    elif master is not None:
        builder = builder.master(master)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session


def owns_session() -> bool:
    """False when a session is already active here: a job must not stop it."""
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() is None


class Progress:
    """Prints a progress line every `every` seconds while a Spark action runs.

    `sample` returns the text after the prefix; it reads accumulators, which the
    driver updates as each task finishes.
    """

    def __init__(
        self, prefix: str, sample: Callable[[], str], every: float = 2.0, out: TextIO | None = None
    ) -> None:
        self._prefix = prefix
        self._sample = sample
        self._every = every
        self._out = out if out is not None else sys.stderr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._started = 0.0

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self._started
        print(f"{self._prefix}: {self._sample()} [{elapsed:.1f}s]", file=self._out, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._line()


def collect(rdd: RDD[T], progress: Progress | None = None) -> list[T]:
    """Run the tasks and gather their rows, printing `progress` lines meanwhile."""
    if progress is None:
        return rdd.collect()
    with progress:
        return rdd.collect()


def rows_frame(spark: SparkSession, schema: StructType, rows: Iterable[Mapping[str, Any]]) -> DataFrame:
    """Plain rows (dicts) as a DataFrame with a fixed schema."""
    names = schema.fieldNames()
    return spark.createDataFrame([tuple(r[n] for n in names) for r in rows], schema)
