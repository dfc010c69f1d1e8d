"""A bytes-blind reference planner the rebalance planner is measured against."""

from __future__ import annotations

from collections.abc import Sequence

from relay.fleet.sharding import SLOT_COUNT, ShardMap


def naive(m: ShardMap, load: Sequence[float], nbytes: Sequence[int], tol: float) -> tuple[int, float]:
    """Bytes-blind reference: peel slots off the end of the hottest shard's last range
    onto the coldest shard until every shard is within tolerance. (bytes moved, max/mean)"""
    owner = [m.shard_for_slot(s) for s in range(SLOT_COUNT)]
    per = {s: 0.0 for s in m.shards}
    for s in range(SLOT_COUNT):
        per[owner[s]] += load[s]
    mean = sum(per.values()) / len(per)
    moved = 0
    for _ in range(SLOT_COUNT):
        hot = max(per, key=lambda s: per[s])
        if per[hot] <= mean * (1 + tol):
            break
        cold = min(per, key=lambda s: per[s])
        slot = max(s for s in range(SLOT_COUNT) if owner[s] == hot)
        owner[slot] = cold
        per[hot] -= load[slot]
        per[cold] += load[slot]
        moved += nbytes[slot]
    return moved, max(per.values()) / mean
