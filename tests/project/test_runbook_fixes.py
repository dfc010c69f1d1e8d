"""Every command a "Fix" of docs/runbook.md gives runs, as written (placeholders filled in),
against a fleet on Kubernetes: a real kube-apiserver holding the fleet's shard map ConfigMap,
the RelayRebalance CRD and the CronJobs the chart and the operator create; a relay watching the
ConfigMap; real redis-servers. Each command's effect is checked, not only its exit status."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
import yaml
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.configmap import configmap_publisher, configmap_reader
from relay.fleet.contract import shardmap_configmap_name
from relay.fleet.migration.crash_points import CRASH_ENV, CRASH_EXIT
from relay.fleet.sharding import ShardMap, even_split, slot_of
from relay.storage import keys as K
from tests.support.fleet_harness import DEBIAN_REDIS, RelayProc, b64, spawn_relay, stop_relays, wait_ready
from tests.support.k8s_cluster import KubeCluster
from tests.support.operator_harness import install_crds
from tests.support.procs import RELAYFLEET

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "docs" / "runbook.md"
FLEET = "rb"
RELEASE = "relayfleet"
# the Fix commands this test runs and checks; a new one in the runbook fails the test until
# it is added here
KNOWN = {
    "redis-check-aof --fix <dir>/appendonlydir/appendonly.aof.manifest",
    "kubectl -n <spark ns> create job --from=cronjob/<release>-retention-<fleet> retention-now",
    "relayfleet plan --shard-map-configmap <ns>/relayfleet-<fleet>-shardmap --rebalance-yaml rebalance.yaml",
    "kubectl -n <ns> apply -f rebalance.yaml",
    "redis-cli -u <url> BGREWRITEAOF",
    "relayfleet migrate --shard-map-configmap <ns>/relayfleet-<fleet>-shardmap --slots <slot> --to <target>",
    "kubectl -n <ns> annotate relayrebalance <name> relayfleet.dev/rebalance=stop --overwrite",
    "kubectl -n <ns> create job --from=cronjob/relayfleet-<shard>-backup backup-now",
}


def fix_commands() -> list[str]:
    """The runnable commands of every **Fix:** paragraph, in order, each once."""
    found: list[str] = []
    for para in re.findall(r"\*\*Fix:\*\*(.*?)(?:\n\n|\Z)", RUNBOOK.read_text(), re.DOTALL):
        for span in re.findall(r"`([^`]+)`", para):
            cmd = " ".join(span.split())
            if (
                cmd.split()[0] in ("relayfleet", "kubectl", "redis-cli", "redis-check-aof")
                and cmd not in found
            ):
                found.append(cmd)
    return found


def test_the_runbook_fixes_are_the_ones_checked_here() -> None:
    assert set(fix_commands()) == KNOWN


def cronjob(name: str, namespace: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "schedule": "0 * * * *",
                "jobTemplate": {
                    "spec": {
                        "template": {
                            "spec": {
                                "restartPolicy": "Never",
                                "containers": [
                                    {"name": "job", "image": "ghcr.io/relayfleet/relayfleet:0.2.0"}
                                ],
                            }
                        }
                    }
                },
            },
        }
    )


class Fleet:
    def __init__(self, cluster: KubeCluster, namespace: str, shards: dict[str, LocalRedis], relay: RelayProc):
        self.cluster = cluster
        self.namespace = namespace
        self.shards = shards
        self.relay = relay

    def run(
        self, cmd: str, cwd: Path, env: dict[str, str] | None = None, answer: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        argv = cmd.split()
        full_env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), **(env or {})}
        if argv[0] == "relayfleet":
            argv = [*RELAYFLEET, *argv[1:]]
        elif argv[0] == "kubectl":
            argv = [self.cluster.tool("kubectl"), "--kubeconfig", str(self.cluster.kubeconfig), *argv[1:]]
        else:
            argv[0] = f"/usr/bin/{argv[0]}"
        return subprocess.run(
            argv, input=answer or "", capture_output=True, text=True, timeout=120, cwd=cwd, env=full_env
        )

    def shard_map(self) -> ShardMap:
        read = configmap_reader(
            self.namespace, shardmap_configmap_name(FLEET), kubeconfig=str(self.cluster.kubeconfig)
        )

        async def now() -> ShardMap:
            return await read()

        return asyncio.run(now())


@pytest.fixture
def fleet(kube_apiserver: KubeCluster, tmp_path: Path) -> Iterator[Fleet]:
    install_crds(kube_apiserver)
    namespace = f"runbook-{uuid.uuid4().hex[:6]}"
    kube_apiserver.kubectl("create", "namespace", namespace)
    # the Spark CronJobs live in the chart's Spark namespace, the backup CronJob beside its shard
    spark_namespace = f"{namespace}-{RELEASE}-spark"
    kube_apiserver.kubectl("create", "namespace", spark_namespace)
    kube_apiserver.kubectl("apply", "-f", "-", input=cronjob(f"{RELEASE}-retention-{FLEET}", spark_namespace))
    kube_apiserver.kubectl("apply", "-f", "-", input=cronjob("relayfleet-a-backup", namespace))
    shards = {n: LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / n)).start() for n in ("a", "b")}
    relay: RelayProc | None = None
    try:
        publish = configmap_publisher(
            namespace, shardmap_configmap_name(FLEET), kubeconfig=str(kube_apiserver.kubeconfig)
        )
        first = even_split(FLEET, {n: s.url for n, s in shards.items()})

        async def publish_first() -> None:
            await publish(first)

        asyncio.run(publish_first())
        relay = spawn_relay(
            ["--shard-map-configmap", f"{namespace}/{shardmap_configmap_name(FLEET)}"],
            tmp_path,
            {"KUBECONFIG": str(kube_apiserver.kubeconfig), "RELAY_FLEET": FLEET},
        )
        wait_ready(relay)
        yield Fleet(kube_apiserver, namespace, shards, relay)
    finally:
        if relay is not None:
            stop_relays([relay])
        for s in shards.values():
            s.stop()
        kube_apiserver.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        kube_apiserver.kubectl("delete", "namespace", spark_namespace, "--wait=false", check=False)


async def _enqueue(relay: RelayProc, recipients: list[bytes], body: bytes) -> None:
    async with aiohttp.ClientSession() as http:
        for r in recipients:
            async with http.post(f"{relay.url}/v1/queues/{b64(r)}/messages", data=body) as resp:
                assert resp.status == 201, await resp.text()


async def _read(relay: RelayProc, recipient: bytes) -> list[str]:
    url = f"{relay.url}/v1/queues/{b64(recipient)}/messages"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        doc = await resp.json()
    return [m["payload"] for m in doc["messages"]]


def test_every_fix_runs_as_written(fleet: Fleet, tmp_path: Path) -> None:
    start = fleet.shard_map()
    on_a = [r for r in (os.urandom(32) for _ in range(4000)) if start.shard_for(r) == "a"][:150]
    asyncio.run(_enqueue(fleet.relay, on_a, b"held on a"))  # a is the loaded shard
    stuck = on_a[0]
    slot = slot_of(stuck)
    aof = LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / "aof")).start()
    values = {
        "<ns>": fleet.namespace,
        "<spark ns>": f"{fleet.namespace}-{RELEASE}-spark",
        "<fleet>": FLEET,
        "<release>": RELEASE,
        "<shard>": "a",
        "<url>": fleet.shards["a"].url,
        "<dir>": aof.dir,
        "<slot>": str(slot),
        "<target>": "b",
        "<name>": "manual-rebalance",
    }

    def filled(cmd: str) -> str:
        for key, value in values.items():
            cmd = cmd.replace(key, value)
        assert "<" not in cmd, cmd
        return cmd

    ran: set[str] = set()

    def run(cmd: str, answer: str | None = None) -> subprocess.CompletedProcess[str]:
        ran.add(cmd)
        out = fleet.run(filled(cmd), tmp_path, answer=answer)
        assert out.returncode == 0, f"{filled(cmd)}\n{out.stdout}\n{out.stderr}"
        assert "Traceback" not in out.stderr
        return out

    # RelayfleetShardRedisDown: an AOF cut short by a crash, fixed on the volume, Redis starts again
    client = redis.Redis.from_url(aof.url)
    for i in range(50):
        client.set(f"k{i}", "v" * 100)
    client.close()
    aof.stop()
    incr = sorted((Path(aof.dir) / "appendonlydir").glob("*.incr.aof"))[-1]
    incr.write_bytes(incr.read_bytes()[:-7])
    fix = next(c for c in fix_commands() if c.startswith("redis-check-aof"))
    run(fix, answer="y\n")  # it asks before it cuts the file (the runbook says so)
    aof.start()
    client = redis.Redis.from_url(aof.url)
    assert client.get("k0") == b"v" * 100
    client.close()
    aof.stop()

    # RelayfleetShardPersistenceFailing: the AOF rewritten once the cause is gone
    out = run("redis-cli -u <url> BGREWRITEAOF")
    assert "rewriting started" in out.stdout or "scheduled" in out.stdout

    # RelayfleetSlotsStuckMigrating: a move killed after the copy leaves the slot migrating;
    # the runbook's migrate, against the ConfigMap the relays watch, finishes it
    migrate = next(c for c in fix_commands() if c.startswith("relayfleet migrate"))
    crashed = fleet.run(filled(migrate), tmp_path, env={CRASH_ENV: "copied"})
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    state = redis.Redis.from_url(fleet.shards["a"].url)
    assert state.get(K.slot_state(slot)) == b"migrating"
    state.close()
    out = run(migrate)
    assert "migrated 1 slot(s) to b" in out.stdout
    assert fleet.shard_map().shard_for_slot(slot) == "b"
    assert asyncio.run(_read(fleet.relay, stuck)) == [b64(b"held on a")]  # the relay follows

    # RelayfleetShardMemoryHigh: retention now, and a plan written as a RelayRebalance, applied
    run("kubectl -n <spark ns> create job --from=cronjob/<release>-retention-<fleet> retention-now")
    spark_ns = f"{fleet.namespace}-{RELEASE}-spark"
    assert fleet.cluster.kubectl("-n", spark_ns, "get", "job", "retention-now").returncode == 0
    plan = next(c for c in fix_commands() if c.startswith("relayfleet plan"))
    run(plan)
    manifest = yaml.safe_load((tmp_path / "rebalance.yaml").read_text())
    moves = manifest["spec"]["proposal"]["moves"]
    assert moves
    assert {(m["from"], m["to"]) for m in moves} == {("a", "b")}
    assert manifest["metadata"]["namespace"] == fleet.namespace
    run("kubectl -n <ns> apply -f rebalance.yaml")

    # RelayfleetRebalanceStuck: stop it
    run("kubectl -n <ns> annotate relayrebalance <name> relayfleet.dev/rebalance=stop --overwrite")
    got = fleet.cluster.kubectl(
        "-n", fleet.namespace, "get", "relayrebalance", "manual-rebalance", "-o", "yaml"
    ).stdout
    assert yaml.safe_load(got)["metadata"]["annotations"]["relayfleet.dev/rebalance"] == "stop"

    # RelayfleetShardBackupMissing: a backup by hand
    run("kubectl -n <ns> create job --from=cronjob/relayfleet-<shard>-backup backup-now")
    assert fleet.cluster.kubectl("-n", fleet.namespace, "get", "job", "backup-now").returncode == 0

    assert ran == KNOWN
