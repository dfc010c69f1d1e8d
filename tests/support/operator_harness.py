"""Shared support of the operator tests (no tests here).

kubectl helpers against a real API server (tests/support/k8s_cluster.py), the CRDs installed once
per cluster, a fresh namespace per test, RelayShard/RelayRebalance documents, the operator
as a subprocess, and queues seeded straight into a shard's Redis. The `kwok_fleet` fixture
puts them together on the kwok cluster: a namespace, its operator (not yet started), real
redis-servers as the shards' Redis and relay processes following the operator's ConfigMap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from relayfleet_testing.localredis import LocalRedis, free_port

from relay.fleet.sharding import SLOT_COUNT, loads_shard_map
from relay.storage import keys as K
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore
from tests.support.fleet_harness import (
    DEBIAN_REDIS,
    RelayProc,
    relay_logs,
    spawn_relay,
    stop_relays,
    wait_ready,
)
from tests.support.k8s_cluster import KIND_PATHS, KubeCluster
from tests.support.procs import stop_process
from tests.support.shard_specs import shard
from tests.support.waiting import wait_for as wait_for  # the operator tests import it from here

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
Queues = dict[bytes, list[tuple[int, bytes]]]  # recipient -> (seq, payload) of each message

# --- kubectl (wait_for: tests/support/waiting.py, imported from here by the operator tests) --------


def get(cluster: KubeCluster, ns: str, *what: str) -> dict[str, Any] | None:
    if len(what) == 2 and what[0] in KIND_PATHS:  # one object by name: no kubectl process
        return cluster.read(ns, *what)
    proc = cluster.kubectl("-n", ns, "get", *what, "-o", "json", check=False)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr:
            return None
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def apply(
    cluster: KubeCluster, ns: str, *docs: dict[str, Any], check: bool = True
) -> subprocess.CompletedProcess[str]:
    text = yaml.safe_dump_all(list(docs))
    return cluster.kubectl("-n", ns, "apply", "-f", "-", input=text, check=check)


def create(cluster: KubeCluster, ns: str, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("-n", ns, "create", "-f", "-", input=yaml.safe_dump(doc), check=False)


_crds_in: set[str] = set()


def install_crds(cluster: KubeCluster) -> None:
    key = str(cluster.kubeconfig)
    if key in _crds_in:
        return
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    # `kubectl wait` can answer NotFound at once while a fresh CRD is still being
    # registered; retry briefly instead of failing the whole module
    for attempt in range(20):
        done = cluster.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/relayshards.relayfleet.dev",
            "crd/relayrebalances.relayfleet.dev",
            "--timeout=60s",
            check=attempt == 19,
        )
        if done.returncode == 0:
            break
        time.sleep(0.5)
    _crds_in.add(key)


@contextlib.contextmanager
def namespace(cluster: KubeCluster) -> Iterator[str]:
    """A fresh namespace on a cluster with the CRDs, deleted (not waited for) afterwards."""
    install_crds(cluster)
    ns = f"rf-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture
def apiserver_ns(kube_apiserver: KubeCluster) -> Iterator[str]:
    """A fresh namespace on the bare API server, the CRDs installed."""
    with namespace(kube_apiserver) as ns:
        yield ns


def create_when_served(
    cluster: KubeCluster, ns: str, doc: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """`create` of `doc` once the API server serves its type (a freshly established CRD may answer
    NotFound for a moment): the answer then, accepted or refused."""

    def attempt() -> subprocess.CompletedProcess[str] | None:
        p = create(cluster, ns, doc)
        return None if "NotFound" in p.stderr else p  # the type is not served yet

    return wait_for("the type to be served", attempt)


# --- the custom resources ------------------------------------------------------------------------


def rebalance(name: str, fleet: str = "main", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayRebalance",
        "metadata": {"name": name},
        "spec": {"fleet": fleet, **spec},
    }


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}


def shard_map(cluster: KubeCluster, ns: str, fleet: str = "main") -> Any:
    cm = get(cluster, ns, "configmap", f"relayfleet-{fleet}-shardmap")
    return None if cm is None else loads_shard_map(cm["data"]["shardmap.json"])


def rebalance_phase(cluster: KubeCluster, ns: str, name: str) -> str:
    got = get(cluster, ns, "rrebalance", name)
    return str(((got or {}).get("status") or {}).get("phase") or "")


# --- the operator --------------------------------------------------------------------------------


@dataclass
class Operator:
    cluster: KubeCluster
    namespace: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    health_port: int = 0
    metrics_port: int = 0

    def start(self, **env: str) -> Operator:
        assert self.proc is None or self.proc.poll() is not None
        self.health_port, self.metrics_port = free_port(), free_port()
        full = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "RELAYFLEET_OPERATOR_HEALTH_PORT": str(self.health_port),
            "RELAYFLEET_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "RELAYFLEET_OPERATOR_RESYNC_SECONDS": "3",
            "RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS": "1",
            "RELAYFLEET_OPERATOR_RETRY_SECONDS": "2",
            # unchanged children are written again this often: drift no read notices (a
            # deleted fleet Service) is corrected within a test's wait
            "RELAYFLEET_OPERATOR_REAPPLY_SECONDS": "4",
            **env,
        }
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "relayfleet_operator", "--namespace", self.namespace],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full,
                cwd=ROOT,
            )
        return self

    def stop(self) -> None:
        stop_process(self.proc, 20, kill_wait=10)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


# --- queues seeded straight into a shard's Redis -------------------------------------------------

PAYLOAD_BYTES = 20  # every seeded message's size, so byte counts are known


def recipients_on(slots: range, n: int, seed: int = 3) -> list[bytes]:
    rng = random.Random(seed)
    out: list[bytes] = []
    while len(out) < n:
        r = rng.randbytes(32)
        if K.queue_keys(r, b"").slot in slots:
            out.append(r)
    return out


async def enqueue_messages(url: str, recipients: Sequence[bytes], per_queue: int) -> None:
    """per_queue messages of PAYLOAD_BYTES for each recipient, each naming its queue and number."""
    store = ShardStore("seed", url, QueueLimits(rate_count=10**9))
    await store.start()
    try:
        for r in recipients:
            for i in range(per_queue):
                payload = f"{r.hex()[:8]}-{i}".encode().ljust(PAYLOAD_BYTES, b".")
                out = await store.enqueue(
                    K.queue_keys(r, b""), EnqueueRequest(r, b"", payload), 1_800_000_000_000 + i
                )
                assert out.kind == "stored"
    finally:
        await store.close()


async def read_queue(url: str, recipient: bytes) -> list[tuple[int, bytes]]:
    store = ShardStore("check", url, QueueLimits())
    await store.start()
    try:
        res = await store.read(K.queue_keys(recipient, b""), None, 1000)
        return [(m.seq, m.payload) for m in res.messages]
    finally:
        await store.close()


async def read_queues(url: str, recipients: Sequence[bytes]) -> Queues:
    return {r: await read_queue(url, r) for r in recipients}


# --- the operator's scene on the kwok cluster ----------------------------------------------------


@dataclass
class KwokFleet:
    """Fleet "main" in a fresh namespace of the kwok cluster, with what its tests drive."""

    cluster: KubeCluster
    ns: str
    operator: Operator
    workdir: Path
    servers: dict[str, LocalRedis] = field(default_factory=dict)
    relays: list[RelayProc] = field(default_factory=list)

    def redis(self, *names: str) -> None:
        """A real redis-server for each named shard (in `servers`), stopped at teardown."""
        binary = DEBIAN_REDIS if os.path.exists(DEBIAN_REDIS) else ""
        for name in names:
            self.servers[name] = LocalRedis(binary=binary).start()

    def external(self, name: str, **spec: Any) -> dict[str, Any]:
        """RelayShard `name` on its redis-server as external Redis, one relay replica."""
        return shard(name, redis={"external": {"url": self.servers[name].url}}, replicas=1, **spec)

    def get(self, *what: str) -> dict[str, Any] | None:
        return get(self.cluster, self.ns, *what)

    def apply(self, *docs: dict[str, Any]) -> None:
        apply(self.cluster, self.ns, *docs)

    def shard_map(self) -> Any:
        return shard_map(self.cluster, self.ns)

    def rebalance_phase(self, name: str) -> str:
        return rebalance_phase(self.cluster, self.ns, name)

    def join(self, *shards: dict[str, Any]) -> None:
        """Apply RelayShards and wait until the published map names them all."""
        names = {d["metadata"]["name"] for d in shards}
        self.apply(*shards)
        wait_for(
            f"{', '.join(sorted(names))} in the map",
            lambda: (m := self.shard_map()) and names <= set(m.shards),
        )

    def found(self, founder: dict[str, Any], *others: dict[str, Any]) -> None:
        """The founder joins alone and takes every slot (data seeded on it is then in place),
        then the others join it."""
        self.join(founder)
        if others:
            self.join(*others)

    def auto_rebalanced_join(self) -> None:
        """Shard a (weight 300) founds the fleet, b joins with autoRebalance; returns once the
        join rebalance b-join is Ready."""
        self.join(self.external("a", weight=300))
        self.apply(self.external("b", autoRebalance=True))
        wait_for("the join rebalance", lambda: self.rebalance_phase("b-join") == "Ready", timeout=120)

    def seed(self, name: str, queues: int, per_queue: int) -> Queues:
        """Queues across all slots on shard `name`'s Redis; what each holds."""
        url = self.servers[name].url
        recipients = recipients_on(range(SLOT_COUNT), queues)
        asyncio.run(enqueue_messages(url, recipients, per_queue))
        return asyncio.run(read_queues(url, recipients))

    def history_intact(self, expected: Queues) -> None:
        """Every seeded queue, read from the shard the published map names, holds exactly its messages."""
        m = self.shard_map()
        for r, want in expected.items():
            owner = m.shard_for(r)
            assert asyncio.run(read_queue(self.servers[owner].url, r)) == want, (
                f"queue {r.hex()[:8]} on {owner}"
            )

    def start_relays(self, n: int) -> list[str]:
        """n relay processes reading the map from the operator's ConfigMap, ready; their URLs."""
        source = ["--shard-map-configmap", f"{self.ns}/relayfleet-main-shardmap"]
        env = {"KUBECONFIG": str(self.cluster.kubeconfig)}
        relays = [spawn_relay(source, self.workdir, env) for _ in range(n)]
        self.relays += relays
        for relay in relays:
            wait_ready(relay)
        return [r.url for r in relays]

    def relay_logs(self) -> str:
        return relay_logs(self.relays)

    def close(self) -> None:
        try:
            stop_relays(self.relays)
            self.operator.stop()
            # shown when the test fails
            if self.operator.log.exists():
                print(f"--- operator log (tail) ---\n{self.operator.tail(200)}")
            if self.relays:
                print(self.relay_logs())
            # Shards still holding the finalizer would keep the namespace: let them go.
            for name in self.cluster.kubectl(
                "-n", self.ns, "get", "rshard", "-o", "name", check=False
            ).stdout.split():
                self.cluster.kubectl(
                    "-n",
                    self.ns,
                    "patch",
                    name,
                    "--type=merge",
                    "-p",
                    '{"metadata":{"finalizers":null}}',
                    check=False,
                )
        finally:
            for server in self.servers.values():
                server.stop()


@pytest.fixture(name="kwok_fleet")
def kwok_fleet_fixture(kwok_cluster: KubeCluster, tmp_path: Path) -> Iterator[KwokFleet]:
    """Import it by this name; tests ask for `kwok_fleet`."""
    with namespace(kwok_cluster) as ns:
        fleet = KwokFleet(kwok_cluster, ns, Operator(kwok_cluster, ns, tmp_path / "operator.log"), tmp_path)
        try:
            yield fleet
        finally:
            fleet.close()
