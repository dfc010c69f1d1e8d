"""RelayShard status from what the operator observed: phase and conditions. Pure.

Conditions follow the Kubernetes convention: one entry per type, lastTransitionTime moves
only when status flips, observedGeneration says which spec the condition describes.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relay.fleet.contract import Obj
from relayfleet_operator.builders import selector_string
from relayfleet_operator.spec import ManagedRedis, ShardSpec

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Migrating")


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> list[Obj]:
    """Conditions with `type_` set; its lastTransitionTime kept unless the status changed."""
    text = "Unknown" if status is None else ("True" if status else "False")
    out: list[Obj] = []
    found = False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        changed = cond.get("status") != text
        out.append(
            {
                "type": type_,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": now if changed else cond.get("lastTransitionTime", now),
                "observedGeneration": generation,
            }
        )
    if not found:
        out.append(
            {
                "type": type_,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": now,
                "observedGeneration": generation,
            }
        )
    return out


def condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in (status or {}).get("conditions") or ():
        if cond.get("type") == type_:
            return dict(cond)
    return None


@dataclass(frozen=True)
class Observed:
    """What one reconcile saw; every field optional so partial failures still report."""

    deployment: Mapping[str, Any] | None = None
    statefulset: Mapping[str, Any] | None = None
    redis_reachable: bool | None = None  # external Redis: did a PING answer?
    redis_endpoint: str | None = None
    slot_count: int | None = None
    shard_map_epoch: int | None = None
    in_shard_map: bool = False
    migrating: str | None = None  # message when slots are moving to/from this shard
    draining: bool = False
    blocked: str | None = None  # deletion refused, and why
    error: str | None = None  # the reconcile itself failed, and why
    replication: Mapping[str, Any] | None = None  # managed Redis: status.redis (replication.py)
    last_backup: str | None = None  # the backup CronJob's status.lastSuccessfulTime
    storage: str | None = None  # managed Redis: why its data claim holds the Pod back (claim_problem)


def _int(obj: Mapping[str, Any] | None, *path: str) -> int:
    cur: Any = obj
    for key in path:
        if not isinstance(cur, Mapping):
            return 0
        cur = cur.get(key)
    return cur if isinstance(cur, int) else 0


def claim_problem(claim: Mapping[str, Any] | None) -> str | None:
    """Why a managed Redis's data claim keeps its Pod from starting (None: bound, or not made yet)."""
    if claim is None:
        return None
    name = (claim.get("metadata") or {}).get("name", "?")
    phase = (claim.get("status") or {}).get("phase")
    size = (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get("storage", "?")
    cls = (claim.get("spec") or {}).get("storageClassName")
    if phase == "Lost":
        return f"PersistentVolumeClaim {name} lost its PersistentVolume: the Redis data is gone"
    if phase != "Pending":
        return None
    if cls:
        why = (
            f"StorageClass {cls} has not provided a volume (does it exist? a WaitForFirstConsumer "
            "class binds only once the Pod is scheduled)"
        )
    else:
        why = (
            "it names no StorageClass (the cluster had no default one when it was made) and no "
            f"PersistentVolume of {size} or more is available"
        )
    return f"PersistentVolumeClaim {name} is Pending: {why}; see docs/operator.md, Storage"


def _deployment_stuck(dep: Mapping[str, Any] | None) -> str | None:
    for cond in (dep or {}).get("status", {}).get("conditions") or ():
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return str(cond.get("message") or "relay rollout exceeded its progress deadline")
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return str(cond.get("message") or "relay pods cannot be created")
    return None


def shard_status(
    spec: ShardSpec, previous: Mapping[str, Any] | None, seen: Observed, now: str | None = None
) -> Obj:
    """The complete status for a RelayShard (kopf's own status.kopf is left untouched)."""
    now = now or now_rfc3339()
    gen = spec.generation
    dep = seen.deployment
    ready_replicas = _int(dep, "status", "readyReplicas")
    replicas = _int(dep, "status", "replicas")
    updated = _int(dep, "status", "updatedReplicas")
    dep_current = dep is not None and _int(dep, "status", "observedGeneration") >= _int(
        dep, "metadata", "generation"
    )
    relays_ready = (
        dep is not None and dep_current and ready_replicas >= spec.replicas and updated >= spec.replicas
    )

    if spec.managed:
        redis_ready = _int(seen.statefulset, "status", "readyReplicas") >= 1
        redis_why = seen.storage or "the Redis StatefulSet has no ready pod yet"
    else:
        redis_ready = seen.redis_reachable is not False
        redis_why = "the external Redis does not answer PING"

    conditions: list[Obj] = list((previous or {}).get("conditions") or ())
    stuck = _deployment_stuck(dep)
    degraded_reason, degraded_msg = "", ""
    if seen.error:
        degraded_reason, degraded_msg = "ReconcileError", seen.error
    elif seen.blocked:
        degraded_reason, degraded_msg = "DeletionBlocked", seen.blocked
    elif not spec.managed and seen.redis_reachable is False:
        degraded_reason, degraded_msg = "RedisUnreachable", redis_why
    elif stuck:
        degraded_reason, degraded_msg = "RolloutStuck", stuck
    elif (why := _replication_trouble(spec, seen.replication)) is not None:
        degraded_reason, degraded_msg = why
    degraded = bool(degraded_reason)

    progressing = not (relays_ready and redis_ready and seen.in_shard_map)
    if progressing:
        parts = []
        if not seen.in_shard_map:
            parts.append("joining the fleet's shard map")
        if not redis_ready:
            parts.append(redis_why)
        if not relays_ready:
            parts.append(f"{ready_replicas}/{spec.replicas} relay pods ready")
        prog_reason, prog_msg = "Reconciling", "; ".join(parts)
    else:
        prog_reason, prog_msg = "Stable", "all objects match the spec"

    ready = not progressing and not degraded and not seen.draining
    if ready:
        ready_reason, ready_msg = "ShardReady", f"{ready_replicas} relay pods ready; Redis ready"
    elif seen.draining:
        ready_reason, ready_msg = "Draining", "the shard is being deleted; its slots are moving away"
    elif degraded:
        ready_reason, ready_msg = degraded_reason, degraded_msg
    else:
        ready_reason, ready_msg = "NotReady", prog_msg

    conditions = set_condition(conditions, "Ready", ready, ready_reason, ready_msg, gen, now)
    conditions = set_condition(conditions, "Progressing", progressing, prog_reason, prog_msg, gen, now)
    conditions = set_condition(
        conditions, "Degraded", degraded, degraded_reason or "AsExpected", degraded_msg, gen, now
    )
    conditions = set_condition(
        conditions,
        "Migrating",
        seen.migrating is not None,
        "SlotsMoving" if seen.migrating else "Idle",
        seen.migrating or "",
        gen,
        now,
    )
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    conditions.sort(key=lambda c: order.get(str(c.get("type")), len(order)))

    if seen.blocked:
        phase = "DeletionBlocked"
    elif seen.draining:
        phase = "Draining"
    elif degraded:
        phase = "Degraded"
    elif ready:
        phase = "Ready"
    elif dep is None and seen.statefulset is None:
        phase = "Pending"
    else:
        phase = "Provisioning"

    status: Obj = {
        "observedGeneration": gen,
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready_replicas,
        "selector": selector_string(spec.name),
        "conditions": conditions,
    }
    if seen.slot_count is not None:
        status["slotCount"] = seen.slot_count
    if seen.shard_map_epoch is not None:
        status["shardMapEpoch"] = seen.shard_map_epoch
    if seen.redis_endpoint is not None:
        status["redisEndpoint"] = seen.redis_endpoint
    if seen.replication is not None:
        status["redis"] = dict(seen.replication)
    if seen.last_backup is not None:
        status["lastBackupTime"] = seen.last_backup
    return status


def _replication_trouble(spec: ShardSpec, seen: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """A replicated shard that cannot take writes: no primary, or fewer replicas online than
    minReplicas (every write would wait for a WAIT that cannot succeed)."""
    redis = spec.redis
    if seen is None or not isinstance(redis, ManagedRedis) or not redis.sentinel:
        return None
    if not seen.get("primary"):
        return "RedisNoPrimary", str(seen.get("message") or "no primary is known")
    online = sum(1 for r in seen.get("replicas") or () if r.get("state") == "online")
    if online < redis.min_replicas:
        return (
            "ReplicasBelowMinimum",
            f"{online} replicas online, minReplicas is {redis.min_replicas}: writes wait and then fail",
        )
    return None
