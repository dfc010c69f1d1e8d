"""RelayShard / RelayRebalance against a real API server (built from source, tests/k8s_cluster.py).

Bare kube-apiserver: the CRDs' schemas, defaults, CEL rules and scale subresource, and the
chart's server-side dry-run. kwok cluster (controllers + fake nodes): the operator, run as a
subprocess, reconciling shards whose Redis are real local redis-servers, so slot moves on
deletion and rebalancing move real data.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from relayfleet_operator import migration

from relay.fleet.sharding import loads_shard_map
from relay.localredis import LocalRedis, free_port
from relay.storage import keys as K
from relay.storage.store import QueueLimits, ShardStore
from tests.k8s_cluster import KubeCluster
from tests.test_crds import HELM

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parent.parent
DEBIAN_REDIS = "/usr/bin/redis-server"
T = TypeVar("T")


# --- helpers -------------------------------------------------------------------------------------


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 90.0, interval: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            result = check()
        except subprocess.CalledProcessError as exc:
            result, last = None, exc.stderr
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last}" if last else ""))
        time.sleep(interval)


def get(cluster: KubeCluster, ns: str, *what: str) -> dict[str, Any] | None:
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


@pytest.fixture
def apiserver_ns(kube_apiserver: KubeCluster) -> Iterator[str]:
    install_crds(kube_apiserver)
    ns = f"rf-{uuid.uuid4().hex[:8]}"
    kube_apiserver.kubectl("create", "namespace", ns)
    yield ns
    kube_apiserver.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def shard(name: str, fleet: str = "main", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"fleet": fleet, "redis": {"managed": {}}}
    body.update(spec)
    return {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayShard",
        "metadata": {"name": name},
        "spec": body,
    }


def rebalance(name: str, fleet: str = "main", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayRebalance",
        "metadata": {"name": name},
        "spec": {"fleet": fleet, **spec},
    }


# --- the CRDs on a bare API server ---------------------------------------------------------------


def test_valid_relayshard_is_accepted_with_defaults(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    # The API server may need a moment before it serves a freshly established type.
    wait_for(
        "RelayShard to be served", lambda: create(kube_apiserver, apiserver_ns, shard("a")).returncode == 0
    )
    got = get(kube_apiserver, apiserver_ns, "rshard", "a")
    assert got is not None
    spec = got["spec"]
    assert spec["replicas"] == 2
    assert spec["weight"] == 100
    assert spec["autoRebalance"] is False
    assert spec["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}
    assert spec["redis"]["managed"]["appendfsync"] == "everysec"
    assert spec["redis"]["managed"]["storage"] == {"size": "1Gi"}
    assert spec["retention"] == {"maxAge": "7d", "maxMessages": 10000}
    assert spec["limits"]["maxPayloadBytes"] == 5242880
    assert spec["limits"]["rateLimitMessages"] == 500
    table = kube_apiserver.kubectl("-n", apiserver_ns, "get", "rshard").stdout.split()
    assert table[:6] == ["NAME", "REPLICAS", "READY", "SLOTS", "PHASE", "AGE"]


INVALID = [
    (shard("x", redis={}), "exactly one of redis.managed or redis.external must be set"),
    (
        shard("x", redis={"managed": {}, "external": {"url": "redis://r:6379/0"}}),
        "exactly one of redis.managed or redis.external must be set",
    ),
    (
        shard("x", redis={"external": {}}),
        "exactly one of redis.external.url or redis.external.secretRef must be set",
    ),
    (shard("x", redis={"external": {"url": "http://r/"}}), "redis.external.url must start with redis://"),
    (shard("x", replicas=-1), "spec.replicas"),
    (shard("x", weight=0), "spec.weight"),
    (shard("x", retention={"maxAge": "1w"}), "spec.retention.maxAge"),
    (shard("x", redis={"managed": {"appendfsync": "no"}}), "spec.redis.managed.appendfsync"),
    (shard("x" * 33), "RelayShard name must be at most 32 characters"),
    (shard("x", fleet="Bad_Fleet"), "spec.fleet"),
    (rebalance("r", mode="drain"), "mode drain needs spec.drainShards"),
    (
        rebalance("r", proposal={"moves": [{"slots": "0-10", "from": "a", "to": "a"}]}),
        "a move's from and to must differ",
    ),
    (
        rebalance("r", proposal={"moves": [{"slots": "0-x", "from": "a", "to": "b"}]}),
        "spec.proposal.moves[0].slots",
    ),
]


@pytest.mark.parametrize(("doc", "message"), INVALID, ids=[m for _, m in INVALID])
def test_invalid_objects_are_rejected_with_their_message(
    kube_apiserver: KubeCluster, apiserver_ns: str, doc: dict[str, Any], message: str
) -> None:
    def attempt() -> subprocess.CompletedProcess[str] | None:
        p = create(kube_apiserver, apiserver_ns, doc)
        return None if "NotFound" in p.stderr else p  # the type is not served yet

    proc = wait_for("the type to be served", attempt)
    assert proc.returncode != 0
    assert "Invalid" in proc.stderr
    assert message in proc.stderr


def test_immutable_fields_are_enforced_on_update(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    wait_for(
        "RelayShard to be served", lambda: create(kube_apiserver, apiserver_ns, shard("a")).returncode == 0
    )

    def patch(p: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return kube_apiserver.kubectl(
            "-n", apiserver_ns, "patch", "rshard", "a", "--type=merge", "-p", json.dumps(p), check=False
        )

    proc = patch({"spec": {"fleet": "other"}})
    assert proc.returncode != 0
    assert "fleet is immutable" in proc.stderr
    proc = patch({"spec": {"redis": {"managed": None, "external": {"url": "redis://r:6379/0"}}}})
    assert proc.returncode != 0
    assert "cannot be switched after creation" in proc.stderr
    proc = patch({"spec": {"redis": {"managed": {"storage": {"size": "5Gi"}}}}})
    assert proc.returncode != 0
    assert "redis.managed.storage is immutable" in proc.stderr
    assert patch({"spec": {"weight": 300, "replicas": 4}}).returncode == 0


def test_scale_subresource(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    wait_for(
        "RelayShard to be served", lambda: create(kube_apiserver, apiserver_ns, shard("a")).returncode == 0
    )
    kube_apiserver.kubectl("-n", apiserver_ns, "scale", "rshard/a", "--replicas=3")
    got = get(kube_apiserver, apiserver_ns, "rshard", "a")
    assert got is not None
    assert got["spec"]["replicas"] == 3
    # The /scale endpoint reads status.replicas and the selector the operator publishes.
    status = {
        "status": {"replicas": 3, "selector": "relayfleet.dev/shard=a,app.kubernetes.io/component=relay"}
    }
    kube_apiserver.kubectl(
        "-n",
        apiserver_ns,
        "patch",
        "rshard",
        "a",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    raw = kube_apiserver.kubectl(
        "get", "--raw", f"/apis/relayfleet.dev/v1alpha1/namespaces/{apiserver_ns}/relayshards/a/scale"
    ).stdout
    scale = json.loads(raw)
    assert scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == status["status"]["selector"]
    proc = kube_apiserver.kubectl("-n", apiserver_ns, "scale", "rshard/a", "--replicas=-2", check=False)
    assert proc.returncode != 0


@pytest.mark.skipif(HELM is None, reason="helm not built yet: run hack/control-plane.sh")
def test_chart_passes_server_side_dry_run(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    assert HELM is not None
    rendered = subprocess.run(
        [HELM, "template", "relayfleet", str(ROOT / "charts" / "relayfleet"), "--namespace", apiserver_ns],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert {d["kind"] for d in docs} >= {"Deployment", "CronJob", "Role", "ServiceAccount"}
    proc = kube_apiserver.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(docs)
    # The CRDs as the chart ships them go through the same check.
    crds = kube_apiserver.kubectl(
        "apply", "--dry-run=server", "-f", str(ROOT / "charts" / "relayfleet" / "crds"), check=False
    )
    assert crds.returncode == 0, crds.stderr


# --- the operator on a kwok cluster --------------------------------------------------------------


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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def kwok_ns(kwok_cluster: KubeCluster) -> Iterator[str]:
    install_crds(kwok_cluster)
    ns = f"rf-{uuid.uuid4().hex[:8]}"
    kwok_cluster.kubectl("create", "namespace", ns)
    yield ns
    kwok_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture
def operator(kwok_cluster: KubeCluster, kwok_ns: str, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(kwok_cluster, kwok_ns, tmp_path / "operator.log")
    try:
        yield op
    finally:
        op.stop()
        if op.log.exists():
            print(f"--- operator log (tail) ---\n{op.tail(200)}")  # shown when the test fails
        # Shards still holding the finalizer would keep the namespace: let them go.
        for name in kwok_cluster.kubectl(
            "-n", kwok_ns, "get", "rshard", "-o", "name", check=False
        ).stdout.split():
            kwok_cluster.kubectl(
                "-n",
                kwok_ns,
                "patch",
                name,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )


@pytest.fixture
def redis_servers() -> Iterator[Callable[[], LocalRedis]]:
    started: list[LocalRedis] = []
    binary = DEBIAN_REDIS if os.path.exists(DEBIAN_REDIS) else ""

    def start() -> LocalRedis:
        server = LocalRedis(binary=binary).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}


def shard_map(cluster: KubeCluster, ns: str, fleet: str = "main") -> Any:
    cm = get(cluster, ns, "configmap", f"relayfleet-{fleet}-shardmap")
    return None if cm is None else loads_shard_map(cm["data"]["shardmap.json"])


def external(name: str, server: LocalRedis, **spec: Any) -> dict[str, Any]:
    return shard(name, redis={"external": {"url": server.url}}, replicas=1, **spec)


def recipients_on(slots: range, n: int, seed: int = 3) -> list[bytes]:
    rng = random.Random(seed)
    out: list[bytes] = []
    while len(out) < n:
        r = rng.randbytes(32)
        if K.queue_keys(r, b"").slot in slots:
            out.append(r)
    return out


async def _enqueue(url: str, recipients: Sequence[bytes], per_queue: int) -> None:
    store = ShardStore("seed", url, QueueLimits(rate_count=10**9))
    await store.start()
    try:
        for r in recipients:
            for i in range(per_queue):
                out = await store.enqueue(
                    K.queue_keys(r, b""), f"{r.hex()[:8]}-{i}".encode(), 1_800_000_000_000 + i
                )
                assert out.kind == "stored"
    finally:
        await store.close()


async def _read(url: str, recipient: bytes) -> list[tuple[int, bytes]]:
    store = ShardStore("check", url, QueueLimits())
    await store.start()
    try:
        res = await store.read(K.queue_keys(recipient, b""), None, 1000)
        return [(m.seq, m.payload) for m in res.messages]
    finally:
        await store.close()


def history_intact(
    cluster: KubeCluster, ns: str, servers: dict[str, LocalRedis], expected: dict[bytes, Any]
) -> None:
    """Every seeded queue, read from the shard the published map names, holds exactly its messages."""
    m = shard_map(cluster, ns)
    for r, want in expected.items():
        owner = m.shard_for(r)
        assert asyncio.run(_read(servers[owner].url, r)) == want, f"queue {r.hex()[:8]} on {owner}"


def test_operator_creates_children_and_reports_status(
    kwok_cluster: KubeCluster, kwok_ns: str, operator: Operator, redis_servers: Callable[[], LocalRedis]
) -> None:
    ns = kwok_ns
    server = redis_servers()
    operator.start()
    apply(kwok_cluster, ns, external("a", server), shard("b", replicas=1))

    def a_ready() -> dict[str, Any] | None:
        got = get(kwok_cluster, ns, "rshard", "a")
        return got if got and (got.get("status") or {}).get("phase") == "Ready" else None

    try:
        a = wait_for("shard a to become Ready", a_ready, timeout=120)
    except BaseException:
        print(operator.tail())
        raise
    status = a["status"]
    assert status["slotCount"] == 16384
    assert status["readyReplicas"] == 1
    assert status["redisEndpoint"] == f"127.0.0.1:{server.port}"
    assert status["observedGeneration"] == a["metadata"]["generation"]
    conds = conditions(a)
    assert {t: c["status"] for t, c in conds.items()} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "Migrating": "False",
    }
    assert all(
        c["observedGeneration"] == a["metadata"]["generation"] and c["lastTransitionTime"]
        for c in conds.values()
    )
    assert "relayfleet.dev/drain" in a["metadata"]["finalizers"]

    # Children of the external shard: relay objects only.
    for kind, name in [
        ("deployment", "relayfleet-a-relay"),
        ("service", "relayfleet-a-relay"),
        ("poddisruptionbudget", "relayfleet-a-relay"),
        ("service", "relayfleet-main"),
        ("serviceaccount", "relayfleet-main-relay"),
        ("role", "relayfleet-main-relay"),
        ("rolebinding", "relayfleet-main-relay"),
        ("secret", "relayfleet-main-credentials"),
    ]:
        obj = wait_for(f"{kind}/{name}", lambda k=kind, n=name: get(kwok_cluster, ns, k, n))  # type: ignore[misc]
        assert obj["metadata"]["labels"]["relayfleet.dev/fleet"] == "main"
    dep = get(kwok_cluster, ns, "deployment", "relayfleet-a-relay")
    assert dep is not None
    assert dep["metadata"]["ownerReferences"][0]["uid"] == a["metadata"]["uid"]
    assert get(kwok_cluster, ns, "statefulset", "relayfleet-a-redis") is None

    # The managed shard gets its Redis objects, joins with no slots, and waits for its PVC.
    for kind, name in [
        ("statefulset", "relayfleet-b-redis"),
        ("service", "relayfleet-b-redis"),
        ("configmap", "relayfleet-b-redis-config"),
        ("secret", "relayfleet-b-redis"),
        ("deployment", "relayfleet-b-relay"),
    ]:
        wait_for(f"{kind}/{name}", lambda k=kind, n=name: get(kwok_cluster, ns, k, n))  # type: ignore[misc]
    conf = get(kwok_cluster, ns, "configmap", "relayfleet-b-redis-config")
    assert conf is not None
    assert "appendonly yes" in conf["data"]["redis.conf"]
    assert "maxmemory-policy noeviction" in conf["data"]["redis.conf"]
    m = wait_for(
        "shard b in the map", lambda: (sm := shard_map(kwok_cluster, ns)) and "b" in sm.shards and sm
    )
    assert m.slot_counts() == {"a": 16384, "b": 0}
    assert m.shards["b"] == f"redis://relayfleet-b-redis.{ns}.svc:6379/0"  # no password in the map
    b = get(kwok_cluster, ns, "rshard", "b")
    assert b is not None
    assert b["status"]["slotCount"] == 0
    assert b["status"]["phase"] in ("Provisioning", "Pending")
    assert conditions(b)["Progressing"]["status"] == "True"

    # Scaling through the scale subresource reaches the Deployment.
    kwok_cluster.kubectl("-n", ns, "scale", "rshard/a", "--replicas=3")
    wait_for(
        "the relay Deployment to scale",
        lambda: (
            (d := get(kwok_cluster, ns, "deployment", "relayfleet-a-relay")) and d["spec"]["replicas"] == 3
        ),
    )
    wait_for(
        "status.readyReplicas to follow",
        lambda: (s := get(kwok_cluster, ns, "rshard", "a")) and s["status"].get("readyReplicas") == 3,
        timeout=120,
    )

    # Drift: a hand edit of an owned field is reverted, a deleted child comes back.
    kwok_cluster.kubectl(
        "-n", ns, "patch", "deployment", "relayfleet-a-relay", "--type=merge", "-p", '{"spec":{"replicas":7}}'
    )
    kwok_cluster.kubectl("-n", ns, "delete", "service", "relayfleet-main")
    wait_for(
        "the Deployment's replicas to be restored",
        lambda: (
            (d := get(kwok_cluster, ns, "deployment", "relayfleet-a-relay")) and d["spec"]["replicas"] == 3
        ),
    )
    wait_for("the fleet Service to come back", lambda: get(kwok_cluster, ns, "service", "relayfleet-main"))
    events = kwok_cluster.kubectl("-n", ns, "get", "events", "-o", "json").stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"JoinedFleet", "Reconciled"} <= reasons

    # The operator's own endpoints: kopf liveness and Prometheus metrics.
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.health_port}/healthz", timeout=5) as resp:
        assert resp.status == 200
        assert json.loads(resp.read())["kube"] == "ok"
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'relayfleet_operator_reconciles_total{kind="RelayShard",result="ok"}' in text
    assert f'relayfleet_operator_shard_map_epoch{{fleet="main",namespace="{ns}"}}' in text


def test_auto_rebalance_gives_a_new_shard_its_share(
    kwok_cluster: KubeCluster, kwok_ns: str, operator: Operator, redis_servers: Callable[[], LocalRedis]
) -> None:
    ns = kwok_ns
    servers = {"a": redis_servers(), "b": redis_servers()}
    recipients = recipients_on(range(16384), 20)
    asyncio.run(_enqueue(servers["a"].url, recipients, 2))
    expected = {r: asyncio.run(_read(servers["a"].url, r)) for r in recipients}
    operator.start()
    apply(kwok_cluster, ns, external("a", servers["a"], weight=300))
    wait_for("a in the map", lambda: (m := shard_map(kwok_cluster, ns)) and "a" in m.shards)
    apply(kwok_cluster, ns, external("b", servers["b"], autoRebalance=True))
    wait_for(
        "the join rebalance", lambda: rebalance_phase(kwok_cluster, ns, "b-join") == "Ready", timeout=120
    )
    assert shard_map(kwok_cluster, ns).slot_counts() == {"a": 12288, "b": 4096}
    history_intact(kwok_cluster, ns, servers, expected)
    joined = get(kwok_cluster, ns, "rrebalance", "b-join")
    assert joined is not None
    assert joined["spec"]["autoApprove"] is True
    assert joined["metadata"]["ownerReferences"][0]["name"] == "b"


def test_deleting_a_shard_moves_its_slots_first(
    kwok_cluster: KubeCluster, kwok_ns: str, operator: Operator, redis_servers: Callable[[], LocalRedis]
) -> None:
    ns = kwok_ns
    servers = {"a": redis_servers(), "b": redis_servers(), "c": redis_servers()}
    recipients = recipients_on(range(16384), 40)
    asyncio.run(_enqueue(servers["a"].url, recipients, 5))
    expected = {r: asyncio.run(_read(servers["a"].url, r)) for r in recipients}
    operator.start()
    apply(kwok_cluster, ns, external("a", servers["a"]))
    wait_for("a in the map", lambda: (m := shard_map(kwok_cluster, ns)) and "a" in m.shards)
    apply(kwok_cluster, ns, external("b", servers["b"], weight=100), external("c", servers["c"], weight=300))
    wait_for("b and c in the map", lambda: (m := shard_map(kwok_cluster, ns)) and {"b", "c"} <= set(m.shards))

    kwok_cluster.kubectl("-n", ns, "delete", "rshard", "a", "--wait=false")
    try:
        wait_for("shard a to be gone", lambda: get(kwok_cluster, ns, "rshard", "a") is None, timeout=180)
    except BaseException:
        print(operator.tail())
        raise
    m = shard_map(kwok_cluster, ns)
    assert set(m.shards) == {"b", "c"}
    counts = m.slot_counts()
    assert counts == {"b": 4096, "c": 12288}  # by weight 1:3
    history_intact(kwok_cluster, ns, servers, expected)
    assert not asyncio.run(migration.holds_data(servers["a"].url, range(16384)))  # source cleaned

    # The last shards: c can leave (b takes its slots); b, alone with data, cannot.
    kwok_cluster.kubectl("-n", ns, "delete", "rshard", "c", "--wait=false")
    wait_for("shard c to be gone", lambda: get(kwok_cluster, ns, "rshard", "c") is None, timeout=180)
    assert shard_map(kwok_cluster, ns).slot_counts() == {"b": 16384}
    history_intact(kwok_cluster, ns, servers, expected)
    kwok_cluster.kubectl("-n", ns, "delete", "rshard", "b", "--wait=false")

    def blocked() -> dict[str, Any] | None:
        got = get(kwok_cluster, ns, "rshard", "b")
        return got if got and got["status"].get("phase") == "DeletionBlocked" else None

    b = wait_for("shard b to refuse deletion", blocked, timeout=60)
    degraded = conditions(b)["Degraded"]
    assert degraded["status"] == "True"
    assert degraded["reason"] == "DeletionBlocked"
    assert "last shard of fleet main and holds data" in degraded["message"]
    time.sleep(3)
    assert get(kwok_cluster, ns, "rshard", "b") is not None
    kwok_cluster.kubectl("-n", ns, "annotate", "rshard", "b", "relayfleet.dev/force-delete=true")
    wait_for("shard b to be gone after force-delete", lambda: get(kwok_cluster, ns, "rshard", "b") is None)
    wait_for("the shard map to be gone", lambda: shard_map(kwok_cluster, ns) is None)


def rebalance_phase(cluster: KubeCluster, ns: str, name: str) -> str:
    got = get(cluster, ns, "rrebalance", name)
    return str(((got or {}).get("status") or {}).get("phase") or "")


def test_rebalance_waits_for_approval_then_moves_data(
    kwok_cluster: KubeCluster, kwok_ns: str, operator: Operator, redis_servers: Callable[[], LocalRedis]
) -> None:
    ns = kwok_ns
    servers = {"a": redis_servers(), "b": redis_servers()}
    recipients = recipients_on(range(16384), 30)
    asyncio.run(_enqueue(servers["a"].url, recipients, 4))
    expected = {r: asyncio.run(_read(servers["a"].url, r)) for r in recipients}
    operator.start()
    apply(kwok_cluster, ns, external("a", servers["a"]))
    wait_for("a in the map", lambda: (m := shard_map(kwok_cluster, ns)) and "a" in m.shards)
    apply(kwok_cluster, ns, external("b", servers["b"]))
    wait_for("b in the map", lambda: (m := shard_map(kwok_cluster, ns)) and "b" in m.shards)

    apply(kwok_cluster, ns, rebalance("even", concurrency=2))
    wait_for("a proposal", lambda: rebalance_phase(kwok_cluster, ns, "even") == "ProposalReady")
    proposal = get(kwok_cluster, ns, "rrebalance", "even")
    assert proposal is not None
    moves = proposal["status"]["moves"]
    assert [(m["from"], m["to"], m["state"]) for m in moves] == [("a", "b", "Pending")]
    assert proposal["status"]["progress"]["slotsTotal"] == 8192
    assert proposal["status"]["progress"]["bytesTotal"] > 0
    time.sleep(3)  # not approved: nothing moves
    assert rebalance_phase(kwok_cluster, ns, "even") == "ProposalReady"
    assert shard_map(kwok_cluster, ns).slot_counts() == {"a": 16384, "b": 0}

    # stop, then refresh: a new proposal, still waiting for approval.
    kwok_cluster.kubectl("-n", ns, "annotate", "rrebalance", "even", "relayfleet.dev/rebalance=stop")
    wait_for("Stopped", lambda: rebalance_phase(kwok_cluster, ns, "even") == "Stopped")
    kwok_cluster.kubectl(
        "-n", ns, "annotate", "--overwrite", "rrebalance", "even", "relayfleet.dev/rebalance=refresh"
    )
    wait_for("a refreshed proposal", lambda: rebalance_phase(kwok_cluster, ns, "even") == "ProposalReady")

    kwok_cluster.kubectl("-n", ns, "annotate", "rrebalance", "even", "relayfleet.dev/rebalance=approve")
    try:
        wait_for(
            "the rebalance to finish",
            lambda: rebalance_phase(kwok_cluster, ns, "even") == "Ready",
            timeout=120,
        )
    except BaseException:
        print(operator.tail())
        raise
    done = get(kwok_cluster, ns, "rrebalance", "even")
    assert done is not None
    assert done["status"]["progress"]["percent"] == "100%"
    assert "relayfleet.dev/rebalance" not in (done["metadata"].get("annotations") or {})
    assert shard_map(kwok_cluster, ns).slot_counts() == {"a": 8192, "b": 8192}
    history_intact(kwok_cluster, ns, servers, expected)
    wait_for(
        "shard b to report its slots",
        lambda: (b := get(kwok_cluster, ns, "rshard", "b")) and b["status"].get("slotCount") == 8192,
    )


def test_operator_killed_mid_rebalance_resumes(
    kwok_cluster: KubeCluster, kwok_ns: str, operator: Operator, redis_servers: Callable[[], LocalRedis]
) -> None:
    ns = kwok_ns
    servers = {"a": redis_servers(), "b": redis_servers(), "c": redis_servers()}
    recipients = recipients_on(range(16384), 40)
    asyncio.run(_enqueue(servers["a"].url, recipients, 3))
    expected = {r: asyncio.run(_read(servers["a"].url, r)) for r in recipients}
    operator.start()
    apply(kwok_cluster, ns, external("a", servers["a"]))
    wait_for("a in the map", lambda: (m := shard_map(kwok_cluster, ns)) and "a" in m.shards)
    apply(kwok_cluster, ns, external("b", servers["b"]), external("c", servers["c"]))
    wait_for("b, c in the map", lambda: (m := shard_map(kwok_cluster, ns)) and {"b", "c"} <= set(m.shards))
    operator.stop()

    # The migration library's own crash hook kills the operator in the middle of a copy.
    operator.start(RELAYFLEET_MIGRATION_CRASH_AT="mid-copy")
    apply(kwok_cluster, ns, rebalance("spread", autoApprove=True))
    assert operator.wait_exit(120) == 86, operator.tail()
    assert rebalance_phase(kwok_cluster, ns, "spread") == "Rebalancing"
    states = [m["state"] for m in get(kwok_cluster, ns, "rrebalance", "spread")["status"]["moves"]]  # type: ignore[index]
    assert "Migrating" in states

    operator.start()
    try:
        wait_for(
            "the resumed rebalance",
            lambda: rebalance_phase(kwok_cluster, ns, "spread") == "Ready",
            timeout=150,
        )
    except BaseException:
        print(operator.tail())
        raise
    counts = shard_map(kwok_cluster, ns).slot_counts()
    assert sorted(counts.values()) == [5461, 5461, 5462]
    history_intact(kwok_cluster, ns, servers, expected)


# --- deletion under live traffic, relays following the real ConfigMap ---------------------------


def start_relay(cluster: KubeCluster, ns: str, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relay",
                "--shard-map-configmap",
                f"{ns}/relayfleet-main-shardmap",
                "--port",
                str(port),
                "--auth",
                "none",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "RELAY_LOG_LEVEL": "WARNING"},
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    wait_for(f"relay on {port} to be ready", ready, timeout=30, interval=0.2)
    return proc, url


async def test_deleting_a_shard_under_traffic_keeps_the_history(
    kwok_cluster: KubeCluster,
    kwok_ns: str,
    operator: Operator,
    redis_servers: Callable[[], LocalRedis],
    tmp_path: Path,
) -> None:
    """Relay processes read the map from the ConfigMap the operator writes; producers,
    read+ack consumers, drainers and long-polls run while deleting shard a makes the
    operator move all 16384 slots to b and c. The history checker then holds every
    guarantee: nothing acknowledged lost, nothing delivered twice or after its ack,
    per-queue order kept, no 5xx but 503 + Retry-After."""
    from tests.test_migration_harness import Workload, make_queues

    ns = kwok_ns
    servers = {"a": redis_servers(), "b": redis_servers(), "c": redis_servers()}
    operator.start()
    apply(kwok_cluster, ns, external("a", servers["a"]))
    await asyncio.to_thread(
        wait_for, "a in the map", lambda: (m := shard_map(kwok_cluster, ns)) and "a" in m.shards
    )
    apply(kwok_cluster, ns, external("b", servers["b"]), external("c", servers["c"]))
    await asyncio.to_thread(
        wait_for,
        "b, c in the map",
        lambda: (m := shard_map(kwok_cluster, ns)) and {"b", "c"} <= set(m.shards),
    )
    relays = [
        await asyncio.to_thread(start_relay, kwok_cluster, ns, tmp_path / f"relay-{i}.log") for i in range(2)
    ]
    try:
        work = Workload([url for _, url in relays], make_queues(16, seed=21), producers=6, seed=21)
        await work.start()
        await asyncio.sleep(2)
        kwok_cluster.kubectl("-n", ns, "delete", "rshard", "a", "--wait=false")
        await asyncio.to_thread(
            wait_for, "shard a to be gone", lambda: get(kwok_cluster, ns, "rshard", "a") is None, 240
        )
        await asyncio.sleep(2)  # traffic on the new owners
        await work.stop()
        verdict = work.history.check()
        print(verdict.render())
        logs = "\n".join((tmp_path / f"relay-{i}.log").read_text(errors="replace")[-3000:] for i in range(2))
        assert verdict.ok, f"{verdict.render()}\n{logs}"
        assert verdict.counts["messages_acknowledged"] > 50
        assert shard_map(kwok_cluster, ns).slot_counts() == {"b": 8192, "c": 8192}
        assert not await migration.holds_data(servers["a"].url, range(16384))
    finally:
        for proc, _ in relays:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in relays:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
