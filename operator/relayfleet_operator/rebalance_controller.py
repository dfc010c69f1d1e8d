"""Driving one RelayRebalance through its states against the API (see rebalance_states.py for the
states). Called repeatedly by a kopf timer; each call does at most one step, except
Rebalancing, which runs the remaining moves to the end (recording each in status.moves so a
restarted operator picks up where this one stopped)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from relay.fleet.contract import Move, Obj, PlanError, move_from_json
from relay.fleet.sharding import ShardMap
from relayfleet_operator import fleet_state, metrics, shard_redis
from relayfleet_operator.executor import MoveFailed, Outcome, run_moves
from relayfleet_operator.kube import KubeError
from relayfleet_operator.rebalance_states import (
    ANNOTATION,
    STOP,
    Action,
    Phase,
    decide,
    moves_status,
    progress,
    remaining,
)
from relayfleet_operator.shards import notify
from relayfleet_operator.spec import API_VERSION, REBALANCE_KIND
from relayfleet_operator.status import now_rfc3339, set_condition
from relayfleet_operator.weight_planner import plan_by_weight, plan_drain, validate_moves

log = logging.getLogger("relayfleet.operator")


def _where(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta["name"])


async def _patch_status(ctx: fleet_state.Context, body: Mapping[str, Any], status: Obj) -> None:
    namespace, name = _where(body)
    await ctx.kube.merge_patch(API_VERSION, REBALANCE_KIND, namespace, name, {"status": status}, "status")


async def _consume_annotation(ctx: fleet_state.Context, body: Mapping[str, Any]) -> None:
    namespace, name = _where(body)
    patch = {"metadata": {"annotations": {ANNOTATION: None}}}
    await ctx.kube.merge_patch(API_VERSION, REBALANCE_KIND, namespace, name, patch)


def _conditions(body: Mapping[str, Any], phase: Phase, message: str) -> list[Obj]:
    """Ready / Progressing / Stalled, so `kubectl wait --for=condition=Ready` works."""
    status = body.get("status") or {}
    gen = int((body.get("metadata") or {}).get("generation") or 0)
    now = now_rfc3339()
    conds: list[Obj] = list(status.get("conditions") or ())
    conds = set_condition(conds, "Ready", phase == Phase.READY, phase.value, message, gen, now)
    busy = phase in (Phase.NEW, Phase.PENDING_PROPOSAL, Phase.REBALANCING)
    conds = set_condition(conds, "Progressing", busy, phase.value, message if busy else "", gen, now)
    stalled = phase in (Phase.NOT_READY, Phase.STOPPED)
    return set_condition(conds, "Stalled", stalled, phase.value, message if stalled else "", gen, now)


async def _to_phase(
    ctx: fleet_state.Context, body: Mapping[str, Any], phase: Phase, message: str, **extra: Any
) -> None:
    gen = int((body.get("metadata") or {}).get("generation") or 0)
    status: Obj = {
        "phase": phase.value,
        "message": message,
        "observedGeneration": gen,
        "conditions": _conditions(body, phase, message),
        **extra,
    }
    await _patch_status(ctx, body, status)
    previous = (body.get("status") or {}).get("phase")
    if previous != phase.value:
        notify(body, phase.value, message, warning=phase == Phase.NOT_READY)


async def advance(ctx: fleet_state.Context, body: Mapping[str, Any], busy: set[tuple[str, str]]) -> None:
    """One step of the state machine for `body` (skipped while a step is already running)."""
    key = _where(body)
    if key in busy:
        return
    busy.add(key)
    try:
        decision = decide(body)
        if decision.consume_annotation:
            await _consume_annotation(ctx, body)
        if decision.action == Action.INIT:
            await _to_phase(ctx, body, Phase.PENDING_PROPOSAL, "computing a proposal")
        elif decision.action == Action.PROPOSE:
            await _propose(ctx, body)
        elif decision.action == Action.START:
            await _to_phase(
                ctx, body, Phase.REBALANCING, f"{decision.reason}: moving slots", startedAt=now_rfc3339()
            )
        elif decision.action == Action.EXECUTE:
            await _execute(ctx, body)
        elif decision.action == Action.STOP:
            await _to_phase(ctx, body, Phase.STOPPED, decision.reason)
        elif decision.action == Action.REFRESH:
            await _to_phase(
                ctx,
                body,
                Phase.PENDING_PROPOSAL,
                f"{decision.reason}: computing a new proposal",
                moves=None,
                progress=None,
                startedAt=None,
                finishedAt=None,
            )
        metrics.RECONCILES.labels("RelayRebalance", "ok").inc()
    except KubeError as exc:
        metrics.RECONCILES.labels("RelayRebalance", "error").inc()
        metrics.ERRORS.labels("RelayRebalance", type(exc).__name__).inc()
        log.warning("rebalance %s/%s: %s", key[0], key[1], exc)
    finally:
        busy.discard(key)


async def _weights_and_urls(
    ctx: fleet_state.Context, namespace: str, fleet_name: str, shard_map: ShardMap
) -> tuple[dict[str, int], dict[str, str], list[Obj]]:
    members = await fleet_state.fleet_shards(ctx.kube, namespace, fleet_name)
    weights = {n: w for n, w in fleet_state.weights_of(members).items() if n in shard_map.shards}
    urls = await fleet_state.fleet_urls(ctx.kube, members)
    return weights, urls, members


async def _propose(ctx: fleet_state.Context, body: Mapping[str, Any]) -> None:
    namespace, _ = _where(body)
    spec = body.get("spec") or {}
    fleet_name = str(spec.get("fleet") or "")
    shard_map, _ = await fleet_state.read_shard_map(ctx.kube, namespace, fleet_name)
    if shard_map is None:
        msg = f"fleet {fleet_name} has no shard map yet: create a RelayShard with spec.fleet={fleet_name}"
        await _to_phase(ctx, body, Phase.NOT_READY, msg)
        return
    weights, urls, _ = await _weights_and_urls(ctx, namespace, fleet_name, shard_map)
    proposal = spec.get("proposal")
    try:
        if isinstance(proposal, Mapping):
            source = "spec"
            moves = [move_from_json(m) for m in proposal.get("moves") or ()]
        else:
            source = "operator"
            if spec.get("mode") == "drain":
                moves = plan_drain(shard_map, list(spec.get("drainShards") or ()), weights)
            else:
                moves = plan_by_weight(shard_map, weights)
        validate_moves(shard_map, moves)
        for m in moves:
            if m.target not in weights:
                raise PlanError(f"move {m.slots}: target {m.target!r} has no RelayShard or is being deleted")
    except PlanError as exc:
        await _to_phase(ctx, body, Phase.NOT_READY, f"invalid proposal: {exc}", proposalSource=None)
        return
    if source == "operator" or not any(m.bytes for m in moves):
        moves = await shard_redis.estimate(moves, urls)
    entries = moves_status(moves)
    extra: Obj = {
        "proposalSource": source,
        "shardMapEpoch": shard_map.epoch,
        "moves": entries,
        "progress": progress(entries),
    }
    if not moves:
        await _to_phase(ctx, body, Phase.READY, "nothing to move: the fleet is already balanced", **extra)
        return
    p = extra["progress"]
    auto = bool(spec.get("autoApprove"))
    msg = f"{p['movesTotal']} moves, {p['slotsTotal']} slots, {p['bytesTotal']} bytes; " + (
        "autoApprove is set: starting" if auto else f"approve with annotation {ANNOTATION}=approve"
    )
    await _to_phase(ctx, body, Phase.PROPOSAL_READY, msg, **extra)


async def _execute(ctx: fleet_state.Context, body: Mapping[str, Any]) -> None:
    namespace, name = _where(body)
    spec = body.get("spec") or {}
    fleet_name = str(spec.get("fleet") or "")
    status = body.get("status") or {}
    entries: list[Obj] = [dict(e) for e in status.get("moves") or ()]
    key = (namespace, fleet_name)
    if key in ctx.moving:
        return  # a drain or another rebalance is moving this fleet's slots; the timer comes back
    # A shard-map write holds the lock for a moment: wait for it (the lock is fair), never skip
    # the step for it. Skipping whenever the lock was held starved a rebalance for good once
    # 100 shards' resyncs kept it busy (docs/design-decisions.md, "The fleet lock guards
    # shard-map writes only").
    async with ctx.locks.fleet(namespace, fleet_name):
        ctx.moving[key] = f"RelayRebalance {name} is moving slots"
        metrics.REBALANCES_ACTIVE.inc()
        persist_lock = asyncio.Lock()

        async def persist() -> None:
            async with persist_lock:
                await _patch_status(ctx, body, {"moves": entries, "progress": progress(entries)})

        try:
            shard_map, _ = await fleet_state.read_shard_map(ctx.kube, namespace, fleet_name)
            if shard_map is None:
                await _to_phase(ctx, body, Phase.NOT_READY, f"fleet {fleet_name} has no shard map")
                return
            _, urls, members = await _weights_and_urls(ctx, namespace, fleet_name, shard_map)
            owners = fleet_state.specs_of(members)
            left = remaining(entries)
            found = fleet_state.targets(members, shard_map)
            waiting = {n: w for n, w in found.waiting.items() if any(entries[i]["to"] == n for i in left)}
            if waiting:
                # slots only move into a Ready shard: wait (the timer comes back), never fail
                slots = sum(move_from_json(entries[i]).size for i in left)
                why = fleet_state.Targets({}, waiting).why_waiting(slots)
                if (body.get("status") or {}).get("message") != why:
                    await _to_phase(ctx, body, Phase.REBALANCING, why)
                return
            if str((body.get("status") or {}).get("message") or "").startswith(fleet_state.WAITING):
                await _to_phase(ctx, body, Phase.REBALANCING, "every target is Ready: moving slots")

            async def run_one(i: int) -> None:
                move = move_from_json(entries[i])
                current, _ = await fleet_state.read_shard_map(ctx.kube, namespace, fleet_name)
                if current is None:
                    raise fleet_state.FleetError(f"fleet {fleet_name} lost its shard map")
                if fleet_state.move_progress(current, move) == "done":
                    entries[i].update(state="Done", finishedAt=entries[i].get("finishedAt") or now_rfc3339())
                    await persist()
                    return
                entries[i].update(state="Migrating", startedAt=now_rfc3339(), message="")
                await persist()
                result = await fleet_state.execute_move(
                    ctx, namespace, fleet_name, current, move, urls, owners, "rebalance"
                )
                entries[i].update(
                    state="Done", bytesMoved=result.bytes, keysMoved=result.keys, finishedAt=now_rfc3339()
                )
                await persist()
                notify(body, "SlotsMoved", f"slots {move.slots}: {move.source} -> {move.target}")

            async def should_stop() -> bool:
                latest = await ctx.kube.get(API_VERSION, REBALANCE_KIND, namespace, name)
                if latest is None:
                    return True
                annotations = (latest.get("metadata") or {}).get("annotations") or {}
                return str(annotations.get(ANNOTATION, "")).strip().lower() == STOP

            concurrency = int(spec.get("concurrency") or 1)
            try:
                outcome = await run_moves(
                    remaining(entries), run_one, concurrency=concurrency, should_stop=should_stop
                )
            except MoveFailed as exc:
                entries[exc.index].update(state="Failed", message=str(exc)[:4000])
                await persist()
                moved: Move = move_from_json(entries[exc.index])
                msg = f"move of slots {moved.slots} ({moved.source} -> {moved.target}) failed: {exc}"
                await _to_phase(ctx, body, Phase.NOT_READY, msg, finishedAt=now_rfc3339())
                return
            if outcome == Outcome.STOPPED:
                await _consume_annotation(ctx, body)
                await _to_phase(
                    ctx, body, Phase.STOPPED, "stopped on request; approve to resume, refresh to replan"
                )
                return
            p = progress(entries)
            msg = f"done: {p['slotsMoved']} slots in {p['movesDone']} moves, {p['bytesMoved']} bytes"
            await _to_phase(ctx, body, Phase.READY, msg, finishedAt=now_rfc3339(), progress=p, moves=entries)
        finally:
            ctx.moving.pop(key, None)
            metrics.REBALANCES_ACTIVE.dec()
