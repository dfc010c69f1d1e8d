"""The operator's pure decision logic: planning, status conditions, the rebalance state
machine and the bounded-concurrency executor. No API server needed."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest
from relayfleet_operator import metrics as operator_metrics
from relayfleet_operator import shards
from relayfleet_operator.executor import MoveFailed, Outcome, run_moves
from relayfleet_operator.fleet_state import Context, founder, targets
from relayfleet_operator.kube import Kube
from relayfleet_operator.rebalance_states import ANNOTATION, Action, decide, moves_status, progress, remaining
from relayfleet_operator.spec import parse_shard
from relayfleet_operator.status import Observed, claim_problem, set_condition, shard_status
from relayfleet_operator.weight_planner import (
    apply_moves,
    plan_by_weight,
    plan_drain,
    target_counts,
    validate_moves,
)

from relay.fleet.contract import Move, PlanError, move_from_json
from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange, even_split

URLS = {"a": "redis://a/0", "b": "redis://b/0", "c": "redis://c/0"}


def one_shard() -> ShardMap:
    return ShardMap(
        "f", 1, {"a": URLS["a"], "b": URLS["b"], "c": URLS["c"]}, (SlotRange(0, SLOT_COUNT - 1, "a"),)
    )


# --- planning ------------------------------------------------------------------------------------


def test_target_counts_follow_weights_and_sum_exactly() -> None:
    counts = target_counts({"a": 1, "b": 1, "c": 1})
    assert sum(counts.values()) == SLOT_COUNT
    assert sorted(counts.values()) == [5461, 5461, 5462]
    assert target_counts({"a": 300, "b": 100}) == {"a": 12288, "b": 4096}
    with pytest.raises(PlanError, match="positive weight"):
        target_counts({"a": 0})


def test_plan_by_weight_balances_with_contiguous_moves() -> None:
    m = one_shard()
    moves = plan_by_weight(m, {"a": 100, "b": 100, "c": 100})
    validate_moves(m, moves)
    after = apply_moves(m, moves)
    assert after.slot_counts() == target_counts({"a": 100, "b": 100, "c": 100})
    assert len(moves) == 2  # one contiguous range per receiver
    assert all(mv.source == "a" for mv in moves)
    assert after.epoch == m.epoch + len(moves)
    # Already balanced: nothing to do.
    assert plan_by_weight(after, {"a": 100, "b": 100, "c": 100}) == []


def test_plan_by_weight_drains_shards_without_weight() -> None:
    m = even_split("f", URLS)
    moves = plan_by_weight(m, {"a": 1, "b": 1})
    after = apply_moves(m, moves)
    assert after.slot_counts()["c"] == 0
    assert after.slot_counts() == {"a": 8192, "b": 8192, "c": 0}


def test_plan_drain_moves_only_the_drained_shard_by_weight() -> None:
    m = even_split("f", URLS)
    moves = plan_drain(m, ["c"], {"a": 300, "b": 100})
    assert {mv.source for mv in moves} == {"c"}
    after = apply_moves(m, moves)
    counts = after.slot_counts()
    assert counts["c"] == 0
    assert counts["a"] + counts["b"] == SLOT_COUNT
    # a (weight 3) needs 12288 - 5461 = 6827, b (weight 1) is already above its 4096 share:
    # every drained slot goes to a.
    assert counts["a"] == 5461 + 5462
    assert plan_drain(after, ["c"], {"a": 1, "b": 1}) == []
    with pytest.raises(PlanError, match="no shard would be left"):
        plan_drain(m, ["c"], {"c": 5})
    with pytest.raises(PlanError, match="not in the shard map"):
        plan_drain(m, ["zz"], {"a": 1})


def test_validate_moves_rejects_bad_proposals() -> None:
    m = even_split("f", {"a": URLS["a"], "b": URLS["b"]})
    validate_moves(m, [Move(0, 10, "a", "b")])
    with pytest.raises(PlanError, match="owned by 'a', not 'b'"):
        validate_moves(m, [Move(0, 10, "b", "a")])
    with pytest.raises(PlanError, match="not in the shard map"):
        validate_moves(m, [Move(0, 10, "a", "x")])
    with pytest.raises(PlanError, match="moved more than once"):
        validate_moves(m, [Move(0, 10, "a", "b"), Move(10, 12, "a", "b")])
    with pytest.raises(PlanError, match="same from and to"):
        move_from_json({"slots": "0-5", "from": "a", "to": "a"})
    with pytest.raises(PlanError, match="bad slot range"):
        move_from_json({"slots": "9-2", "from": "a", "to": "b"})
    assert move_from_json({"slots": "7", "from": "a", "to": "b", "bytes": 5}) == Move(7, 7, "a", "b", 5)


# --- founding a fleet -----------------------------------------------------------------------------


def member(name: str, created: str, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created, **meta},
        "spec": {"fleet": "f", "redis": {"external": {"url": "redis://x/0"}}},
    }


def test_founder_is_the_oldest_valid_shard_whatever_the_handling_order() -> None:
    same = "2026-01-01T00:00:00Z"
    assert founder([member("b", same), member("a", same)]) == "a"  # same second: by name
    older = [member("z", "2025-12-31T23:59:59Z"), member("a", same)]
    assert founder(older) == founder(list(reversed(older))) == "z"
    leaving = member("z", "2025-01-01T00:00:00Z", deletionTimestamp=same)
    invalid = member("bad", "2020-01-01T00:00:00Z")
    invalid["spec"]["backup"] = {"schedule": "hourly"}  # passes the schema, not parse_shard
    assert founder([leaving, invalid, member("m", same)]) == "m"
    assert founder([]) is None


def test_an_invalid_spec_is_counted_as_an_operator_error() -> None:
    """What the schema cannot refuse ends the reconcile and counts in relayfleet_operator_errors_total."""
    body = member("bad", "2026-01-01T00:00:00Z")
    body["spec"]["backup"] = {"schedule": "hourly"}

    def errors() -> float:
        labels = {"kind": "RelayShard", "error": "SpecError"}
        return operator_metrics.REGISTRY.get_sample_value("relayfleet_operator_errors_total", labels) or 0.0

    before = errors()
    with pytest.raises(kopf.PermanentError, match="5 fields"):
        # fails before any I/O: the client is never used
        asyncio.run(shards.reconcile(Context(kube=Kube(None)), body, announce=False))
    assert errors() == before + 1


# --- status ---------------------------------------------------------------------------------------


def shard(**spec: Any) -> Any:
    body = {
        "metadata": {"name": "a", "namespace": "ns", "uid": "u", "generation": 4},
        "spec": {"fleet": "f", "redis": {"external": {"url": "redis://x/0"}}, "replicas": 2, **spec},
    }
    return parse_shard(body)


def conds(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status["conditions"]}


def _member(name: str, ready: str | None, message: str = "", deleting: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"fleet": "f", "redis": {"external": {"url": "redis://x/0"}}, "weight": 100},
    }
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    if ready is not None:
        obj["status"] = {"conditions": [{"type": "Ready", "status": ready, "message": message}]}
    return obj


def test_slots_only_move_into_ready_shards() -> None:
    """A drain (or a rebalance) picks its targets among Ready shards; the others are named
    with why they are not Ready, so the status says what the move waits for."""
    shard_map = one_shard()
    members = [
        _member("a", "True", deleting=True),
        _member("b", "False", "the Redis StatefulSet has no ready pod yet"),
        _member("c", None),
    ]
    found = targets(members, shard_map, leaving=["a"])
    assert found.weights == {}
    assert found.waiting == {"b": "the Redis StatefulSet has no ready pod yet", "c": "not reconciled yet"}
    assert found.why_waiting(SLOT_COUNT) == (
        "waiting for a Ready shard to take 16384 slots "
        "(b: the Redis StatefulSet has no ready pod yet; c: not reconciled yet)"
    )
    members[2] = _member("c", "True")
    found = targets(members, shard_map, leaving=["a"])
    assert (found.weights, list(found.waiting)) == ({"c": 100}, ["b"])
    assert plan_drain(shard_map, ["a"], found.weights)[0].target == "c"
    # a shard outside the map (not joined yet) is neither a target nor waited for
    assert targets(members, ShardMap("f", 1, {"a": URLS["a"]}, (SlotRange(0, SLOT_COUNT - 1, "a"),))) == (
        targets([], shard_map)
    )


def _claim(phase: str, storage_class: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"resources": {"requests": {"storage": "1Gi"}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {"metadata": {"name": "data-relayfleet-m-redis-0"}, "spec": spec, "status": {"phase": phase}}


def test_a_pending_redis_claim_is_named_in_the_shard_status() -> None:
    """No StorageClass and no PersistentVolume: the claim stays Pending, and the status says so
    instead of only "the Redis StatefulSet has no ready pod yet"."""
    spec = parse_shard(
        {
            "metadata": {"name": "m", "namespace": "ns", "generation": 1},
            "spec": {"fleet": "f", "redis": {"managed": {}}},
        }
    )
    no_class = claim_problem(_claim("Pending"))
    assert no_class == (
        "PersistentVolumeClaim data-relayfleet-m-redis-0 is Pending: it names no StorageClass (the "
        "cluster had no default one when it was made) and no PersistentVolume of 1Gi or more is "
        "available; see docs/operator.md, Storage"
    )
    assert "StorageClass fast has not provided a volume" in str(claim_problem(_claim("Pending", "fast")))
    assert "lost its PersistentVolume" in str(claim_problem(_claim("Lost")))
    assert claim_problem(_claim("Bound")) is None
    assert claim_problem(None) is None
    sts = {"status": {"replicas": 1, "readyReplicas": 0}}
    status = shard_status(spec, None, Observed(statefulset=sts, in_shard_map=True, storage=no_class))
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["message"]) == ("False", f"{no_class}; 0/2 relay pods ready")
    plain = shard_status(spec, None, Observed(statefulset=sts, in_shard_map=True))
    assert "the Redis StatefulSet has no ready pod yet" in str(plain["conditions"])


def test_status_provisioning_then_ready() -> None:
    spec = shard()
    pending = shard_status(spec, None, Observed(), now="2025-01-01T00:00:00Z")
    assert pending["phase"] == "Pending"
    assert conds(pending) == {
        "Ready": "False",
        "Progressing": "True",
        "Degraded": "False",
        "Migrating": "False",
    }
    assert all(c["observedGeneration"] == 4 for c in pending["conditions"])
    dep = {
        "metadata": {"generation": 2},
        "status": {"observedGeneration": 2, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2},
    }
    ready = shard_status(
        spec,
        pending,
        Observed(
            deployment=dep, redis_reachable=True, in_shard_map=True, slot_count=16384, redis_endpoint="x:6379"
        ),
        now="2025-01-01T00:01:00Z",
    )
    assert ready["phase"] == "Ready"
    assert ready["readyReplicas"] == 2
    assert ready["slotCount"] == 16384
    assert ready["redisEndpoint"] == "x:6379"
    assert conds(ready) == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
        "Migrating": "False",
    }
    by_type = {c["type"]: c for c in ready["conditions"]}
    assert by_type["Ready"]["lastTransitionTime"] == "2025-01-01T00:01:00Z"
    assert by_type["Degraded"]["lastTransitionTime"] == "2025-01-01T00:00:00Z"  # unchanged status keeps it


def test_status_degraded_and_draining() -> None:
    spec = shard()
    down = shard_status(spec, None, Observed(redis_reachable=False, in_shard_map=True))
    assert down["phase"] == "Degraded"
    assert conds(down)["Degraded"] == "True"
    assert {c["type"]: c["reason"] for c in down["conditions"]}["Degraded"] == "RedisUnreachable"
    draining = shard_status(spec, None, Observed(draining=True, migrating="moving 0-100"))
    assert draining["phase"] == "Draining"
    assert conds(draining)["Migrating"] == "True"
    blocked = shard_status(spec, None, Observed(blocked="last shard holds data"))
    assert blocked["phase"] == "DeletionBlocked"
    assert {c["type"]: c["message"] for c in blocked["conditions"]}["Degraded"] == "last shard holds data"


def test_set_condition_keeps_transition_time_when_status_unchanged() -> None:
    c1 = set_condition([], "Ready", False, "X", "m", 1, "t1")
    c2 = set_condition(c1, "Ready", False, "Y", "m2", 2, "t2")
    assert c2[0]["lastTransitionTime"] == "t1"
    assert c2[0]["observedGeneration"] == 2
    c3 = set_condition(c2, "Ready", True, "Z", "", 2, "t3")
    assert c3[0]["lastTransitionTime"] == "t3"


# --- the rebalance state machine -----------------------------------------------------------------


def rr(
    phase: str | None = None, annotation: str | None = None, generation: int = 1, **spec: Any
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "r", "namespace": "ns", "generation": generation}
    if annotation:
        meta["annotations"] = {ANNOTATION: annotation}
    body: dict[str, Any] = {"metadata": meta, "spec": {"fleet": "f", **spec}}
    if phase:
        body["status"] = {"phase": phase, "observedGeneration": 1}
    return body


@pytest.mark.parametrize(
    ("body", "action", "consume"),
    [
        (rr(), Action.INIT, False),
        (rr("PendingProposal"), Action.PROPOSE, False),
        (rr("ProposalReady"), Action.WAIT, False),
        (rr("ProposalReady", "approve"), Action.START, True),
        (rr("ProposalReady", autoApprove=True), Action.START, False),
        (rr("ProposalReady", "stop"), Action.STOP, True),
        (rr("ProposalReady", "refresh"), Action.REFRESH, True),
        (rr("ProposalReady", generation=2), Action.REFRESH, False),
        (rr("Rebalancing"), Action.EXECUTE, False),
        (rr("Rebalancing", "stop"), Action.STOP, True),
        (rr("Stopped", "approve"), Action.START, True),
        (rr("Stopped", "refresh"), Action.REFRESH, True),
        (rr("Stopped"), Action.WAIT, False),
        (rr("Ready"), Action.WAIT, False),
        (rr("Ready", "refresh"), Action.REFRESH, True),
        (rr("Ready", "approve"), Action.WAIT, True),
        (rr("NotReady", generation=2), Action.REFRESH, False),
    ],
)
def test_decide(body: dict[str, Any], action: Action, consume: bool) -> None:
    d = decide(body)
    assert d.action == action
    assert d.consume_annotation == consume


def test_progress_and_remaining() -> None:
    entries = moves_status([Move(0, 99, "a", "b", 1000), Move(100, 399, "a", "c", 3000)])
    assert progress(entries)["percent"] == "0%"
    entries[1]["state"] = "Done"
    entries[1]["bytesMoved"] = 2900
    p = progress(entries)
    assert p == {
        "movesTotal": 2,
        "movesDone": 1,
        "slotsTotal": 400,
        "slotsMoved": 300,
        "bytesTotal": 4000,
        "bytesMoved": 2900,
        "percent": "75%",
    }
    assert remaining(entries) == [0]


# --- the executor --------------------------------------------------------------------------------


async def test_executor_bounds_concurrency() -> None:
    running = 0
    peak = 0
    done: list[int] = []

    async def run_one(i: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        done.append(i)

    assert await run_moves(range(10), run_one, concurrency=3) == Outcome.DONE
    assert sorted(done) == list(range(10))
    assert peak == 3


async def test_executor_stops_between_moves_and_waits_for_running_ones() -> None:
    started: list[int] = []
    finished: list[int] = []

    async def run_one(i: int) -> None:
        started.append(i)
        await asyncio.sleep(0.01)
        finished.append(i)

    async def should_stop() -> bool:
        return len(started) >= 2

    assert await run_moves(range(5), run_one, concurrency=1, should_stop=should_stop) == Outcome.STOPPED
    assert started == [0, 1]
    assert finished == [0, 1]


async def test_executor_reports_the_failed_move() -> None:
    async def run_one(i: int) -> None:
        if i == 1:
            raise RuntimeError("target refused MIGRATE")

    with pytest.raises(MoveFailed, match="target refused MIGRATE") as info:
        await run_moves([0, 1, 2], run_one, concurrency=1)
    assert info.value.index == 1
