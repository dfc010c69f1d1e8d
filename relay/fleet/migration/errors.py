"""What a migration fails with: one base error, and the failover case the protocol resumes."""

from __future__ import annotations

__all__ = ["MigrationError", "ShardInterrupted"]


class MigrationError(Exception):
    """A migration could not go on; the message says which slot or shard and why."""


class ShardInterrupted(MigrationError):
    """A shard's connection broke or its node stopped being the primary (a failover): the
    run stops like a crash would, and ``migrate_slots`` resumes it on the new primary."""
