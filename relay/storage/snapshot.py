"""Moving a whole Redis dataset as one RDB snapshot, over Redis's own replication protocol.

- ``fetch_rdb``: take a point-in-time snapshot of a running Redis from anywhere the Redis
  port is reachable: the connection asks for a full sync (``SYNC``, as ``redis-cli --rdb``
  does) and keeps the RDB payload. The server forks and writes the snapshot exactly as
  BGSAVE does, so it is consistent across keys; no access to the server's disk is needed.
- ``load_rdb``: load a snapshot into a running (fresh) Redis from anywhere the Redis can
  reach back: this process briefly acts as a primary that serves only that RDB, the
  target is made its replica (``REPLICAOF``), loads it as a replica loads a full sync
  (and rewrites its AOF), and is promoted back (``REPLICAOF NO ONE``).

Neither needs a shell on the Redis host or a Redis restart, so both work for the
operator's managed Redis and for a Redis that only exposes its port. Commands go through
redis-py; the replication stream itself (a SYNC's payload, the stream served to the target)
is not a command and its reply, which redis-py does not speak: it runs on the hand-written
connection (relay/storage/pipeline.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from relay.storage.connection import RedisTarget
from relay.storage.pipeline import encode, open_connection

Progress = Callable[[str, int, int | None], None]  # (phase, done bytes, total bytes or None)
_CHUNK = 1 << 20
_IDLE_S = 60.0  # the server sends a newline every second while it forks and writes


class SnapshotError(RuntimeError):
    """The snapshot could not be taken or loaded; the message is safe to print."""


def _quiet(_phase: str, _done: int, _total: int | None) -> None:
    return None


@dataclass(frozen=True)
class SourceInfo:
    """What the source said about itself just before the snapshot."""

    redis_version: str
    run_id: str
    repl_offset: int
    role: str


async def _call(client: aioredis.Redis, *parts: str) -> Any:
    """One command through redis-py; SnapshotError (its text safe to print) when it fails."""
    try:
        return await client.execute_command(*parts)  # type: ignore[no-untyped-call]
    except RedisError as exc:
        raise SnapshotError(f"{parts[0]} failed: {str(exc)[:200] or type(exc).__name__}") from None


def _client(target: RedisTarget, timeout: float) -> aioredis.Redis:
    return target.client(socket_timeout=_IDLE_S, socket_connect_timeout=timeout)


async def fetch_rdb(
    target: RedisTarget, out: BinaryIO, progress: Progress = _quiet, timeout: float = 10.0
) -> tuple[SourceInfo, int]:
    """Write a point-in-time RDB of `target` to `out`; returns what the source said and the
    number of bytes written."""
    client = _client(target, timeout)
    try:
        info = {**await _call(client, "INFO", "server"), **await _call(client, "INFO", "replication")}
    finally:
        await client.aclose()
    source = SourceInfo(
        redis_version=str(info.get("redis_version", "?")),
        run_id=str(info.get("run_id", "")),
        repl_offset=int(info.get("master_repl_offset", 0) or 0),
        role=str(info.get("role", "?")),
    )
    reader, writer = await open_connection(target, timeout)
    try:
        # Only the snapshot, not the command stream after it (Redis >= 7; older refuse it,
        # an error reply that is read and ignored).
        writer.write(encode("REPLCONF", "rdb-only", "1"))
        async with asyncio.timeout(_IDLE_S):
            if not await reader.readline():
                raise SnapshotError("the server closed the connection during REPLCONF")
        writer.write(encode("SYNC"))
        await writer.drain()
        progress("snapshot", 0, None)
        while True:
            async with asyncio.timeout(_IDLE_S):
                line = await reader.readline()
            if not line:
                raise SnapshotError("the server closed the connection before sending the snapshot")
            if line.strip():
                break  # anything else was a keep-alive newline while the server forked
        if line.startswith(b"-"):
            raise SnapshotError(f"the server refused SYNC: {line[1:].strip().decode(errors='replace')}")
        header = line.strip()
        if header.startswith(b"$EOF:"):
            raise SnapshotError(
                "the server sent a diskless (EOF-delimited) snapshot, which was not asked for"
            )
        if not header.startswith(b"$") or not header[1:].isdigit():
            raise SnapshotError("unexpected reply to SYNC")
        total = int(header[1:])
        done = 0
        while done < total:
            async with asyncio.timeout(_IDLE_S):
                chunk = await reader.read(min(_CHUNK, total - done))
            if not chunk:
                raise SnapshotError(f"the connection closed after {done} of {total} snapshot bytes")
            out.write(chunk)
            done += len(chunk)
            progress("snapshot", done, total)
        return source, total
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def local_address_towards(host: str, port: int) -> str:
    """The local IP the target would see us from (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


class Replica:
    """The target while it is the replica of this process, before its promotion: readable
    by clients (which cannot write to it: READONLY, a retryable answer), and writable only
    through the replication stream this process feeds it."""

    def __init__(self, link: asyncio.StreamWriter, client: aioredis.Redis):
        self._link = link
        self._client = client
        self.offset = 0  # bytes of replication stream sent after the snapshot

    async def apply(self, *parts: str | bytes | int) -> None:
        """Run one command on the target as its primary would (no reply comes back)."""
        data = encode(*parts)
        self._link.write(data)
        await self._link.drain()
        self.offset += len(data)

    async def settle(self) -> None:
        """Wait until the target has executed everything `apply` sent."""
        while True:
            info = await _call(self._client, "INFO", "replication")
            if int(info.get("slave_repl_offset", -1)) >= self.offset:
                return
            await asyncio.sleep(0.05)


Prepare = Callable[[Replica], Awaitable[None]]


async def load_rdb(
    target: RedisTarget,
    rdb: Path,
    progress: Progress = _quiet,
    advertise_host: str | None = None,
    prepare: Prepare | None = None,
    timeout: float = 10.0,
    load_timeout: float = 3600.0,
) -> None:
    """Replace `target`'s whole dataset with the snapshot in `rdb` (see the module doc).
    `prepare` runs after the snapshot is loaded and before the target takes client writes:
    what it sends through `Replica.apply` is in place before the first client write."""
    if target.unix_path is not None:
        raise SnapshotError("restore needs a TCP address: a Redis replica cannot connect to a socket path")
    host = advertise_host or local_address_towards(target.host, target.port)
    size = (await asyncio.to_thread(rdb.stat)).st_size
    served = asyncio.Event()
    finished = asyncio.Event()
    links: list[asyncio.StreamWriter] = []
    failures: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rd = hiredis.Reader()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                if served.is_set():
                    continue  # acks and keep-alive newlines from the loading replica: nothing to answer
                rd.feed(data)
                while (cmd := rd.gets()) is not False:
                    if not isinstance(cmd, list) or not cmd:
                        continue
                    name = bytes(cmd[0]).upper()
                    arg = bytes(cmd[1]).upper() if len(cmd) > 1 else b""
                    if name == b"PING":
                        writer.write(b"+PONG\r\n")
                    elif name == b"REPLCONF" and arg in (b"ACK", b"GETACK"):
                        continue  # acknowledgements expect no reply
                    elif name in (b"AUTH", b"REPLCONF"):
                        writer.write(b"+OK\r\n")
                    elif name in (b"PSYNC", b"SYNC") and not links:
                        if name == b"PSYNC":
                            writer.write(b"+FULLRESYNC %s 0\r\n" % secrets.token_hex(20).encode())
                        writer.write(b"$%d\r\n" % size)
                        await _send_file(writer, rdb, size, progress)
                        links.append(writer)
                        served.set()
                    else:
                        writer.write(b"-ERR not supported by the restore source\r\n")
                    await writer.drain()
        except (OSError, SnapshotError, hiredis.ProtocolError) as exc:
            failures.append(f"sending the snapshot failed: {type(exc).__name__}")
            served.set()
        finally:
            if writer in links:
                await finished.wait()  # the link carries `prepare`'s commands until promotion
            writer.close()

    server = await asyncio.start_server(serve, host, 0)
    port = server.sockets[0].getsockname()[1]
    client = _client(target, timeout)
    try:
        await _call(client, "REPLICAOF", host, str(port))
        async with asyncio.timeout(load_timeout):
            await served.wait()
            if failures or not links:
                raise SnapshotError(failures[0] if failures else "the target did not ask for the snapshot")
            progress("loading", 0, None)
            while True:
                info = await _call(client, "INFO", "replication")
                loading = await _call(client, "INFO", "persistence")
                if info.get("master_link_status") == "up" and loading.get("loading") == 0:
                    break
                await asyncio.sleep(0.1)
            progress("loaded", size, size)
            if prepare is not None:
                replica = Replica(links[0], client)
                if target.db:
                    await replica.apply("SELECT", target.db)
                await prepare(replica)
                await replica.settle()
        await _call(client, "REPLICAOF", "NO", "ONE")
    except BaseException:
        # Never leave the target following a primary that is about to vanish.
        with contextlib.suppress(Exception):
            await _call(client, "REPLICAOF", "NO", "ONE")
        raise
    finally:
        finished.set()
        await client.aclose()
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()


async def _send_file(writer: asyncio.StreamWriter, rdb: Path, size: int, progress: Progress) -> None:
    sent = 0
    with rdb.open("rb") as f:
        while chunk := f.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
            progress("sending", sent, size)
    if sent != size:
        raise SnapshotError(f"{rdb.name} changed while it was sent")
