"""kopf handlers: registration and wiring only; the work is in shards.py and rebalance_controller.py.

`register(registry, settings)` adds them to a kopf registry (main.run does, with the
settings read once at start); importing this module registers nothing and reads no
environment, so the periods come from OperatorSettings, not from import time.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from relayfleet_operator import fleet_state, rebalance_controller, shards
from relayfleet_operator.applied import Written
from relayfleet_operator.config import OperatorSettings
from relayfleet_operator.kube import Kube
from relayfleet_operator.spec import GROUP, REBALANCE_PLURAL, SHARD_PLURAL, VERSION

FINALIZER = "relayfleet.dev/drain"


def _ctx(memo: kopf.Memo) -> fleet_state.Context:
    ctx = memo.get("ctx")
    if not isinstance(ctx, fleet_state.Context):
        raise kopf.TemporaryError("operator context not initialised yet", delay=1)
    return ctx


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # kopf's bookkeeping goes to status.kopf (the CRDs preserve it) and to one annotation
    # under our own prefix, not to kopf.zalando.org/* annotations.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="relayfleet.dev", key="last-handled-configuration"
    )
    # Our own Events are posted explicitly (shards.notify); kopf's log lines become Events
    # only from WARNING up, or every periodic resync would leave one behind.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.execution.max_workers = 8
    # The namespaces to serve are given explicitly (or all of them) and the chart installs
    # the CRDs first: no dynamic scanning, which would need cluster-wide list on namespaces
    # that least-privilege RBAC does not grant (kopf retried ~60 s on the 403 at start-up).
    settings.scanning.disabled = True
    kube, config = memo.get("kube"), memo.get("settings")
    if not isinstance(kube, Kube) or not isinstance(config, OperatorSettings):
        raise kopf.PermanentError("start the operator through relayfleet_operator.main.run")
    memo["ctx"] = fleet_state.Context(
        kube=kube,
        retry_seconds=config.retry_seconds,
        images=config.images,
        limit_defaults=config.limit_defaults,
        neighbours=config.neighbours,
        written=Written(config.reapply_seconds),
    )
    memo["rebalancing"] = set()


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    ctx = memo.get("ctx")
    if isinstance(ctx, fleet_state.Context):
        await ctx.kube.close()


async def probe_kube(memo: kopf.Memo, **_: Any) -> str:
    """Liveness detail: the API server answers our own client too."""
    ctx = _ctx(memo)
    await ctx.kube.version()
    return "ok"


# --- RelayShard ---------------------------------------------------------------------------------


INDEX = "fleet_members"  # the index's id: kopf hands it to every handler as a keyword


async def fleet_members(body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    """The index of RelayShards by (namespace, fleet), kept from the watch kopf has anyway.
    Async although it awaits nothing: kopf runs a plain function in its thread pool, a thread
    hop per watch event (and up to 8 more threads, each with its own malloc arena)."""
    key, entry = fleet_state.member_entry(body)
    return {key: entry}


def _members(body: kopf.Body, kwargs: dict[str, Any]) -> list[Any]:
    """This shard's fleet as the index holds it now (a copy: the index moves on)."""
    key, _ = fleet_state.member_entry(body)
    index: kopf.Index[tuple[str, str], Any] = kwargs[INDEX]
    return list(index.get(key) or ())


async def shard_changed(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    await shards.reconcile(_ctx(memo), body, announce=True, members=_members(body, kwargs))


async def shard_resync(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """Periodic resync: corrects drift in child objects and refreshes status."""
    await shards.reconcile(_ctx(memo), body, announce=False, members=_members(body, kwargs))


async def shard_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Holds the finalizer until the shard's slots live elsewhere."""
    await shards.drain(_ctx(memo), body)


# --- RelayRebalance -----------------------------------------------------------------------------


async def rebalance_tick(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    busy = memo.get("rebalancing")
    await rebalance_controller.advance(_ctx(memo), body, busy if isinstance(busy, set) else set())


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    """Every handler above, on `registry`, with the periods `settings` gives."""
    kopf.on.startup(registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.on.probe(id="kube", registry=registry)(probe_kube)
    kopf.index(GROUP, VERSION, SHARD_PLURAL, id=INDEX, registry=registry)(fleet_members)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(GROUP, VERSION, SHARD_PLURAL, registry=registry)(shard_changed)
    resync = settings.resync_seconds
    kopf.timer(GROUP, VERSION, SHARD_PLURAL, interval=resync, initial_delay=resync, registry=registry)(
        shard_resync
    )
    kopf.on.delete(GROUP, VERSION, SHARD_PLURAL, registry=registry)(shard_deleted)
    tick = settings.rebalance_tick_seconds
    kopf.timer(GROUP, VERSION, REBALANCE_PLURAL, interval=tick, registry=registry)(rebalance_tick)
