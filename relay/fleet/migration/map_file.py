"""The shard map as a file (`relayfleet migrate --shard-map FILE`, the relays' RELAY_SHARD_MAP):
written atomically by rename, and published under an flock so that two migrations on one host
cannot both write the same epoch."""

from __future__ import annotations

import asyncio
import fcntl
import os

from relay.fleet.migration.publishing import CurrentMap, MapConflict, PublishMap
from relay.fleet.sharding import ShardMap, loads_shard_map

__all__ = ["file_publisher", "file_reader", "read_map_file", "write_map_file"]


def write_map_file(path: str, shard_map: ShardMap) -> None:
    """Replace the file atomically (write, fsync, rename): readers see the old map or the new one."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(shard_map.dumps())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_map_file(path: str) -> ShardMap:
    with open(path, "rb") as f:
        return loads_shard_map(f.read())


def _publish_file(path: str, new_map: ShardMap) -> None:
    # The lock makes read-compare-write atomic against other migrations on this host.
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = read_map_file(path)
            if current.epoch >= new_map.epoch:
                raise MapConflict(f"{path} changed during the migration (now epoch {current.epoch})")
            write_map_file(path, new_map)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def file_publisher(path: str) -> PublishMap:
    """Publishes to a shard map file; `MapConflict` when someone else published a newer map."""

    async def publish(new_map: ShardMap) -> ShardMap:
        await asyncio.to_thread(_publish_file, path, new_map)
        return new_map

    return publish


def file_reader(path: str) -> CurrentMap:
    """The map in the file now (the `current_map` that goes with `file_publisher`)."""

    async def read() -> ShardMap:
        return await asyncio.to_thread(read_map_file, path)

    return read
