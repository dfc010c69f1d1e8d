"""NetworkPolicies: who may reach a managed shard's Redis and Sentinel ports."""

from __future__ import annotations

from relay.fleet.contract import Obj
from relayfleet_operator.builders.meta import shard_meta
from relayfleet_operator.builders.names import (
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_REDIS_CLIENT,
    REDIS_PORT,
    SENTINEL_PORT,
    redis_name,
    redis_selector,
    sentinel_name,
    sentinel_selector,
)
from relayfleet_operator.spec import ShardSpec


def redis_network_policy(shard: ShardSpec) -> Obj:
    """Only the fleet's own parts may reach a managed shard's Redis port: its relays, the
    other shards' Redis (MIGRATE connects server to server), the shard's Sentinels, the operator
    (migrations) and pods that carry the redis-client label (the Spark jobs' driver and
    executors, the backup job)."""
    fleet = shard.fleet
    peers: list[Obj] = [
        {"podSelector": {"matchLabels": {LABEL_FLEET: fleet, LABEL_COMPONENT: "relay"}}},
        {"podSelector": {"matchLabels": {LABEL_FLEET: fleet, LABEL_COMPONENT: "redis"}}},
        {"podSelector": {"matchLabels": {LABEL_FLEET: fleet, LABEL_COMPONENT: "sentinel"}}},
        {"podSelector": {"matchLabels": {LABEL_REDIS_CLIENT: "true"}}},
        {
            # the operator may run in another namespace (watchAllNamespaces)
            "namespaceSelector": {},
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "relayfleet", LABEL_COMPONENT: "operator"}
            },
        },
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": shard_meta(redis_name(shard.name), shard, "redis"),
        "spec": {
            "podSelector": {"matchLabels": redis_selector(shard.name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}],
        },
    }


def sentinel_network_policy(shard: ShardSpec) -> Obj:
    """The Sentinel port: the same parties as the Redis port (relays and the migrator ask
    it for the primary; the shard's Redis pods ask it at start-up)."""
    policy = redis_network_policy(shard)
    policy["metadata"] = shard_meta(sentinel_name(shard.name), shard, "sentinel")
    policy["spec"]["podSelector"] = {"matchLabels": sentinel_selector(shard)}
    policy["spec"]["ingress"][0]["ports"] = [{"protocol": "TCP", "port": SENTINEL_PORT}]
    return policy
