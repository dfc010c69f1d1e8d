"""Reconciling one RelayShard against the API: children, fleet membership, status; and
draining it (moving its slots away) before it may be deleted."""

from __future__ import annotations

import base64
import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import kopf

from relay.fleet.contract import Move, Obj, PlanError, move_from_json
from relay.fleet.sharding import ShardMap, ShardMapError
from relayfleet_operator import applied, builders, fleet_state, metrics, shard_redis
from relayfleet_operator.kube import KubeError
from relayfleet_operator.replication import probe as probe_replication
from relayfleet_operator.spec import API_VERSION, SHARD_KIND, ManagedRedis, ShardSpec, SpecError, parse_shard
from relayfleet_operator.status import Observed, claim_problem, condition, now_rfc3339, shard_status
from relayfleet_operator.weight_planner import plan_drain

FORCE_DELETE = "relayfleet.dev/force-delete"
log = logging.getLogger("relayfleet.operator")


def notify(body: Mapping[str, Any], reason: str, message: str, warning: bool = False) -> None:
    """Post a Kubernetes Event on the object (no-op outside a running operator), and log it."""
    meta = body.get("metadata") or {}
    log.log(
        logging.WARNING if warning else logging.INFO,
        "%s %s/%s: %s: %s",
        body.get("kind", "object"),
        meta.get("namespace"),
        meta.get("name"),
        reason,
        message,
    )
    try:
        target = cast(kopf.Body, body)  # kopf accepts any mapping with apiVersion/kind/metadata
        # kopf.event posts regardless of settings.posting.level, which is kept at WARNING so
        # kopf's own per-handler log lines do not become Events.
        kopf.event(target, type="Warning" if warning else "Normal", reason=reason, message=message)
    except LookupError:
        pass


async def write_status(ctx: fleet_state.Context, body: Mapping[str, Any], status: Obj) -> None:
    meta = body.get("metadata") or {}
    try:
        await ctx.kube.merge_patch(
            API_VERSION, SHARD_KIND, meta.get("namespace"), meta["name"], {"status": status}, "status"
        )
    except KubeError as exc:
        if exc.status != 404:  # gone already: nothing to report on
            raise


async def _observe(
    ctx: fleet_state.Context, shard: ShardSpec, url: str | None, shard_map: ShardMap | None
) -> Observed:
    """What the shard's children and Redis show now; `shard_map` is the map this reconcile read."""
    kube = ctx.kube
    relay, redis = builders.relay_name(shard.name), builders.redis_name(shard.name)
    dep = await kube.get("apps/v1", "Deployment", shard.namespace, relay)
    # a spec moved since our write (its generation) or a child gone: written again next time
    ctx.written.observed(applied.key("apps/v1", "Deployment", shard.namespace, relay), dep)
    sts = None
    reachable = None
    replication = None
    storage = None
    if isinstance(shard.redis, ManagedRedis):
        sts = await kube.get("apps/v1", "StatefulSet", shard.namespace, redis)
        ctx.written.observed(applied.key("apps/v1", "StatefulSet", shard.namespace, redis), sts)
        if url is not None and sts is not None:
            replication = await probe_replication(url, now_rfc3339())
        if not ((sts or {}).get("status") or {}).get("readyReplicas"):
            claim = builders.redis_claim_name(shard.name)
            storage = claim_problem(await kube.get("v1", "PersistentVolumeClaim", shard.namespace, claim))
    elif url is not None:
        reachable = await shard_redis.ping(url)
    last_backup = None
    if shard.backup is not None:
        cron = await kube.get("batch/v1", "CronJob", shard.namespace, builders.backup_name(shard.name))
        last_backup = ((cron or {}).get("status") or {}).get("lastSuccessfulTime")
    return Observed(
        last_backup=last_backup if isinstance(last_backup, str) else None,
        deployment=dep,
        statefulset=sts,
        redis_reachable=reachable,
        redis_endpoint=builders.endpoint_of(url) if url else None,
        slot_count=fleet_state.owned_by(shard_map, shard.name),
        shard_map_epoch=shard_map.epoch if shard_map else None,
        in_shard_map=shard_map is not None and shard.name in shard_map.shards,
        migrating=ctx.moving.get((shard.namespace, shard.fleet)),
        replication=replication,
        storage=storage,
    )


async def relay_secrets_digest(ctx: fleet_state.Context, shard: ShardSpec) -> str | None:
    """Digest of the Secrets spec.relay mounts (None when it mounts none): rotating a token
    rolls the relays on the next reconcile (resync period)."""
    refs = builders.relay_secret_refs(shard)
    if not refs:
        return None
    values: list[bytes | None] = []
    for ref in refs:
        secret = await ctx.kube.get("v1", "Secret", shard.namespace, ref.name)
        raw = ((secret or {}).get("data") or {}).get(ref.key)
        values.append(base64.b64decode(raw) if isinstance(raw, str) else None)
    return builders.secrets_hash(shard, values)


async def apply(ctx: fleet_state.Context, obj: Obj) -> None:
    """Server-side apply `obj`, unless the same content was applied to it and is not due again."""
    key, content = applied.object_key(obj), applied.digest(obj)
    if ctx.written.fresh(key, content):
        return
    ctx.written.record(key, content, await ctx.kube.apply(obj))


async def _delete_retired(ctx: fleet_state.Context, shard: ShardSpec) -> None:
    """Delete the children the spec no longer asks for (a group's first member says whether
    the group exists); once seen gone, a group is looked for again only when due."""
    for group in builders.retired_children(shard):
        api_version, kind, name = group[0]
        key = applied.key(api_version, kind, shard.namespace, name)
        if ctx.written.fresh(key, applied.ABSENT):
            continue
        if await ctx.kube.get(api_version, kind, shard.namespace, name) is not None:
            for member in group:
                await ctx.kube.delete(member[0], member[1], shard.namespace, member[2])
                ctx.written.forget(applied.key(member[0], member[1], shard.namespace, member[2]))
        ctx.written.record(key, applied.ABSENT)


async def reconcile(
    ctx: fleet_state.Context,
    body: Mapping[str, Any],
    *,
    announce: bool,
    members: Sequence[Mapping[str, Any]] | None = None,
) -> Obj:
    """Make the world match one RelayShard; returns its status.

    Idempotent: the change handlers and the periodic resync both call it, and the resync is
    what corrects drift (server-side apply resets every field we own; an unchanged write is
    skipped until it falls due, `ctx.written`). `members`: the fleet's RelayShards as the
    operator's index holds them (fleet_state.member_entry); None lists them."""
    started = time.monotonic()
    try:
        shard = parse_shard(body, ctx.images, ctx.limit_defaults)
    except SpecError as exc:
        metrics.ERRORS.labels("RelayShard", "SpecError").inc()
        notify(body, "InvalidSpec", str(exc), warning=True)
        raise kopf.PermanentError(str(exc)) from None
    if fleet_state.deleting(body):
        return {}
    previous = body.get("status") or {}
    try:
        url, after, founder = await _converge(ctx, shard, body, members)
        # What _converge read of the fleet (its shards, their specs) went with its frame: a
        # reconcile waiting here for a slot held all of it, ~40 of them at once at 100 shards,
        # and that was the operator's memory growing with the square of the fleet
        # (docs/design-decisions.md, "Operator memory: what a waiting reconcile holds").
        async with ctx.reconciling:
            seen = await _observe(ctx, shard, url, after)
    except (KubeError, fleet_state.FleetError, ShardMapError) as exc:
        metrics.ERRORS.labels("RelayShard", type(exc).__name__).inc()
        metrics.RECONCILES.labels("RelayShard", "error").inc()
        status = shard_status(shard, previous, Observed(error=str(exc), redis_endpoint=None))
        status["slotCount"] = previous.get("slotCount", 0)
        await _safe_status(ctx, body, status)
        if announce or condition(previous, "Degraded") is None or _was_not_degraded(previous):
            notify(body, "ReconcileError", str(exc), warning=True)
        raise kopf.TemporaryError(str(exc), delay=ctx.retry_seconds) from None
    status = shard_status(shard, previous, seen)
    if any(previous.get(key) != value for key, value in status.items()):
        await write_status(ctx, body, status)  # a merge patch: the same values change nothing
    _export_redis(shard, previous, status)
    if after is None:
        # Not in a map yet: the fleet's founder has not written it. Come back soon rather
        # than at the next resync, so a fleet applied in one go forms within seconds.
        metrics.RECONCILES.labels("RelayShard", "waiting").inc()
        raise kopf.TemporaryError(f"waiting for shard {founder} to found fleet {shard.fleet}", delay=2)
    if announce:
        notify(body, "Reconciled", f"children applied; phase {status['phase']}")
    elif previous.get("phase") != status["phase"]:
        notify(body, "PhaseChanged", f"phase {previous.get('phase', '-')} -> {status['phase']}")
    metrics.RECONCILES.labels("RelayShard", "ok").inc()
    metrics.RECONCILE_SECONDS.labels("RelayShard").observe(time.monotonic() - started)
    return status


async def _converge(
    ctx: fleet_state.Context,
    shard: ShardSpec,
    body: Mapping[str, Any],
    members: Sequence[Mapping[str, Any]] | None,
) -> tuple[str, ShardMap | None, str | None]:
    """The shard's children, the fleet's shared objects, its credentials and its place in the
    shard map as the spec wants them; returns its Redis URL, the map now and the founder."""
    # A bounded number of reconciles talk to the API at once (a fleet applied in one go,
    # or every shard's resync falling due together, is a burst, not a stampede).
    async with ctx.reconciling:
        url = await fleet_state.redis_url(ctx.kube, shard)
        digest = await relay_secrets_digest(ctx, shard)
        before, _ = await fleet_state.read_shard_map(ctx.kube, shard.namespace, shard.fleet)
        if members is None or before is None:
            # No map yet: the founder must be the same whoever asks, so the API's list
            # decides, not an index that may not hold every shard applied together yet.
            members = await fleet_state.fleet_shards(ctx.kube, shard.namespace, shard.fleet)
        owners = fleet_state.specs_of(members)
        for obj in builders.reconcile_objects(shard, owners, digest, ctx.neighbours):
            await apply(ctx, obj)
        await _delete_retired(ctx, shard)
        spark = ctx.neighbours.spark_for(shard.namespace, shard.fleet)
        await fleet_state.set_credentials(
            ctx.kube, shard.namespace, shard.fleet, shard.name, url, owners, spark, ctx.written
        )
        public = builders.strip_credentials(url)
        founder = fleet_state.founder(members)

        def join(m: ShardMap | None) -> ShardMap | None:
            if m is None and founder not in (None, shard.name):
                return None  # the founder creates the map; this shard joins it afterwards
            return builders.join_shard_map(m, shard.fleet, shard.name, public)

    # Only a shard-map write takes the fleet's lock (slot moves publish under it), and only
    # when the map must change: held for a whole reconcile, 100 shards' resyncs queued on
    # it for minutes and a RelayRebalance never found it free (docs/design-decisions.md,
    # "The fleet lock guards shard-map writes only").
    after, written = before, False
    if join(before) != before:
        async with ctx.locks.fleet(shard.namespace, shard.fleet):
            before, _ = await fleet_state.read_shard_map(ctx.kube, shard.namespace, shard.fleet)
            after, written = await fleet_state.update_shard_map(
                ctx.kube, shard.namespace, shard.fleet, join, owners
            )
    if written and after is not None:
        joined = before is None or shard.name not in before.shards
        if joined:
            slots = after.slot_counts().get(shard.name, 0)
            notify(
                body,
                "JoinedFleet",
                f"joined fleet {shard.fleet} with {slots} slots (epoch {after.epoch})",
            )
            if before is not None and shard.auto_rebalance:
                await _propose_join_rebalance(ctx, shard, body)
        else:
            notify(body, "ShardMapUpdated", f"Redis URL updated in the shard map (epoch {after.epoch})")
    return url, after, founder


def _export_redis(shard: ShardSpec, previous: Mapping[str, Any], status: Obj) -> None:
    """Replication and backup figures of a managed shard as the operator's own metrics."""
    labels = (shard.namespace, shard.fleet, shard.name)  # as the relays' series: namespace, fleet, shard
    redis = status.get("redis")
    if isinstance(shard.redis, ManagedRedis) and shard.redis.sentinel:
        metrics.REDIS_MIN_REPLICAS.labels(*labels).set(shard.redis.min_replicas)
    if isinstance(redis, Mapping) and redis.get("primary"):
        replicas = redis.get("replicas") or ()
        metrics.REDIS_REPLICAS_ONLINE.labels(*labels).set(
            sum(1 for r in replicas if r.get("state") == "online")
        )
        metrics.REDIS_REPLICA_LAG_BYTES.labels(*labels).set(
            max((r.get("lagBytes", 0) for r in replicas), default=0)
        )
        before = (previous.get("redis") or {}).get("primary")
        if before and before != redis["primary"]:
            metrics.REDIS_PRIMARY_CHANGES.labels(*labels).inc()
    stamp = status.get("lastBackupTime")
    if isinstance(stamp, str):
        try:
            when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            return
        metrics.LAST_BACKUP_SECONDS.labels(*labels).set(when.timestamp())


def _was_not_degraded(previous: Mapping[str, Any]) -> bool:
    cond = condition(previous, "Degraded")
    return cond is None or cond.get("status") != "True"


async def _safe_status(ctx: fleet_state.Context, body: Mapping[str, Any], status: Obj) -> None:
    try:
        await write_status(ctx, body, status)
    except KubeError:
        log.warning("could not write the status of %s", (body.get("metadata") or {}).get("name"))


async def _propose_join_rebalance(
    ctx: fleet_state.Context, shard: ShardSpec, body: Mapping[str, Any]
) -> None:
    """spec.autoRebalance: a new shard asks for its share of the fleet's slots at once."""
    obj = builders.join_rebalance(shard)
    try:
        await ctx.kube.create(obj)
    except KubeError as exc:
        if exc.status != 409:
            raise
        return
    name = builders.join_rebalance_name(shard)
    notify(body, "RebalanceProposed", f"created RelayRebalance {name} (autoRebalance)")


# --- deletion ---------------------------------------------------------------------------------


async def drain(ctx: fleet_state.Context, body: Mapping[str, Any]) -> None:
    """Finalizer: move every slot of this shard to the others by weight, then leave the map.

    Returns when the shard may go; raises kopf.TemporaryError to be called again later.
    Resumable: the plan is kept in status.drain and moves already published are skipped."""
    try:
        shard = parse_shard(body, ctx.images, ctx.limit_defaults)
    except SpecError:
        return  # never reconciled, owns nothing: let it go
    key = (shard.namespace, shard.fleet)
    lock = ctx.locks.fleet(*key)
    if lock.locked() and key in ctx.moving:
        raise kopf.TemporaryError(f"waiting: {ctx.moving[key]}", delay=ctx.retry_seconds)
    previous = body.get("status") or {}
    async with lock:
        members = await fleet_state.fleet_shards(ctx.kube, shard.namespace, shard.fleet)
        owners = fleet_state.specs_of(members)
        shard_map, _ = await fleet_state.read_shard_map(ctx.kube, shard.namespace, shard.fleet)
        owned = fleet_state.owned_by(shard_map, shard.name)
        drop_map = False
        if shard_map is not None and owned:
            # Only shards already in the map (reconciled at least once) and Ready take slots.
            found = fleet_state.targets(members, shard_map, leaving=[shard.name])
            others = sorted(n for n in shard_map.shards if n != shard.name)
            if found.weights:
                await _move_away(ctx, body, shard, shard_map, found.weights, owners, previous)
            elif found.waiting:
                why = found.why_waiting(owned)
                status = shard_status(shard, previous, Observed(blocked=why, slot_count=owned))
                await _safe_status(ctx, body, status)
                if (condition(previous, "Ready") or {}).get("message") != why:
                    notify(body, "WaitingForTarget", why, warning=True)
                raise kopf.TemporaryError(why, delay=ctx.retry_seconds)
            elif others and not set(others) <= _deleting_names(members):
                why = f"no shard can take the slots yet ({', '.join(others)} are leaving the fleet too)"
                raise kopf.TemporaryError(why, delay=ctx.retry_seconds)
            else:
                # The last shard, or every shard of the fleet is being deleted (a namespace
                # or an uninstall going): the fleet ends, if no data would be lost with it.
                await _last_shard(ctx, body, shard, shard_map, previous, members)
                drop_map = True  # the fleet ends with its last shard

        def change(m: ShardMap | None) -> ShardMap | None:
            return None if m is None or drop_map else builders.leave_shard_map(m, shard.name)

        left, _ = await fleet_state.update_shard_map(
            ctx.kube, shard.namespace, shard.fleet, change, [o for o in owners if o.name != shard.name]
        )
        await fleet_state.set_credentials(
            ctx.kube,
            shard.namespace,
            shard.fleet,
            shard.name,
            None,
            [],
            ctx.neighbours.spark_for(shard.namespace, shard.fleet),
            ctx.written,
        )
    notify(body, "LeftFleet", f"left fleet {shard.fleet}" + ("" if left else "; it was the last shard"))
    await _delete_children(ctx, shard)


async def _delete_children(ctx: fleet_state.Context, shard: ShardSpec) -> None:
    """Remove the shard's own objects once its slots are gone, newest first, instead of
    leaving them to the garbage collector: they go before the finalizer is released, on
    clusters whose garbage collector is slow or stalled too. Claims (data) are kept."""
    for obj in reversed(builders.shard_children(shard)):
        if obj["kind"] == "PersistentVolumeClaim":
            continue  # the backups outlive the shard
        meta = obj["metadata"]
        await ctx.kube.delete(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        ctx.written.forget(applied.object_key(obj))


def _deleting_names(members: list[Obj]) -> set[str]:
    return {str((o.get("metadata") or {}).get("name")) for o in members if fleet_state.deleting(o)}


async def _holds_data(ctx: fleet_state.Context, obj: Mapping[str, Any], shard_map: ShardMap) -> str | None:
    """None when the shard may go without losing data (force-delete, or its Redis holds no
    queue); otherwise why not."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    if annotations.get(FORCE_DELETE) == "true":
        return None
    try:
        spec = parse_shard(obj)
        url = await fleet_state.redis_url(ctx.kube, spec)
        if not await shard_redis.holds_data(url, shard_map.slots_of(spec.name)):
            return None
        return "holds data"
    except Exception as exc:  # failing to look means "assume data"
        return f"holds data (could not check: {type(exc).__name__})"


async def _last_shard(
    ctx: fleet_state.Context,
    body: Mapping[str, Any],
    shard: ShardSpec,
    shard_map: ShardMap,
    previous: Obj,
    members: list[Obj],
) -> None:
    """No other shard can take the slots (this is the last one, or every shard of the fleet
    is being deleted): allow deletion only if nothing would be lost."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    if annotations.get(FORCE_DELETE) == "true":
        notify(body, "ForceDelete", f"{FORCE_DELETE}=true: deleting the shard without moving its data", True)
    going = [o for o in members if (o.get("metadata") or {}).get("name") in shard_map.shards]
    if len(going) <= 1:
        reason = await _holds_data(ctx, body, shard_map)
        if reason is None:
            return
        why = (
            f"{shard.name} is the last shard of fleet {shard.fleet} and {reason}: its slots have "
            f"nowhere to go. Add another RelayShard to the fleet and the deletion continues, or annotate "
            f"{FORCE_DELETE}=true to delete the data with it."
        )
    else:
        reasons = {str(o["metadata"]["name"]): await _holds_data(ctx, o, shard_map) for o in going}
        keeping = {n: r for n, r in sorted(reasons.items()) if r is not None}
        if not keeping:
            return
        who = "; ".join(f"{n} {r}" for n, r in keeping.items())
        why = (
            f"every shard of fleet {shard.fleet} is being deleted and {who}: the slots have nowhere "
            f"to go. Add a RelayShard to the fleet and the data moves there, or annotate each "
            f"{FORCE_DELETE}=true to delete the data with it."
        )
    status = shard_status(
        shard, previous, Observed(blocked=why, slot_count=len(shard_map.slots_of(shard.name)))
    )
    await _safe_status(ctx, body, status)
    notify(body, "DeletionBlocked", why, warning=True)
    metrics.ERRORS.labels("RelayShard", "DeletionBlocked").inc()
    raise kopf.TemporaryError(why, delay=ctx.retry_seconds)


async def _move_away(
    ctx: fleet_state.Context,
    body: Mapping[str, Any],
    shard: ShardSpec,
    shard_map: ShardMap,
    weights: dict[str, int],
    owners: list[ShardSpec],
    previous: Obj,
) -> None:
    key = (shard.namespace, shard.fleet)
    urls = await fleet_state.fleet_urls(
        ctx.kube, await fleet_state.fleet_shards(ctx.kube, shard.namespace, shard.fleet)
    )
    entries = [dict(e) for e in (previous.get("drain") or {}).get("moves") or ()]
    plan = [move_from_json(e) for e in entries]
    # A kept plan is reused while its targets still exist; otherwise plan afresh.
    if not plan or any(m.target not in weights for m in plan if _entry_state(entries, m) != "Done"):
        try:
            plan = plan_drain(shard_map, [shard.name], weights)
        except PlanError as exc:
            raise kopf.TemporaryError(str(exc), delay=ctx.retry_seconds) from None
        plan = await shard_redis.estimate(plan, urls)
        entries = [{**m.to_json(), "state": "Pending"} for m in plan]
    total = sum(m.size for m in plan)
    notify(body, "Draining", f"moving {total} slots in {len(plan)} ranges to {', '.join(sorted(weights))}")
    ctx.moving[key] = f"draining {shard.name}: {total} slots in {len(plan)} ranges"
    try:
        for i, move in enumerate(plan):
            if entries[i].get("state") == "Done":
                continue
            current, _ = await fleet_state.read_shard_map(ctx.kube, shard.namespace, shard.fleet)
            if current is None:
                raise kopf.TemporaryError("the shard map disappeared", delay=ctx.retry_seconds)
            try:
                if fleet_state.move_progress(current, move) == "done":
                    entries[i]["state"] = "Done"
                    continue
            except fleet_state.FleetError as exc:
                # Someone else moved these slots: forget the kept plan and plan again.
                await _safe_status(ctx, body, {"drain": None})
                raise kopf.TemporaryError(
                    f"drain plan is stale ({exc}); planning again", delay=ctx.retry_seconds
                ) from None
            entries[i]["state"] = "Migrating"
            await _drain_status(ctx, body, shard, previous, entries, i, current)
            try:
                result = await fleet_state.execute_move(
                    ctx, shard.namespace, shard.fleet, current, move, urls, owners, "drain"
                )
            except Exception as exc:
                entries[i]["state"] = "Failed"
                entries[i]["message"] = f"{type(exc).__name__}: {exc}"[:4000]
                await _drain_status(ctx, body, shard, previous, entries, i, current)
                notify(body, "MoveFailed", f"slots {move.slots} -> {move.target}: {exc}", warning=True)
                raise kopf.TemporaryError(
                    f"moving slots {move.slots} failed: {exc}", delay=ctx.retry_seconds
                ) from None
            entries[i].update(state="Done", bytesMoved=result.bytes, keysMoved=result.keys)
            notify(
                body,
                "SlotsMoved",
                f"slots {move.slots} -> {move.target} ({result.keys} keys, {result.bytes} B)",
            )
        done_map, _ = await fleet_state.read_shard_map(ctx.kube, shard.namespace, shard.fleet)
        await _drain_status(ctx, body, shard, previous, entries, len(entries), done_map)
    finally:
        ctx.moving.pop(key, None)


def _entry_state(entries: list[Obj], move: Move) -> str:
    for e in entries:
        if e.get("slots") == move.slots and e.get("to") == move.target:
            return str(e.get("state"))
    return "Pending"


async def _drain_status(
    ctx: fleet_state.Context,
    body: Mapping[str, Any],
    shard: ShardSpec,
    previous: Obj,
    entries: list[Obj],
    index: int,
    shard_map: ShardMap | None,
) -> None:
    done = sum(1 for e in entries if e.get("state") == "Done")
    msg = f"draining: {done}/{len(entries)} ranges moved"
    if index < len(entries):
        e = entries[index]
        msg += f"; now slots {e['slots']} -> {e['to']}"
    status = shard_status(
        shard,
        previous,
        Observed(draining=True, migrating=msg, slot_count=fleet_state.owned_by(shard_map, shard.name)),
    )
    status["drain"] = {"moves": entries}
    await _safe_status(ctx, body, status)
