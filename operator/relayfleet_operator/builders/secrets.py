"""Secrets: a managed shard's Redis password, and the fleet's full Redis URLs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from relay.fleet.contract import Obj
from relayfleet_operator.builders.meta import fleet_meta, shard_meta
from relayfleet_operator.builders.names import credentials_name, labels, redis_name
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


# On the Spark namespace's copy: which namespace's fleet it copies (two releases' fleets of
# one name stay apart by namespace, and a reader sees where it comes from).
SOURCE_NAMESPACE_ANNOTATION = "relayfleet.dev/source-namespace"


def spark_credentials_secret(
    spark_namespace: str, namespace: str, fleet: str, data: Mapping[str, str]
) -> Obj:
    """The copy of a fleet's credentials Secret (`data`: its base64 values) in the Spark jobs'
    namespace, under the same name: the Spark driver and executors mount it there, and the
    Spark ServiceAccount never reads a Secret of the fleet's namespace. No owner references
    (they cannot cross namespaces): the operator removes each shard's key as the shard leaves."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": credentials_name(fleet),
            "namespace": spark_namespace,
            "labels": labels(fleet, None, "spark-credentials"),
            "annotations": {SOURCE_NAMESPACE_ANNOTATION: namespace},
        },
        "type": "Opaque",
        "data": dict(sorted(data.items())),
    }
