"""The backup directory: ``<dir>/<shard>/<UTC time>.rdb`` plus its JSON manifest, written last
(a snapshot without one is incomplete and ignored); listing, pruning to the newest N, and
locating and verifying (size, sha256) the backup to restore."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relay.backup.errors import BackupError

__all__ = ["Manifest", "fsync_dir", "locate", "manifests", "prune", "sha256_of", "write_atomically"]


@dataclass(frozen=True)
class Manifest:
    shard: str
    name: str  # the backup's file stem
    createdAt: str
    createdAtMs: int
    bytes: int
    sha256: str
    redisVersion: str
    source: str  # host:port of the node the snapshot came from (no credentials)
    role: str
    replOffset: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Manifest:
        try:
            return cls(**{f: doc[f] for f in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            raise BackupError(f"{where} is not a relayfleet backup manifest") from None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifests(directory: Path, shard: str) -> list[tuple[Manifest, Path]]:
    """The shard's complete backups, oldest first."""
    out = []
    for path in sorted((directory / shard).glob("*.json")):
        try:
            doc = json.loads(path.read_text("utf-8"))
        except (OSError, ValueError):
            continue
        try:
            out.append((Manifest.from_json(doc, str(path)), path))
        except BackupError:
            continue
    out.sort(key=lambda mp: (mp[0].createdAtMs, mp[0].name))
    return out


def prune(directory: Path, shard: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` backups (and leftovers of interrupted ones)."""
    found = manifests(directory, shard)
    removed = []
    for manifest, path in found[: max(0, len(found) - keep)]:
        path.with_suffix(".rdb").unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        removed.append(manifest.name)
    kept = {m.name for m, _ in found[-keep:]}
    for rdb in (directory / shard).glob("*.rdb"):
        if rdb.stem not in kept and rdb.stem not in removed:
            rdb.unlink(missing_ok=True)  # a snapshot whose manifest was never written
    for partial in (directory / shard).glob(".*.partial"):
        partial.unlink(missing_ok=True)
    return removed


def locate(source: Path, shard: str | None) -> tuple[Manifest, Path]:
    """A backup from a manifest, its .rdb, or a backup directory (+ --shard: the newest)."""
    if source.is_dir():
        if not shard:
            raise BackupError("--shard is required when --from names a backup directory")
        found = manifests(source, shard)
        if not found:
            raise BackupError(f"no complete backup of shard {shard} under {source}")
        manifest, path = found[-1]
    else:
        path = source.with_suffix(".json")
        try:
            doc = json.loads(path.read_text("utf-8"))
        except (OSError, ValueError):
            raise BackupError(f"{path} (the backup's manifest) is missing or unreadable") from None
        manifest = Manifest.from_json(doc, str(path))
    rdb = path.with_suffix(".rdb")
    if not rdb.is_file() or rdb.stat().st_size != manifest.bytes:
        raise BackupError(f"{rdb} is missing or not the size its manifest says")
    if sha256_of(rdb) != manifest.sha256:
        raise BackupError(f"{rdb} does not match its manifest's sha256: the file is damaged")
    return manifest, rdb
