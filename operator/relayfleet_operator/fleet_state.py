"""Fleet bookkeeping against the API: the shard map ConfigMap, Redis URLs and credentials,
the fleet's RelayShards and the per-fleet lock that keeps slot moves one-at-a-time-per-fleet.

The shard map is only ever changed through `update_shard_map`: a read-modify-write with the
ConfigMap's resourceVersion (optimistic concurrency), so two writers cannot lose an update.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import logging
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relay.fleet import contract
from relay.fleet.contract import MapChange, MapWriteConflict, Move, Obj
from relay.fleet.sharding import ShardMap
from relayfleet_operator import builders, metrics, shard_redis
from relayfleet_operator.applied import Written, digest
from relayfleet_operator.kube import Conflict, Kube, KubeError
from relayfleet_operator.spec import (
    API_VERSION,
    SHARD_KIND,
    ExternalRedis,
    ImageDefaults,
    LimitDefaults,
    Neighbours,
    ShardSpec,
    SpecError,
    parse_shard,
)

_MAP_WRITE_ATTEMPTS = 8
RECONCILES_AT_ONCE = 8
_log = logging.getLogger(__name__)


class FleetError(RuntimeError):
    """Fleet state the operator cannot work with (a missing Secret key, a broken map)."""


@dataclass
class Locks:
    """One lock per (namespace, fleet): shard-map writes and slot moves never interleave."""

    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)

    def fleet(self, namespace: str, fleet: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, fleet), asyncio.Lock())


@dataclass
class Context:
    """Everything handlers share; lives in kopf's memo."""

    kube: Kube
    # how long a failed or blocked step waits before kopf calls the handler again
    retry_seconds: float = 15.0
    # the images of a RelayShard that names none (OperatorSettings.images)
    images: ImageDefaults = field(default_factory=ImageDefaults)
    # the spec.limits quota keys of a RelayShard that leaves them out (OperatorSettings.limit_defaults)
    limit_defaults: LimitDefaults = field(default_factory=LimitDefaults)
    # the operator's own namespace and labels, the Spark jobs' namespace and fleets
    # (OperatorSettings.neighbours): the Redis NetworkPolicies and the credentials' copy
    neighbours: Neighbours = field(default_factory=Neighbours)
    locks: Locks = field(default_factory=Locks)
    # RelayShard reconciles talking to the API at once. One at a time (under the fleet lock)
    # left 100 shards' resyncs queued for minutes; all at once, 90 shards applied together
    # sent ~1,000 requests in a burst and the API server's answers ran past their 30 s limit.
    reconciling: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(RECONCILES_AT_ONCE))
    # Which fleets are moving slots right now, and for what (shown in shard conditions).
    moving: dict[tuple[str, str], str] = field(default_factory=dict)
    # What was last written to each child and shared object (applied.py): an unchanged
    # resync writes nothing until an entry falls due (OperatorSettings.reapply_seconds).
    # The handlers pass one built from OperatorSettings.reapply_seconds; the default (period 0:
    # every write due) keeps a bare Context, as tests build it, from reading the environment.
    written: Written = field(default_factory=lambda: Written(0.0))


# --- reading ----------------------------------------------------------------------------------


async def read_shard_map(kube: Kube, namespace: str, fleet: str) -> tuple[ShardMap | None, Obj | None]:
    cm = await kube.get("v1", "ConfigMap", namespace, contract.shardmap_configmap_name(fleet))
    return builders.shard_map_from_configmap(cm), cm


async def fleet_shards(kube: Kube, namespace: str, fleet: str) -> list[Obj]:
    """Every RelayShard object of `fleet` in `namespace` (deleting ones included)."""
    items = await kube.list(API_VERSION, SHARD_KIND, namespace)
    return [o for o in items if (o.get("spec") or {}).get("fleet") == fleet]


_MEMBER_META = ("name", "namespace", "uid", "generation", "creationTimestamp", "deletionTimestamp")


def member_entry(body: Mapping[str, Any]) -> tuple[tuple[str, str], Obj]:
    """A RelayShard as the operator's fleet index keeps it, under (namespace, fleet): what
    `specs_of`, `founder` and `deleting` read (its spec and identity), not its status or
    managed fields. The index replaces a list of the fleet's shards in every reconcile
    (docs/design-decisions.md, "Unchanged applies cost nothing")."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    entry: Obj = {
        "apiVersion": API_VERSION,
        "kind": SHARD_KIND,
        "metadata": {k: meta[k] for k in _MEMBER_META if meta.get(k) is not None},
        "spec": copy.deepcopy(dict(spec)),
    }
    return (str(meta.get("namespace") or "default"), str(spec.get("fleet") or "")), entry


def specs_of(objs: Sequence[Mapping[str, Any]]) -> list[ShardSpec]:
    out = []
    for obj in objs:
        try:
            out.append(parse_shard(obj))
        except SpecError:
            continue  # an invalid shard is reported on its own status; it owns nothing here
    return out


def deleting(obj: Mapping[str, Any]) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def _staying(objs: Sequence[Mapping[str, Any]]) -> Iterator[tuple[Mapping[str, Any], ShardSpec]]:
    """The shards that may hold slots: valid and not being deleted, with their objects."""
    for obj in objs:
        if deleting(obj):
            continue
        try:
            yield obj, parse_shard(obj)
        except SpecError:
            continue


def founder(objs: Sequence[Mapping[str, Any]]) -> str | None:
    """The shard that founds a fleet (gets all 16384 slots when no map exists yet): the oldest
    staying RelayShard, ties broken by name. Deterministic, so shards applied together found
    the same fleet whatever order the operator happens to handle them in."""
    candidates = [
        (str((obj.get("metadata") or {}).get("creationTimestamp") or ""), spec.name)
        for obj, spec in _staying(objs)
    ]
    return min(candidates)[1] if candidates else None


def weights_of(objs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Weights of the shards that may hold slots (valid and not being deleted)."""
    return {spec.name: spec.weight for _, spec in _staying(objs)}


def not_ready(obj: Mapping[str, Any]) -> str | None:
    """Why a RelayShard cannot take slots now (None when its Ready condition is True): slots
    moved into a shard whose Redis is down would be unreachable, and the move would fail."""
    for cond in (obj.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready":
            if cond.get("status") == "True":
                return None
            return str(cond.get("message") or cond.get("reason") or "not Ready")
    return "not reconciled yet"


WAITING = "waiting for a Ready shard"


@dataclass(frozen=True)
class Targets:
    """The shards that may take slots now, by weight, and the ones that will once Ready."""

    weights: dict[str, int]
    waiting: dict[str, str]  # shard -> why it is not Ready

    def why_waiting(self, slots: int) -> str:
        who = "; ".join(f"{name}: {why}" for name, why in sorted(self.waiting.items()))
        return f"{WAITING} to take {slots} slots ({who})"


def targets(objs: Sequence[Mapping[str, Any]], shard_map: ShardMap, leaving: Sequence[str] = ()) -> Targets:
    """Shards that may receive slots: staying, in the map, not `leaving`, and Ready."""
    weights: dict[str, int] = {}
    waiting: dict[str, str] = {}
    for obj, spec in _staying(objs):
        if spec.name in leaving or spec.name not in shard_map.shards:
            continue
        why = not_ready(obj)
        if why is None:
            weights[spec.name] = spec.weight
        else:
            waiting[spec.name] = why
    return Targets(weights, waiting)


# --- URLs and credentials --------------------------------------------------------------------


async def ensure_password(kube: Kube, shard: ShardSpec) -> str:
    """The managed Redis password: read from its Secret, generated and stored the first time."""
    name = builders.redis_name(shard.name)
    existing = await kube.get("v1", "Secret", shard.namespace, name)
    if existing is None:
        # Conflict: created concurrently; read the winner's password below.
        with contextlib.suppress(Conflict):
            await kube.create(builders.redis_password_secret(shard, secrets.token_urlsafe(32)))
        existing = await kube.get("v1", "Secret", shard.namespace, name)
    data = (existing or {}).get("data") or {}
    if "password" not in data:
        raise FleetError(f"Secret {name} has no 'password' key; delete it to have a new one generated")
    return base64.b64decode(data["password"]).decode()


async def redis_url(kube: Kube, shard: ShardSpec) -> str:
    """The full Redis URL of a shard (credentials included): for the operator and relays only."""
    if isinstance(shard.redis, ExternalRedis):
        if shard.redis.url is not None:
            return shard.redis.url
        name, key = shard.redis.secret_name or "", shard.redis.secret_key
        secret = await kube.get("v1", "Secret", shard.namespace, name)
        if secret is None:
            raise FleetError(f"Secret {name} named in spec.redis.external.secretRef does not exist")
        value = (secret.get("data") or {}).get(key)
        if value is None:
            raise FleetError(f"Secret {name} has no key {key!r} (spec.redis.external.secretRef.key)")
        url = base64.b64decode(value).decode().strip()
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise FleetError(f"Secret {name} key {key!r} does not hold a redis://, rediss:// or unix:// URL")
        return url
    password = await ensure_password(kube, shard)
    tls = shard.redis.tls_secret
    if not tls:
        return builders.managed_redis_url(shard, password)
    secret = await kube.get("v1", "Secret", shard.namespace, tls)
    if secret is None:
        raise FleetError(f"Secret {tls} named in spec.redis.managed.tls.secretName does not exist")
    ca = (secret.get("data") or {}).get("ca.crt")
    if ca is None:
        raise FleetError(f"Secret {tls} has no key 'ca.crt' (the CA the Redis certificate is issued by)")
    try:
        return builders.managed_redis_url(shard, password, base64.b64decode(ca).decode())
    except (ValueError, UnicodeDecodeError):
        raise FleetError(f"Secret {tls} key 'ca.crt' holds no PEM certificate") from None


async def fleet_urls(kube: Kube, objs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Full URLs of every shard of the fleet that the operator can resolve."""
    out: dict[str, str] = {}
    for shard in specs_of(objs):
        try:
            out[shard.name] = await redis_url(kube, shard)
        except FleetError:
            continue
    return out


async def set_credentials(
    kube: Kube,
    namespace: str,
    fleet: str,
    shard: str,
    url: str | None,
    owners: Sequence[ShardSpec],
    spark_namespace: str | None = None,
    written: Written | None = None,
) -> None:
    """Add, update (url) or remove (None) one shard's key in the fleet credentials Secret,
    and keep its copy in the Spark jobs' namespace (`spark_namespace`) the same. With
    `written`, the same key set again within its period reads and writes nothing."""
    name = builders.credentials_name(fleet)
    key = ("v1", "Secret", namespace, name, shard)
    content = digest([url, spark_namespace])
    if written is not None and written.fresh(key, content):
        return
    current = await kube.get("v1", "Secret", namespace, name)
    encoded = base64.b64encode(url.encode()).decode() if url is not None else None
    data: dict[str, str] = dict((current or {}).get("data") or {})
    if current is None and url is not None:
        with contextlib.suppress(Conflict):  # created concurrently: the winner's is read below
            await kube.create(builders.credentials_secret(namespace, fleet, {shard: url}, owners))
        current = await kube.get("v1", "Secret", namespace, name)
        data = dict((current or {}).get("data") or {})
    if current is not None and data.get(shard) != encoded:
        patch: Obj = {"data": {shard: encoded}}
        if owners:
            patch["metadata"] = {"ownerReferences": builders.fleet_owner_references(owners)}
        answer = await kube.merge_patch("v1", "Secret", namespace, name, patch)
        data = dict(answer.get("data") or {})
    copied = spark_namespace is None or await _copy_credentials(kube, spark_namespace, namespace, fleet, data)
    if written is not None and copied:
        written.record(key, content)


async def _copy_credentials(
    kube: Kube, spark_namespace: str, namespace: str, fleet: str, data: Mapping[str, str]
) -> bool:
    """The Spark namespace's copy holds what the fleet's Secret holds. A failure is logged and
    the shard's reconcile goes on: relays never wait on Spark; the next resync tries again."""
    name = builders.credentials_name(fleet)
    try:
        copy = await kube.get("v1", "Secret", spark_namespace, name)
        if copy is None:
            if data:
                await kube.create(builders.spark_credentials_secret(spark_namespace, namespace, fleet, data))
            return True
        held = copy.get("data") or {}
        if held != data:
            # merge patch: null removes a key the fleet no longer has
            patch: Obj = {"data": {k: data.get(k) for k in {*held, *data}}}
            await kube.merge_patch("v1", "Secret", spark_namespace, name, patch)
        return True
    except KubeError as exc:
        # the status and reason only: never the Secret's content
        _log.warning(
            "cannot copy Secret %s/%s to the Spark namespace %s: %s %s",
            namespace,
            name,
            spark_namespace,
            exc.status,
            exc.reason,
        )
        metrics.ERRORS.labels("Secret", "SparkCredentialsCopy").inc()
        return False


# --- the shard map ----------------------------------------------------------------------------


async def update_shard_map(
    kube: Kube, namespace: str, fleet: str, change: MapChange, owners: Sequence[ShardSpec]
) -> tuple[ShardMap | None, bool]:
    """Apply `change` to the fleet's map; returns (the map now, whether it was written).

    The read-recompute-conditional-write loop is the fleet contract's
    (`relay.fleet.contract.update_shard_map`); this side supplies the API calls."""
    name = contract.shardmap_configmap_name(fleet)

    async def read() -> tuple[ShardMap | None, Obj | None]:
        return await read_shard_map(kube, namespace, fleet)

    async def write(wanted: ShardMap, cm: Obj | None) -> None:
        obj = builders.shard_map_configmap(namespace, wanted, owners)
        try:
            if cm is None:
                await kube.create(obj)
            else:
                obj["metadata"]["resourceVersion"] = cm["metadata"]["resourceVersion"]
                await kube.replace(obj)
        except Conflict:
            raise MapWriteConflict from None  # someone wrote in between: recompute from theirs

    async def delete() -> None:
        try:
            await kube.delete("v1", "ConfigMap", namespace, name)
        except Conflict:
            raise MapWriteConflict from None

    try:
        wanted, written = await contract.update_shard_map(
            contract.MapStore(read, write, delete), change, _MAP_WRITE_ATTEMPTS
        )
    except MapWriteConflict:
        raise FleetError(f"shard map of fleet {fleet} kept changing under us; will retry") from None
    if written and wanted is not None:
        metrics.SHARD_MAP_EPOCH.labels(namespace, fleet).set(wanted.epoch)
    return wanted, written


async def publish_move(
    kube: Kube, namespace: str, fleet: str, slots: Sequence[int], target: str, owners: Sequence[ShardSpec]
) -> ShardMap:
    """Record in the shard map that `slots` now belong to `target` (epoch + 1)."""

    def change(current: ShardMap | None) -> ShardMap | None:
        if current is None:
            raise FleetError(f"fleet {fleet} has no shard map")
        if all(current.shard_for_slot(s) == target for s in slots):
            return current  # already published (a resumed move)
        return current.with_slots(slots, target)

    result, _ = await update_shard_map(kube, namespace, fleet, change, owners)
    assert result is not None
    return result


def owned_by(shard_map: ShardMap | None, shard: str) -> int:
    return 0 if shard_map is None else shard_map.slot_counts().get(shard, 0)


# --- moving slots -----------------------------------------------------------------------------


def move_progress(shard_map: ShardMap, move: Move) -> str:
    """'done' if the map already gives every slot to the target (a move resumed after its
    flip was published), 'run' if the source still holds some; raises if a third shard does."""
    owners = {shard_map.shard_for_slot(s) for s in move.slot_list()}
    if owners == {move.target}:
        return "done"
    strangers = owners - {move.source, move.target}
    if strangers:
        raise FleetError(f"slots {move.slots} are now (partly) owned by {', '.join(sorted(strangers))}")
    return "run"


async def execute_move(
    ctx: Context,
    namespace: str,
    fleet_name: str,
    shard_map: ShardMap,
    move: Move,
    urls: Mapping[str, str],
    owners: Sequence[ShardSpec],
    cause: str,
) -> shard_redis.MoveResult:
    """One range through the migration adapter; the map is published at each flip."""

    async def publish(slots: Sequence[int], target: str) -> ShardMap:
        return await publish_move(ctx.kube, namespace, fleet_name, slots, target, owners)

    try:
        result = await shard_redis.migrate_range(shard_map, move, urls, publish)
    except Exception:
        metrics.MIGRATIONS.labels(cause, "error").inc()
        raise
    # A no-op when the library published every batch already (it does, at each flip).
    await publish(move.slot_list(), move.target)
    metrics.MIGRATIONS.labels(cause, "ok").inc()
    metrics.SLOTS_MOVED.labels(fleet_name).inc(move.size)
    metrics.BYTES_MOVED.labels(fleet_name).inc(result.bytes)
    return result
