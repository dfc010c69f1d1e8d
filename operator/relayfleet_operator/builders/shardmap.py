"""Shard-map arithmetic: a fleet's first map, a shard joining and leaving; and reading the
map back from its ConfigMap."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relay.fleet.contract import shard_map_from_configmap_data
from relay.fleet.sharding import (
    SLOT_COUNT,
    ShardMap,
    ShardMapError,
    SlotRange,
)


def initial_shard_map(fleet: str, shard: str, url: str) -> ShardMap:
    """The first shard of a fleet owns all 16384 slots."""
    return ShardMap(fleet, 1, {shard: url}, (SlotRange(0, SLOT_COUNT - 1, shard),))


def join_shard_map(current: ShardMap | None, fleet: str, shard: str, url: str) -> ShardMap:
    """The map after `shard` joins (with no slots) or changes its URL; unchanged if neither."""
    if current is None:
        return initial_shard_map(fleet, shard, url)
    if current.fleet != fleet:
        raise ShardMapError(f"shard map belongs to fleet {current.fleet!r}, not {fleet!r}")
    if current.shards.get(shard) == url:
        return current
    shards = {**current.shards, shard: url}
    return ShardMap(current.fleet, current.epoch + 1, shards, current.ranges)


def leave_shard_map(current: ShardMap, shard: str) -> ShardMap | None:
    """The map without `shard`, which must own no slots; None when no shard is left."""
    if shard not in current.shards:
        return current
    owned = current.slot_counts().get(shard, 0)
    if owned:
        raise ShardMapError(f"shard {shard!r} still owns {owned} slots; migrate them away first")
    shards = {k: v for k, v in current.shards.items() if k != shard}
    if not shards:
        return None
    return ShardMap(current.fleet, current.epoch + 1, shards, current.ranges)


def shard_map_from_configmap(cm: Mapping[str, Any] | None) -> ShardMap | None:
    if not cm:
        return None
    meta = cm.get("metadata") or {}
    return shard_map_from_configmap_data(cm.get("data"), f"{meta.get('namespace')}/{meta.get('name')}")
