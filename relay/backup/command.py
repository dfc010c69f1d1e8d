"""`relayfleet backup` and `relayfleet restore`: arguments (each flag's env named in --help),
the URL or URL file, the JSON result on stdout and the exit codes (1 failed, 2 bad URL/map)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from redis.exceptions import RedisError

from relay.backup.errors import BackupError
from relay.backup.restoring import restore
from relay.backup.taking import backup
from relay.envconfig import ConfigError, EnvHelpParser, add_flag, resolve_flags
from relay.fleet.sharding import ShardMapError
from relay.progress import ProgressReporter
from relay.settings import REDIS_URL
from relay.storage.connection import RedisConnectError, RedisURLError
from relay.storage.snapshot import SnapshotError

__all__ = ["backup_main", "read_url", "restore_main"]

T = TypeVar("T")
BYTE_PHASES = ("snapshot", "sending", "loaded")  # relay/storage/snapshot.py counts these in bytes


def read_url(url: str | None, url_file: str | None) -> str:
    if url_file:
        try:
            text = Path(url_file).read_text("utf-8").strip()
        except OSError as exc:
            raise RedisURLError(f"cannot read {url_file}: {exc.strerror}") from None
        if not text:
            raise RedisURLError(f"{url_file} is empty")
        return text
    if url:
        return url
    # configuration errors (exit 2), not a failure of the shard
    raise RedisURLError("one of --redis-url (or RELAY_REDIS_URL) or --redis-url-file is required")


class _Parser(EnvHelpParser):  # every flag: its env and default
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"relayfleet {self.prog.split()[-1]}: {message}\n")


def _url_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    add_flag(p, REDIS_URL, to=src)
    src.add_argument("--redis-url-file", metavar="FILE", help="a file holding the URL (credentials Secret)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _parse(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    args = p.parse_args(argv)
    try:
        resolve_flags(args)  # --redis-url, else RELAY_REDIS_URL
    except ConfigError as exc:
        p.error(str(exc))
    return args


def backup_main(argv: Sequence[str]) -> int:
    p = _Parser(
        prog="relayfleet backup",
        description="Take a point-in-time snapshot of a shard's Redis into DIR/SHARD/, keeping the newest N.",
    )
    _url_args(p)
    p.add_argument("--shard", required=True, help="the shard's name (names the backup folder)")
    p.add_argument("--to", required=True, type=Path, metavar="DIR", help="backup directory (a mounted claim)")
    p.add_argument("--keep", type=int, default=24, help="backups to keep (default 24)")
    args = _parse(p, argv)
    if args.keep < 1:
        p.error("--keep must be at least 1")
    progress = ProgressReporter("backup", args.quiet, byte_phases=BYTE_PHASES)
    return _run_command(
        "backup",
        lambda: backup(
            read_url(args.redis_url, args.redis_url_file), args.to, args.shard, args.keep, progress
        ),
        lambda manifest: manifest.to_json(),
    )


def restore_main(argv: Sequence[str]) -> int:
    p = _Parser(
        prog="relayfleet restore",
        description=(
            "Load a backup into a fresh Redis and give every restored queue a new epoch, with seqs "
            "continuing above anything handed out after the backup."
        ),
    )
    _url_args(p)
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        type=Path,
        metavar="PATH",
        help="a backup's .json/.rdb, or DIR",
    )
    p.add_argument("--shard", help="with --from DIR: restore this shard's newest backup")
    p.add_argument("--force", action="store_true", help="replace a Redis that already holds keys")
    p.add_argument(
        "--seq-jump", type=int, help="seq jump instead of the time-based bound (see docs/runbook.md)"
    )
    p.add_argument(
        "--advertise-host", help="the address the target Redis reaches this process at (default: found out)"
    )
    args = _parse(p, argv)
    if args.seq_jump is not None and args.seq_jump < 1:
        p.error("--seq-jump must be at least 1")
    progress = ProgressReporter("restore", args.quiet, byte_phases=BYTE_PHASES)
    return _run_command(
        "restore",
        lambda: restore(
            read_url(args.redis_url, args.redis_url_file),
            args.source,
            args.shard,
            progress,
            force=args.force,
            seq_jump=args.seq_jump,
            advertise_host=args.advertise_host,
        ),
        asdict,
    )


def _run_command(name: str, run: Callable[[], Awaitable[T]], to_json: Callable[[T], Any]) -> int:
    """Run one CLI command's coroutine: its JSON result on stdout and exit 0; a failure of the
    shard or the disk exits 1 without secrets, a bad URL or map exits 2 (one line each)."""
    try:
        result = asyncio.run(_awaited(run))
    except (BackupError, SnapshotError, RedisConnectError, RedisError, OSError, TimeoutError) as exc:
        print(f"relayfleet {name}: failed: {_safe(exc)}", file=sys.stderr)
        return 1
    except (RedisURLError, ShardMapError) as exc:
        print(f"relayfleet {name}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(result)))
    return 0


async def _awaited(run: Callable[[], Awaitable[T]]) -> T:
    # the URL is read inside run(): a bad URL file is reported like any other bad argument
    return await run()


def _safe(exc: BaseException) -> str:
    # redis-py errors can echo a command's arguments; ours are written to be printed.
    if isinstance(exc, BackupError | SnapshotError | RedisConnectError):
        return str(exc)
    return type(exc).__name__ + (f": {exc.strerror}" if isinstance(exc, OSError) and exc.strerror else "")
