"""`relayfleet backup` and `relayfleet restore`: a shard's Redis to a snapshot file and back.

A backup is a point-in-time RDB snapshot taken over the replication protocol (see
relay/storage/snapshot.py) plus a JSON manifest beside it; the manifest is written last,
so a backup without one is incomplete and ignored. Backups of a shard live in
``<dir>/<shard>/<UTC time>.rdb|.json``; after each backup only the newest ``--keep`` stay.

Restoring loads a backup into a fresh Redis and then applies the epoch rule. Everything a
queue got after the backup's point is gone, so, as after a lost AOF tail (lua/_prelude.lua,
check_boot), every restored queue gets a new epoch and its seq counter jumps past anything
that could have been handed out since the backup; ``rf:seq-floor`` does the same for
queues that will be created afterwards (they may have existed, and handed out seqs, after
the backup). The jump assumes no shard runs more than a million writes a second, the bound
the lost-tail rule uses too: a million seqs per second since the backup (plus a minute).

The modules:

    archive     the backup directory: manifests, pruning, locating and verifying a backup
    taking      `backup`: snapshot a shard's primary into the archive
    restoring   `restore`: load a backup into a fresh Redis, then the epoch rule
    errors      `BackupError`
    command     `relayfleet backup|restore`: arguments, JSON result, exit codes
"""

from __future__ import annotations

from relay.backup.archive import Manifest, locate, manifests, prune
from relay.backup.errors import BackupError
from relay.backup.restoring import (
    MARGIN_SECONDS,
    WRITES_PER_SECOND_BOUND,
    RestoreReport,
    restore,
    seq_jump_for,
)
from relay.backup.taking import backup

__all__ = [
    "MARGIN_SECONDS",
    "WRITES_PER_SECOND_BOUND",
    "BackupError",
    "Manifest",
    "RestoreReport",
    "backup",
    "locate",
    "manifests",
    "prune",
    "restore",
    "seq_jump_for",
]
