"""The fleet contract (relay.fleet.contract): one Move and JSON form, one slot-range
syntax, one shard-map ConfigMap name/key and update loop for relay, operator and Spark."""

from __future__ import annotations

import pytest
import relayfleet_operator.builders as builders
import relayfleet_operator.weight_planner as op_planning

import spark_jobs.load_planner as spark_planning
from relay.fleet import contract
from relay.fleet.contract import MapStore, MapWriteConflict, Move, PlanError, move_from_json, parse_slots
from relay.fleet.sharding import ShardMap, ShardMapError, even_split, parse_slot_spec


def test_every_side_uses_the_same_move() -> None:
    assert op_planning.__dict__["Move"] is Move  # imported from the contract, not a copy
    assert spark_planning.__dict__["Move"] is Move  # the planner builds them; rebalance writes to_json()
    move = Move(0, 99, "a", "b", 1000, 7)
    assert move.to_json() == {"slots": "0-99", "from": "a", "to": "b", "bytes": 1000, "messages": 7}
    assert move_from_json(move.to_json()) == move
    assert move_from_json({"slots": "7", "from": "a", "to": "b"}) == Move(7, 7, "a", "b")


@pytest.mark.parametrize(
    ("text", "error"),
    [("x-2", "expected A-B"), ("5-2", "within 0-16383"), ("0-16384", "within 0-16383")],
)
def test_one_slot_range_syntax(text: str, error: str) -> None:
    with pytest.raises(PlanError, match=error):
        parse_slots(text)
    with pytest.raises(ShardMapError, match=error):
        parse_slot_spec(text)
    with pytest.raises(PlanError, match=error):
        move_from_json({"slots": text, "from": "a", "to": "b"})


def test_one_configmap_name_and_key() -> None:
    """The operator builds and reads the ConfigMap through the contract, as the relay does."""
    assert contract.shardmap_configmap_name("f") == "relayfleet-f-shardmap"
    assert contract.SHARDMAP_KEY == "shardmap.json"
    shard_map = even_split("f", {"a": "redis://a", "b": "redis://b"})
    cm = builders.shard_map_configmap("ns", shard_map, [])
    assert cm["metadata"]["name"] == "relayfleet-f-shardmap"
    assert cm["data"] == contract.shard_map_configmap_data(shard_map) == {"shardmap.json": shard_map.dumps()}
    assert builders.shard_map_from_configmap(cm) == shard_map
    assert contract.shard_map_from_configmap_data(cm["data"], "ns/relayfleet-f-shardmap") == shard_map


@pytest.mark.parametrize(
    ("data", "error"),
    [(None, "ConfigMap ns/m has no key shardmap.json"), ({"shardmap.json": "{"}, "ConfigMap ns/m: ")],
)
def test_one_configmap_reader(data: dict[str, str] | None, error: str) -> None:
    with pytest.raises(ShardMapError, match=error):
        contract.shard_map_from_configmap_data(data, "ns/m")
    with pytest.raises(ShardMapError, match=error):
        builders.shard_map_from_configmap({"metadata": {"namespace": "ns", "name": "m"}, "data": data})


async def test_update_loop_recomputes_after_a_lost_race() -> None:
    """A writer that loses a race re-reads the winner's map and applies its change on top."""
    state: dict[str, tuple[ShardMap, int]] = {
        "cm": (even_split("f", {"a": "redis://a", "b": "redis://b"}), 1)
    }
    raced = [False]

    async def read() -> tuple[ShardMap | None, int | None]:
        current, version = state["cm"]
        return current, version

    async def write(new: ShardMap, version: int | None) -> None:
        if not raced[0]:  # another writer gets in first, once
            raced[0] = True
            winner = state["cm"][0].with_slots([0], "b")
            state["cm"] = (winner, state["cm"][1] + 1)
        if version != state["cm"][1]:
            raise MapWriteConflict
        state["cm"] = (new, version + 1)

    result, written = await contract.update_shard_map(
        MapStore(read, write), lambda m: None if m is None else m.with_slots([16383], "a"), 3
    )
    assert written
    assert result is not None
    assert result.shard_for_slot(0) == "b"  # the winner's write is kept
    assert result.shard_for_slot(16383) == "a"  # and ours applied on top
    assert state["cm"][0] == result

    same, written = await contract.update_shard_map(MapStore(read, write), lambda m: m, 3)
    assert not written
    assert same == result


def test_spark_proposal_moves_read_back_by_the_operator() -> None:
    """The moves a Spark proposal carries are exactly what the operator parses."""
    from spark_jobs.load_planner import SlotLoad, plan
    from spark_jobs.rebalance import proposal_spec

    shard_map = even_split("f", {"a": "redis://a", "b": "redis://b"})
    stats = [SlotLoad(slot, "a", msgs=100, bytes=10_000) for slot in range(0, 8192, 64)]
    result = plan(shard_map, stats, metric="bytes", tolerance=0.05)
    assert result.moves
    entries = proposal_spec(result)["moves"]
    assert [move_from_json(e) for e in entries] == list(result.moves)
    assert set(entries[0]) == {"slots", "from", "to", "bytes", "messages"}
