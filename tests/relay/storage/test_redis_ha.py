"""The operator's replicated-Redis start-up scripts and its replication probe, on real
redis-server and redis-sentinel processes on loopback.

The scripts are the exact text the operator puts in the shard's ConfigMap; only their
environment (addresses, ports, directories) differs from a pod's. The probe is the code
that fills status.redis on every reconcile.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from relayfleet_operator import builders, replication
from relayfleet_operator.redis_scripts import PRE_STOP_REDIS, START_REDIS, START_SENTINEL
from relayfleet_operator.spec import parse_shard
from relayfleet_operator.status import Observed, shard_status
from relayfleet_testing.localredis import free_port

from relay.fleet.sharding import SentinelTarget
from tests.support.procs import stop_process

DEBIAN = Path("/usr/bin")
PASSWORD = "pw-Xy_9"
SERVICE = "shard-a"
T = TypeVar("T")

pytestmark = pytest.mark.skipif(
    not (DEBIAN / "redis-server").exists() or not (DEBIAN / "redis-cli").exists(),
    reason="Debian redis-server / redis-cli not installed",
)


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 30.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@dataclass
class Node:
    name: str
    port: int
    script: str
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(["sh", "-c", self.script], env=self.env, stdout=out, stderr=out)

    def kill(self) -> None:
        # sh exec()s redis-server, so this is the server's own pid: a real SIGKILL.
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        stop_process(self.proc, 10, kill_wait=10)
        self.proc = None


@dataclass
class LocalShard:
    """Three Redis nodes and three Sentinels started exactly as the pods start them."""

    root: Path
    nodes: list[Node] = field(default_factory=list)
    sentinels: list[Node] = field(default_factory=list)

    @property
    def target(self) -> SentinelTarget:
        return SentinelTarget(tuple(("127.0.0.1", s.port) for s in self.sentinels), SERVICE, PASSWORD)

    def url(self) -> str:
        return self.target.url()

    def client(self, node: Node) -> redis.Redis:
        return redis.Redis(port=node.port, password=PASSWORD, socket_timeout=2, decode_responses=True)

    def role(self, node: Node) -> str | None:
        try:
            return str(self.client(node).role()[0])
        except (redis.RedisError, OSError):
            return None

    def node_at(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def probe(self) -> dict[str, Any]:
        return asyncio.run(replication.probe(self.url(), "2026-01-01T00:00:00Z"))


@pytest.fixture
def local_shard(tmp_path: Path) -> Iterator[LocalShard]:
    ports = [free_port() for _ in range(3)]
    sports = [free_port() for _ in range(3)]
    (tmp_path / "auth.conf").write_text(builders.redis_auth_conf(PASSWORD))
    shard = LocalShard(tmp_path)
    common = {
        "PATH": f"{DEBIAN}:/bin",
        "ANNOUNCE": "127.0.0.1",
        "PRIMARY0": "127.0.0.1",
        "PRIMARY0_PORT": str(ports[0]),
        "SENTINELS": " ".join(f"127.0.0.1:{p}" for p in sports),
        "MASTER_NAME": SERVICE,
        "REDISCLI_AUTH": PASSWORD,
        "MIN_REPLICAS": "1",
    }
    for i, port in enumerate(ports):
        data = tmp_path / f"redis{i}"
        data.mkdir()
        base = data / "base.conf"
        base.write_text(builders.redis_conf(data_dir=str(data), auth_include=str(tmp_path / "auth.conf")))
        env = {**common, "REDIS_PORT": str(port), "CONF_DIR": str(data), "BASE_CONF": str(base)}
        shard.nodes.append(Node(f"redis{i}", port, START_REDIS, env, data / "log"))
    for i, port in enumerate(sports):
        conf_dir = tmp_path / f"sentinel{i}"
        conf_dir.mkdir()
        env = {
            **common,
            "SENTINEL_PORT": str(port),
            "REDIS_PORT": str(ports[0]),
            "CONF_DIR": str(conf_dir),
            "DOWN_AFTER_MS": "1000",
            "FAILOVER_TIMEOUT_MS": "4000",
            "MYID_SEED": f"test/sentinel-{i}",
        }
        shard.sentinels.append(Node(f"sentinel{i}", port, START_SENTINEL, env, conf_dir / "log"))
    try:
        for node in shard.nodes:
            node.start()
            wait_for(f"{node.name} up", lambda n=node: shard.role(n))  # type: ignore[misc]
        for sentinel in shard.sentinels:
            sentinel.start()
        yield shard
    finally:
        for node in [*shard.sentinels, *shard.nodes]:
            node.stop()


def _online(status: dict[str, Any]) -> list[str]:
    return sorted(r["address"] for r in status.get("replicas") or () if r.get("state") == "online")


def test_scripts_form_a_replicated_shard_and_the_probe_reports_primary_and_lag(
    local_shard: LocalShard,
) -> None:
    shard = local_shard
    n0, n1, n2 = shard.nodes
    assert shard.role(n0) == "master"  # no Sentinel knew a primary: pod 0 leads
    assert shard.role(n1) == shard.role(n2) == "slave"

    def settled() -> dict[str, Any] | None:
        s = shard.probe()
        return s if s.get("sentinelsReachable") == 3 and len(_online(s)) == 2 else None

    status = wait_for("3 Sentinels and 2 online replicas", settled)
    assert status["primary"] == f"127.0.0.1:{n0.port}"
    assert _online(status) == sorted(f"127.0.0.1:{n.port}" for n in (n1, n2))
    for r in status["replicas"]:
        assert r["lagBytes"] >= 0
        assert r["offset"] <= status["primaryOffset"]
    # Writes move the primary's offset; the replicas' offsets follow.
    primary = shard.client(n0)
    primary.set("k", "x" * 10_000)
    primary.wait(2, 2000)
    # MIN_REPLICAS=1: start-redis.sh set min-replicas-to-write, so a primary cut off from
    # its replicas would refuse writes
    assert primary.config_get("min-replicas-to-write")["min-replicas-to-write"] == "1"
    after = shard.probe()
    assert after["primaryOffset"] >= status["primaryOffset"] + 10_000
    assert all(r["offset"] >= status["primaryOffset"] + 10_000 for r in after["replicas"])


def test_after_a_sigkill_the_sentinels_promote_a_replica_and_the_old_primary_rejoins_as_replica(
    local_shard: LocalShard,
) -> None:
    shard = local_shard
    n0 = shard.nodes[0]
    wait_for("Sentinels see both replicas", lambda: True if len(_online(shard.probe())) == 2 else None)
    shard.client(n0).set("before", "1")
    shard.client(n0).wait(2, 2000)
    killed = time.monotonic()
    n0.kill()

    def promoted() -> dict[str, Any] | None:
        s = shard.probe()
        settled = s.get("primaryOffset") is not None
        return s if settled and s.get("primary") not in (None, f"127.0.0.1:{n0.port}") else None

    status = wait_for("a replica promoted", promoted, timeout=30)
    failover_s = time.monotonic() - killed
    new = shard.node_at(int(status["primary"].rsplit(":", 1)[1]))
    assert shard.role(new) == "master"
    assert shard.client(new).get("before") == "1"
    print(f"failover after SIGKILL of the primary: {failover_s:.1f} s (down-after 1 s)")

    # The old primary comes back through the same script: it asks the Sentinels and
    # starts as a replica of the new primary instead of a second primary.
    n0.start()
    wait_for("old primary rejoined", lambda: True if shard.role(n0) == "slave" else None)
    assert f"replicaof 127.0.0.1 {new.port}" in (Path(n0.env["CONF_DIR"]) / "redis.conf").read_text()

    def rejoined() -> dict[str, Any] | None:
        s = shard.probe()
        return s if len(_online(s)) == 2 else None

    final = wait_for("2 replicas again", rejoined)
    assert f"127.0.0.1:{n0.port}" in _online(final)
    assert shard.client(n0).get("before") == "1"


def test_probe_of_an_unreachable_shard_says_so_instead_of_raising(tmp_path: Path) -> None:
    dead = SentinelTarget((("127.0.0.1", free_port()),), SERVICE, PASSWORD)
    got = asyncio.run(replication.probe(dead.url(), "2026-01-01T00:00:00Z"))
    assert {k: v for k, v in got.items() if v is not None} == {
        "observedAt": "2026-01-01T00:00:00Z",
        "sentinelsReachable": 0,
        "message": "no Sentinel answers",
    }
    plain = asyncio.run(replication.probe(f"redis://127.0.0.1:{free_port()}/0", "t"))
    assert plain["message"].startswith("cannot read replication state")


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies the operator's status writes."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def test_a_recovered_shard_clears_the_old_message_under_a_merge_patch(tmp_path: Path) -> None:
    """status.redis is written with a merge patch: a field the new answer lacks would stay, so
    "no Sentinel answers" would sit next to sentinelsReachable: 3 (every field is named, null
    when unknown)."""
    dead = SentinelTarget((("127.0.0.1", free_port()),), SERVICE, PASSWORD)
    outage = asyncio.run(replication.probe(dead.url(), "t0"))
    healthy = replication.replication_status(
        "10.0.0.1:6379", {"role": "master", "master_repl_offset": "5"}, 3, "t1"
    )
    stored = _merge_patch(_merge_patch({}, {"status": {"redis": outage}}), {"status": {"redis": healthy}})
    assert stored["status"]["redis"] == {
        "primary": "10.0.0.1:6379",
        "observedAt": "t1",
        "sentinelsReachable": 3,
        "primaryOffset": 5,
        "replicas": [],
    }
    again = _merge_patch(stored, {"status": {"redis": outage}})["status"]["redis"]
    assert again == {"observedAt": "t0", "sentinelsReachable": 0, "message": "no Sentinel answers"}


def test_replication_status_from_info_text_and_degraded_conditions() -> None:
    # INFO replication as redis-py's client.info() parses it (slaveN values become dicts)
    info = {
        "role": "master",
        "connected_slaves": 2,
        "slave0": {"ip": "10.0.0.2", "port": 6379, "state": "online", "offset": 900, "lag": 0},
        "slave1": {"ip": "10.0.0.3", "port": 6379, "state": "wait_bgsave", "offset": 0, "lag": 3},
        "master_repl_offset": 1000,
    }
    got = replication.replication_status("10.0.0.1:6379", info, 3, "now")
    assert got == {
        "message": None,
        "primary": "10.0.0.1:6379",
        "observedAt": "now",
        "sentinelsReachable": 3,
        "primaryOffset": 1000,
        "replicas": [
            {"address": "10.0.0.2:6379", "state": "online", "offset": 900, "lagBytes": 100, "lagSeconds": 0},
            {
                "address": "10.0.0.3:6379",
                "state": "wait_bgsave",
                "offset": 0,
                "lagBytes": 1000,
                "lagSeconds": 3,
            },
        ],
    }
    demoted = replication.replication_status("10.0.0.1:6379", {"role": "slave"}, 2, "now")
    assert "failover is under way" in demoted["message"]

    body = {
        "metadata": {"name": "a", "namespace": "ns", "generation": 1},
        "spec": {"fleet": "main", "redis": {"managed": {"replicas": 2, "minReplicas": 2}}},
    }
    spec = parse_shard(body)
    status = shard_status(spec, None, Observed(replication=got, in_shard_map=True))
    assert status["redis"] == got
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReplicasBelowMinimum")
    assert "lastBackupTime" not in status
    assert shard_status(spec, None, Observed(last_backup="2026-01-01T01:17:00Z"))["lastBackupTime"] == (
        "2026-01-01T01:17:00Z"
    )
    status = shard_status(spec, None, Observed(replication={"message": "no Sentinel answers"}))
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "RedisNoPrimary"
    spec1 = parse_shard(
        {**body, "spec": {"fleet": "main", "redis": {"managed": {"replicas": 2, "minReplicas": 1}}}}
    )
    status = shard_status(spec1, None, Observed(replication=got, in_shard_map=True))
    assert next(c for c in status["conditions"] if c["type"] == "Degraded")["status"] == "False"


def test_sentinel_ids_are_stable_per_pod(local_shard: LocalShard) -> None:
    """A restarted Sentinel keeps its id (from MYID_SEED), so its peers do not count a
    stale voter; ids differ between Sentinels."""
    shard = local_shard
    ids = []
    for s in shard.sentinels:
        ids.append(wait_for("sentinel up", lambda p=s.port: _myid(p)))  # type: ignore[misc]
    assert len(set(ids)) == 3
    first = shard.sentinels[0]
    first.stop()
    first.start()
    assert wait_for("sentinel back", lambda: _myid(first.port)) == ids[0]
    assert os.path.exists(Path(first.env["CONF_DIR"]) / "sentinel.conf")


def _myid(port: int) -> str | None:
    proc = subprocess.run(
        [str(DEBIAN / "redis-cli"), "-p", str(port), "sentinel", "myid"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and len(out) == 40 else None


def test_pre_stop_hands_the_primary_role_to_a_replica(local_shard: LocalShard) -> None:
    """The preStop hook of a primary pod: Sentinel promotes a replica before the pod stops."""
    shard = local_shard
    n0 = shard.nodes[0]
    wait_for("Sentinels see both replicas", lambda: True if len(_online(shard.probe())) == 2 else None)
    started = time.monotonic()
    proc = subprocess.run(
        ["sh", "-c", PRE_STOP_REDIS], env=n0.env, capture_output=True, timeout=60, check=False
    )
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert b"handed the primary role to" in proc.stdout
    # the hook returns once a replica is promoted; the Sentinels' view may lag it briefly
    status = wait_for("the new primary", lambda: _settled_primary_not(shard, n0))
    assert status["primary"] != f"127.0.0.1:{n0.port}"
    new = shard.node_at(int(status["primary"].rsplit(":", 1)[1]))
    # min-replicas-to-write 1: the new primary takes writes once Sentinel has re-pointed a
    # replica at it (NOREPLICAS until then), which on a loaded machine can lag the promotion
    wait_for("the new primary takes writes", lambda: _set(shard, new, "after", "1"))
    # the old primary takes no write any more: it is paused until its process stops
    slow = redis.Redis(port=n0.port, password=PASSWORD, socket_timeout=0.5)
    # (paused, the write times out; once its replicas follow the new primary,
    # min-replicas-to-write refuses it outright: either way nothing is written)
    with pytest.raises((redis.TimeoutError, redis.ResponseError), match=r"Timeout|NOREPLICAS"):
        slow.set("lost", "1")
    print(f"pre-stop handover: {took:.1f} s")
    n0.stop()  # the pod stops; it comes back as a replica and never applied the paused write
    n0.start()
    wait_for("old primary rejoined", lambda: True if shard.role(n0) == "slave" else None)
    wait_for("it caught up", lambda: _get(shard, n0, "after"))
    assert shard.client(n0).get("lost") is None
    assert shard.client(new).get("lost") is None
    # on a replica the hook does nothing
    assert subprocess.run(["sh", "-c", PRE_STOP_REDIS], env=n0.env, timeout=10, check=False).returncode == 0


def _set(shard: LocalShard, node: Node, key: str, value: str) -> bool | None:
    try:
        return bool(shard.client(node).set(key, value)) or None
    except redis.ResponseError as e:
        if str(e).startswith("NOREPLICAS"):
            return None
        raise


def _get(shard: LocalShard, node: Node, key: str) -> str | None:
    try:
        value = shard.client(node).get(key)
    except redis.RedisError:  # still syncing: a replica serves no stale data
        return None
    return None if value is None else str(value)


def test_backup_of_a_replicated_shard_follows_the_primary_across_a_failover(
    local_shard: LocalShard, tmp_path: Path
) -> None:
    """The backup CronJob's URL names the Sentinels: each backup is taken from the primary
    they name at that moment."""
    from relay import backup as B
    from relay.progress import ProgressReporter

    shard = local_shard
    n0 = shard.nodes[0]
    wait_for("Sentinels see both replicas", lambda: True if len(_online(shard.probe())) == 2 else None)
    shard.client(n0).set("k", "1")
    quiet = ProgressReporter("backup", quiet=True)
    first = asyncio.run(B.backup(shard.url(), tmp_path, "a", 5, quiet))
    assert first.source == f"127.0.0.1:{n0.port}"
    assert first.role == "master"
    n0.kill()
    status = wait_for("a replica promoted", lambda: _settled_primary_not(shard, n0), timeout=30)
    second = asyncio.run(B.backup(shard.url(), tmp_path, "a", 5, quiet))
    assert second.source == status["primary"]
    assert second.role == "master"
    assert [m.name for m, _ in B.manifests(tmp_path, "a")] == [first.name, second.name]


def _settled_primary_not(shard: LocalShard, old: Node) -> dict[str, Any] | None:
    s = shard.probe()
    return s if s.get("primaryOffset") is not None and s.get("primary") != f"127.0.0.1:{old.port}" else None


def test_operator_moves_slots_off_a_replicated_shard_after_and_during_failovers(
    local_shard: LocalShard,
) -> None:
    """Scale-in of a replicated shard through the operator's migration adapter (what a
    RelayShard deletion runs): half the slots after a failover, the other half with the new
    primary SIGKILLed mid-move and the move run again, as the operator retries it."""
    from relayfleet_operator.shard_redis import MoveError, holds_data, migrate_range
    from relayfleet_testing.localredis import LocalRedis

    from relay.fleet.contract import Move
    from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange
    from tests.support.operator_harness import enqueue_messages, read_queues, recipients_on

    shard = local_shard
    wait_for("Sentinels see both replicas", lambda: True if len(_online(shard.probe())) == 2 else None)
    target = LocalRedis(binary=str(DEBIAN / "redis-server"), password=PASSWORD).start()
    try:
        urls = {"a": shard.url(), "b": target.url}
        recipients = recipients_on(range(SLOT_COUNT), 60)
        asyncio.run(enqueue_messages(urls["a"], recipients, 3))
        expected = asyncio.run(read_queues(urls["a"], recipients))
        assert all(len(v) == 3 for v in expected.values())
        current = [
            ShardMap("main", 1, {"a": urls["a"], "b": urls["b"]}, (SlotRange(0, SLOT_COUNT - 1, "a"),))
        ]

        async def publish(slots: Any, to: str) -> ShardMap:
            current[0] = current[0].with_slots(slots, to)
            return current[0]

        def move(m: Move) -> None:
            asyncio.run(migrate_range(current[0], m, urls, publish))

        # after a failover
        old = shard.node_at(int(shard.probe()["primary"].rsplit(":", 1)[1]))
        old.kill()
        wait_for("a replica promoted", lambda: _settled_primary_not(shard, old), timeout=30)
        move(Move(0, 8191, "a", "b"))
        # the pod comes back as a replica, as its StatefulSet restarts it: with minReplicas 1
        # the shard needs a replica left after the next kill to take writes at all
        old.start()
        wait_for("old primary rejoined", lambda: True if shard.role(old) == "slave" else None)
        wait_for("Sentinels see both replicas", lambda: True if len(_online(shard.probe())) == 2 else None)
        assert current[0].slot_counts() == {"a": 8192, "b": 8192}

        # during one: kill the primary while the move runs, then run the move again
        status = shard.probe()
        primary = shard.node_at(int(status["primary"].rsplit(":", 1)[1]))

        async def move_while_failing_over() -> str:
            task = asyncio.create_task(migrate_range(current[0], Move(8192, 16383, "a", "b"), urls, publish))
            await asyncio.sleep(0.1)
            assert not task.done(), "the move ended before the kill: nothing shown"
            primary.kill()
            killed = time.monotonic()
            try:
                await task
            except MoveError as exc:
                return f"interrupted: {exc}"
            return f"finished {time.monotonic() - killed:.1f} s after the kill"

        outcome = asyncio.run(move_while_failing_over())
        wait_for("a replica promoted again", lambda: _settled_primary_not(shard, primary), timeout=30)
        if current[0].slot_counts().get("a"):
            move(Move(8192, 16383, "a", "b"))
        print(f"move during the failover: {outcome}")
        assert current[0].slot_counts() == {"a": 0, "b": SLOT_COUNT}
        assert asyncio.run(read_queues(urls["b"], recipients)) == expected
        assert not asyncio.run(holds_data(urls["a"], range(SLOT_COUNT)))
    finally:
        target.stop()


def test_replication_and_backup_figures_become_operator_metrics() -> None:
    from relayfleet_operator import metrics, shards

    spec = parse_shard(
        {
            "metadata": {"name": "m1", "namespace": "ns-m"},
            "spec": {"fleet": "main", "redis": {"managed": {"replicas": 2}}},
        }
    )
    labels = {"namespace": "ns-m", "fleet": "main", "shard": "m1"}
    first = {
        "redis": {
            "primary": "a:6379",
            "replicas": [{"state": "online", "lagBytes": 10}, {"state": "wait_bgsave", "lagBytes": 900}],
        },
        "lastBackupTime": "2026-01-01T00:00:00Z",
    }
    shards._export_redis(spec, {}, first)
    sample = metrics.REGISTRY.get_sample_value
    assert sample("relayfleet_operator_redis_replicas_online", labels) == 1
    assert sample("relayfleet_operator_redis_replica_lag_bytes", labels) == 900
    assert sample("relayfleet_operator_last_backup_timestamp_seconds", labels) == 1767225600
    before = sample("relayfleet_operator_redis_primary_changes_total", labels) or 0
    shards._export_redis(spec, first, {"redis": {"primary": "b:6379", "replicas": []}})
    assert sample("relayfleet_operator_redis_primary_changes_total", labels) == before + 1
    assert sample("relayfleet_operator_redis_replicas_online", labels) == 0
