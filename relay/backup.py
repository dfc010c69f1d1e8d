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
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from relay.fleet.sharding import SLOT_COUNT, ShardMapError, is_sentinel_url
from relay.helpfmt import EnvHelpFormatter
from relay.storage import keys as K
from relay.storage import scripts
from relay.storage.boot import MARK_SCRIPT
from relay.storage.connection import RedisConnectError, RedisTarget, RedisURLError
from relay.storage.sentinel import NoPrimary, primary_url
from relay.storage.snapshot import Replica, SnapshotError, fetch_rdb, load_rdb

T = TypeVar("T")

WRITES_PER_SECOND_BOUND = 1_000_000
MARGIN_SECONDS = 60
_BATCH = 500  # queues per restore_epoch call
_SLOT_BATCH = 1024  # slots per pipelined round trip


class BackupError(RuntimeError):
    """A backup or restore that cannot go on; the message is safe to print."""


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


@dataclass(frozen=True)
class RestoreReport:
    backup: str
    keys: int
    queues: int
    seq_jump: int
    seq_floor: int
    fenced_slots: int
    seconds: float


# --- progress --------------------------------------------------------------------------------


class Reporter:
    """Progress lines on stderr: each phase once, then at most every 2 s or 10 %."""

    def __init__(self, command: str, quiet: bool = False) -> None:
        self.command = command
        self.quiet = quiet
        self._phase = ""
        self._at = 0.0
        self._pct = -100

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"{self.command}: {text}", file=sys.stderr, flush=True)

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        pct = int(100 * done / total) if total else 0
        if phase == self._phase and now - self._at < 2 and pct - self._pct < 10 and done != total:
            return
        self._phase, self._at, self._pct = phase, now, pct
        if total and phase in _BYTE_PHASES:
            self.say(f"{phase} {_mib(done)}/{_mib(total)} MiB ({pct}%)")
        elif total:
            self.say(f"{phase} {done}/{total} ({pct}%)")
        else:
            self.say(f"{phase} ...")


_BYTE_PHASES = {"snapshot", "sending", "loaded"}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


# --- where the data is -----------------------------------------------------------------------


async def resolve(url: str) -> RedisTarget:
    """The node to talk to: the URL's own, or the primary a Sentinel URL's Sentinels name."""
    try:
        return RedisTarget.from_url(await primary_url(url))
    except NoPrimary as exc:
        raise BackupError(str(exc)) from None


def read_url(url: str | None, url_file: str | None) -> str:
    if url_file:
        try:
            text = Path(url_file).read_text("utf-8").strip()
        except OSError as exc:
            raise BackupError(f"cannot read {url_file}: {exc.strerror}") from None
        if not text:
            raise BackupError(f"{url_file} is empty")
        return text
    if url:
        return url
    raise BackupError("one of --redis-url (or RELAY_REDIS_URL) or --redis-url-file is required")


# --- backup ----------------------------------------------------------------------------------


def _utc(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _fsync_dir(path: Path) -> None:
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


async def backup(url: str, directory: Path, shard: str, keep: int, progress: Reporter) -> Manifest:
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
        sha256=_sha256(rdb),
        redisVersion=source.redis_version,
        source=target.address,
        role=source.role,
        replOffset=source.repl_offset,
    )
    _write_atomically(rdb.with_suffix(".json"), (json.dumps(manifest.to_json(), indent=2) + "\n").encode())
    _fsync_dir(folder)
    removed = prune(directory, shard, keep)
    progress.say(
        f"done: {name} ({_mib(size)} MiB, sha256 {manifest.sha256[:12]}); "
        f"kept {min(keep, len(manifests(directory, shard)))}, removed {len(removed)}"
    )
    return manifest


# --- restore ---------------------------------------------------------------------------------


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
    if _sha256(rdb) != manifest.sha256:
        raise BackupError(f"{rdb} does not match its manifest's sha256: the file is damaged")
    return manifest, rdb


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
    client: aioredis.Redis, replica: Replica, restore_id: str, jump: int, progress: Reporter
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
    progress: Reporter,
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
            f"restoring {manifest.name} of shard {manifest.shard} ({_mib(manifest.bytes)} MiB, "
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


# --- command line ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", EnvHelpFormatter)  # every flag: its env and default
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"relayfleet {self.prog.split()[-1]}: {message}\n")


def _url_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--redis-url",
        default=os.environ.get("RELAY_REDIS_URL") or None,
        help="redis://, rediss:// or redis+sentinel:// URL (env RELAY_REDIS_URL)",
    )
    src.add_argument("--redis-url-file", metavar="FILE", help="a file holding the URL (credentials Secret)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def backup_main(argv: Sequence[str]) -> int:
    p = _Parser(
        prog="relayfleet backup",
        description="Take a point-in-time snapshot of a shard's Redis into DIR/SHARD/, keeping the newest N.",
    )
    _url_args(p)
    p.add_argument("--shard", required=True, help="the shard's name (names the backup folder)")
    p.add_argument("--to", required=True, type=Path, metavar="DIR", help="backup directory (a mounted claim)")
    p.add_argument("--keep", type=int, default=24, help="backups to keep (default 24)")
    args = p.parse_args(argv)
    if args.keep < 1:
        p.error("--keep must be at least 1")
    progress = Reporter("backup", args.quiet)
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
    args = p.parse_args(argv)
    if args.seq_jump is not None and args.seq_jump < 1:
        p.error("--seq-jump must be at least 1")
    progress = Reporter("restore", args.quiet)
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


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
