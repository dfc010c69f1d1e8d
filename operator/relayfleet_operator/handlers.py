"""kopf handlers: registration and wiring only; the work is in shards.py and rebalance_controller.py.

Importing this module registers the handlers with kopf's default registry.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from relayfleet_operator import fleet_state, rebalance_controller, shards
from relayfleet_operator.kube import Kube
from relayfleet_operator.spec import GROUP, REBALANCE_PLURAL, SHARD_PLURAL, VERSION

FINALIZER = "relayfleet.dev/drain"
RESYNC_SECONDS = float(os.environ.get("RELAYFLEET_OPERATOR_RESYNC_SECONDS", "30"))
REBALANCE_TICK_SECONDS = float(os.environ.get("RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS", "2"))


def _ctx(memo: kopf.Memo) -> fleet_state.Context:
    ctx = memo.get("ctx")
    if not isinstance(ctx, fleet_state.Context):
        raise kopf.TemporaryError("operator context not initialised yet", delay=1)
    return ctx


@kopf.on.startup()
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
    kube = memo.get("kube")
    if not isinstance(kube, Kube):  # started by kopf directly, not through main.run
        kube = Kube.from_config(os.environ.get("RELAYFLEET_OPERATOR_KUBECONFIG"))
    memo["ctx"] = fleet_state.Context(kube=kube)
    memo["rebalancing"] = set()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    ctx = memo.get("ctx")
    if isinstance(ctx, fleet_state.Context):
        await ctx.kube.close()


@kopf.on.probe(id="kube")
async def probe_kube(memo: kopf.Memo, **_: Any) -> str:
    """Liveness detail: the API server answers our own client too."""
    ctx = _ctx(memo)
    await ctx.kube.request("GET", "/version")
    return "ok"


# --- RelayShard ---------------------------------------------------------------------------------


@kopf.on.create(GROUP, VERSION, SHARD_PLURAL)
@kopf.on.update(GROUP, VERSION, SHARD_PLURAL)
@kopf.on.resume(GROUP, VERSION, SHARD_PLURAL)
async def shard_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await shards.reconcile(_ctx(memo), body, announce=True)


@kopf.timer(GROUP, VERSION, SHARD_PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
async def shard_resync(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Periodic re-apply: corrects drift in child objects and refreshes status."""
    await shards.reconcile(_ctx(memo), body, announce=False)


@kopf.on.delete(GROUP, VERSION, SHARD_PLURAL)
async def shard_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Holds the finalizer until the shard's slots live elsewhere."""
    await shards.drain(_ctx(memo), body)


# --- RelayRebalance -----------------------------------------------------------------------------


@kopf.timer(GROUP, VERSION, REBALANCE_PLURAL, interval=REBALANCE_TICK_SECONDS)
async def rebalance_tick(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    busy = memo.get("rebalancing")
    await rebalance_controller.advance(_ctx(memo), body, busy if isinstance(busy, set) else set())
