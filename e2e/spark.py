"""The chart's Spark CronJobs run for real: a Job made from the CronJob (`kubectl create job
--from=cronjob/...`) whose Pod is the driver (`spark-submit --master k8s://... --deploy-mode
client`), executors as Pods of the Spark image it creates with the chart's RBAC, all in the
chart's Spark namespace (Pod Security "restricted" enforced there).

`JobRun` follows one such Job: every executor Pod seen while it ran, its time, its log. Retention
is checked as tests/test_spark_retention.py checks it: old messages seeded straight into each
shard's Redis (through ShardStore, with old receive times), then exactly those past max-age gone.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from e2e.env import FLEET, RELEASE, Env
from e2e.probes import primary_pod, shard_map
from relay.fleet.sharding import ShardMap
from relay.storage import keys as K
from tests.support.spark_session import Seed, recipient_on, seed

HOUR_MS = 3_600_000
# The age limit the e2e installs the chart with (spark.retention.maxAgeSeconds).
MAX_AGE_S = 3600
EXECUTOR_SELECTOR = "spark-role=executor"


@dataclass
class JobRun:
    """One Job made from a CronJob of the chart, watched until it ends."""

    env: Env
    job: str  # "retention" | "rebalance"
    name: str = ""
    started: float = 0.0
    seconds: float = 0.0
    executors: set[str] = field(default_factory=set)
    executor_nodes: set[str] = field(default_factory=set)
    # each executor Pod's spec as the API admitted it (its securityContext is checked)
    executor_specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    log: str = ""
    _done: threading.Event = field(default_factory=threading.Event)
    _watch: threading.Thread | None = None

    spark: Env = field(init=False)  # the Spark namespace, where the Job and its Pods run

    def __post_init__(self) -> None:
        self.spark = self.env.spark()

    def start(self) -> JobRun:
        self.name = f"e2e-{self.job}-{int(time.time())}"
        self.started = time.monotonic()
        self.spark.kubectl("create", "job", f"--from=cronjob/{RELEASE}-{self.job}-{FLEET}", self.name)
        self._watch = threading.Thread(target=self._watch_executors, name=f"watch-{self.name}", daemon=True)
        self._watch.start()
        return self

    def _watch_executors(self) -> None:
        # Executors live for seconds: list them every half second while the Job runs.
        while not self._done.is_set():
            for pod in executor_pods(self.env, self.name):
                self.executor_specs.setdefault(pod["metadata"]["name"], pod["spec"])
                self.executors.add(pod["metadata"]["name"])
                if pod["spec"].get("nodeName"):
                    self.executor_nodes.add(pod["spec"]["nodeName"])
            self._done.wait(0.5)

    def finished(self) -> bool:
        """True once the Job succeeded; a failed Job fails the test with the driver's log."""
        obj = self.spark.get("job", self.name)
        status = (obj or {}).get("status") or {}
        if status.get("failed"):
            self._stop()
            logs = self.spark.kubectl("logs", f"job/{self.name}", "--tail=60", check=False)
            raise AssertionError(f"job {self.name} failed: {logs.stdout}{logs.stderr}")
        if not status.get("succeeded"):
            return False
        self.seconds = round(time.monotonic() - self.started, 1)
        self._stop()
        self.log = self.spark.kubectl("logs", f"job/{self.name}", check=False).stdout
        return True

    def _stop(self) -> None:
        self._done.set()
        if self._watch is not None:
            self._watch.join(10)

    def json_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out


def executor_pods(env: Env, job_name: str) -> list[dict[str, Any]]:
    """The executor Pods of the Job `job_name`: those its driver Pods own (Spark sets the driver
    Pod as their owner; their names come from the driver Pod's UID, unique per run), in the
    Spark namespace."""
    spark = env.spark()
    drivers = {p["metadata"]["name"] for p in spark.pods(f"batch.kubernetes.io/job-name={job_name}")}
    return [
        p
        for p in spark.pods(EXECUTOR_SELECTOR)
        if any(
            o.get("kind") == "Pod" and o.get("name") in drivers
            for o in p["metadata"].get("ownerReferences") or ()
        )
    ]


def local_shard_map(env: Env) -> ShardMap:
    """The fleet's shard map with each shard's URL replaced by one this process reaches:
    its Redis primary Pod, with the shard's password."""
    m = shard_map(env)
    assert m is not None
    urls = {}
    for name in m.shards:
        pod = primary_pod(env, name)
        host, port = env.pod_address(pod, 6379)
        password = env.secret_value(f"relayfleet-{name}-redis", "password")
        urls[name] = f"redis://:{password}@{host}:{port}/0"
    return ShardMap(m.fleet, m.epoch, urls, m.ranges)


@dataclass
class RetentionSeed:
    """Per shard: a queue of old messages only (emptied, then deleted as idle), and a queue of
    old then recent messages (the old ones go, the recent stay)."""

    shard_map: ShardMap
    old_only: dict[str, bytes] = field(default_factory=dict)
    mixed: dict[str, bytes] = field(default_factory=dict)
    old_per_queue: int = 4
    recent_per_queue: int = 2

    @property
    def expected_removed(self) -> int:
        return 2 * self.old_per_queue * len(self.shard_map.shards)

    def plant(self) -> None:
        rng = random.Random(26)
        now = int(time.time() * 1000)
        old, recent = now - 2 * HOUR_MS, now - 10 * 60_000
        seeds: list[Seed] = []
        for name in sorted(self.shard_map.shards):
            self.old_only[name] = recipient_on(self.shard_map, name, rng)
            self.mixed[name] = recipient_on(self.shard_map, name, rng)
            for i in range(self.old_per_queue):
                seeds.append(Seed(self.old_only[name], b"", b"old-" + bytes([65 + i]) * 10, old + i))
                seeds.append(Seed(self.mixed[name], b"", b"old-" + bytes([65 + i]) * 20, old + i))
            for i in range(self.recent_per_queue):
                seeds.append(Seed(self.mixed[name], b"", b"recent-" + bytes([65 + i]), recent + i))
        seed(self.shard_map, seeds)

    def left(self) -> dict[str, dict[str, Any]]:
        """What Redis holds of each seeded queue now."""
        import redis

        out: dict[str, dict[str, Any]] = {}
        for name, url in self.shard_map.shards.items():
            with redis.Redis.from_url(url) as r:
                for kind, recipient in (("old_only", self.old_only[name]), ("mixed", self.mixed[name])):
                    q = K.queue_keys(recipient, b"")
                    entries = r.xrange(q.msgs)
                    out[f"{name}/{kind}"] = {
                        "seqs": [int(e[0].split(b"-")[0]) for e in entries],
                        "exists": bool(r.exists(q.meta, q.msgs)),
                    }
        return out
