"""Taking a backup: a point-in-time RDB snapshot of a shard's primary over the replication
protocol (relay/storage/snapshot.py) into the archive, its manifest, then pruning."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

from relay.backup.archive import Manifest, fsync_dir, manifests, prune, sha256_of, write_atomically
from relay.backup.errors import BackupError
from relay.progress import ProgressReporter, mib
from relay.storage.connection import RedisTarget
from relay.storage.sentinel import NoPrimary, primary_url
from relay.storage.snapshot import fetch_rdb

__all__ = ["backup", "resolve"]


async def resolve(url: str) -> RedisTarget:
    """The node to talk to: the URL's own, or the primary a Sentinel URL's Sentinels name."""
    try:
        return RedisTarget.from_url(await primary_url(url))
    except NoPrimary as exc:
        raise BackupError(str(exc)) from None


def _utc(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)


async def backup(url: str, directory: Path, shard: str, keep: int, progress: ProgressReporter) -> Manifest:
    if not shard or "/" in shard or shard.startswith("."):
        raise BackupError("--shard must be a plain name")
    target = await resolve(url)
    folder = directory / shard
    folder.mkdir(parents=True, exist_ok=True)
    started_ms = int(time.time() * 1000)
    name = _utc(started_ms).strftime("%Y%m%dT%H%M%S") + f"{started_ms % 1000:03d}Z"
    rdb = folder / f"{name}.rdb"
    tmp = folder / f".{name}.rdb.partial"
    progress.say(f"snapshot of {target.address} (shard {shard}) into {rdb}")
    try:
        with tmp.open("wb") as f:
            source, size = await fetch_rdb(target, f, progress)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(rdb)
    manifest = Manifest(
        shard=shard,
        name=name,
        createdAt=_utc(started_ms).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        createdAtMs=started_ms,
        bytes=size,
        sha256=sha256_of(rdb),
        redisVersion=source.redis_version,
        source=target.address,
        role=source.role,
        replOffset=source.repl_offset,
    )
    write_atomically(rdb.with_suffix(".json"), (json.dumps(manifest.to_json(), indent=2) + "\n").encode())
    fsync_dir(folder)
    removed = prune(directory, shard, keep)
    progress.say(
        f"done: {name} ({mib(size)} MiB, sha256 {manifest.sha256[:12]}); "
        f"kept {min(keep, len(manifests(directory, shard)))}, removed {len(removed)}"
    )
    return manifest
