"""RelayRebalance objects the operator proposes itself (spec.autoRebalance)."""

from __future__ import annotations

from relay.fleet.contract import Obj
from relayfleet_operator.builders.meta import owner_reference
from relayfleet_operator.builders.names import labels
from relayfleet_operator.spec import API_VERSION, REBALANCE_KIND, ShardSpec


def join_rebalance_name(shard: ShardSpec) -> str:
    return f"{shard.name}-join"


def join_rebalance(shard: ShardSpec) -> Obj:
    """A new shard's request for its share of the fleet's slots, approved at once; owned by
    the shard (not as controller), so it goes away with it."""
    return {
        "apiVersion": API_VERSION,
        "kind": REBALANCE_KIND,
        "metadata": {
            "name": join_rebalance_name(shard),
            "namespace": shard.namespace,
            "labels": labels(shard.fleet, shard.name, "rebalance"),
            "ownerReferences": [owner_reference(shard, controller=False)],
        },
        "spec": {"fleet": shard.fleet, "mode": "weight", "autoApprove": True},
    }
