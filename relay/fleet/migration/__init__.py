"""Online slot migration: the fenced MIGRATE protocol of docs/migration.md, as a library (this package's
entry points, below) and the `relayfleet migrate` command (`command.migrate_main`).

The modules, each owning one thing (docs/migration.md explains the protocol):

    protocol      the steps per batch of slots — locate, fence, copy, flip, publish, wake,
                  clean — and `migrate_slots`, which resumes after any crash or failover
    shard_ops     one shard's Redis operations for the migrator (state CAS, guarded deletes,
                  key listing, WAIT) and the address another shard's MIGRATE reaches it at
    publishing    the interface to the map's keeper: `PublishMap`, `CurrentMap`, `MapConflict`
    map_file      the shard map as a file: atomic write, flock-guarded publish
    report        `Progress` while running, `MigrationReport` at the end
    errors        `MigrationError` and the resumable `ShardInterrupted`
    crash_points  test hook: die at a named step (RELAYFLEET_MIGRATION_CRASH_AT)
    command       `relayfleet migrate`: arguments, progress bar, exit codes
"""

from __future__ import annotations

from relay.fleet.migration.errors import MigrationError
from relay.fleet.migration.map_file import file_publisher, file_reader, write_map_file
from relay.fleet.migration.protocol import migrate_slots
from relay.fleet.migration.publishing import CurrentMap, MapConflict, MapPlace, PublishMap
from relay.fleet.migration.report import MigrationReport, Progress, ProgressFn

__all__ = [
    "CurrentMap",
    "MapConflict",
    "MapPlace",
    "MigrationError",
    "MigrationReport",
    "Progress",
    "ProgressFn",
    "PublishMap",
    "file_publisher",
    "file_reader",
    "migrate_slots",
    "write_map_file",
]
