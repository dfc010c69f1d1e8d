"""Secrets: a managed shard's Redis password, and the fleet's full Redis URLs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from relay.fleet.contract import Obj
from relayfleet_operator.builders.meta import fleet_meta, shard_meta
from relayfleet_operator.builders.names import credentials_name, redis_name
from relayfleet_operator.builders.redis_conf import redis_auth_conf
from relayfleet_operator.spec import ShardSpec


def redis_password_secret(shard: ShardSpec, password: str) -> Obj:
    """Created once (the handler generates the password); never rewritten afterwards."""
    if not password:
        raise ValueError("the Redis password must not be empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": shard_meta(redis_name(shard.name), shard, "redis"),
        "type": "Opaque",
        "stringData": {"password": password, "auth.conf": redis_auth_conf(password)},
    }


def credentials_secret(
    namespace: str, fleet: str, urls: Mapping[str, str], owners: Sequence[ShardSpec]
) -> Obj:
    """Full Redis URLs (with passwords) per shard, mounted into relay pods as files named
    after the shards; the shard map itself carries only credential-free URLs."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": fleet_meta(credentials_name(fleet), namespace, fleet, "fleet", owners),
        "type": "Opaque",
        "stringData": dict(sorted(urls.items())),
    }
