"""Backup → wipe → restore on real redis-server, through the `relayfleet` CLI.

Messages are stored through the relay's own storage code (ShardStore, the Lua scripts);
"acknowledged" means the enqueue answered `stored` with a seq. The backup runs while the
shard is live; more messages follow it (those are lost with the node); the node is
killed and its data directory deleted; a fresh Redis on another port gets the backup.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay import backup as B
from relay.storage import keys as K
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore
from tests.support.procs import RELAYFLEET

DEBIAN_REDIS = "/usr/bin/redis-server"
PASSWORD = "backup-pw"
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not os.path.exists(DEBIAN_REDIS), reason="Debian redis-server not installed")

Queue = K.QueueKeys


def start_redis() -> LocalRedis:
    return LocalRedis(binary=DEBIAN_REDIS, password=PASSWORD).start()


@pytest.fixture
def node() -> Iterator[LocalRedis]:
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")])}
    proc = subprocess.run(
        [*RELAYFLEET, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def queues(n: int, tag: bytes) -> list[Queue]:
    return [K.queue_keys(bytes([i]) * 31 + tag, b"") for i in range(n)]


async def enqueue_all(
    store: ShardStore, qs: list[Queue], per_queue: int, label: str
) -> dict[Queue, dict[int, bytes]]:
    acked: dict[Queue, dict[int, bytes]] = {q: {} for q in qs}
    for i in range(per_queue):
        for q in qs:
            payload = f"{label}-{q.qid[:6]}-{i}".encode() * 3
            out = await store.enqueue(q, EnqueueRequest(b"", b"", payload), int(time.time() * 1000))
            assert out.kind == "stored"
            acked[q][out.seq] = payload
    return acked


async def everything(store: ShardStore, q: Queue) -> tuple[dict[int, bytes], str]:
    got: dict[int, bytes] = {}
    epoch = ""
    cursor: int | None = None
    while True:
        res = await store.read(q, cursor, 1000)
        epoch = res.epoch
        if not res.messages:
            return got, epoch
        for m in res.messages:
            got[m.seq] = m.payload
        cursor = res.messages[-1].seq + 1


async def test_backup_wipe_restore_brings_back_every_acknowledged_message_with_new_epochs(
    node: LocalRedis, tmp_path: Path
) -> None:
    store = ShardStore("a", node.url, QueueLimits())
    await store.start()
    old = queues(12, b"o")
    before = await enqueue_all(store, old, 25, "before")
    # acknowledged deletions before the backup stay deleted
    for q in old[:4]:
        assert await store.ack_upto(q, min(before[q]) + 4) == 5
        for seq in sorted(before[q])[:5]:
            del before[q][seq]
    epochs_before = {q: (await store.status(q)).epoch for q in old}

    backups = tmp_path / "backups"
    proc = cli("backup", "--redis-url", node.url, "--shard", "a", "--to", str(backups), "--keep", "3")
    manifest = json.loads(proc.stdout)
    assert manifest["shard"] == "a"
    assert manifest["bytes"] > 0
    assert "snapshot" in proc.stderr
    assert "done:" in proc.stderr
    assert PASSWORD not in proc.stderr + proc.stdout

    # after the backup's point: more messages on old queues and on queues the backup lacks
    new = queues(5, b"n")
    after = await enqueue_all(store, old + new, 7, "after")
    top_seq = {q: max([*before.get(q, {}), *after[q]]) for q in old + new}
    epochs_after = {q: (await store.status(q)).epoch for q in new}
    await store.close()

    # the node and its disk are lost
    node.stop()
    shutil.rmtree(node.dir, ignore_errors=True)
    fresh = start_redis()
    try:
        proc = cli("restore", "--from", str(backups), "--shard", "a", "--redis-url", fresh.url)
        report = json.loads(proc.stdout)
        assert "loaded" in proc.stderr
        assert "new epoch" in proc.stderr
        assert report["queues"] == len(old)
        assert report["seq_jump"] >= 1_000_000
        assert report["seq_floor"] == report["seq_jump"]

        # rf:boot names the restored Redis's own run (so no relay re-epochs the queues again)
        direct = redis.Redis.from_url(fresh.url, decode_responses=True)
        run_id = str(direct.info("server")["run_id"])
        assert str(direct.get(K.SHARD_BOOT)).startswith(run_id + ":")
        assert int(direct.get(K.SHARD_SEQ_FLOOR) or 0) == report["seq_floor"]
        assert direct.info("replication")["role"] == "master"
        direct.close()

        store = ShardStore("a", fresh.url, QueueLimits())
        await store.start()
        for q in old:
            got, epoch = await everything(store, q)
            assert got == before[q], "every message acknowledged before the backup is back, nothing else"
            assert epoch != epochs_before[q], "history after the backup was lost: a new epoch"
            status = await store.status(q)
            assert status.epoch == epoch
            assert status.last_seq == max(before[q]) + report["seq_jump"]
            out = await store.enqueue(q, EnqueueRequest(b"", b"", b"next"), int(time.time() * 1000))
            assert out.kind == "stored"
            assert out.seq > top_seq[q], "seqs never reused: above anything handed out before the wipe"
            assert out.seq == max(before[q]) + report["seq_jump"] + 1  # one jump, not one per reconnect
            assert (await store.status(q)).epoch == epoch  # stable from now on
        for q in new:
            got, _ = await everything(store, q)
            assert got == {}
            out = await store.enqueue(q, EnqueueRequest(b"", b"", b"next"), int(time.time() * 1000))
            assert out.seq > top_seq[q]
            assert (await store.status(q)).epoch != epochs_after[q]
        await store.close()
    finally:
        fresh.stop()


def test_backups_rotate_and_damaged_or_wrong_ones_are_refused(node: LocalRedis, tmp_path: Path) -> None:
    client = redis.Redis.from_url(node.url)
    client.set("x", "1")
    backups = tmp_path / "b"
    names = []
    for _ in range(4):
        names.append(
            json.loads(
                cli(
                    "backup", "--redis-url", node.url, "--shard", "s", "--to", str(backups), "--keep", "2"
                ).stdout
            )["name"]
        )
        time.sleep(0.01)
    kept = sorted(p.name for p in (backups / "s").iterdir())
    assert kept == sorted([f"{n}.{ext}" for n in names[-2:] for ext in ("json", "rdb")])

    # a non-empty target is refused unless --force
    proc = cli("restore", "--from", str(backups), "--shard", "s", "--redis-url", node.url, check=False)
    assert proc.returncode == 1
    assert "holds 1 keys" in proc.stderr
    # a damaged file is refused before anything is touched
    rdb = backups / "s" / f"{names[-1]}.rdb"
    data = bytearray(rdb.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rdb.write_bytes(bytes(data))
    proc = cli("restore", "--from", str(rdb), "--redis-url", node.url, "--force", check=False)
    assert proc.returncode == 1
    assert "sha256" in proc.stderr
    # a Sentinel URL is refused with the procedure
    proc = cli(
        "restore",
        "--from",
        str(backups),
        "--shard",
        "s",
        "--redis-url",
        "redis+sentinel://h:26379/s",
        check=False,
    )
    assert proc.returncode == 1
    assert "replicas" in proc.stderr
    assert cli("restore", "--redis-url", node.url, check=False).returncode == 2
    # --force restores the older, intact backup over existing data
    client.set("y", "2")
    cli("restore", "--from", str(backups / "s" / f"{names[-2]}.json"), "--redis-url", node.url, "--force")
    assert client.get("x") == b"1"
    assert client.get("y") is None
    client.close()


def test_seq_jump_bound() -> None:
    assert B.seq_jump_for(0, 0) == 60 * B.WRITES_PER_SECOND_BOUND
    assert B.seq_jump_for(1_000, 3_601_000) == 3660 * B.WRITES_PER_SECOND_BOUND
    # a year since the backup still fits a JSON-safe integer many times over
    assert B.seq_jump_for(0, 366 * 86400 * 1000) < 2**53 // 100


async def test_until_promotion_the_restored_redis_refuses_client_writes(
    node: LocalRedis, tmp_path: Path
) -> None:
    """The epoch pass runs while the target is a read-only replica: a relay's write in that
    window is refused (READONLY, a retryable answer), never applied under an old epoch."""
    from relay.storage.connection import RedisTarget
    from relay.storage.snapshot import Replica, load_rdb

    client = redis.Redis.from_url(node.url)
    client.set("kept", "1")
    cli("backup", "--redis-url", node.url, "--shard", "s", "--to", str(tmp_path), "--quiet")
    rdb = next((tmp_path / "s").glob("*.rdb"))
    fresh = start_redis()
    seen: list[str] = []
    try:
        writer = redis.asyncio.Redis.from_url(fresh.url)

        async def prepare(replica: Replica) -> None:
            with pytest.raises(redis.ReadOnlyError):
                await writer.set("racing", "1")
            await replica.apply("SET", "applied", "1")
            seen.append("refused")

        await load_rdb(RedisTarget.from_url(fresh.url), rdb, prepare=prepare)
        await writer.aclose()
        after = redis.Redis.from_url(fresh.url)
        assert seen == ["refused"]
        assert after.get("kept") == b"1"
        assert after.get("applied") == b"1"  # what went through the replication stream is there
        assert after.get("racing") is None
        assert after.set("now", "1")  # promoted: writable again
        after.close()
    finally:
        client.close()
        fresh.stop()
