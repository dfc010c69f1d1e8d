"""Services: a shard's relays, its Redis and Sentinels (headless), and the fleet-wide one."""

from __future__ import annotations

from collections.abc import Sequence

from relay.fleet.contract import Obj
from relayfleet_operator.builders.meta import fleet_meta, shard_meta
from relayfleet_operator.builders.names import (
    LABEL_COMPONENT,
    LABEL_FLEET,
    REDIS_PORT,
    SENTINEL_PORT,
    fleet_service_name,
    redis_name,
    redis_selector,
    relay_name,
    relay_selector,
    sentinel_name,
    sentinel_selector,
)
from relayfleet_operator.spec import ShardSpec


def _http_ports() -> list[Obj]:
    """Port 80 onto the relay container's named port."""
    return [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


def relay_service(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": shard_meta(relay_name(shard.name), shard, "relay"),
        "spec": {
            "type": "ClusterIP",
            "selector": relay_selector(shard.name),
            "ports": _http_ports(),
        },
    }


def redis_headless_service(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": shard_meta(redis_name(shard.name), shard, "redis"),
        "spec": {
            "clusterIP": "None",
            # Clients address the one pod by the Service name; it must resolve before Ready
            # is known so the operator can wait on it.
            "publishNotReadyAddresses": True,
            "selector": redis_selector(shard.name),
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }


def sentinel_service(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": shard_meta(sentinel_name(shard.name), shard, "sentinel"),
        "spec": {
            "clusterIP": "None",
            # Each Sentinel is addressed by its own pod name, also before it is Ready.
            "publishNotReadyAddresses": True,
            "selector": sentinel_selector(shard),
            "ports": [
                {"name": "sentinel", "port": SENTINEL_PORT, "targetPort": "sentinel", "protocol": "TCP"}
            ],
        },
    }


def fleet_service(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> Obj:
    """One Service across every relay pod of the fleet: clients need not know the shards."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": fleet_meta(fleet_service_name(fleet), namespace, fleet, "fleet", owners),
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_FLEET: fleet, LABEL_COMPONENT: "relay"},
            "ports": _http_ports(),
        },
    }
