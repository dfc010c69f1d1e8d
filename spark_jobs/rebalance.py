"""Rebalance planning over the whole fleet, as a Spark job.

    python -m spark_jobs.rebalance --shard-map FILE --dry-run
    python -m spark_jobs.rebalance --shard-map-configmap NS/relayfleet-F-shardmap [--auto-approve]

Spark tasks, one per (shard, slot range), read every slot's statistics
(messages, bytes, enqueue rate: O(1) per slot, no payload) from all shards in
parallel. The driver plans moves with spark_jobs.load_planner and prints a
before/after balance table on stderr. With --dry-run the plan is printed as
JSON on stdout; otherwise it becomes a RelayRebalance proposal
(relayfleet.dev/v1alpha1) that the operator executes once approved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.fleet.sharding import ShardMap
from spark_jobs.load_planner import (
    Plan,
    PlanningError,
    SlotLoad,
    add_plan_args,
    map_from_args,
    plan,
    resolve_weights,
)
from spark_jobs.run_summary import JobInput, RunSummary, add_job_args, run_job
from spark_jobs.settings import environment_help
from spark_jobs.shard_io import (
    GROUP,
    VERSION,
    ArgParser,
    JobError,
    SlotTask,
    UsageError,
    kube_api,
    now_ms,
    read_slot_stats,
    split_ns_name,
    split_tasks,
    with_credentials,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

PROPOSER = "spark-rebalance"
LABEL_FLEET = "relayfleet.dev/fleet"
LABEL_PROPOSER = "relayfleet.dev/proposed-by"
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def collect_slot_stats(
    spark: SparkSession, tasks: Sequence[SlotTask], at_ms: int, progress: bool = False
) -> list[dict[str, Any]]:
    """Every task's per-slot statistics rows, read in parallel Spark tasks."""
    from spark_jobs.session import Progress, collect

    sc = spark.sparkContext
    done = sc.accumulator(0)

    def read(task: SlotTask) -> list[dict[str, Any]]:
        rows = read_slot_stats(task, at_ms)
        done.add(1)
        return rows

    def sample() -> str:
        return f"{done.value}/{len(tasks)} tasks read"

    rdd = sc.parallelize(list(tasks), max(1, len(tasks))).flatMap(read)
    return collect(rdd, Progress("rebalance", sample) if progress else None)


def slot_frame(spark: SparkSession, rows: Iterable[Mapping[str, Any]]) -> DataFrame:
    """Slot statistics rows as a DataFrame with a fixed schema."""
    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    from spark_jobs.session import rows_frame

    schema = StructType(
        [
            StructField("shard", StringType(), False),
            StructField("slot", LongType(), False),
            StructField("state", StringType(), True),
            StructField("msgs", LongType(), False),
            StructField("bytes", LongType(), False),
            StructField("rate", DoubleType(), False),
            StructField("queues", LongType(), False),
        ]
    )
    return rows_frame(spark, schema, rows)


def shard_totals(slots: DataFrame) -> DataFrame:
    """Per shard: slots with data, messages, bytes, enqueue rate, queues, pinned slots."""
    from pyspark.sql import functions as F

    return (
        slots.groupBy("shard")
        .agg(
            F.count(F.lit(1)).alias("slots"),
            F.sum("msgs").alias("msgs"),
            F.sum("bytes").alias("bytes"),
            F.round(F.sum("rate"), 3).alias("rate"),
            F.sum("queues").alias("queues"),
            F.sum(F.when(F.col("state").isNotNull(), 1).otherwise(0)).alias("pinned"),
        )
        .orderBy("shard")
    )


def loads_from(slots: DataFrame) -> list[SlotLoad]:
    return [SlotLoad.from_row(r.asDict()) for r in slots.collect()]


def proposal_body(result: Plan, namespace: str, auto_approve: bool = False) -> dict[str, Any]:
    """The RelayRebalance object carrying the plan (crds/relayrebalances.yaml)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RelayRebalance",
        "metadata": {
            "generateName": f"{result.fleet}-rebalance-",
            "namespace": namespace,
            "labels": {LABEL_FLEET: result.fleet, LABEL_PROPOSER: PROPOSER},
        },
        "spec": {
            "fleet": result.fleet,
            "autoApprove": auto_approve,
            "proposal": proposal_spec(result),
        },
    }


def proposal_spec(result: Plan) -> dict[str, Any]:
    return result.proposal()


def submit_proposal(result: Plan, namespace: str, auto_approve: bool) -> str:
    """Create the RelayRebalance, or refresh this job's earlier proposal that nobody
    approved yet (one open proposal per fleet, as Strimzi's KafkaRebalance refresh).
    Returns what was done, for the log."""
    from kubernetes import client

    api: Any = client.CustomObjectsApi(kube_api())
    plural = "relayrebalances"
    selector = f"{LABEL_FLEET}={result.fleet},{LABEL_PROPOSER}={PROPOSER}"
    try:
        existing = api.list_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, label_selector=selector
        )
        for item in existing.get("items", []):
            phase = (item.get("status") or {}).get("phase")
            name = item["metadata"]["name"]
            if phase == "Rebalancing":
                return f"not proposing: {namespace}/{name} is still rebalancing fleet {result.fleet}"
            if phase in (None, "New", "PendingProposal", "ProposalReady", "NotReady"):
                patch = {"spec": {"proposal": proposal_spec(result), "autoApprove": auto_approve}}
                api.patch_namespaced_custom_object(GROUP, VERSION, namespace, plural, name, patch)
                return f"refreshed proposal {namespace}/{name}"
        created = api.create_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, proposal_body(result, namespace, auto_approve)
        )
    except client.ApiException as exc:
        raise JobError(f"cannot write RelayRebalance in {namespace}: {exc.status} {exc.reason}") from None
    return f"created proposal {namespace}/{created['metadata']['name']}"


def _namespace(args: Any) -> str:
    if args.namespace:
        return str(args.namespace)
    if args.shard_map_configmap:
        return split_ns_name(args.shard_map_configmap, "--shard-map-configmap")[0]
    try:
        return _SA_NAMESPACE.read_text("utf-8").strip()
    except OSError:
        raise UsageError("--namespace is required outside a cluster without --shard-map-configmap") from None


def _parser() -> ArgParser:
    p = ArgParser(
        prog="python -m spark_jobs.rebalance",
        description=__doc__.split("\n\n")[0],
        epilog=environment_help(),
    )
    add_plan_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON; change nothing")
    p.add_argument("--namespace", help="where the RelayRebalance goes (default: the ConfigMap's)")
    p.add_argument("--auto-approve", action="store_true", help="set spec.autoApprove on the proposal")
    p.add_argument("--output", metavar="FILE", help="also write the JSON plan to FILE")
    add_job_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # a plan the options make impossible (tolerance, weights) is bad input, during the run too
    return run_job("rebalance", argv, _parser(), _prepare, bad_input=(PlanningError,))


def _prepare(args: argparse.Namespace) -> JobInput:
    """Read the shard map and the weights; where the proposal goes."""
    shard_map = map_from_args(args)
    weights = resolve_weights(args, shard_map)
    shard_map = with_credentials(shard_map, args.credentials_dir)
    tasks = split_tasks(shard_map, args.task_slots)
    namespace = None if args.dry_run else _namespace(args)
    return JobInput(shard_map, tasks, partial(_propose, args, shard_map, tasks, weights, namespace))


def _propose(
    args: argparse.Namespace,
    shard_map: ShardMap,
    tasks: Sequence[SlotTask],
    weights: Mapping[str, float],
    namespace: str | None,
    spark: SparkSession,
    run: RunSummary,
) -> None:
    """The Spark part: scan, plan, then the JSON plan or the RelayRebalance proposal."""
    rows = collect_slot_stats(spark, tasks, now_ms(), progress=not args.quiet)
    loads = loads_from(slot_frame(spark, rows))
    result = plan(shard_map, loads, weights, args.metric, args.tolerance, args.min_bytes, args.min_rate)
    print(result.table(), file=sys.stderr)
    summary = result.to_json()
    run.figures.update(
        slots_proposed=float(summary["slotsMoved"]),
        bytes_proposed=float(summary["bytesMoved"]),
        max_over_mean_before=float(summary["maxOverMean"]["before"]),
        max_over_mean_after=float(summary["maxOverMean"]["after"]),
    )
    doc = json.dumps(result.to_json(), indent=2)
    if args.output:
        try:
            Path(args.output).write_text(doc + "\n", "utf-8")
        except OSError as exc:
            raise JobError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    if args.dry_run:
        print(doc)
    elif not result.moves:
        print("rebalance: nothing to propose: the fleet is balanced", file=sys.stderr)
    else:
        assert namespace is not None
        print(f"rebalance: {submit_proposal(result, namespace, args.auto_approve)}", file=sys.stderr)
    print(f"rebalance: done in {time.monotonic() - run.started:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
