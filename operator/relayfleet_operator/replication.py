"""What a managed shard's replication looks like now: the primary and each replica's lag.

`probe` asks every Sentinel of the shard which node is the primary and counts the ones that
answer (relay.storage.sentinel.survey_primary, the relay's own Sentinel client), then reads
INFO replication from that primary; for a shard without replicas it
reads INFO replication from the one node. `replication_status` turns the answers into the
RelayShard's status.redis, and is pure so tests can feed it INFO text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from relay.fleet.contract import Obj
from relay.fleet.sharding import is_sentinel_url, parse_sentinel_url
from relay.storage.sentinel import survey_primary

_TIMEOUT_S = 2.0
# Every field status.redis may hold. The status is written with a JSON merge patch, which
# keeps a field the new value leaves out: each answer names them all, null for "not now"
# (an old "no Sentinel answers" must not stay next to sentinelsReachable: 3).
_FIELDS = ("primary", "observedAt", "sentinelsReachable", "message", "primaryOffset", "replicas")


def _status(now: str, **fields: Any) -> Obj:
    return {**dict.fromkeys(_FIELDS), "observedAt": now, **fields}


def parse_info(text: str) -> dict[str, str]:
    """INFO's `key:value` lines as a dict (section headers and blanks skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or ":" not in line:
            continue
        key, _, value = line.partition(":")
        out[key.strip()] = value.strip()
    return out


def _fields(value: object) -> dict[str, str]:
    """`ip=10.0.0.1,port=6379,state=online,offset=9,lag=0` (or redis-py's dict of it)."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    text = str(value or "")
    return dict(part.partition("=")[::2] for part in text.split(",") if "=" in part)


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value)) if value is not None else None
    except ValueError:
        return None


def replication_status(
    primary: str, info: Mapping[str, Any], sentinels_reachable: int | None, now: str
) -> Obj:
    """status.redis from the primary's INFO replication (parse_info's text form, or the
    dict redis-py makes of it)."""
    out = _status(now, primary=primary, sentinelsReachable=sentinels_reachable)
    role = info.get("role")
    if role != "master":
        out["message"] = f"{primary} reports role {role or 'unknown'}: a failover is under way"
        return out
    top = _int(info.get("master_repl_offset")) or 0
    out["primaryOffset"] = top
    replicas: list[Obj] = []
    for i in range(_int(info.get("connected_slaves")) or 0):
        f = _fields(info.get(f"slave{i}", ""))
        host, port = f.get("ip", "?"), f.get("port", "?")
        entry: Obj = {"address": f"{host}:{port}", "state": f.get("state", "unknown")}
        offset = _int(f.get("offset"))
        if offset is not None:
            entry["offset"] = offset
            entry["lagBytes"] = max(0, top - offset)
        lag = _int(f.get("lag"))
        if lag is not None:
            entry["lagSeconds"] = lag
        replicas.append(entry)
    out["replicas"] = replicas
    return out


async def _info(host: str, port: int, password: str | None, username: str | None) -> dict[str, Any]:
    client = aioredis.Redis(
        host=host,
        port=port,
        username=username,
        password=password,
        socket_timeout=_TIMEOUT_S,
        socket_connect_timeout=_TIMEOUT_S,
    )
    try:
        return await _read_info(client)
    finally:
        await client.aclose()


async def _read_info(client: aioredis.Redis) -> dict[str, Any]:
    # redis-py parses INFO: slaveN lines arrive as dicts, which replication_status takes too.
    return dict(await asyncio.wait_for(client.info("replication"), _TIMEOUT_S))


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def probe(url: str, now: str) -> Obj:
    """status.redis for the shard at `url` (redis:// or redis+sentinel://); never raises:
    what could not be seen is said in `message`."""
    reachable: int | None = None
    try:
        if is_sentinel_url(url):
            target = parse_sentinel_url(url)
            found, reachable = await survey_primary(target, _TIMEOUT_S)
            if found is None:
                why = "no Sentinel answers" if reachable == 0 else "no Sentinel names a primary"
                return _status(now, sentinelsReachable=reachable, message=why)
            host, port = found
            info = await _info(host, port, target.password, target.username)
        else:
            client = aioredis.Redis.from_url(
                url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S
            )
            kwargs = client.connection_pool.connection_kwargs
            host, port = str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379))
            try:
                info = await _read_info(client)
            finally:
                await client.aclose()
    except (RedisError, OSError, TimeoutError, ValueError) as exc:
        why = f"cannot read replication state: {type(exc).__name__}"
        return _status(now, sentinelsReachable=reachable, message=why)
    return replication_status(_join(host, port), info, reachable, now)
