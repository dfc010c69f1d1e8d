"""ConfigMaps: redis.conf, the replicated shard's start-up scripts, and the shard map."""

from __future__ import annotations

from collections.abc import Sequence

from relay.fleet.contract import Obj, shard_map_configmap_data, shardmap_configmap_name
from relay.fleet.sharding import (
    ShardMap,
    parse_shard_map,
)
from relayfleet_operator.builders.meta import fleet_meta, managed_spec, shard_meta
from relayfleet_operator.builders.names import redis_config_name, redis_ha_name
from relayfleet_operator.builders.redis_conf import redis_conf
from relayfleet_operator.redis_scripts import PRE_STOP_REDIS, START_REDIS, START_SENTINEL
from relayfleet_operator.spec import ShardSpec


def redis_config_map(shard: ShardSpec) -> Obj:
    managed = managed_spec(shard)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": shard_meta(redis_config_name(shard.name), shard, "redis"),
        "data": {
            "redis.conf": redis_conf(
                managed.appendfsync, managed.maxmemory_bytes, tls=managed.tls_secret is not None
            )
        },
    }


def redis_ha_config_map(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": shard_meta(redis_ha_name(shard.name), shard, "redis"),
        "data": {
            "start-redis.sh": START_REDIS,
            "pre-stop-redis.sh": PRE_STOP_REDIS,
            "start-sentinel.sh": START_SENTINEL,
        },
    }


def shard_map_configmap(namespace: str, shard_map: ShardMap, owners: Sequence[ShardSpec]) -> Obj:
    # Round-trip through the validator: a map that breaks the contract never gets written.
    parse_shard_map(shard_map.to_json())
    meta = fleet_meta(
        shardmap_configmap_name(shard_map.fleet), namespace, shard_map.fleet, "shardmap", owners
    )
    meta["annotations"] = {"relayfleet.dev/epoch": str(shard_map.epoch)}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": shard_map_configmap_data(shard_map),
    }
