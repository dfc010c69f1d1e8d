"""Metadata every builder uses: owner references, a shard's or a fleet's object metadata;
and the config digest and the managed-Redis part of a spec."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from relay.fleet.contract import Obj
from relayfleet_operator.builders.names import labels
from relayfleet_operator.spec import (
    API_VERSION,
    SHARD_KIND,
    ManagedRedis,
    ShardSpec,
)


def owner_reference(shard: ShardSpec, controller: bool = True) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": SHARD_KIND,
        "name": shard.name,
        "uid": shard.uid,
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def fleet_owner_references(owners: Iterable[ShardSpec]) -> list[Obj]:
    """Fleet-wide objects belong to every shard of the fleet, none as controller, so the
    garbage collector removes them only when the last shard is gone."""
    return [owner_reference(s, controller=False) for s in sorted(owners, key=lambda s: s.name)]


def shard_meta(name: str, shard: ShardSpec, component: str, **extra: Any) -> Obj:
    meta: Obj = {
        "name": name,
        "namespace": shard.namespace,
        "labels": labels(shard.fleet, shard.name, component),
        "ownerReferences": [owner_reference(shard)],
    }
    meta.update(extra)
    return meta


def fleet_meta(name: str, namespace: str, fleet: str, component: str, owners: Sequence[ShardSpec]) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace, "labels": labels(fleet, None, component)}
    if owners:
        meta["ownerReferences"] = fleet_owner_references(owners)
    return meta


def managed_spec(shard: ShardSpec) -> ManagedRedis:
    if not isinstance(shard.redis, ManagedRedis):
        raise ValueError(f"RelayShard {shard.name} uses external Redis: no Redis objects to build")
    return shard.redis


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
