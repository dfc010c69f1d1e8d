"""The one error of a backup or restore (a shard's or the disk's failure has its own types)."""

from __future__ import annotations

__all__ = ["BackupError"]


class BackupError(RuntimeError):
    """A backup or restore that cannot go on; the message is safe to print."""
