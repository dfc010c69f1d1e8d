"""PodDisruptionBudgets: one pod of each kind down at a time."""

from __future__ import annotations

from collections.abc import Mapping

from relay.fleet.contract import Obj
from relayfleet_operator.builders.meta import shard_meta
from relayfleet_operator.builders.names import (
    redis_name,
    redis_selector,
    relay_name,
    relay_selector,
    sentinel_name,
    sentinel_selector,
)
from relayfleet_operator.spec import ShardSpec


def relay_pdb(shard: ShardSpec) -> Obj:
    return _pdb(relay_name(shard.name), shard, "relay", relay_selector(shard.name))


def _pdb(name: str, shard: ShardSpec, component: str, selector: Mapping[str, str]) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": shard_meta(name, shard, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(selector)}},
    }


def redis_pdb(shard: ShardSpec) -> Obj:
    """One Redis node down at a time (a drain never takes the primary and its last replica)."""
    return _pdb(redis_name(shard.name), shard, "redis", redis_selector(shard.name))


def sentinel_pdb(shard: ShardSpec) -> Obj:
    """Two of three Sentinels stay: the quorum and the failover majority both need two."""
    return _pdb(sentinel_name(shard.name), shard, "sentinel", sentinel_selector(shard))
