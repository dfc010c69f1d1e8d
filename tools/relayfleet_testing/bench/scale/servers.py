"""The Redis a scale phase measures: a redis-server with the chart's settings (the operator's
redis.conf for a managed shard, so settings the operator adds are measured too), and its CPU.
Its memory is read with the memory helper's measure (relayfleet_testing.bench.memory)."""

from __future__ import annotations

import shlex
import tempfile

import redis
from relayfleet_operator.builders.redis_conf import redis_conf
from relayfleet_testing.localredis import LocalRedis
from relayfleet_testing.localredis import redis_server_binary as _binary

# set by LocalRedis itself, or only meaningful in a pod (listening, data dir, password include)
_OWN = {"bind", "port", "dir", "include", "appendonly", "appendfsync", "save", "maxmemory-policy"}


def chart_args() -> list[str]:
    """The managed shard's redis.conf lines LocalRedis does not set, as command-line arguments."""
    out: list[str] = []
    for line in redis_conf(auth_include=None).splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, *values = shlex.split(line)
        if name not in _OWN:
            out += [f"--{name}", *values]
    return out


def chart_redis(appendonly: bool = True) -> LocalRedis:
    """A started redis-server with the chart's settings (AOF everysec unless `appendonly` is
    False: a seeding run whose data is thrown away)."""
    args = chart_args() + ([] if appendonly else ["--appendonly", "no"])
    return LocalRedis(
        binary=_binary(), dir=tempfile.mkdtemp(prefix="relayfleet-scale-"), extra_args=args
    ).start(30)


def redis_cpu_s(url: str) -> float:
    """CPU seconds the redis-server has used (INFO CPU, user + system of its main process)."""
    with redis.Redis.from_url(url) as r:
        info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
