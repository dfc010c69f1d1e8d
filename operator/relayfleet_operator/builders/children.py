"""Which objects one shard and one fleet own, in apply order, and which ones a changed spec retires."""

from __future__ import annotations

from collections.abc import Sequence

from relay.fleet.contract import Obj
from relayfleet_operator.builders.backup import backup_claim, backup_cronjob
from relayfleet_operator.builders.configmaps import redis_config_map, redis_ha_config_map
from relayfleet_operator.builders.deployments import relay_deployment
from relayfleet_operator.builders.meta import managed_spec
from relayfleet_operator.builders.names import backup_name, redis_ha_name, redis_name, sentinel_name
from relayfleet_operator.builders.network_policies import redis_network_policy, sentinel_network_policy
from relayfleet_operator.builders.pdbs import redis_pdb, relay_pdb, sentinel_pdb
from relayfleet_operator.builders.rbac import relay_role, relay_role_binding, relay_service_account
from relayfleet_operator.builders.services import (
    fleet_service,
    redis_headless_service,
    relay_service,
    sentinel_service,
)
from relayfleet_operator.builders.statefulsets import redis_statefulset, sentinel_statefulset
from relayfleet_operator.spec import (
    DEFAULT_NEIGHBOURS,
    ExternalRedis,
    ManagedRedis,
    Neighbours,
    ShardSpec,
)


def redis_ha_objects(shard: ShardSpec, neighbours: Neighbours = DEFAULT_NEIGHBOURS) -> list[Obj]:
    """The extra objects of a shard with replicas (none without)."""
    if not managed_spec(shard).sentinel:
        return []
    return [
        redis_ha_config_map(shard),
        sentinel_service(shard),
        sentinel_network_policy(shard, neighbours),
        redis_pdb(shard),
        sentinel_pdb(shard),
        sentinel_statefulset(shard),
    ]


def backup_objects(shard: ShardSpec) -> list[Obj]:
    return [] if shard.backup is None else [backup_claim(shard), backup_cronjob(shard)]


Ref = tuple[str, str, str]  # apiVersion, kind, name


def retired_children(shard: ShardSpec) -> list[list[Ref]]:
    """Optional children the spec no longer asks for, in groups whose first member tells
    whether the group exists (one GET per group on a resync, not one DELETE per object):
    the Sentinel objects after replicas went back to 0, the backup CronJob after spec.backup
    was removed (its claim, holding the backups, stays)."""
    out: list[list[Ref]] = []
    if isinstance(shard.redis, ManagedRedis) and not shard.redis.sentinel:
        sentinel = sentinel_name(shard.name)
        out.append(
            [
                ("apps/v1", "StatefulSet", sentinel),
                ("policy/v1", "PodDisruptionBudget", sentinel),
                ("policy/v1", "PodDisruptionBudget", redis_name(shard.name)),
                ("networking.k8s.io/v1", "NetworkPolicy", sentinel),
                ("v1", "Service", sentinel),
                ("v1", "ConfigMap", redis_ha_name(shard.name)),
            ]
        )
    if shard.backup is None:
        out.append([("batch/v1", "CronJob", backup_name(shard.name))])
    return out


def shard_children(
    shard: ShardSpec, secrets_digest: str | None = None, neighbours: Neighbours = DEFAULT_NEIGHBOURS
) -> list[Obj]:
    """Every object owned by one shard, in apply order (the password Secret excepted: it is
    created once by the handler, never re-applied); `neighbours` for the NetworkPolicies."""
    objs = [relay_service(shard), relay_pdb(shard), relay_deployment(shard, secrets_digest)]
    if isinstance(shard.redis, ExternalRedis):
        return objs
    return [
        redis_config_map(shard),
        redis_headless_service(shard),
        redis_network_policy(shard, neighbours),
        *redis_ha_objects(shard, neighbours),
        redis_statefulset(shard),
        *backup_objects(shard),
        *objs,
    ]


def reconcile_objects(
    shard: ShardSpec,
    owners: Sequence[ShardSpec],
    secrets_digest: str | None,
    neighbours: Neighbours = DEFAULT_NEIGHBOURS,
) -> list[Obj]:
    """What one reconcile applies, in order: the fleet's objects first, so the ServiceAccount
    the relay Deployment runs as exists before it (else its ReplicaSet meets FailedCreate)."""
    return [
        *fleet_objects(shard.namespace, shard.fleet, owners),
        *shard_children(shard, secrets_digest, neighbours),
    ]


def fleet_objects(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> list[Obj]:
    return [
        relay_service_account(namespace, fleet, owners),
        relay_role(namespace, fleet, owners),
        relay_role_binding(namespace, fleet, owners),
        fleet_service(namespace, fleet, owners),
    ]
