"""What a managed shard's replication looks like now: the primary and each replica's lag.

`probe` asks every Sentinel of the shard which node is the primary and counts the ones that
answer (relay.storage.sentinel.survey_primary, the relay's own Sentinel client), then reads
INFO replication from that primary (relay.storage.connection.read_info); for a shard without
replicas it reads INFO replication from the one node. `replication_status` turns the parsed
INFO into the RelayShard's status.redis, and is pure so tests can feed it a parsed INFO.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relay.fleet.contract import Obj
from relay.fleet.sharding import is_sentinel_url, parse_sentinel_url
from relay.storage.connection import RedisTarget, read_info
from relay.storage.sentinel import node_url, survey_primary

_TIMEOUT_S = 2.0
# Every field status.redis may hold. The status is written with a JSON merge patch, which
# keeps a field the new value leaves out: each answer names them all, null for "not now"
# (an old "no Sentinel answers" must not stay next to sentinelsReachable: 3).
_FIELDS = ("primary", "observedAt", "sentinelsReachable", "message", "primaryOffset", "replicas")


def _status(now: str, **fields: Any) -> Obj:
    return {**dict.fromkeys(_FIELDS), "observedAt": now, **fields}


def _fields(value: object) -> Mapping[str, object]:
    """An INFO slaveN value as redis-py parses `ip=10.0.0.1,port=6379,state=online,offset=9,lag=0`."""
    return value if isinstance(value, dict) else {}


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
    """status.redis from the primary's INFO replication, as redis-py parses it."""
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


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def probe(url: str, now: str) -> Obj:
    """status.redis for the shard at `url` (redis:// or redis+sentinel://); never raises:
    what could not be seen is said in `message`."""
    reachable: int | None = None
    try:
        if is_sentinel_url(url):
            shard = parse_sentinel_url(url)
            found, reachable = await survey_primary(shard, _TIMEOUT_S)
            if found is None:
                why = "no Sentinel answers" if reachable == 0 else "no Sentinel names a primary"
                return _status(now, sentinelsReachable=reachable, message=why)
            host, port = found
            target = RedisTarget.from_url(node_url(shard, host, port))
        else:
            target = RedisTarget.from_url(url)
        info = await read_info(target, "replication", _TIMEOUT_S)
    except (OSError, TimeoutError, ValueError) as exc:
        why = f"cannot read replication state: {type(exc).__name__}"
        return _status(now, sentinelsReachable=reachable, message=why)
    where = target.address if target.unix_path is not None else _join(target.host, target.port)
    return replication_status(where, info, reachable, now)
