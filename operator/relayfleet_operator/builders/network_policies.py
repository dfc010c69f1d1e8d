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
from relayfleet_operator.spec import DEFAULT_NEIGHBOURS, Neighbours, ShardSpec

# The label every namespace carries with its own name (set by the API server, immutable):
# a namespaceSelector on it names one namespace, where a selector on other labels would admit
# any namespace someone labels alike.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def redis_network_policy(shard: ShardSpec, neighbours: Neighbours = DEFAULT_NEIGHBOURS) -> Obj:
    """Only the fleet's own parts may reach a managed shard's Redis port: its relays, the
    other shards' Redis (MIGRATE connects server to server), the shard's Sentinels and the
    fleet's Pods that carry the redis-client label (the backup job), all of the shard's own
    namespace; the operator's Pods of the operator's namespace (migrations); and the Spark
    jobs' Pods of the fleet in the Spark namespace (retention trims Redis). A peer outside the
    shard's namespace is named by namespace and labels both: labels alone would admit any Pod
    of any namespace that copies them."""
    fleet = shard.fleet
    own = {LABEL_FLEET: fleet}
    peers: list[Obj] = [
        {"podSelector": {"matchLabels": {**own, LABEL_COMPONENT: "relay"}}},
        {"podSelector": {"matchLabels": {**own, LABEL_COMPONENT: "redis"}}},
        {"podSelector": {"matchLabels": {**own, LABEL_COMPONENT: "sentinel"}}},
        {"podSelector": {"matchLabels": {**own, LABEL_REDIS_CLIENT: "true"}}},
        _peer(neighbours.operator_namespace or shard.namespace, dict(neighbours.operator_labels)),
    ]
    spark = neighbours.spark_for(shard.namespace, fleet)
    if spark is not None:
        peers.append(_peer(spark, {**own, LABEL_REDIS_CLIENT: "true"}))
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


def _peer(namespace: str, pod_labels: dict[str, str]) -> Obj:
    """Pods with these labels in that one namespace (one peer: both selectors must match)."""
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}},
        "podSelector": {"matchLabels": pod_labels},
    }


def sentinel_network_policy(shard: ShardSpec, neighbours: Neighbours = DEFAULT_NEIGHBOURS) -> Obj:
    """The Sentinel port: the same parties as the Redis port (relays and the migrator ask
    it for the primary; the shard's Redis pods ask it at start-up)."""
    policy = redis_network_policy(shard, neighbours)
    policy["metadata"] = shard_meta(sentinel_name(shard.name), shard, "sentinel")
    policy["spec"]["podSelector"] = {"matchLabels": sentinel_selector(shard)}
    policy["spec"]["ingress"][0]["ports"] = [{"protocol": "TCP", "port": SENTINEL_PORT}]
    return policy
