"""What the jobs read before and around their Spark work: the shard map, the
fleet's RelayShard settings, the (shard, slot range) task list, and per-slot
statistics of one task.

No pyspark here: `relayfleet plan` uses the same reading code without Spark,
and executors import this module with only the task function's needs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from relay.envconfig import ConfigError, EnvHelpParser
from relay.fleet import credentials
from relay.fleet.contract import shard_map_from_configmap_data
from relay.fleet.sharding import ShardMap, ShardMapError, loads_shard_map
from relay.storage.maintenance import ShardMaintenance

GROUP = "relayfleet.dev"
VERSION = "v1alpha1"
DEFAULT_TASK_SLOTS = 512


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class JobError(Exception):
    """The job could not do its work (unreachable shard, API refused): exit status 1."""


class ArgParser(EnvHelpParser):
    """argparse whose errors become UsageError, so the caller prints one line; --help names
    every flag's variable and default (relay/envconfig.py)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parse_job_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`argv` parsed, each flag not given filled from its variable (spark_jobs/settings.py); a bad
    value is a UsageError naming the flag or the variable."""
    from spark_jobs import settings

    args = parser.parse_args(argv)
    try:
        settings.resolve(args)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return args


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class SlotTask:
    """One unit of distributed work: a contiguous slot range owned by one shard."""

    shard: str
    url: str = field(repr=False)  # may carry a password
    start: int
    end: int  # inclusive

    @property
    def slots(self) -> range:
        return range(self.start, self.end + 1)


def split_tasks(shard_map: ShardMap, max_slots: int = DEFAULT_TASK_SLOTS) -> list[SlotTask]:
    """Every owned range cut into tasks of at most `max_slots` slots.

    Small tasks spread one busy shard over several executors and keep a failed
    task's retry cheap; tasks of different shards interleave so the first
    executors do not all start on the same Redis.
    """
    if max_slots < 1:
        raise UsageError("--task-slots must be >= 1")
    per_shard: dict[str, list[SlotTask]] = {}
    for r in shard_map.ranges:
        for start in range(r.start, r.end + 1, max_slots):
            end = min(r.end, start + max_slots - 1)
            per_shard.setdefault(r.shard, []).append(SlotTask(r.shard, shard_map.shards[r.shard], start, end))
    lists = list(per_shard.values())
    out: list[SlotTask] = []
    for i in range(max((len(x) for x in lists), default=0)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


def kube_api() -> Any:
    """An ApiClient of the project's one Kubernetes client (relay/kubeapi.py: in-cluster, else
    $KUBECONFIG; retries on transient errors)."""
    from relay import kubeapi

    try:
        return kubeapi.api_client()
    except kubeapi.KubernetesMissing:
        raise UsageError("--shard-map-configmap needs the kubernetes client (the [operator] extra)") from None
    except kubeapi.KubeConfigError as exc:
        raise JobError(str(exc)) from None


def split_ns_name(value: str, flag: str) -> tuple[str, str]:
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise UsageError(f"{flag} must be NAMESPACE/NAME, got {value!r}")
    return namespace, name


def load_shard_map(path: str | None, configmap: str | None) -> ShardMap:
    """The shard map from a file or from ConfigMap NS/NAME (key shardmap.json)."""
    if path and configmap:
        raise UsageError("give either --shard-map or --shard-map-configmap, not both")
    if path:
        try:
            text = Path(path).read_text("utf-8")
        except OSError as exc:
            raise UsageError(f"cannot read shard map {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise UsageError(f"shard map {path} is not UTF-8 text") from None
        try:
            return loads_shard_map(text)
        except ShardMapError as exc:
            raise UsageError(f"shard map {path}: {exc}") from None
    if configmap:
        namespace, name = split_ns_name(configmap, "--shard-map-configmap")
        api = kube_api()
        from kubernetes import client

        try:
            cm = client.CoreV1Api(api).read_namespaced_config_map(name, namespace)
        except client.ApiException as exc:
            raise JobError(f"cannot read ConfigMap {namespace}/{name}: {exc.status} {exc.reason}") from None
        try:
            return shard_map_from_configmap_data(cm.data, f"{namespace}/{name}")
        except ShardMapError as exc:
            raise JobError(str(exc)) from None
    raise UsageError("one of --shard-map or --shard-map-configmap is required")


def with_credentials(shard_map: ShardMap, directory: str | None) -> ShardMap:
    """The map with each shard's full Redis URL from `directory`/<shard> where present."""
    try:
        return credentials.apply_credentials(shard_map, directory)
    except credentials.CredentialsError as exc:
        if "does not exist" in str(exc):
            raise UsageError(str(exc)) from None
        raise JobError(str(exc)) from None


def fleet_shard_specs(namespace: str, fleet: str) -> dict[str, Mapping[str, Any]]:
    """spec of every RelayShard of the fleet in the namespace, by name."""
    from kubernetes import client

    from relay.kubeapi import list_all

    api: Any = client.CustomObjectsApi(kube_api())
    try:
        listing = list_all(api.list_namespaced_custom_object, GROUP, VERSION, namespace, "relayshards")
    except client.ApiException as exc:
        raise JobError(f"cannot list RelayShards in {namespace}: {exc.status} {exc.reason}") from None
    out: dict[str, Mapping[str, Any]] = {}
    for item in listing:
        spec = item.get("spec") or {}
        if spec.get("fleet") == fleet:
            out[item["metadata"]["name"]] = spec
    return out


def parse_duration_s(text: str) -> int:
    """'90', '90s', '15m', '12h', '7d' into seconds (RelayShard retention.maxAge format)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip()
    mult = units.get(t[-1:], 0)
    digits = t[:-1] if mult else t
    if not digits.isdigit():
        raise UsageError(f"bad duration {text!r}: expected seconds or a number with s, m, h or d")
    return int(digits) * (mult or 1)


def parse_weights(items: Sequence[str]) -> dict[str, float]:
    """['a=2', 'b=1'] into {'a': 2.0, 'b': 1.0}."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not name or not weight > 0:
            raise UsageError(f"bad --weight {item!r}: expected SHARD=POSITIVE_NUMBER")
        out[name] = weight
    return out


def read_slot_stats(task: SlotTask, at_ms: int) -> list[dict[str, Any]]:
    """Per-slot statistics of one task's slots as plain rows (the rebalance scan).

    Rows for slots with nothing in them and owned normally are left out: most
    of a young fleet's slots are empty and the driver treats a missing slot as
    zero load.
    """
    with ShardMaintenance(task.url) as m:
        stats = m.slot_stats(list(task.slots), at_ms)
    return [
        {
            "shard": task.shard,
            "slot": s.slot,
            "state": s.state,
            "msgs": s.msgs,
            "bytes": s.bytes,
            "rate": s.rate,
            "queues": s.queues,
        }
        for s in stats
        if s.msgs or s.bytes or s.rate or s.queues or s.state is not None
    ]


def failure_line(exc: BaseException) -> str:
    """One line for a failed Spark action: a task's own error when it carries one
    (it reaches the driver wrapped in a Py4J error with the task's traceback)."""
    text = str(exc)
    for marker in ("MaintenanceError: ", "JobError: "):
        if marker in text:
            return text.split(marker, 1)[1].splitlines()[0]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}"
