"""Restoring loads a backup into a fresh Redis and then applies the epoch rule. Everything a
queue got after the backup's point is gone, so, as after a lost AOF tail (lua/_prelude.lua,
check_boot), every restored queue gets a new epoch and its seq counter jumps past anything
that could have been handed out since the backup; ``rf:seq-floor`` does the same for
queues that will be created afterwards (they may have existed, and handed out seqs, after
the backup). The jump assumes no shard runs more than a million writes a second, the bound
the lost-tail rule uses too: a million seqs per second since the backup (plus a minute).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from relay.backup.archive import locate
from relay.backup.errors import BackupError
from relay.fleet.sharding import SLOT_COUNT, is_sentinel_url
from relay.progress import ProgressReporter, mib
from relay.storage import keys as K
from relay.storage import scripts
from relay.storage.boot import MARK_SCRIPT
from relay.storage.connection import RedisTarget
from relay.storage.snapshot import Replica, load_rdb

__all__ = [
    "MARGIN_SECONDS",
    "WRITES_PER_SECOND_BOUND",
    "RestoreReport",
    "new_epochs",
    "restore",
    "seq_jump_for",
]

WRITES_PER_SECOND_BOUND = 1_000_000
MARGIN_SECONDS = 60
_BATCH = 500  # queues per restore_epoch call
_SLOT_BATCH = 1024  # slots per pipelined round trip


@dataclass(frozen=True)
class RestoreReport:
    backup: str
    keys: int
    queues: int
    seq_jump: int
    seq_floor: int
    fenced_slots: int
    seconds: float


def seq_jump_for(created_at_ms: int, now_ms: int) -> int:
    """Seqs a queue could have been handed out between the backup and now, at most."""
    seconds = max(0, now_ms - created_at_ms) / 1000 + MARGIN_SECONDS
    return math.ceil(seconds) * WRITES_PER_SECOND_BOUND


async def _slot_reads(client: aioredis.Redis, key_of: Any, command: str) -> list[Any]:
    out: list[Any] = []
    for start in range(0, SLOT_COUNT, _SLOT_BATCH):
        pipe = client.pipeline(transaction=False)
        for slot in range(start, min(SLOT_COUNT, start + _SLOT_BATCH)):
            pipe.execute_command(command, key_of(slot))
        out += await pipe.execute()
    return out


async def new_epochs(
    client: aioredis.Redis, replica: Replica, restore_id: str, jump: int, progress: ProgressReporter
) -> int:
    """lua/restore_epoch.lua on every indexed queue, sent through the replication stream while
    the target is still a replica; `client` reads the slot indexes. Returns the queues sent."""
    counts = await _slot_reads(client, K.slot_index, "SCARD")
    slots = [slot for slot, n in enumerate(counts) if int(n)]
    sent = 0
    for i, slot in enumerate(slots):
        cursor: int = 0
        while True:
            cursor, members = await client.sscan(K.slot_index(slot), cursor, count=_BATCH)
            qids = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
            if qids:
                metas = [K.queue_keys_for_id(slot, q).meta for q in qids]
                await replica.apply(
                    "EVAL", scripts.RESTORE_EPOCH.source, len(metas), *metas, restore_id, jump
                )
                sent += len(metas)
            if cursor == 0:
                break
        progress("new epochs, slots", i + 1, len(slots))
    return sent


async def restore(
    url: str,
    source: Path,
    shard: str | None,
    progress: ProgressReporter,
    force: bool = False,
    seq_jump: int | None = None,
    advertise_host: str | None = None,
) -> RestoreReport:
    started = time.monotonic()
    if is_sentinel_url(url):
        raise BackupError(
            "restore into one Redis, not a Sentinel group: set the shard's redis.managed.replicas "
            "to 0, restore into its Redis, then raise replicas again (docs/runbook.md)"
        )
    manifest, rdb = locate(source, shard)
    if shard and manifest.shard != shard:
        raise BackupError(f"{rdb} is a backup of shard {manifest.shard}, not {shard}")
    target = RedisTarget.from_url(url)
    client = aioredis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)
    try:
        held = int(await client.dbsize())
        if held and not force:
            raise BackupError(
                f"{target.address} holds {held} keys; restore goes into a fresh Redis "
                "(--force replaces everything in it)"
            )
        progress.say(
            f"restoring {manifest.name} of shard {manifest.shard} ({mib(manifest.bytes)} MiB, "
            f"taken {manifest.createdAt}) into {target.address}"
        )
        jump = (
            seq_jump if seq_jump is not None else seq_jump_for(manifest.createdAtMs, int(time.time() * 1000))
        )
        done: dict[str, int] = {}

        async def prepare(replica: Replica) -> None:
            # Still a replica: clients get READONLY (retryable) until every queue has its new
            # epoch, so no client write lands on a restored queue under its old epoch.
            done["keys"] = int(await client.dbsize())
            progress.say(f"loaded {done['keys']} keys")
            fsync = {_s(k): _s(v) for k, v in (await client.config_get("appendfsync")).items()}
            if fsync.get("appendfsync") == "always":
                await replica.apply("DEL", K.SHARD_BOOT)  # as mark_boot: no lost tail to detect
            else:  # this Redis's run in rf:boot, not the backup's
                await replica.apply("EVAL", MARK_SCRIPT, 1, K.SHARD_BOOT, "")
            done["queues"] = await new_epochs(client, replica, secrets.token_hex(8), jump, progress)
            done["floor"] = int(await client.get(K.SHARD_SEQ_FLOOR) or 0) + jump
            await replica.apply("SET", K.SHARD_SEQ_FLOOR, done["floor"])

        await load_rdb(target, rdb, progress, advertise_host, prepare)
        keys, queues, floor = done["keys"], done["queues"], done["floor"]
        progress.say(
            f"promoted: new epoch and seq + {jump} on {queues} queues; new queues start above {floor}"
        )
        states = await _slot_reads(client, K.slot_state, "GET")
        fenced = sum(1 for s in states if s is not None)
        if fenced:
            progress.say(
                f"{fenced} slots carry a migration fence from the backup (migrating or moved): "
                "check them against the shard map (docs/runbook.md)"
            )
    finally:
        await client.aclose()
    report = RestoreReport(
        manifest.name, keys, queues, jump, floor, fenced, round(time.monotonic() - started, 3)
    )
    progress.say(f"done in {report.seconds:.1f} s")
    return report


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
